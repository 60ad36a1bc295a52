"""Catch-up: bring a cache shard up to the index's latest completed instant before it serves lookups.

The cache is a replica; the index is the truth. Whatever happened while this cache was not looking (another
executor ran the shard, another writer committed, this process crashed with its memtable), the fix is the same:
read the committed entries after each partition's synced seq for this shard, apply them in commit order, and
reload a partition from a snapshot when its history has been cleaned away, the gap is larger than
`max_catchup_entries`, or the gap is large next to what the cache holds for the partition (more than
RELOAD_FRACTION of it: applying costs a write per entry, reloading streams the partition's snapshot into one SST, and
the measured crossover is in benchmarks/RESULTS.md, "Catch-up crossover").

A partitioned table's entries are applied without reading the cache first (RecordIndexCache.apply_exact): each one
inserts an absent key or removes a present one at the location it names, so it says itself how it moves the
counters. A global table's moves do not name the location they leave, so its entries are applied read-first.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from dbidx.arrays import one_chunk
from dbidx.cache.codec import global_location
from dbidx.cache.loading import load_from_snapshot
from dbidx.cache.record_cache import GLOBAL_PARTITION, RecordIndexCache
from dbidx.cache.staging import promote
from dbidx.errors import CacheMismatchError, HistoryCompactedError
from dbidx.index.rli_files import DELETED, FILE_GROUP, KEY, PARTITION
from dbidx.table.facade import Table


# Reload instead of apply when the entries to catch up exceed this fraction of the partition's cached entries (and
# RELOAD_MIN_ENTRIES): benchmarks/restart_bench.py measures applying against reloading per change fraction.
# Measured since applying stopped reading first (300 k held): applying wins up to 2x the held entries, and at 4x the
# two are even (1.09 s vs 1.05 s; 0.93 s vs 1.53 s in another run); past 3x a reload also leaves one compact SST.
RELOAD_FRACTION = 3.0
RELOAD_MIN_ENTRIES = 2_000
READ_AHEAD = 2  # partitions whose entries catch-up's reader thread may hold beside the one being applied


def prefers_reload(pending: int, held: int, bound: int) -> bool:
    """Whether a partition holding `held` entries takes `pending` new ones faster (or only) by a reload."""
    return pending > bound or (pending > RELOAD_MIN_ENTRIES and pending > RELOAD_FRACTION * held)


@dataclass
class CatchUpResult:
    """What one catch-up did."""

    from_seq: int
    to_seq: int
    applied_entries: int = 0
    applied_partitions: list[str] = field(default_factory=list)
    reloaded_partitions: list[str] = field(default_factory=list)
    dropped_partitions: list[str] = field(default_factory=list)  # the cache was ahead of its table: rebuilt
    staged_partitions: list[str] = field(default_factory=list)  # installed from a bulk load's staged SSTs
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return dict(vars(self))


def check_table(cache: RecordIndexCache, table: Table) -> None:
    """Refuse to sync a cache from a table it does not replicate."""
    ident = cache.identity
    if (ident.table_id, ident.num_shards, ident.index_mode) != (
        table.props.table_id,
        table.num_shards,
        table.props.index_mode,
    ) or ident.location not in ("", table.location):
        raise CacheMismatchError(
            f"cache {cache.path} replicates table {ident.table_id} at {ident.location or '?'} "
            f"({ident.num_shards} shards, {ident.index_mode}), not {table.location} "
            f"({table.props.table_id})"
        )


def sync(cache: RecordIndexCache, table: Table, max_catchup_entries: int | None = None) -> CatchUpResult:
    """Catch the cache up to the table's latest completed instant (its shard, its ready partitions only).

    Not to be called while this thread holds the table's view (`Table.held_data_view`): the reader thread of a
    catch-up may need the view's lock to report a file a clean removed meanwhile.
    """
    started = time.perf_counter()
    check_table(cache, table)
    bound = cache.config.max_catchup_entries if max_catchup_entries is None else max_catchup_entries
    shard = cache.shard
    # 1. The target: the latest completion the table's index view holds. Not the timeline's latest seq: a thread
    #    sharing the table may have read newer records into the timeline (starting or publishing an instant) that
    #    the view has not folded yet, and a watermark past the view would skip their entries for good.
    view = table.refresh()
    latest = view.applied_seq
    if cache.watermark > latest:
        # A task's pinned view may be older than what another process caught this cache up to meanwhile: only a
        # cache ahead of the table's newest state means a restored table.
        view = table.refresh(force=True)
        latest = view.applied_seq
    if cache.needs_recovery_bound:
        # Opened after a crash: whatever the crashed session applied was completed before this open, so the newest
        # completed seq read now bounds it (the task's pinned view may be older; catch-up reads first up to it).
        table.timeline.refresh()  # the timeline only: the task's (pinned) index view stays as it is
        cache.bound_recovery(table.timeline.latest_seq)
    result = CatchUpResult(from_seq=cache.watermark, to_seq=latest)
    if cache.watermark > latest:
        # The cache saw completions the table no longer has (the table was restored from a backup): what it holds
        # is another history. Never served: every partition is dropped and loads again from the table.
        result.dropped_partitions = sorted(cache.partitions())
        for partition in result.dropped_partitions:
            cache.drop_partition(partition)
        cache.set_watermark(0)
    # 1b. Partitions a bulk load staged beside this cache, confirmed by its completion: installed at its seq, so
    #     the steps below catch them up like any other (cache/staging.py).
    result.staged_partitions = promote(cache, table, view, latest).installed
    # 2. Group ready partitions by how far they already are (usually all at the watermark).
    by_start: dict[int, list[str]] = defaultdict(list)
    for partition, state in cache.partitions().items():
        if state.synced_seq < latest:
            by_start[state.synced_seq].append(partition)
    states = cache.partitions()
    for start, partitions in sorted(by_start.items()):
        # 3. Decide per partition from the file records alone: apply the deltas, or reload (history cleaned away,
        #    or a change so large next to what the cache holds that streaming the snapshot is cheaper).
        plan = table.incremental_plan(start, latest, shard=shard)
        stale = table.history_before(start)  # opened from a checkpoint past cleaned history: nothing to apply
        apply_now, reload = [], []
        for partition in partitions:
            rows, cleaned = plan.get(None if cache.global_mode else partition, (0, stale))
            big = prefers_reload(rows, states[partition].entries, bound)
            (reload if cleaned or big else apply_now).append(partition)
        # 4. Apply committed entries in commit order (the cache's apply() is idempotent).
        if apply_now:
            try:
                result.applied_entries += _apply_incremental(cache, table, start, latest, apply_now)
                result.applied_partitions += apply_now
            except HistoryCompactedError:  # a clean raced with us between plan and read
                reload += apply_now
        for partition in reload:
            load_from_snapshot(cache, table, partition, latest)
            result.reloaded_partitions.append(partition)
    cache.set_watermark(latest)
    result.seconds = time.perf_counter() - started
    cache.metrics.add(syncs=1, sync_seconds=result.seconds, reloads=len(result.reloaded_partitions))
    return result


def _apply_incremental(cache: RecordIndexCache, table: Table, start: int, end: int, partitions: list[str]) -> int:
    """Read (start, end] for the partitions of this shard and apply them partition by partition."""
    if not cache.global_mode:
        return _apply_partitioned(cache, table, start, end, partitions)
    changes = table.incremental(start, end, shard=cache.shard)
    if changes.num_rows == 0:
        return cache.apply(GLOBAL_PARTITION, [], [], [], synced_seq=end)
    # A move's entry does not name the location it leaves: only a read says what each entry changes.
    locations = [
        global_location(p, fg) if fg is not None else None
        for p, fg in zip(changes.column(PARTITION).to_pylist(), changes.column(FILE_GROUP).to_pylist())
    ]
    return cache.apply(
        GLOBAL_PARTITION, changes.column(KEY), locations, changes.column(DELETED).to_numpy(), synced_seq=end
    )


def _apply_partitioned(cache: RecordIndexCache, table: Table, start: int, end: int, partitions: list[str]) -> int:
    """Each partition's entries, applied without a read of the cache (changes.exact_changes): one write per entry.

    The delta files are listed once, here; a helper thread reads the next partition's files while this one is
    applied (Parquet decoding releases the GIL), at most READ_AHEAD partitions ahead so memory holds a few
    partitions' entries, not the whole gap. The helper only reads files: no listing, no refresh, no lock the caller
    may hold.
    """
    files: dict[str | None, list] = defaultdict(list)
    for seq, record in table.incremental_files(start, end, partitions, shard=cache.shard):
        files[record.partition].append((seq, record))
    todo = iter(partitions)
    applied = 0
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dbidx-catchup-read") as reader:
        ahead: deque = deque()

        def top_up() -> None:
            for partition in itertools.islice(todo, READ_AHEAD - len(ahead)):
                ahead.append((partition, reader.submit(table.read_incremental, files.get(partition, []))))

        top_up()
        try:
            while ahead:
                partition, future = ahead.popleft()
                changes = future.result()
                top_up()
                applied += cache.apply_exact(
                    partition,
                    one_chunk(changes.column(KEY)),
                    one_chunk(changes.column(FILE_GROUP)),
                    changes.column(DELETED).to_numpy(),
                    synced_seq=end,
                )
        finally:
            for _, future in ahead:  # a failed read or apply: the reads not started yet are not made
                future.cancel()
    return applied
