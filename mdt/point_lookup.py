"""Point lookups in the persisted index: the live entries of given keys, read from the RLI files of their shards.

Per shard: the files of the (partition, shard) group (the whole shard in global mode), each read whole or only the
row groups whose key range holds a wanted key (`rli_files.read_matching`), every file verified; the latest entry per
key wins and deletes drop out (`rli_files.resolve_latest`). What `Table.lookup` and `dbidx lookup` run.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbidx.errors import InvalidInputError
from dbidx.mdt import layout, rli_files
from dbidx.mdt.keys import normalize_keys

if TYPE_CHECKING:
    from dbidx.mdt.table import Table


def lookup(table: "Table", keys: Sequence[str] | pa.Array, partition: str | None, mode: str,
           seek_threshold: float, plan: dict[str, int] | None) -> pa.Table:
    """Live entries of `keys` (see Table.lookup for the arguments); absent keys are not in the result."""
    if mode not in ("auto", "seek", "scan"):
        raise InvalidInputError(f"lookup mode must be auto, seek or scan, got {mode!r}")
    if partition is None and not table.global_index:
        raise InvalidInputError("lookup in a partitioned index needs the partition path of the keys")
    if partition is not None:
        layout.validate_partition(partition)
    view = table.refresh()
    array = normalize_keys(keys, "lookup key")
    if len(array) == 0:
        return table.schema.empty_table()
    shards = table.shard_of(array)
    pieces = []
    for s in np.unique(shards):
        mine = pc.unique(array.filter(pa.array(shards == s)))
        sorted_keys = sorted(mine.to_pylist())
        found = []
        for record in view.files(None if table.global_index else partition, int(s)):
            rows, how = table.read_index_file(record, lambda: rli_files.read_matching(
                table.io, record, sorted_keys, mine, mode, seek_threshold))
            if plan is not None:
                plan[how] = plan.get(how, 0) + 1
            found.append(rows)
        merged = rli_files.resolve_latest(found, table.schema)
        if table.global_index and partition is not None:
            merged = merged.filter(pc.equal(merged.column(rli_files.PARTITION), partition))
        pieces.append(merged)
    return pa.concat_tables(pieces) if pieces else table.schema.empty_table()
