"""Bucket assigners: dynamic and simple hash buckets (docs/DESIGN.md section 4).

Both answer one question for the keys a batch inserts into a partition: which file group. Keys that already exist
never ask (their location comes from the index and never changes), so only new keys consume bucket capacity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

import numpy as np
import pyarrow as pa

from dbidx.buckets.naming import MAX_BUCKET, bucket_of, file_group_id
from dbidx.errors import ConfigError
from dbidx.storage.keyhash import shard_of

__all__ = ["BucketSpec"]

DYNAMIC = "dynamic"
SIMPLE = "simple"
Fills = Mapping[str, int] | Callable[[], Mapping[str, int]]


@dataclass(frozen=True)
class BucketSpec:
    """How a table routes new keys: the mode and its one parameter (capacity or bucket count)."""

    mode: str = DYNAMIC
    capacity: int = 1_000_000  # dynamic: most live keys a bucket takes before a new bucket opens
    num_buckets: int = 0  # simple: N in hash(key) % N; 0 = the table's shard count

    def __post_init__(self) -> None:
        if self.mode not in (DYNAMIC, SIMPLE):
            raise ConfigError(f"bucket mode must be {DYNAMIC!r} or {SIMPLE!r}, got {self.mode!r}")
        if not isinstance(self.capacity, int) or self.capacity < 1:
            raise ConfigError(f"bucket capacity must be a positive integer, got {self.capacity!r}")
        if not isinstance(self.num_buckets, int) or not 0 <= self.num_buckets <= MAX_BUCKET + 1:
            raise ConfigError(f"num_buckets must be an integer in 0..{MAX_BUCKET + 1}, got {self.num_buckets!r}")

    def to_dict(self) -> dict[str, object]:
        """The form recorded in commit metadata (so later writers can check they route the same way)."""
        if self.mode == SIMPLE:
            return {"mode": SIMPLE, "num_buckets": self.num_buckets}
        return {"mode": DYNAMIC, "capacity": self.capacity}

    def assigner(self, table_id: str, num_shards: int, shard: int) -> "BucketAssigner":
        """The assigner a task of one shard uses."""
        if self.mode == SIMPLE:
            return SimpleBucketAssigner(table_id, self.num_buckets or num_shards)
        return DynamicBucketAssigner(table_id, num_shards, shard, self.capacity)


class BucketAssigner(Protocol):
    """Assigns file groups to the new keys of a partition."""

    def assign(self, partition: str, keys: pa.Array, fills: Fills) -> pa.Array:
        """File group per new key (keys not in the index yet), in input order, as a string array (built from runs
        or a dictionary: a Python list of millions of repeated names costs a second to convert)."""
        ...


class DynamicBucketAssigner:
    """New keys of one shard go to the lowest non-full bucket the shard owns; a new bucket opens when all are full.

    A shard owns bucket b when b % num_shards == shard, so shards never create the same bucket and no
    coordination is needed. The first bucket a shard opens in a partition is b = shard: the initial bucket count
    of a partition is the shard count. Fills (live keys per file group, from the index) are read once per
    partition and then counted forward as this assigner places keys, so a task never overfills a bucket even
    across many Arrow batches. Deletes do not give capacity back within a batch (conservative).
    """

    def __init__(self, table_id: str, num_shards: int, shard: int, capacity: int) -> None:
        self.table_id = table_id
        self.num_shards = num_shards
        self.shard = shard
        self.capacity = capacity
        self._fills: dict[str, dict[int, int]] = {}
        self.opened: dict[str, list[int]] = {}  # buckets opened by this assigner, per partition

    def _owned(self, partition: str, fills: Fills) -> dict[int, int]:
        state = self._fills.get(partition)
        if state is None:
            source = fills() if callable(fills) else fills
            state = {}
            for fg, n in source.items():
                bucket = bucket_of(fg)
                if bucket is not None and bucket % self.num_shards == self.shard:
                    state[bucket] = state.get(bucket, 0) + int(n)
            self._fills[partition] = state
        return state

    def assign(self, partition: str, keys: pa.Array, fills: Fills) -> pa.Array:
        """File groups for len(keys) new keys of `partition` (the keys themselves do not matter here)."""
        return _repeated(self.placements(partition, len(keys), fills))

    def placements(self, partition: str, remaining: int, fills: Fills) -> list[tuple[str, int]]:
        """(file group, how many keys) in placement order, for `remaining` new keys (what `assign` expands; a caller
        that only needs each key's file group by position uses it without materializing the names per key)."""
        if remaining == 0:
            return []
        owned = self._owned(partition, fills)
        out: list[tuple[str, int]] = []
        # 1. Fill the owned buckets that have room, lowest bucket id first (fewer, fuller files).
        for bucket in sorted(owned):
            room = self.capacity - owned[bucket]
            if room <= 0:
                continue
            take = min(room, remaining)
            out.append((file_group_id(self.table_id, partition, bucket), take))
            owned[bucket] += take
            remaining -= take
            if remaining == 0:
                return out
        # 2. All full: open the next owned bucket ids (shard, shard + n, shard + 2n, ...) until every key has one.
        candidate = self.shard
        while remaining:
            while candidate in owned:
                candidate += self.num_shards
            if candidate > MAX_BUCKET:
                raise ConfigError(
                    f"partition {partition!r} needs more than {MAX_BUCKET + 1} buckets; raise the "
                    f"bucket capacity (now {self.capacity})"
                )
            take = min(self.capacity, remaining)
            out.append((file_group_id(self.table_id, partition, candidate), take))
            owned[candidate] = take
            self.opened.setdefault(partition, []).append(candidate)
            remaining -= take
        return out


class SimpleBucketAssigner:
    """Hash buckets: bucket = pmod(murmur3(key), N), the same hash Spark and the shard mapping use."""

    def __init__(self, table_id: str, num_buckets: int) -> None:
        self.table_id = table_id
        self.num_buckets = num_buckets
        self._names: dict[tuple[str, int], str] = {}

    def assign(self, partition: str, keys: pa.Array, fills: Fills) -> pa.Array:
        """File group per key from its hash alone; fills are not needed."""
        if len(keys) == 0:
            return pa.array([], pa.string())
        buckets = shard_of(keys, self.num_buckets)
        used, codes = np.unique(buckets, return_inverse=True)
        names = pa.array([self._name(partition, int(b)) for b in used], pa.string())
        return names.take(pa.array(codes.astype(np.int32)))

    def _name(self, partition: str, bucket: int) -> str:
        name = self._names.get((partition, bucket))
        if name is None:
            name = self._names[(partition, bucket)] = file_group_id(self.table_id, partition, bucket)
        return name


def _repeated(placements: list[tuple[str, int]]) -> pa.Array:
    """A string array of `count` times each name, in order."""
    if not placements:
        return pa.array([], pa.string())
    return pa.concat_arrays([pa.repeat(pa.scalar(name, pa.string()), count) for name, count in placements])
