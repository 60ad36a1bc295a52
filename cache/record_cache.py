"""RecordIndexCache: one table shard's executor-local record index in RocksDB.

One column family per data partition (key -> location) and the `default` column family as registry; it holds
committed entries only (catch-up applies them once their instant completed). Lookups go ready partition -> (not
ready: the caller loads it) -> None = new key. The cache knows nothing of Spark; it reads the index only in
catchup.py (and installs a bulk load's staged partitions in staging.py).

Crash-safety rules (the WAL is off): a partition's column family name is new for every load, so the registry can
only point at a completely ingested family; the registry is flushed after the data; on open, families the registry
does not point at are dropped, and after an unclean shutdown the counters are recounted from the data.
"""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pyarrow as pa

from dbidx.cache import codec, registry
from dbidx.cache.base_dir import default_base_path, prepare_dir
from dbidx.cache.change_writes import write_changes
from dbidx.cache.changes import exact_changes, last_per_key, plan_changes
from dbidx.cache.committed import committed_items, lookup_committed
from dbidx.cache.locations import LocationDictionary
from dbidx.cache.metrics import CacheMetrics
from dbidx.cache.registry import CacheIdentity, PartitionState
from dbidx.cache.sst_builder import PreparedLoad, build_sst
from dbidx.cache.store import Store, get, multi_get
from dbidx.config import CacheConfig
from dbidx.errors import CacheError, InvalidInputError, PartitionNotReadyError
from dbidx.storage.keys import normalize_keys
from dbidx.storage.layout import partition_dir_name, validate_partition

GLOBAL_PARTITION = ""  # global mode keeps the whole shard in one partition entry


def _now_ms() -> int:
    return int(time.time() * 1000)


class RecordIndexCache:
    """Executor-local, disposable replica of one (table, shard) slice of the record-level index."""

    def __init__(self, path: str | Path, identity: CacheIdentity | None, config: CacheConfig | None = None) -> None:
        """identity None: open an existing cache directory as whatever table and shard it says it holds."""
        self.path = Path(path)
        self.identity = identity
        self.config = config or CacheConfig()
        self.metrics = CacheMetrics()
        self.recovered = False
        self.lock_identity: str | None = None
        self.store: Store | None = None
        self.watermark = 0
        self._states: dict[str, PartitionState] = {}
        self._unsure: set[str] = set()  # partitions whose data may be ahead of their registry (see apply_exact)
        self.recovery_bound: int | None = None  # the seq past which a crashed session cannot have applied anything
        self._dictionary = LocationDictionary(self.path)
        self._lock = threading.RLock()

    # ---- construction --------------------------------------------------------------------------------------
    @classmethod
    def for_table(
        cls, table: Any, shard: int, config: CacheConfig | None = None, base_path: str | Path | None = None
    ) -> "RecordIndexCache":
        """The (unopened) cache of one shard of a table, under the configured or default base path."""
        config = config or CacheConfig()
        if not 0 <= shard < table.num_shards:
            raise InvalidInputError(f"shard {shard} is out of range 0..{table.num_shards - 1} for {table.uri}")
        identity = CacheIdentity.of_table(table, shard)
        return cls(identity.shard_dir(base_path or config.base_path or default_base_path()), identity, config)

    @property
    def scratch_dir(self) -> Path:
        """Where loads write SST files before ingesting them: private to this shard, emptied on open."""
        return Path(str(self.path) + ".tmp")

    def __enter__(self) -> "RecordIndexCache":
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def shard(self) -> int:
        """The shard this cache holds (its identity's: known once a cache opened without one has read it)."""
        if self.identity is None:
            raise CacheError(f"cache {self.path} is not open yet: its identity, and so its shard, is unknown")
        return self.identity.shard

    @property
    def global_mode(self) -> bool:
        """True when the cache replicates a global index (one partition entry for the whole shard)."""
        return self.identity.index_mode == "global"

    # ---- open / close --------------------------------------------------------------------------------------
    def open(self) -> "RecordIndexCache":
        """Open (creating if needed), check identity, recover from an unclean shutdown, load the registry.

        Idempotent: opening an open cache returns it (a second flock from the same process would wait on itself).
        """
        if self.store is not None:
            return self
        prepare_dir(self.path.parent)
        store = Store(self.path, self.config)
        try:
            self.store = store.open()
        finally:  # also when the open fails: what a later discard may delete is the incarnation this opener saw
            self.lock_identity = store.lock_identity
        try:
            # Leftover SST files of a load killed before its ingest (we hold the shard's lock: nobody else writes here).
            shutil.rmtree(self.scratch_dir, ignore_errors=True)
            self.scratch_dir.mkdir(mode=0o700)
            self._open_registry()
        except BaseException:
            self.store.close()
            self.store = None
            raise
        return self

    def _open_registry(self) -> None:
        db = self._require_store().db
        # 1. Identity: a directory never serves another table, shard count or shard.
        self.identity = registry.open_identity(db, self.identity, self.path)
        # 2. Crash detection: "open" still set means the last user did not close cleanly.
        self.recovered = get(db, registry.SESSION_KEY) == registry.SESSION_OPEN
        # 3. Registry entries; a ready partition whose column family is gone is not loaded.
        families = set(self.store.column_families())  # type: ignore[union-attr]
        self._states = registry.ready_states(db, families, self.path)
        self.watermark = registry.read_watermark(db, self.path)
        # 4. Families nobody points at are leftovers of interrupted loads or drops.
        #    (A cache written by an earlier version may hold an `_overlay` family of uncommitted entries: it goes too.)
        wanted = {s.cf for s in self._states.values()}
        for name in families - wanted:
            self.store.drop(name)  # type: ignore[union-attr]
        for state in self._states.values():
            self._dictionary.load(self.store, state.cf)  # type: ignore[arg-type]
            if self.recovered:
                self._recount(state)
        if self.recovered:
            self.metrics.add(recoveries=1)
        self._unsure = set(self._states) if self.recovered else set()
        self.recovery_bound = None
        db[registry.SESSION_KEY] = registry.SESSION_OPEN
        self.store.flush()  # type: ignore[union-attr]

    def close(self) -> None:
        """Persist counters and last-access times, mark the session closed and release the directory."""
        if self.store is None:
            return
        with self._lock:
            store, self.store = self.store, None
            try:
                try:
                    batch = store.batch()  # type: ignore[union-attr]
                    registry.put_states(batch, self._states.values())
                    # A partition still unsure (a crash left its data possibly ahead of its registry, and no catch-up
                    # has passed the crash's reach yet) keeps the session "open": the next open recovers it again.
                    batch.put(registry.SESSION_KEY, registry.SESSION_OPEN if self._unsure else registry.SESSION_CLOSED)
                    store.write(batch)  # type: ignore[union-attr]
                finally:
                    store.close()  # type: ignore[union-attr]  # releases the directory lock whatever happened
            except Exception as exc:  # rocksdict raises a bare Exception (e.g. no space left on the device)
                raise CacheError(
                    f"closing cache {self.path} failed (disk full?): {exc}; the lock is released and "
                    "the next open repairs the cache from the index"
                ) from exc

    # ---- registry views ------------------------------------------------------------------------------------
    def partitions(self) -> dict[str, PartitionState]:
        """Ready partitions by path (copies of their states)."""
        with self._lock:
            return {p: PartitionState(**vars(s)) for p, s in self._states.items()}

    def is_ready(self, partition: str) -> bool:
        """Whether lookups can be served for a partition."""
        return partition in self._states

    def fills(self, partition: str) -> dict[str, int]:
        """Live keys of this shard per location of a ready partition (bucket fills for the assigner); {} if cold."""
        with self._lock:
            state = self._states.get(partition)
            return {} if state is None else dict(state.fills)

    def not_ready(self, partitions: Iterable[str]) -> list[str]:
        """The partitions of a batch that must be loaded before tagging (sorted, unique)."""
        return sorted({p for p in partitions if p not in self._states})

    # ---- loading -------------------------------------------------------------------------------------------
    def load_partition(
        self, partition: str, keys: Any, locations: Any, synced_seq: int, tmp_dir: Path | None = None
    ) -> PartitionState:
        """Replace a partition's content with the given live entries (one shard's slice), then mark it ready.

        Builds the SST in this thread (see sst_builder for building elsewhere) and installs it.
        """
        validate_partition(partition)
        keys = normalize_keys(keys)
        sst = (tmp_dir or self.scratch_dir) / f"load-{uuid.uuid4().hex[:12]}.sst"
        try:
            return self.install_partition(build_sst(partition, keys, locations, sst, self.config), synced_seq)
        except BaseException:
            sst.unlink(missing_ok=True)  # a build or an ingest that failed leaves no scratch file behind
            raise

    def install_partition(self, prepared: PreparedLoad, synced_seq: int, durable: bool = True) -> PartitionState:
        """Ingest a prepared SST into a fresh column family, then flip the registry to it in one write.

        The family name is new for every load, so the registry can only ever point at a completely ingested
        family: no reader (and no restart after a crash) sees a partial partition as ready. durable=False skips
        the flush of a first load (bulk loaders flush periodically instead); a flip lost in a crash only means the
        partition is loaded again.
        """
        partition = validate_partition(prepared.partition)
        started = time.perf_counter()
        store = self._require_store()
        # 1. A fresh column family holding the whole content after one ingest (data and location dictionary).
        cf = f"{partition_dir_name(partition)}~{uuid.uuid4().hex[:10]}"
        store.create_from_sst(cf, prepared.sst_path)
        # 2. Flip the registry to the new family, then drop the old one.
        now = _now_ms()
        state = PartitionState(
            partition=partition,
            cf=cf,
            state=registry.READY,
            loaded_seq=synced_seq,
            synced_seq=synced_seq,
            entries=prepared.entries,
            last_access_ms=now,
            loaded_at_ms=now,
            fills=dict(prepared.fills),
        )
        with self._lock:
            old = self._states.get(partition)
            store.write(registry.put_states(store.batch(), [state]))
            self._states[partition] = state
            self._unsure.discard(partition)  # a fresh family: its counters are its content's
            self._dictionary.set(cf, list(prepared.locations))
            # Durable flip (data first, registry last): a crash after this keeps the partition, and the old family
            # can only be dropped once nothing on disk points at it.
            if durable or old is not None:
                store.flush()
            if old is not None:
                self._forget_family(old.cf)
        elapsed = time.perf_counter() - started + prepared.seconds
        self.metrics.add(partition=partition, loads=1, load_seconds=elapsed)
        self.metrics.add(loaded_entries=prepared.entries)
        return state

    def drop_partition(self, partition: str) -> bool:
        """Forget a partition (O(1): drop its column family)."""
        with self._lock:
            state = self._states.pop(partition, None)
            if state is None:
                return False
            store = self._require_store()
            batch = store.batch()
            batch.delete(registry.partition_key(partition))
            store.write(batch)
            store.flush(registry_too=True)
            self._unsure.discard(partition)  # gone from disk too: nothing of it can be counted twice
            self._forget_family(state.cf)
            return True

    # ---- lookups -------------------------------------------------------------------------------------------
    def lookup(self, partition: str, keys: Sequence[str] | pa.Array) -> list[str | None]:
        """Location of each key (None = not in the index: a new key), in input order.

        The partition must be ready (see not_ready()); in global mode pass partition "" and read locations as
        "partition\\0file group".
        """
        return self.lookup_array(partition, keys).tolist()

    def lookup_array(self, partition: str, keys: Sequence[str] | pa.Array) -> np.ndarray:
        """`lookup` as a numpy object array (what the tagger computes with: no list built and converted back)."""
        store = self._require_store()
        # Take the family view and its decoder together: a concurrent reload or reaper drop may replace or
        # remove the family, but this lookup keeps reading the consistent one it started with.
        with self._lock:
            state = self._ready_state(partition)
            view, decoder, cf_name = store.cf(state.cf), self._dictionary.decoder(state.cf), state.cf
        binary = codec.encode_keys_binary(normalize_keys(keys))
        n = len(binary)
        # The family taken above: multi-get in key order, decoded, scattered back.
        result, hits = lookup_committed(view, binary, decoder, lambda raw: self._dictionary.decode(cf_name, raw))
        state.last_access_ms = _now_ms()
        self.metrics.add(partition=partition, lookups=n, hits=hits, misses=n - hits)
        return result

    def touch(self, partition: str, at_ms: int | None = None) -> None:
        """Record an access (writes count as access for the TTL reaper); at_ms backdates it (tests, tools)."""
        state = self._states.get(partition)
        if state is not None:
            state.last_access_ms = _now_ms() if at_ms is None else int(at_ms)

    # ---- committed changes (catch-up) ----------------------------------------------------------------------
    def apply(
        self,
        partition: str,
        keys: Sequence[str] | pa.Array,
        locations: Sequence[str | None],
        deleted: Sequence[bool],
        synced_seq: int,
    ) -> int:
        """Apply committed index entries in order (inserts and tombstones) and move the partition's synced seq.

        Idempotent: applying entries the partition already reflects changes nothing, which is what makes replay
        from an older registry state (after a crash) safe.
        """
        with self._lock:
            state = self._states.get(partition)
            if state is None:
                return 0
            store = self._require_store()
            # 1. One final entry per key, keys sorted; then what the family holds for them now.
            unique_keys, final_locations, final_deleted = last_per_key(
                codec.encode_keys_binary(normalize_keys(keys)), locations, deleted
            )
            family, handle = store.cf(state.cf), store.handle(state.cf)
            old_values = multi_get(family, unique_keys)
            decoder = self._dictionary.decoder(state.cf)
            plan = plan_changes(
                unique_keys,
                final_locations,
                final_deleted,
                old_values,
                lambda raw: decoder.get(raw) or self._dictionary.decode(state.cf, raw),
            )
            # 2. One write batch: new dictionary entries first, then the puts and deletes, then the registry.
            batch = store.batch()
            values = {
                loc: self._dictionary.encode(store, state.cf, loc, batch) for loc in dict.fromkeys(plan.put_locations)
            }
            put, delete = batch.put, batch.delete
            for key, loc in zip(plan.put_keys, plan.put_locations):
                put(key, values[loc], handle)
            for key in plan.delete_keys:
                delete(key, handle)
            # 3. Counters by the net change, and the partition's synced seq, in the same batch.
            state.entries += plan.entries_delta
            for loc, delta in plan.fills_delta.items():
                state.bump_fill(loc, delta)
            state.synced_seq = max(state.synced_seq, synced_seq)
            store.write(registry.put_states(batch, [state]))
            changed = plan.changed
        self.metrics.add(partition=partition, catchup_entries=changed)
        if self.recovery_bound is not None and synced_seq >= self.recovery_bound:
            self._unsure.discard(partition)  # read-first past anything a crashed session can have applied
        return changed

    @property
    def needs_recovery_bound(self) -> bool:
        """Whether partitions are unsure and catch-up has not yet said how far a crashed session can have got."""
        return bool(self._unsure) and self.recovery_bound is None

    def bound_recovery(self, seq: int) -> None:
        """Record the table's newest completed seq, read after this open: a session that crashed before it could
        not have applied anything past it, so a partition read-first up to it is sure again (apply_exact)."""
        if self._unsure and self.recovery_bound is None:
            self.recovery_bound = seq

    def apply_exact(
        self, partition: str, keys: Sequence[str] | pa.Array, locations: pa.Array, deleted: np.ndarray, synced_seq: int
    ) -> int:
        """`apply` for entries each of which changes the family (a partitioned table's committed entries: see
        changes.exact_changes), without reading the family first: every entry is one write and moves the counters
        by its own +1 or -1, so a catch-up costs no lookup per entry.

        Falls back to `apply` where the entries cannot say what they change (an entry without a location) or the
        family may already hold some of them: opened after an unclean shutdown, its data may be ahead of its
        registry, and only a read makes a replay harmless, until the partition is caught up past `recovery_bound`.
        """
        with self._lock:
            state = self._states.get(partition)
            if state is None:
                return 0
            plan = (
                None
                if partition in self._unsure or locations.null_count
                else exact_changes(codec.encode_keys_binary(normalize_keys(keys)), locations, deleted)
            )
            if plan is None:
                return self.apply(partition, keys, locations.to_pylist(), deleted, synced_seq)
            store = self._require_store()
            # 1. New dictionary entries, the changes in key order (a write batch, or one SST when large), the registry.
            batch = store.batch()
            known = len(self._dictionary.locations(state.cf))
            value_of = np.empty(len(plan.locations), dtype=object)
            value_of[:] = [self._dictionary.encode(store, state.cf, loc, batch) for loc in plan.locations]
            dictionary = self._dictionary.locations(state.cf)
            ingested = write_changes(
                store,
                state.cf,
                plan,
                value_of[plan.codes].tolist(),
                batch,
                dictionary if len(dictionary) > known else None,
                self.scratch_dir,
                self.config,
            )
            # 2. Counters by the entries' own movements, and the partition's synced seq, in the same batch.
            state.entries += plan.entries_delta
            for loc, delta in plan.fills_delta.items():  # no zero movements (exact_changes leaves them out)
                state.bump_fill(loc, delta)
            state.synced_seq = max(state.synced_seq, synced_seq)
            store.write(registry.put_states(batch, [state]))
            if ingested:
                # The ingested SST is durable at once, the registry only once flushed: flush it now, so a crash
                # leaves the data ahead of its registry (counted again by the next open) for milliseconds only.
                store.flush()
        self.metrics.add(partition=partition, catchup_entries=plan.changed)
        return plan.changed

    def set_watermark(self, seq: int) -> None:
        """Record the completion seq up to which the whole cache (all its partitions) is caught up."""
        with self._lock:
            for state in self._states.values():
                state.synced_seq = max(state.synced_seq, seq)
            self.watermark = seq
            batch = registry.put_states(self._require_store().batch(), self._states.values())
            batch.put(registry.WATERMARK_KEY, str(seq).encode())
            self._require_store().write(batch)

    def set_info(self, name: str, value: dict[str, Any]) -> None:
        """Store a small named record in the registry (e.g. the last bootstrap's window and instant)."""
        with self._lock:
            self._require_store().db[registry.info_key(name)] = registry.pack(value)

    def info(self, name: str) -> dict[str, Any] | None:
        """A named registry record written by set_info (None if never written)."""
        return registry.read_info(self._require_store().db, name, self.path)

    # ---- sizes and iteration -------------------------------------------------------------------------------
    def disk_bytes(self, partition: str | None = None) -> int:
        """On-disk bytes of one partition's SST files, or of the whole cache directory."""
        store = self._require_store()
        if partition is None:
            return store.disk_bytes()
        state = self._states.get(partition)
        return 0 if state is None else store.disk_bytes(state.cf)

    def items(self, partition: str) -> Iterable[tuple[str, str]]:
        """(key, location) of every committed entry of a ready partition, in encoded-key order (for verify)."""
        with self._lock:
            state = self._ready_state(partition)
            view = self._require_store().cf(state.cf)
        yield from committed_items(view, lambda raw: self._dictionary.decode(state.cf, raw))

    def flush(self) -> None:
        """Persist all memtables (data first, registry last)."""
        self._require_store().flush()

    # ---- helpers -------------------------------------------------------------------------------------------
    def _require_store(self) -> Store:
        if self.store is None:
            raise CacheError(f"cache {self.path} is not open")
        return self.store

    def _ready_state(self, partition: str) -> PartitionState:
        state = self._states.get(partition)
        if state is None:
            raise PartitionNotReadyError(
                f"partition {partition!r} is not loaded in cache {self.path}; load it (bootstrap or on-demand) first"
            )
        return state

    def _forget_family(self, cf: str) -> None:
        self._require_store().drop(cf)
        self._dictionary.forget(cf)

    def _recount(self, state: PartitionState) -> None:
        """After an unclean shutdown the data may be ahead of the registry: recount entries and fills."""
        state.entries, state.fills = self._dictionary.count(self._require_store(), state.cf)
        self._require_store().db[registry.partition_key(state.partition)] = registry.pack(state)
