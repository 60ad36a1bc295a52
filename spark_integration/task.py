"""What runs inside one Spark task: tag rows against their shard's cache (a session of shard_sessions.py: open,
catch up, load cold partitions); for an upsert also write the data files, their deletion vectors' rows and the
shard's index files, and hand their records back to the driver.

Shards are independent cache directories, so tasks of different shards run on different cores at once. With the
opt-in cache service (cache.service) a task's work runs instead in the shard's service process, which holds the
cache open between tasks (shard_service.py). Nothing here imports pyspark: the Spark wrappers in `api.py` pass the
task attempt id in.
"""

from __future__ import annotations

import itertools
import logging
import time
from contextlib import ExitStack, nullcontext
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbidx.arrays import batches_as_one_chunk, one_chunk
from dbidx.cache import key_file_sweep
from dbidx.cache.record_cache import RecordIndexCache
from dbidx.cache.staging import StagedLoad
from dbidx.data.key_columns import KeySources
from dbidx.data.column_mapping import schema_string_in_force
from dbidx.data.not_null import check_not_null
from dbidx.data.key_files import KeyFiles
from dbidx.data.superseded import superseded_rows
from dbidx.errors import CacheCorruptError, CacheServiceError, DbidxError
from dbidx.table.facade import Table
from dbidx.spark_integration import datafiles, service_client
from dbidx.spark_integration.dedupe import latest_per_key
from dbidx.spark_integration.shard_sessions import (
    HeldCache,
    OpenShard,
    rebuilding,
    shard_session,
    tag_rebuilding,
    warm_table,
)
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

log = logging.getLogger(__name__)


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
                        rebuilding(ShardMetrics(shard=shard), damage)
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
        tagged, _tagger = tag_rebuilding(table, shard, options, metrics, rows, held)
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
    # NOT NULL as the task's own view has the schema (it absorbed what the driver absorbed before the job).
    check_not_null(batch, schema_string_in_force(table.data_view()), options.delete_column, f"upsert into {table.uri}")
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
            tagged_part, tagger = tag_rebuilding(table, shard, options, metrics, rows, held)
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
