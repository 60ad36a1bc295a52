"""A task's session on one shard's cache: open it under the shard's lock, catch it up to the latest commit, serve
on-demand loads, reap at the end, and discard a damaged replica so that the next session rebuilds it; plus the
worker's long-lived tables and the cache a cache service holds open between sessions (`HeldCache`).

Process model (docs/DESIGN.md): a task opens its shard's cache directory, uses it and closes it before it ends.
PySpark runs tasks in several Python worker processes, RocksDB admits one read-write opener per directory, and an
idle worker never gets a chance to give a directory back; holding a cache only for the length of a task is what
makes every placement correct. With the opt-in cache service (cache.service) the shard's service process holds the
directory open between tasks instead (`HeldCache`) and gives it back on request (shard_service.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pyarrow as pa

from dbidx.bootstrap.on_demand import OnDemandLoader
from dbidx.cache.catchup import sync
from dbidx.cache.dir_lock import lock_path
from dbidx.cache.metrics import CacheMetrics
from dbidx.cache.reaper import discard_cache_dir, reap, sweep_abandoned
from dbidx.cache.record_cache import RecordIndexCache
from dbidx.config import CacheConfig
from dbidx.errors import CacheCorruptError, CacheError, CacheServiceError, CorruptFileError, HistoryCompactedError
from dbidx.spark_integration.tagger import ShardTagger, TagOptions
from dbidx.spark_integration.task_result import ShardMetrics
from dbidx.table.facade import Table

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


def tag_rebuilding(
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
            rebuilding(metrics, exc)
    raise AssertionError("unreachable")  # the loop returns or raises


def rebuilding(metrics: ShardMetrics, damage: CacheCorruptError) -> None:
    """Count and log a damaged cache that this task rebuilds from the index."""
    metrics.cache_rebuilds += 1
    log.warning(
        "dbidx: the cache of shard %d was damaged and is rebuilt from the index in this task: %s", metrics.shard, damage
    )
