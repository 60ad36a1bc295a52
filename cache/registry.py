"""The registry: what the cache's `default` column family says about the cache and each partition.

Keys (msgpack values):
  b"meta"            cache identity: table id, num_shards, shard, index mode, format (a dir never serves another table)
  b"session"         b"open" while a process uses the cache, b"closed" after a clean close (crash detection)
  b"p:" + partition  PartitionState of one data partition (global mode: the single partition "")
  b"i:" + name       small named records (e.g. "bootstrap": the last time-bounded load's window and instant)
Each partition column family also holds its location dictionary (see sst_builder.LOCATIONS_KEY).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack
import xxhash

from dbidx.errors import CacheMismatchError

FORMAT = 1
LOADING = "loading"
READY = "ready"
META_KEY = b"meta"
SESSION_KEY = b"session"
SESSION_OPEN = b"open"
SESSION_CLOSED = b"closed"


@dataclass(frozen=True)
class CacheIdentity:
    """Which table and shard a cache directory replicates."""

    table_id: str
    num_shards: int
    shard: int
    index_mode: str
    format: int = FORMAT
    location: str = ""  # where the table lives ("<fs type>://<root>"); "" when built by hand (benchmarks)

    @property
    def dir_name(self) -> str:
        """The per-table directory under a base path: the table id plus a hash of its location, so a copy of a
        table (same id, other place) never shares, reads or poisons the original's caches."""
        if not self.location:
            return self.table_id
        return f"{self.table_id}-{xxhash.xxh64_hexdigest(self.location.encode('utf-8'))[:8]}"

    def check(self, stored: "CacheIdentity", where: str) -> None:
        """Refuse a directory that belongs to another table, table location, shard count, shard or format."""
        if stored != self:
            copy = (" (the same table id at another location: a copy of the table?)"
                    if stored.table_id == self.table_id and stored.location != self.location else "")
            raise CacheMismatchError(
                f"cache directory {where} belongs to table {stored.table_id} at {stored.location or '?'} shard "
                f"{stored.shard}/{stored.num_shards} ({stored.index_mode}, format {stored.format}), not table "
                f"{self.table_id} at {self.location or '?'} shard {self.shard}/{self.num_shards} ({self.index_mode}, "
                f"format {self.format}){copy}; use another cache dir or delete this one"
            )


@dataclass
class PartitionState:
    """One partition in the cache: its column family, load state and counters."""

    partition: str
    cf: str
    state: str = LOADING
    loaded_seq: int = 0  # MDT completion seq of the snapshot it was loaded from
    synced_seq: int = 0  # MDT completion seq its content reflects (catch-up moves it forward)
    entries: int = 0
    last_access_ms: int = 0
    loaded_at_ms: int = 0
    fills: dict[str, int] = field(default_factory=dict)  # location -> live keys of this shard

    @property
    def ready(self) -> bool:
        """Whether lookups may be served from this partition."""
        return self.state == READY


def partition_key(partition: str) -> bytes:
    """Registry key of a partition."""
    return b"p:" + partition.encode("utf-8")


def pack(value: Any) -> bytes:
    """msgpack a registry value (dataclasses as dicts)."""
    if hasattr(value, "__dataclass_fields__"):
        value = asdict(value)
    return msgpack.packb(value, use_bin_type=True)


def unpack_state(raw: bytes) -> PartitionState:
    """Read a PartitionState written by pack()."""
    return PartitionState(**msgpack.unpackb(raw, raw=False, strict_map_key=False))


def unpack_identity(raw: bytes) -> CacheIdentity:
    """Read the cache identity."""
    return CacheIdentity(**msgpack.unpackb(raw, raw=False))


def unpack_list(raw: bytes | None) -> list[str]:
    """Read a location dictionary."""
    return [] if raw is None else list(msgpack.unpackb(raw, raw=False))
