"""The tagger's batch logic without Spark: the distinct-keys test (with and without the keys' hashes), one row per
record, and the bulk path's tags (file groups per partition, nulls for delete rows)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dbidx.buckets.assigner import BucketSpec
from dbidx.buckets.naming import bucket_of
from dbidx.config import CacheConfig
from dbidx.errors import InvalidInputError
from dbidx.table.facade import Table
from dbidx.spark_integration import dedupe as dedupe_module
from dbidx.spark_integration.dedupe import all_distinct, latest_per_key
from dbidx.spark_integration.tagger import (
    TAG_FILE_GROUP,
    TAG_IS_DELETE,
    TAG_IS_UPDATE,
    TAG_PARTITION,
    ShardTagger,
    TagOptions,
    file_group_column,
)
from dbidx.storage.keyhash import shard_of, spark_hash


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c", "d", "e", "f", "g"]), max_size=12), st.integers(0, 3))
def test_all_distinct_is_exact_whatever_the_hashes(keys: list[str], buckets: int) -> None:
    """Hashes that collide a lot (every key in `buckets + 1` hash values, all equal when 0) or not at all give the
    same answer as comparing the keys: only keys sharing a hash are compared, and equal keys always do."""
    array = pa.array(keys, pa.string())
    truth = len(set(keys)) == len(keys)
    forced = np.array([ord(k) % (buckets + 1) for k in keys], dtype=np.int32)
    assert all_distinct(array, forced) is truth
    assert all_distinct(array, spark_hash(array)) is truth
    assert all_distinct(array) is truth


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.sampled_from("abcdefg"), max_size=12),
    st.lists(st.sampled_from([-(2**31), -257, -256, -1, 0, 1, 255, 256, 257, 2**31 - 1]), min_size=7, max_size=7),
)
def test_all_distinct_is_exact_when_hashes_share_their_top_bits(keys: list[str], values: list[int]) -> None:
    """Hash values that agree in their top 24 bits but not in the low 8 (and negative ones) pass the bitmap of
    shared hashes without being shared: still only equal hashes are compared, and the answer is exact."""
    array = pa.array(keys, pa.string())
    forced = np.array([values["abcdefg".index(k)] for k in keys], dtype=np.int32)
    truth = len(set(keys)) == len(keys)
    assert all_distinct(array, forced) is truth  # small: every hash searched
    saved, dedupe_module._BITMAP_FROM = dedupe_module._BITMAP_FROM, 0  # the bitmap path of big batches
    try:
        assert all_distinct(array, forced) is truth
    finally:
        dedupe_module._BITMAP_FROM = saved


def test_latest_per_key_with_hashes_keeps_distinct_keys_and_collapses_repeats() -> None:
    options = TagOptions(key="id", partition="dt", ordering="v")
    batch = pa.table({"id": ["k1", "k2", "k3", "k2"], "dt": ["d1"] * 4, "v": [1, 5, 1, 9]})
    colliding = np.zeros(4, dtype=np.int32)  # every key shares one hash: the keys themselves decide
    kept, dropped = latest_per_key(batch, options, False, colliding)
    assert dropped == 1 and sorted(zip(kept.column("id").to_pylist(), kept.column("v").to_pylist())) == [
        ("k1", 1),
        ("k2", 9),
        ("k3", 1),
    ]
    distinct = batch.slice(0, 3)
    assert latest_per_key(distinct, options, False, np.zeros(3, dtype=np.int32)) == (distinct, 0)


def test_tag_new_places_inserts_per_partition_and_leaves_deletes_without_a_file_group(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    options = TagOptions(
        key="id",
        partition="dt",
        buckets=BucketSpec(capacity=2),
        cache=CacheConfig(base_path=str(tmp_path / "c")),
        bulk_seq=0,
    )
    rows = pa.table(
        {
            "id": ["a", "b", "c", "d", "e", "f"],
            "dt": ["d2", "d1", "d2", "d1", "d2", "d2"],
            "_dbidx_delete": [False, False, True, False, False, False],
        }
    )
    tagged = ShardTagger(table, 0, options).tag_new(rows)
    groups = tagged.column(TAG_FILE_GROUP).to_pylist()
    assert tagged.column(TAG_PARTITION).to_pylist() == ["dt=d2", "dt=d1", "dt=d2", "dt=d1", "dt=d2", "dt=d2"]
    assert groups[2] is None and all(g is not None for i, g in enumerate(groups) if i != 2)
    # Capacity 2 per bucket: d1's two keys share the first bucket; d2's three inserts fill it, then open the next.
    assert [bucket_of(groups[i]) for i in (1, 3)] == [0, 0]
    assert [bucket_of(groups[i]) for i in (0, 4, 5)] == [0, 0, 1]
    assert groups[1] != groups[0]  # one partition's bucket 0 is not another's
    assert tagged.column(TAG_IS_DELETE).to_pylist() == [False, False, True, False, False, False]
    assert not any(tagged.column(TAG_IS_UPDATE).to_pylist())


def test_file_group_column_is_null_at_minus_one_and_refused_past_the_offset_limit() -> None:
    """The tagged file-group column comes from integer codes: -1 (a delete row) is null; names whose bytes pass what
    32-bit string offsets hold are refused with a typed error that says what to change (the limit lowered here)."""
    codes = np.array([1, -1, 0, 1, 1], dtype=np.int32)
    small = file_group_column(["fg-a", "fg-bb"], codes)
    assert small.type == pa.string() and small.to_pylist() == ["fg-bb", None, "fg-a", "fg-bb", "fg-bb"]
    assert file_group_column(["fg-a", "fg-bb"], codes, limit=19).to_pylist() == small.to_pylist()  # 4 + 3 x 5
    with pytest.raises(InvalidInputError, match="more key shards"):
        file_group_column(["fg-a", "fg-bb"], codes, limit=18)


def test_tag_new_with_simple_buckets_places_each_key_by_its_hash(tmp_path: Path) -> None:
    """The simple assigner (which reads the keys) through tag_new's code path: each insert's file group is the
    bucket of its own key's hash, whatever the row order."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    options = TagOptions(
        key="id",
        partition="dt",
        buckets=BucketSpec(mode="simple", num_buckets=4),
        cache=CacheConfig(base_path=str(tmp_path / "c")),
        bulk_seq=0,
    )
    keys = [f"key-{i}" for i in range(40)]
    rows = pa.table({"id": keys, "dt": ["d1", "d2"] * 20, "_dbidx_delete": [False] * 39 + [True]})
    groups = ShardTagger(table, 0, options).tag_new(rows).column(TAG_FILE_GROUP).to_pylist()
    assert groups[-1] is None
    assert [bucket_of(g) for g in groups[:-1]] == shard_of(pa.array(keys[:-1]), 4).tolist()
