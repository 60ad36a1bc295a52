"""dbidx/arrays.py: Arrow helpers."""
from __future__ import annotations

import pyarrow as pa

from dbidx.arrays import one_chunk


def test_one_chunk_never_copies_a_single_chunk() -> None:
    """dbidx.arrays.one_chunk: a one-chunk column comes back as that chunk (slices keep their offset), several chunks
    are combined, a plain array passes through."""
    base = pa.array(["a", "bb", "ccc", "dddd"]).slice(1)
    single = one_chunk(pa.chunked_array([base]))
    assert single.buffers()[2].address == base.buffers()[2].address and single.offset == 1
    assert one_chunk(pa.chunked_array([base, base])).to_pylist() == ["bb", "ccc", "dddd"] * 2
    assert one_chunk(base) is base
