"""dbidx/arrays.py: Arrow helpers."""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from hypothesis import given, settings
from hypothesis import strategies as st

from dbidx.arrays import one_chunk, string_sort_indices


def test_one_chunk_never_copies_a_single_chunk() -> None:
    """dbidx.arrays.one_chunk: a one-chunk column comes back as that chunk (slices keep their offset), several chunks
    are combined, a plain array passes through."""
    base = pa.array(["a", "bb", "ccc", "dddd"]).slice(1)
    single = one_chunk(pa.chunked_array([base]))
    assert single.buffers()[2].address == base.buffers()[2].address and single.offset == 1
    assert one_chunk(pa.chunked_array([base, base])).to_pylist() == ["bb", "ccc", "dddd"] * 2
    assert one_chunk(base) is base


VALUES = st.one_of(
    st.binary(max_size=12).map(lambda b: b.decode("latin-1")),  # NULs, bytes >= 0x80 (as 2-byte UTF-8), short
    st.text(alphabet="ab\x00é", min_size=6, max_size=10),  # many share their first 8 bytes: tie runs
    st.uuids().map(str),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(VALUES, max_size=40), st.integers(1, 60), st.integers(0, 3), st.booleans())
def test_string_sort_indices_is_arrows_stable_sort(values: list[str], copies: int, cut: int, large: bool) -> None:
    """Past the small-array cut-over (lists repeated to ~1-2 k values: equal values must keep arrival order), sliced,
    string and large_string: the same positions as pc.sort_indices."""
    repeated = (values * (1100 // len(values) + copies))[:2500] if values else []
    array = pa.array(["pad"] * cut + repeated, pa.large_string() if large else pa.string()).slice(cut)
    assert string_sort_indices(array).tolist() == pc.sort_indices(array).to_numpy().tolist()


def test_string_sort_indices_of_unique_heads_and_of_shared_prefixes() -> None:
    """The paths without ties, with a few ties, and with too many ties to sort them apart (Arrow sorts all)."""
    rng = np.random.default_rng(5)
    ids = [f"{rng.integers(0, 2**63):016x}" for _ in range(5000)]
    few = ids[:3000] + [i[:8] + "zz" + i[10:] for i in ids[:20]]  # 20 values share their first 8 bytes with another
    shared = [f"customer-{i:08d}" for i in rng.permutation(5000)]  # every value shares its first 8 bytes
    short = ["".join(p) for n in range(6) for p in itertools.product("ab\x00z", repeat=n)]  # past-the-end bytes
    short = [short[i] for i in rng.permutation(len(short))]  # count as zero ("a" < "a\x00" < "aa" still tie)
    for values in (ids, few, shared, short):
        array = pa.array(values, pa.string())
        assert string_sort_indices(array).tolist() == pc.sort_indices(array).to_numpy().tolist()
