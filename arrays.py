"""Arrow helpers every floor uses: a column as one array, without a copy when it is one already."""
from __future__ import annotations

import pyarrow as pa


def one_chunk(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    """The column as one Arrow array. `ChunkedArray.combine_chunks` copies even a column of a single chunk (a 5 M-row
    task's partition and file group columns: ~190 MB each time), so a single chunk is returned as it is."""
    if isinstance(column, pa.ChunkedArray):
        return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    return column
