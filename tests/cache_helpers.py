"""Helpers shared by the cache tests: a table with known content and a cache on a temp dir."""

from __future__ import annotations

import uuid
from pathlib import Path

from dbidx.cache.record_cache import RecordIndexCache
from dbidx.config import CacheConfig
from dbidx.table.facade import Table

DAY1, DAY2, DAY3 = "dt=2025-01-01", "dt=2025-01-02", "dt=2025-01-03"


def make_table(root: Path, num_shards: int = 2, keys_per_day: int = 300, global_index: bool = False) -> Table:
    """A table with three daily partitions, each key in file group fg-<day>-<i % 3>."""
    table = Table.create(str(root / "table"), num_shards=num_shards, row_group_size=128, global_index=global_index)
    for day, partition in enumerate((DAY1, DAY2, DAY3), start=1):
        keys = [f"k{day}-{i:05d}" for i in range(keys_per_day)]
        with table.new_commit() as w:
            w.insert(partition, keys, [f"fg-{day}-{i % 3}" for i in range(keys_per_day)])
    return table


def truth(table: Table, partition: str | None, shard: int) -> dict[str, str]:
    """The index's key -> file group map of one shard (the reference every cache answer is checked against)."""
    snap = table.snapshot(partition, shard=shard)
    return dict(zip(snap.column("key").to_pylist(), snap.column("file_group").to_pylist()))


def open_cache(table: Table, shard: int, base: Path, **config: object) -> RecordIndexCache:
    """An opened cache of one shard under a temp base path."""
    return RecordIndexCache.for_table(table, shard, CacheConfig(**config), base_path=base).open()


def random_uuids(n: int) -> list[str]:
    """n random canonical UUID strings."""
    return [str(uuid.uuid4()) for _ in range(n)]
