"""Bucket assignment without Spark: dynamic and simple hash buckets (docs/DESIGN.md section 4)."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dbidx.buckets.assigner import BucketSpec, DynamicBucketAssigner, SimpleBucketAssigner
from dbidx.buckets.naming import bucket_of, file_group_id
from dbidx.errors import ConfigError, InvalidInputError
from dbidx.storage.keyhash import shard_of


def keys(n: int, prefix: str = "k") -> pa.Array:
    return pa.array([f"{prefix}{i}" for i in range(n)])


def test_file_group_id_is_stable_named_and_parsable() -> None:
    fg = file_group_id("table-a", "dt=2025-01-01", 7)
    assert fg == file_group_id("table-a", "dt=2025-01-01", 7)
    assert fg.startswith("00000007-") and len(fg) == 8 + 1 + 24
    assert fg != file_group_id("table-a", "dt=2025-01-02", 7) != file_group_id("table-b", "dt=2025-01-01", 7)
    assert bucket_of(fg) == 7 and bucket_of("part-0001") is None
    with pytest.raises(InvalidInputError, match="bucket id"):
        file_group_id("t", "p", -1)


def test_dynamic_first_bucket_is_the_shard_then_fills_before_opening() -> None:
    assigner = DynamicBucketAssigner("t", num_shards=4, shard=2, capacity=3)
    fgs = assigner.assign("p", keys(7), {})
    assert fgs.type == pa.string() and [bucket_of(f) for f in fgs.to_pylist()] == [2, 2, 2, 6, 6, 6, 10]
    # Later batches (same task) continue from what this assigner placed: bucket 10 has room for 2 more.
    assert [bucket_of(f) for f in assigner.assign("p", keys(3, "x"), {}).to_pylist()] == [10, 10, 14]
    assert assigner.opened["p"] == [2, 6, 10, 14]


def test_dynamic_reuses_non_full_buckets_from_the_index_and_ignores_foreign_ones() -> None:
    fills = {
        file_group_id("t", "p", 1): 5,
        file_group_id("t", "p", 3): 2,
        file_group_id("t", "p", 2): 0,
        "migrated-file": 100,
    }
    assigner = DynamicBucketAssigner("t", num_shards=2, shard=1, capacity=5)
    # Bucket 1 is full, bucket 3 (owned by shard 1) has room for 3; bucket 2 belongs to shard 0.
    assert [bucket_of(f) for f in assigner.assign("p", keys(5), fills).to_pylist()] == [3, 3, 3, 5, 5]


@settings(max_examples=60, deadline=None)
@given(
    num_shards=st.integers(1, 6),
    capacity=st.integers(1, 20),
    batches=st.lists(st.integers(0, 40), min_size=1, max_size=6),
)
def test_dynamic_never_exceeds_capacity_and_shards_never_collide(
    num_shards: int, capacity: int, batches: list[int]
) -> None:
    per_bucket: dict[int, int] = {}
    owner: dict[int, int] = {}
    for shard in range(num_shards):
        assigner = DynamicBucketAssigner("t", num_shards, shard, capacity)
        for i, n in enumerate(batches):
            assigned = assigner.assign("p", keys(n, f"s{shard}b{i}-"), {})
            assert len(assigned) == n
            for fg in assigned.to_pylist():
                bucket = bucket_of(fg)
                per_bucket[bucket] = per_bucket.get(bucket, 0) + 1
                assert owner.setdefault(bucket, shard) == shard  # no bucket is created by two shards
    assert all(n <= capacity for n in per_bucket.values())
    for shard in range(num_shards):  # only the last bucket a shard opened may be partly empty
        sizes = sorted((b, n) for b, n in per_bucket.items() if owner[b] == shard)
        assert all(n == capacity for _, n in sizes[:-1])


def test_simple_routes_by_the_spark_hash() -> None:
    ks = keys(500)
    fgs = SimpleBucketAssigner("t", 8).assign("p", ks, {}).to_pylist()
    assert [bucket_of(f) for f in fgs] == shard_of(ks, 8).tolist()
    assert len(set(fgs)) == 8


def test_spec_validation_and_defaults() -> None:
    with pytest.raises(ConfigError, match="bucket mode"):
        BucketSpec(mode="range")
    with pytest.raises(ConfigError, match="capacity"):
        BucketSpec(capacity=0)
    assert isinstance(BucketSpec(mode="simple").assigner("t", 4, 0), SimpleBucketAssigner)
    assert BucketSpec(mode="simple").assigner("t", 4, 0).num_buckets == 4  # default N = shard count
    assert BucketSpec(mode="simple", num_buckets=16).to_dict() == {"mode": "simple", "num_buckets": 16}
