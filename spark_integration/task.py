"""What runs inside one Spark task: open the shard's cache, catch up, load cold partitions, tag; for an upsert also
write the data files and hand the index entries back to the driver.

Process model (docs/DESIGN.md): a task opens its shard's cache directory under the shard's flock, uses it and
closes it before it ends. PySpark runs tasks in several Python worker processes (and RDD and Arrow workers are
different processes), RocksDB admits one read-write opener per directory, and an idle worker never gets a chance
to give a directory back; holding a cache only for the length of a task is what makes every placement correct.
Shards are independent directories, so tasks of different shards run on different cores at once. With the opt-in
cache service (cache.service) an upsert task's work runs instead in the shard's service process, which holds the
directory open between tasks (`HeldCache`) and gives it back on request (shard_service.py). Nothing here imports
pyspark: the Spark wrappers in `api.py` pass the task attempt id in.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
import traceback
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbidx.arrays import batches_as_one_chunk, one_chunk
from dbidx.bootstrap.on_demand import OnDemandLoader
from dbidx.cache import key_file_sweep
from dbidx.cache.catchup import sync
from dbidx.cache.dir_lock import lock_path
from dbidx.cache.metrics import CacheMetrics
from dbidx.cache.reaper import discard_cache_dir, reap, sweep_abandoned
from dbidx.cache.record_cache import RecordIndexCache
from dbidx.cache.staging import StagedLoad
from dbidx.data.key_columns import KeySources
from dbidx.data.key_files import KeyFiles
from dbidx.data.superseded import superseded_rows
from dbidx.config import CacheConfig
from dbidx.errors import (
    CacheCorruptError,
    CacheError,
    CacheServiceError,
    CorruptFileError,
    DbidxError,
    HistoryCompactedError,
)
from dbidx.table.facade import Table
from dbidx.spark_integration import datafiles, service_client
from dbidx.spark_integration.dedupe import latest_per_key
from dbidx.spark_integration.tagger import (
    ROW_ID,
    TAG_FILE_GROUP,
    TAG_IS_DELETE,
    TAG_IS_UPDATE,
    TAG_NAMES,
    TAG_OLD_FILE_GROUP,
    TAG_OLD_PARTITION,
    TAG_PARTITION,
    ShardTagger,
    TagOptions,
)
from dbidx.spark_integration.task_index import stage_each_delta, write_task_index, written_paths
from dbidx.spark_integration.task_result import ShardMetrics, TaskResult
from dbidx.storage.keyhash import shards_of_hashes, spark_hash

REAPER_INFO = "reaper"
_TABLES: dict[tuple[str, str], Table] = {}  # per worker process: Python workers are reused, timelines stay warm
_TABLES_LOCK = threading.Lock()
log = logging.getLogger(__name__)


def warm_table(table: Table) -> Table:
    """The worker's long-lived Table for this table id (its timeline is refreshed incrementally, not re-read),
    refreshed: what a task's `pinned()` block starts from."""
    with _TABLES_LOCK:
        key = (table.props.table_id, table.uri)
        known = _TABLES.get(key)
        if known is not None:
            try:
                known.refresh()
            except (CorruptFileError, HistoryCompactedError):  # its log shrank (a restored table), or retention
                # expired records it had not read (a worker or service idle for long): start over from the task's
                # own copy,
                known = None  # which reports real damage again if there is any
        if known is None:
            table.refresh()
            known = _TABLES[key] = table
        known.unpin_thread()  # a task that ended without leaving its pinned block (an abandoned generator) pins nothing
        return known


@dataclass
class OpenShard:
    """A task's hold on one shard: its open cache and the on-demand loader serving it (both end with the session)."""

    cache: RecordIndexCache
    loader: OnDemandLoader


class HeldCache:
    """A shard's cache kept open between task sessions by the process that holds it (the cache service): the
    directory stays locked and warm; a failed session, a release request or the service's exit closes it."""

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = Path(os.path.realpath(cache_dir))
        self.cache: RecordIndexCache | None = None
        self.ahead = ShardMetrics(shard=-1)  # what catch-ups between sessions did (catch_up_held), not yet reported

    def catch_up_held(self, table: Table, shard: int, options: TagOptions, open_cache: bool = False) -> int:
        """Catch the held cache up to the table's latest commit between tasks (the service, once the commit of the
        batch it served lands), so the next task finds nothing to catch up; what it did is reported by the next
        session (ShardMetrics.ahead_entries, and staged_loads: partitions a load staged). Nothing when the cache was
        let go meanwhile (another opener may want the directory), unless `open_cache` (after a bulk load: the cache
        is opened, the load's staged partitions installed, before the first batch comes)."""
        if not open_cache and (self.cache is None or self.cache.store is None):
            return 0
        table = warm_table(table)
        metrics = ShardMetrics(shard=shard)
        with table.pinned(refreshed=True), shard_session(table, shard, options, metrics, self):
            pass
        self.ahead.add(metrics)
        return metrics.catchup_entries

    def cache_for(self, table: Table, shard: int, config: CacheConfig) -> RecordIndexCache:
        """The held cache for this shard (the one directory this holder serves), reopened if it was let go."""
        wanted = RecordIndexCache.for_table(table, shard, config)
        if Path(os.path.realpath(wanted.path)) != self.cache_dir:
            raise CacheServiceError(
                f"the cache service of {self.cache_dir} was asked for shard {shard} of {table.uri}, whose cache is "
                f"{wanted.path}: a task reached the wrong service"
            )
        held = self.cache
        if held is not None and (held.store is None or held.config != config or held.identity != wanted.identity):
            self.release()
            held = None
        if held is None:
            held = self.cache = wanted
        elif held.store is not None:  # a kept directory counts as opened now (the abandoned-cache sweep's clock)
            with contextlib.suppress(OSError):
                os.utime(lock_path(held.path))
        return held

    def release(self) -> None:
        """Close the held cache (flushed, its lock given back), if any."""
        cache, self.cache = self.cache, None
        if cache is not None:
            cache.close()


@contextmanager
def shard_session(
    table: Table, shard: int, options: TagOptions, metrics: ShardMetrics, held: HeldCache | None = None
) -> Iterator[OpenShard]:
    """The shard's cache, opened under its lock and caught up to the latest commit, with the session's on-demand
    loader; both closed when the block ends (the loader first: no load outlives the cache it writes). With `held`
    (the cache service), the cache stays open after a clean end, and is closed by a failing one."""
    cache = (
        held.cache_for(table, shard, options.cache)
        if held is not None
        else RecordIndexCache.for_table(table, shard, options.cache)
    )
    try:
        with _opened(cache, table, metrics, keep=held is not None) as session:
            yield session
        if held is not None:
            ahead, held.ahead = held.ahead, ShardMetrics(shard=-1)  # reported by this session (off its path)
            metrics.add(ahead_entries=ahead.catchup_entries + ahead.ahead_entries, staged_loads=ahead.staged_loads)
    except BaseException as exc:
        if held is not None:
            held.cache = None  # closed by the failing session (below, or in _opened): reopened next time
        if not isinstance(exc, CacheError):
            raise
        damage = next((e for e in _causes(exc) if isinstance(e, CacheCorruptError)), None)
        if damage is None:
            raise
        # A damaged replica is never read again: discard it, so a retry of this task rebuilds it from the index.
        # First drop the frames' locals: a column family view alive in a traceback keeps RocksDB's in-process
        # LOCK of the closed directory, and the rebuilt cache at the same path could not open in this worker.
        for cause in _causes(exc):
            traceback.clear_frames(cause.__traceback__)
        outcome = discard_cache_dir(cache.path, cache.lock_identity)
        raise CacheCorruptError(f"{damage} [cache {cache.path}: {outcome}]") from exc


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """An exception and the ones it was raised from or during (a failing close may hide the damage it met)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]


@contextmanager
def _opened(cache: RecordIndexCache, table: Table, metrics: ShardMetrics, keep: bool = False) -> Iterator[OpenShard]:
    started = time.perf_counter()
    if cache.store is not None:  # held open since an earlier session: count this session's work only
        cache.metrics = CacheMetrics()
    else:
        cache.open()
        metrics.open_seconds += time.perf_counter() - started
    kept = False
    try:
        metrics.tagged_seq = sync(cache, table).to_seq
        with OnDemandLoader(cache, table) as loader:
            yield OpenShard(cache, loader)
        reap_if_due(cache)
        metrics.add(cache.metrics)  # hits, misses, loads and stalls, catch-up entries and seconds, evictions
        metrics.cache_entries = sum(s.entries for s in cache.partitions().values())
        metrics.cache_disk_bytes = cache.disk_bytes()
        kept = keep
    finally:
        if not kept:
            cache.close()
    if kept and cache.store is not None:  # what RocksDB created since (it makes files 0644) is tightened as a close
        with contextlib.suppress(OSError):  # would; best effort, as there: the directory is 0700 in any case
            cache.store.make_files_private()


def reap_if_due(cache: RecordIndexCache, now_ms: int | None = None) -> bool:
    """Run the TTL / disk-budget reaper at most every reaper_interval_s per cache, at the end of a task.

    Why here: without the opt-in cache service no process outlives the tasks that open a cache (section 2 of
    docs/DESIGN.md), so a background reaper thread has nowhere to live (the service runs it the same way); the end
    of a task is when the batch's partitions have just been touched (TTL keeps them) and the task holds the lock
    anyway.
    """
    now = int(time.time() * 1000) if now_ms is None else now_ms
    last = (cache.info(REAPER_INFO) or {}).get("last_ms", 0)
    if now - last < cache.config.reaper_interval_s * 1000:
        return False
    result = reap(cache, now_ms=now)
    # Whole caches of other shards or tables nobody opened for the TTL (dead executors' leftovers) go too.
    abandoned = sweep_abandoned(cache.path.parent.parent, cache.config.partition_ttl_hours, now_s=now / 1000)
    cache.set_info(REAPER_INFO, {"last_ms": now, "dropped": result.dropped, "abandoned": [a.path for a in abandoned]})
    return True


def _shard_slices(table: Table, batch: pa.Table, hashes: np.ndarray) -> list[tuple[int, pa.Table]]:
    """The batch split by key shard (after repartitioning by shard there is exactly one); `hashes`: the keys'
    `spark_hash`."""
    shards = shards_of_hashes(hashes, table.num_shards)
    distinct = np.unique(shards)
    if len(distinct) == 1:
        return [(int(distinct[0]), batch)]
    return [(int(s), batch.filter(pa.array(shards == s))) for s in distinct]


# A `tag` task sends its rows to the cache service (cache.service) only up to this many bytes of input: the request
# holds them all in memory twice (the task's copy and the service's), where a task tagging itself streams them.
TAG_SERVICE_MAX_BYTES = 256 << 20


def tag_batches(batches: Iterable[pa.RecordBatch], table: Table, options: TagOptions) -> Iterator[pa.RecordBatch]:
    """mapInArrow body of `tag`: every row back with its tag columns; one cache open at a time, per task.

    With `cache.service` on, a task's rows of one shard (up to TAG_SERVICE_MAX_BYTES) are tagged by the shard's cache
    service, which holds the cache open and warm across tasks (service_client.tag_in_service); otherwise here.
    Each shard session lives in an ExitStack, so an error (or the consumer stopping early) takes the session's
    failure path: the cache is closed without the success epilogue (reaper, metrics) running on a broken task.
    """
    if options.cache.service:
        gathered, rest = _gather(iter(batches), TAG_SERVICE_MAX_BYTES)
        if rest is None and gathered:
            served = service_client.tag_in_service(gathered, table, options)
            if served is not None:
                yield from served.to_batches()
                return
        batches = itertools.chain(gathered, rest or ())
    table = warm_table(table)
    taggers: dict[int, ShardTagger] = {}
    with ExitStack() as stack:
        stack.enter_context(table.pinned(refreshed=True))  # one view of the table for the whole task
        current: tuple[int, ExitStack, OpenShard] | None = None
        for record_batch in batches:
            batch = pa.Table.from_batches([record_batch])
            if batch.num_rows == 0:
                continue
            for shard, rows in _shard_slices(table, batch, spark_hash(options.keys_of(batch))):
                tagger = taggers.setdefault(shard, ShardTagger(table, shard, options))
                for attempt in (0, 1):
                    try:
                        # 1. Switch caches only when the shard changes (never two held at once: no lock-order
                        #    deadlock).
                        if current is None or current[0] != shard:
                            if current is not None:
                                current[1].close()  # the previous shard finished cleanly: its epilogue runs
                                current = None
                            session = stack.enter_context(ExitStack())
                            held = session.enter_context(
                                shard_session(table, shard, options, ShardMetrics(shard=shard))
                            )
                            current = (shard, session, held)
                        current[2].loader.ensure_loaded(tagger.partitions_needed(rows))
                        tagged = tagger.tag(current[2].cache, rows)
                        break
                    except CacheCorruptError as exc:
                        # 2. A damaged cache: its session discards it (if the damage surfaced after the open, by
                        #    ending the session with the error), then one more session rebuilds it from the index.
                        damage: CacheCorruptError = exc
                        if current is not None:
                            failed, current = current, None
                            try:
                                failed[1].__exit__(type(exc), exc, exc.__traceback__)
                            except CacheCorruptError as discarded:
                                damage = discarded
                        if attempt:
                            if damage is exc:
                                raise
                            raise damage from exc
                        _rebuilding(ShardMetrics(shard=shard), damage)
                yield from tagged.to_batches()


def _gather(
    batches: Iterator[pa.RecordBatch], max_bytes: int
) -> tuple[list[pa.RecordBatch], Iterator[pa.RecordBatch] | None]:
    """The non-empty batches up to `max_bytes`, and None if that was all, else the iterator of the rest (the batch
    that crossed the limit is the last one gathered)."""
    gathered: list[pa.RecordBatch] = []
    size = 0
    for batch in batches:
        if batch.num_rows:
            gathered.append(batch)
            size += batch.nbytes
        if size > max_bytes:
            return gathered, batches
    return gathered, None


def tag_in_held(batches: list[pa.RecordBatch], table: Table, options: TagOptions, held: HeldCache) -> pa.Table:
    """What the cache service runs for a `tag` request: the rows (all of one shard) with their tag columns, in input
    order, tagged in one session of the held cache (a damaged cache is rebuilt once, as in an upsert task)."""
    table = warm_table(table)
    rows = pa.Table.from_batches(batches)
    with table.pinned(refreshed=True):  # one view of the table for the whole request
        slices = _shard_slices(table, rows, spark_hash(options.keys_of(rows)))
        if len(slices) != 1:
            raise CacheServiceError(
                f"the cache service of {held.cache_dir} was sent rows of shards {[s for s, _ in slices]} to tag; "
                "a request holds one shard's rows"
            )
        shard, rows = slices[0]
        metrics = ShardMetrics(shard=shard)
        tagged, _tagger = _tag_rebuilding(table, shard, options, metrics, rows, held)
    # A tag reports no metrics: what this session and the catch-ups before it applied is reported by the next upsert,
    # as work done before it came (ahead_entries, staged_loads).
    held.ahead.add(ahead_entries=metrics.catchup_entries + metrics.ahead_entries, staged_loads=metrics.staged_loads)
    return tagged


def upsert_batches(
    batches: Iterable[pa.RecordBatch],
    table: Table,
    options: TagOptions,
    instant: str,
    attempt: int,
    held: HeldCache | None = None,
) -> TaskResult:
    """Task body of `upsert`: dedupe, tag, write data files and the shard's index files; returns their records.

    The cache is not written: new keys reach it only through catch-up after the instant completes, so a failed
    or losing task attempt leaves nothing any later batch could mistake for committed. What goes back to the driver
    is metadata only (file records, touched-key ranges, partition stats, metrics): never a key.
    With `cache.service` on, the work runs in the shard's cache service instead (service_client.py), unless the
    rows span several shards or no service can be reached; `held` is the service's own call.
    """
    if held is None and options.cache.service and options.bulk_seq is None:
        batches = [b for b in batches if b.num_rows]
        served = service_client.upsert_in_service(batches, table, options, instant, attempt)
        if served is not None:
            return served
    view_read_s = time.time()  # before the refresh: what the key-file sweep counts as "modified after the view"
    table = warm_table(table)
    with table.pinned(refreshed=True):  # one view of the table for the whole task (the settled check reads anew)
        result = _upsert_rows(batches, table, options, instant, attempt, view_read_s, held)
    if options.cache.service and options.bulk_seq is not None and len(result.metrics) == 1:
        service_client.prestart(table, result.metrics[0].shard, options)  # up before the next batch's task
    return result


def _upsert_rows(
    batches: Iterable[pa.RecordBatch],
    table: Table,
    options: TagOptions,
    instant: str,
    attempt: int,
    view_read_s: float,
    held: HeldCache | None,
) -> TaskResult:
    received = [b for b in batches if b.num_rows]
    if not received:
        return TaskResult(superseded_seq=table.data_view().applied_seq)
    # One chunk per column (arrays.batches_as_one_chunk says why), the input's copy freed column by column.
    batch = batches_as_one_chunk(received)
    received_rows = batch.num_rows
    # 1. One row per record: ordering field first, then arrival. The keys' hashes serve both the test for distinct
    #    keys and the shard split.
    hashes = spark_hash(options.keys_of(batch))
    batch, dropped = latest_per_key(batch, options, table.global_index, hashes)
    if dropped:
        hashes = spark_hash(options.keys_of(batch))
    tagged_parts: list[pa.Table] = []
    shard_metrics: list[ShardMetrics] = []
    slices = _shard_slices(table, batch, hashes)
    del hashes
    for shard, rows in slices:
        first = not shard_metrics  # the task-wide counts go to its first shard, once
        metrics = ShardMetrics(
            shard=shard,
            duplicates_dropped=dropped if first else 0,
            input_rows=received_rows if first else 0,
            served=int(held is not None),
        )
        # 2. Tag against the shard's cache, caught up to the latest commit, cold partitions loaded on demand; or,
        #    when the driver found that no key can be in the index yet, without the cache (the bulk path).
        tagger = ShardTagger(table, shard, options)
        if options.bulk_seq is not None:
            started = time.perf_counter()
            tagged_parts.append(tagger.tag_new(rows))
            metrics.tag_seconds, metrics.tagged_seq = time.perf_counter() - started, options.bulk_seq
        else:
            tagged_part, tagger = _tag_rebuilding(table, shard, options, metrics, rows, held)
            tagged_parts.append(tagged_part)
            del tagged_part  # held only by tagged_parts: the user's columns can go once the data files are written
        metrics.add(tagger.counts)
        shard_metrics.append(metrics)
    tagged = pa.concat_tables(tagged_parts)
    # 3. Data files, one per (partition, file group) of this attempt, each announced by a marker first.
    started = time.perf_counter()
    moves = move_tombstones(tagged)
    # Without moves (every bulk load, most batches) the columns stay one chunk each: no copy to combine them.
    to_write = pa.concat_tables([tagged, moves]) if moves.num_rows else tagged
    del moves
    written_rows: list = []
    files = datafiles.write_groups(
        table.io,
        data_rows(to_write, options),
        one_chunk(to_write.column(TAG_IS_DELETE)),
        one_chunk(to_write.column(TAG_PARTITION)),
        one_chunk(to_write.column(TAG_FILE_GROUP)),
        instant,
        attempt,
        options.key,
        written_rows,
    )
    del to_write
    # From here on only the key and the tag columns are read: the user's other columns (most of the input's bytes)
    # are let go before the deletion vectors and the index files are built.
    shards = [shard for shard, _rows in slices]
    tagged = tagged.select([c for c in tagged.column_names if c == options.key or c in TAG_NAMES])
    del batch, slices, tagged_parts, rows
    # 3b. The rows these files supersede (their deletion vectors), found here on the executor, where the keys are
    #     in memory and the older files' key columns stay cached in the worker; the driver uses them if nothing
    #     committed since changed these file groups (table/writer.CommitWriter._tasks_fresh).
    #     The view is held while they are computed: the seq they are stamped with is exactly the state they saw (a
    #     thread sharing this warm table may publish and refresh meanwhile; a later seq would hide its commit).
    disk, sources = datafiles.key_files_for(table, shards[0], options.cache), KeySources()  # (no lock needed)
    disk = _announced(disk, instant, attempt, written_rows)
    with table.held_data_view() as view:
        basis_seq = view.applied_seq
        fresh = superseded_rows(table.io, view, written_rows, options.key, disk, sources)
    lead = shard_metrics[0]  # task-wide figures go to its first shard, once
    lead.keys_from_memory, lead.keys_from_key_files = sources.memory, sources.key_files
    lead.keys_from_data_files = sources.data_files
    del written_rows
    # 4. The shard's index delta files and touched keys, announced the same way. A bulk load also stages each
    #    delta's entries as the shard cache's own SST beside the cache (a warm first batch after the load).
    load = None
    if options.bulk_seq is not None and options.cache.stage_loads and len(shards) == 1:
        load = StagedLoad(
            RecordIndexCache.for_table(table, shards[0], options.cache).path, instant, attempt, options.cache
        )
    with load if load is not None else nullcontext():
        index_files, touched, changes = write_task_index(
            table,
            tagged,
            options,
            instant,
            attempt,
            {m.shard: m.tagged_seq for m in shard_metrics},
            shard=shards[0] if len(shards) == 1 else None,
            on_written=None if load is None else stage_each_delta(load, table.global_index),
        )
    if load is not None:
        shard_metrics[0].stage_seconds, shard_metrics[0].staged_entries = load.seconds, load.entries
    # 5. An attempt that outlived its job (rolled back) or lost to another attempt (committed without it) withdraws.
    datafiles.withdraw_if_settled(table.io, table.timeline, instant, written_paths(files, index_files, touched))
    if disk is not None:
        _sweep_key_files(disk, table, view_read_s)
    for metrics in shard_metrics:
        metrics.write_seconds = (time.perf_counter() - started) / len(shard_metrics)
        metrics.partitions = sorted({f.partition for f in files})
    return TaskResult(
        superseded_seq=basis_seq,
        files=files,
        index_files=index_files,
        touched=touched,
        changes=changes,
        superseded=fresh,
        metrics=shard_metrics,
    )


def _announced(disk: KeyFiles | None, instant: str, attempt: int, written: list) -> KeyFiles | None:
    """The executor's key files, once this attempt announced the ones it will save for its new data files
    (cache/key_file_sweep.py: a sweep keeps them while the instant is pending); None, with a warning, when it cannot
    announce them: then it saves none, rather than files a sweep could not tell from dead ones."""
    if disk is None:
        return None
    names = [
        (record.path, path.name) for record, _keys, _deleted in written if (path := disk.path_of(record)) is not None
    ]
    try:
        key_file_sweep.announce(disk.root, instant, attempt, names)
    except (OSError, ValueError) as exc:
        log.warning("dbidx keeps no key files for %s this task: announcing them failed (%s)", disk.root, exc)
        return None
    return disk


def _sweep_key_files(disk: KeyFiles, table: Table, view_read_s: float) -> None:
    """Delete the executor's key files of data files the table no longer has (cache/key_file_sweep.py says which and
    why); never fails the task (a key file is never needed), so a failure is a warning."""
    try:
        result = key_file_sweep.sweep(disk, table, view_read_s)
    except (OSError, DbidxError) as exc:
        log.warning(
            "dbidx could not sweep the key files of data files %s no longer has in %s: %s", table.uri, disk.root, exc
        )
        return
    if result.deleted:
        log.info(
            "dbidx deleted %d key files (%d bytes) of data files %s no longer has",
            len(result.deleted),
            result.deleted_bytes,
            table.uri,
        )


def _tag_rebuilding(
    table: Table, shard: int, options: TagOptions, metrics: ShardMetrics, rows: pa.Table, held: HeldCache | None
) -> tuple[pa.Table, ShardTagger]:
    """Tag one shard's rows in a session; if the cache is damaged (the session discarded it), tag them again in a
    second session, which rebuilds the cache from the index, counted in `cache_rebuilds`. Only a second failure
    fails the task.

    Why in the same task: the cache is a replica of the index, so damage to it (a flipped byte, a manifest deleted
    by hand) costs a reload, never the user's batch. Nothing was tagged from the damaged cache: RocksDB's
    checksums fail the read instead of answering.
    """
    for attempt in (0, 1):
        tagger = ShardTagger(table, shard, options)
        try:
            with shard_session(table, shard, options, metrics, held) as session:
                started = time.perf_counter()
                session.loader.ensure_loaded(tagger.partitions_needed(rows))
                tagged = tagger.tag(session.cache, rows, last=True)  # a fresh tagger, one call
                metrics.tag_seconds += time.perf_counter() - started
            return tagged, tagger
        except CacheCorruptError as exc:
            if attempt:
                raise
            _rebuilding(metrics, exc)
    raise AssertionError("unreachable")  # the loop returns or raises


def _rebuilding(metrics: ShardMetrics, damage: CacheCorruptError) -> None:
    metrics.cache_rebuilds += 1
    log.warning(
        "dbidx: the cache of shard %d was damaged and is rebuilt from the index in this task: %s", metrics.shard, damage
    )


def move_tombstones(tagged: pa.Table) -> pa.Table:
    """Delete rows for the old file groups of records that moved partition (global index): readers merge one file
    group at a time (data/reads.py), so the old group must itself say that the record left it."""
    old_part = tagged.column(TAG_OLD_PARTITION)
    moved = pc.and_(
        pc.fill_null(tagged.column(TAG_IS_UPDATE), False),
        pc.fill_null(pc.not_equal(old_part, tagged.column(TAG_PARTITION)), False),
    )
    gone = tagged.filter(moved)
    if gone.num_rows == 0:
        return gone
    gone = gone.set_column(gone.schema.get_field_index(TAG_PARTITION), TAG_PARTITION, gone.column(TAG_OLD_PARTITION))
    gone = gone.set_column(gone.schema.get_field_index(TAG_FILE_GROUP), TAG_FILE_GROUP, gone.column(TAG_OLD_FILE_GROUP))
    flag = pa.array([True] * gone.num_rows, tagged.schema.field(TAG_IS_DELETE).type)
    return gone.set_column(gone.schema.get_field_index(TAG_IS_DELETE), TAG_IS_DELETE, flag)


def data_rows(tagged: pa.Table, options: TagOptions) -> pa.Table:
    """The user's columns of tagged rows (minus the delete flag): what a data file stores, before write_groups
    appends the instant and deleted columns per file."""
    drop = {
        ROW_ID,
        TAG_PARTITION,
        TAG_FILE_GROUP,
        TAG_IS_UPDATE,
        TAG_OLD_PARTITION,
        TAG_OLD_FILE_GROUP,
        TAG_IS_DELETE,
        options.delete_column,
    }
    return tagged.select([c for c in tagged.column_names if c not in drop])
