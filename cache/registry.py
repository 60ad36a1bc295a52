"""The registry: what the cache's `default` column family says about the cache and each partition.

Keys (msgpack values):
  b"meta"            cache identity: table id, num_shards, shard, index mode, format (a dir never serves another table)
  b"session"         b"open" while a process uses the cache, b"closed" after a clean close (crash detection)
  b"p:" + partition  PartitionState of one data partition (global mode: the single partition "")
  b"watermark"       the completion seq the whole cache is caught up to (decimal text)
  b"i:" + name       small named records (e.g. "bootstrap": the last time-bounded load's window and instant)
Every value is read back as untrusted: one that does not parse is a CacheCorruptError naming the cache (`damaged`;
the cache is disposable: deleting it rebuilds it from the index).
Each partition column family also holds its location dictionary (see sst_builder.LOCATIONS_KEY).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import msgpack
import xxhash

from dbidx.cache.store import get, scan
from dbidx.errors import CacheCorruptError, CacheError, CacheMismatchError
from dbidx.plain import plain

FORMAT = 1
LOADING = "loading"
READY = "ready"
META_KEY = b"meta"
SESSION_KEY = b"session"
SESSION_OPEN = b"open"
SESSION_CLOSED = b"closed"
WATERMARK_KEY = b"watermark"
PARTITION_PREFIX = b"p:"
INFO_PREFIX = b"i:"


@dataclass(frozen=True)
class CacheIdentity:
    """Which table and shard a cache directory replicates."""

    table_id: str
    num_shards: int
    shard: int
    index_mode: str
    format: int = FORMAT
    location: str = ""  # where the table lives ("<fs type>://<root>"); "" when built by hand (benchmarks)

    @classmethod
    def of_table(cls, table: Any, shard: int) -> "CacheIdentity":
        """The identity of one shard's cache of a table."""
        return cls(table.props.table_id, table.num_shards, shard, table.props.index_mode, location=table.location)

    def shard_dir(self, base: str | Path) -> Path:
        """Where this shard's cache lives under a base path: <base>/<dir_name>/shard-NNNNN-of-NNNNN."""
        return Path(base) / self.dir_name / f"shard-{self.shard:05d}-of-{self.num_shards:05d}"

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
            copy = (
                " (the same table id at another location: a copy of the table?)"
                if stored.table_id == self.table_id and stored.location != self.location
                else ""
            )
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
    loaded_seq: int = 0  # completion seq of the snapshot it was loaded from
    synced_seq: int = 0  # completion seq its content reflects (catch-up moves it forward)
    entries: int = 0
    last_access_ms: int = 0
    loaded_at_ms: int = 0
    fills: dict[str, int] = field(default_factory=dict)  # location -> live keys of this shard

    @property
    def ready(self) -> bool:
        """Whether lookups may be served from this partition."""
        return self.state == READY

    def bump_fill(self, location: str | None, delta: int) -> None:
        """Move one location's live-key count (bucket fills); a count that reaches 0 leaves the map."""
        if location is None:
            return
        n = self.fills.get(location, 0) + delta
        if n > 0:
            self.fills[location] = n
        else:
            self.fills.pop(location, None)


def partition_key(partition: str) -> bytes:
    """Registry key of a partition."""
    return PARTITION_PREFIX + partition.encode("utf-8")


def put_states(batch: Any, states: Iterable[PartitionState]) -> Any:
    """Add the registry entries of partition states to a write batch (returned, for chaining)."""
    for state in states:
        batch.put(partition_key(state.partition), pack(state))
    return batch


def info_key(name: str) -> bytes:
    """Registry key of a named record."""
    return INFO_PREFIX + name.encode("utf-8")


def pack(value: Any) -> bytes:
    """msgpack a registry value (dataclasses as dicts)."""
    if hasattr(value, "__dataclass_fields__"):
        value = plain(value)
    return msgpack.packb(value, use_bin_type=True)


def unpack_state(raw: bytes) -> PartitionState:
    """Read a PartitionState written by pack(), every field checked (a wrong type raises ValueError)."""
    state = PartitionState(**msgpack.unpackb(raw, raw=False, strict_map_key=False))
    counts = (state.loaded_seq, state.synced_seq, state.entries, state.last_access_ms, state.loaded_at_ms)
    if not (
        isinstance(state.partition, str)
        and isinstance(state.cf, str)
        and state.cf
        and state.state in (LOADING, READY)
        and all(type(n) is int and n >= 0 for n in counts)
        and isinstance(state.fills, dict)
        and all(isinstance(k, str) and type(v) is int and v > 0 for k, v in state.fills.items())
    ):
        raise ValueError(f"not a partition state: {vars(state)!r:.200}")
    return state


def unpack_identity(raw: bytes) -> CacheIdentity:
    """Read the cache identity."""
    return CacheIdentity(**msgpack.unpackb(raw, raw=False))


def unpack_list(raw: bytes | None) -> list[str]:
    """Read a location dictionary."""
    return [] if raw is None else list(msgpack.unpackb(raw, raw=False))


def damaged(path: Path, what: str, problem: Exception | str) -> CacheCorruptError:
    """The error for stored cache bytes that do not read back as what was written (registry values, location
    dictionaries): names the cache and the piece; the cache is disposable, so the way out is to
    delete it (a Spark task session does that itself)."""
    if isinstance(problem, Exception):
        problem = f"{type(problem).__name__}: {problem}"
    return CacheCorruptError(
        f"cache {path}: {what} is damaged ({problem}); delete the cache directory to rebuild it from the index"
    )


def open_identity(db: Any, identity: CacheIdentity | None, path: Path) -> CacheIdentity:
    """The identity a cache directory holds, written on first open and checked on every later one: a directory
    never serves another table, shard count or shard. identity None: adopt what the directory says (CLI tools)."""
    raw = get(db, META_KEY)
    if raw is None and identity is None:
        raise CacheError(
            f"{path} is not a dbidx cache (its registry has no identity); pass the cache directory of "
            "one shard, e.g. <base>/<table id>-<location hash>/shard-00000-of-00004"
        )
    if raw is None:
        db[META_KEY] = pack(identity)
        return identity  # type: ignore[return-value]
    try:
        stored = unpack_identity(raw)
    except Exception as exc:
        raise damaged(path, "its registry's identity", exc) from exc
    if identity is None:
        return stored
    identity.check(stored, str(path))
    return identity


def ready_states(db: Any, families: set[str], path: Path) -> dict[str, PartitionState]:
    """The ready partitions whose column family exists; other partition entries are deleted (a load or drop that
    did not finish)."""
    states: dict[str, PartitionState] = {}
    for key, raw in scan(db, from_key=PARTITION_PREFIX):
        if not key.startswith(PARTITION_PREFIX):
            break
        try:
            state = unpack_state(raw)
        except Exception as exc:
            raise damaged(path, f"its registry's entry {bytes(key[:80])!r}", exc) from exc
        if state.ready and state.cf in families:
            states[state.partition] = state
        else:
            del db[key]
    return states


def read_watermark(db: Any, path: Path) -> int:
    """The completion seq the cache is caught up to (0 for a new cache)."""
    raw = get(db, WATERMARK_KEY)
    try:
        return int(raw.decode("ascii")) if raw else 0
    except (UnicodeDecodeError, ValueError) as exc:
        raise damaged(path, "its registry's watermark", exc) from exc


def read_info(db: Any, name: str, path: Path) -> dict[str, Any] | None:
    """A named record (None if never written)."""
    raw = get(db, info_key(name))
    try:
        return None if raw is None else msgpack.unpackb(raw, raw=False)
    except Exception as exc:
        raise damaged(path, f"its registry's record {name!r}", exc) from exc


def table_cache_dir_name(table: Any) -> str:
    """The directory under a base path that holds one table's shard caches (table id + location hash)."""
    return CacheIdentity.of_table(table, 0).dir_name
