"""What runs inside one Spark task: open the shard's cache, catch up, load cold partitions, tag; for an upsert also
write the data files and hand the index entries back to the driver.

Process model (docs/DESIGN.md): a task opens its shard's cache directory under the shard's flock, uses it and
closes it before it ends. PySpark runs tasks in several Python worker processes (and RDD and Arrow workers are
different processes), RocksDB admits one read-write opener per directory, and an idle worker never gets a chance
to give a directory back; holding a cache only for the length of a task is what makes every placement correct.
Shards are independent directories, so tasks of different shards run on different cores at once. Nothing here
imports pyspark: the Spark wrappers in `api.py` pass the task attempt id in.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable, Iterator

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbidx.bootstrap.on_demand import ensure_loaded
from dbidx.cache.catchup import sync
from dbidx.cache.reaper import reap
from dbidx.cache.record_cache import RecordIndexCache
from dbidx.mdt.table import Table
from dbidx.spark_integration import datafiles
from dbidx.spark_integration.tagger import (
    ROW_ID, TAG_FILE_GROUP, TAG_IS_DELETE, TAG_IS_UPDATE, TAG_OLD_FILE_GROUP, TAG_OLD_PARTITION, TAG_PARTITION,
    ShardTagger, TagCounts, TagOptions, latest_per_key,
)

RESULT_DDL = "shard int, attempt long, payload binary"
OP_INSERT, OP_DELETE, OP_MOVE = "insert", "delete", "move"
ENTRY_SCHEMA = pa.schema([("op", pa.string()), ("key", pa.string()), ("partition", pa.string()),
                          ("file_group", pa.string()), ("old_partition", pa.string()),
                          ("old_file_group", pa.string())])
REAPER_INFO = "reaper"
TAG_COUNTS = [f.name for f in fields(TagCounts)]
_TABLES: dict[tuple[str, str], Table] = {}  # per worker process: Python workers are reused, timelines stay warm
_TABLES_LOCK = threading.Lock()


@dataclass
class TaskCounts(TagCounts):
    """Tagging counts plus the cache counters of the same work (summed per shard, then per commit)."""

    hits: int = 0
    misses: int = 0
    on_demand_loads: int = 0
    stall_seconds: float = 0.0
    catchup_entries: int = 0
    reloads: int = 0
    evictions: int = 0


CACHE_COUNTERS = [f.name for f in fields(TaskCounts) if f.name not in TAG_COUNTS]


@dataclass
class ShardMetrics(TaskCounts):
    """One shard's work in one task (F30): tagging counts, cache counters, catch-up and timings."""

    shard: int = 0
    open_seconds: float = 0.0
    sync_seconds: float = 0.0
    tag_seconds: float = 0.0
    write_seconds: float = 0.0
    cache_disk_bytes: int = 0
    cache_entries: int = 0
    partitions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for msgpack and JSON."""
        return asdict(self)


def warm_table(table: Table) -> Table:
    """The worker's long-lived Table for this table id (its timeline is refreshed incrementally, not re-read)."""
    with _TABLES_LOCK:
        key = (table.props.table_id, table.uri)
        known = _TABLES.get(key)
        if known is None:
            known = _TABLES[key] = table
        return known


@contextmanager
def shard_session(table: Table, shard: int, options: TagOptions, metrics: ShardMetrics) -> Iterator[RecordIndexCache]:
    """The shard's cache, opened under its lock and caught up to the latest commit; closed when the block ends."""
    started = time.perf_counter()
    cache = RecordIndexCache.for_table(table, shard, options.cache).open()
    try:
        metrics.open_seconds += time.perf_counter() - started
        result = sync(cache, table)
        metrics.sync_seconds += result.seconds
        yield cache
        reap_if_due(cache)
        for name in CACHE_COUNTERS:
            setattr(metrics, name, getattr(metrics, name) + getattr(cache.metrics, name))
        metrics.cache_entries = sum(s.entries for s in cache.partitions().values())
        metrics.cache_disk_bytes = cache.disk_bytes()
    finally:
        cache.close()


def reap_if_due(cache: RecordIndexCache, now_ms: int | None = None) -> bool:
    """Run the TTL / disk-budget reaper at most every reaper_interval_s per cache, at the end of a task.

    Why here: no process outlives the tasks that open a cache (section 2 of docs/DESIGN.md), so a background reaper
    thread has nowhere to live; the end of a task is when the batch's partitions have just been touched (TTL keeps
    them) and the task holds the lock anyway.
    """
    now = int(time.time() * 1000) if now_ms is None else now_ms
    last = (cache.info(REAPER_INFO) or {}).get("last_ms", 0)
    if now - last < cache.config.reaper_interval_s * 1000:
        return False
    result = reap(cache, now_ms=now)
    cache.set_info(REAPER_INFO, {"last_ms": now, "dropped": result.dropped})
    return True


def _count_into(metrics: ShardMetrics, counts: TagCounts) -> None:
    for name in TAG_COUNTS:
        setattr(metrics, name, getattr(metrics, name) + getattr(counts, name))


def _shard_slices(table: Table, batch: pa.Table, options: TagOptions) -> list[tuple[int, pa.Table]]:
    """The batch split by key shard (after repartitioning by shard there is exactly one)."""
    shards = table.shard_of(options.keys_of(batch))
    distinct = np.unique(shards)
    if len(distinct) == 1:
        return [(int(distinct[0]), batch)]
    return [(int(s), batch.filter(pa.array(shards == s))) for s in distinct]


def tag_batches(batches: Iterable[pa.RecordBatch], table: Table, options: TagOptions) -> Iterator[pa.RecordBatch]:
    """mapInArrow body of `tag`: every row back with its tag columns; one cache open at a time, per task."""
    table = warm_table(table)
    taggers: dict[int, ShardTagger] = {}
    current: tuple[int, Any, RecordIndexCache] | None = None
    try:
        for record_batch in batches:
            batch = pa.Table.from_batches([record_batch])
            if batch.num_rows == 0:
                continue
            for shard, rows in _shard_slices(table, batch, options):
                # 1. Switch caches only when the shard changes (never two held at once: no lock-order deadlock).
                if current is None or current[0] != shard:
                    if current is not None:
                        current[1].__exit__(None, None, None)
                        current = None
                    session = shard_session(table, shard, options, ShardMetrics(shard=shard))
                    current = (shard, session, session.__enter__())
                tagger = taggers.setdefault(shard, ShardTagger(table, shard, options))
                ensure_loaded(current[2], table, tagger.partitions_needed(rows))
                yield from tagger.tag(current[2], rows).to_batches()
    finally:
        if current is not None:
            current[1].__exit__(None, None, None)


def upsert_batches(batches: Iterable[pa.RecordBatch], table: Table, options: TagOptions, instant: str,
                   attempt: int) -> dict[str, Any]:
    """Task body of `upsert`: dedupe, tag, write data files; returns files, index entries and metrics.

    The cache is not written: new keys reach it only through catch-up after the instant completes, so a failed
    or losing task attempt leaves nothing any later batch could mistake for committed.
    """
    table = warm_table(table)
    received = [b for b in batches if b.num_rows]
    if not received:
        return {"files": [], "entries": b"", "metrics": []}
    batch = pa.Table.from_batches(received)
    # 1. One row per record: ordering field first, then arrival.
    batch, dropped = latest_per_key(batch, options, table.global_index)
    tagged_parts, shard_metrics = [], []
    for shard, rows in _shard_slices(table, batch, options):
        metrics = ShardMetrics(shard=shard, duplicates_dropped=dropped if not shard_metrics else 0)
        # 2. Tag against the shard's cache, caught up to the latest commit, cold partitions loaded on demand.
        with shard_session(table, shard, options, metrics) as cache:
            started = time.perf_counter()
            tagger = ShardTagger(table, shard, options)
            ensure_loaded(cache, table, tagger.partitions_needed(rows))
            tagged_parts.append(tagger.tag(cache, rows))
            metrics.tag_seconds = time.perf_counter() - started
        _count_into(metrics, tagger.counts)
        shard_metrics.append(metrics)
    tagged = pa.concat_tables(tagged_parts)
    # 3. Data files, one per (partition, file group) of this attempt, each announced by a marker first.
    started = time.perf_counter()
    files = datafiles.write_groups(table.io, data_rows(tagged, options, instant),
                                   tagged.column(TAG_PARTITION).combine_chunks(),
                                   tagged.column(TAG_FILE_GROUP).combine_chunks(), instant, attempt)
    # 4. An attempt that outlived its job (rolled back) or lost to another attempt (committed without it) withdraws.
    datafiles.withdraw_if_settled(table.io, table.timeline, instant, files)
    for metrics in shard_metrics:
        metrics.write_seconds = (time.perf_counter() - started) / len(shard_metrics)
        metrics.partitions = sorted({f.partition for f in files})
    return {"files": [asdict(f) for f in files], "entries": _to_ipc(index_entries(tagged, options)),
            "metrics": [m.to_dict() for m in shard_metrics]}


def data_rows(tagged: pa.Table, options: TagOptions, instant: str) -> pa.Table:
    """What a data file stores: the user's columns (minus the delete flag), the instant and a deleted flag."""
    drop = {ROW_ID, TAG_PARTITION, TAG_FILE_GROUP, TAG_IS_UPDATE, TAG_OLD_PARTITION, TAG_OLD_FILE_GROUP,
            TAG_IS_DELETE, options.delete_column}
    rows = tagged.select([c for c in tagged.column_names if c not in drop])
    rows = rows.append_column(datafiles.INSTANT_COLUMN, pa.array([instant] * tagged.num_rows, pa.string()))
    return rows.append_column(datafiles.DELETED_COLUMN, tagged.column(TAG_IS_DELETE))


def index_entries(tagged: pa.Table, options: TagOptions) -> pa.Table:
    """Index changes of a tagged batch: inserts of new keys, tombstones of deleted ones, moves (global mode).

    Updates in place change nothing in the index: a key's location is immutable.
    """
    is_update = tagged.column(TAG_IS_UPDATE).to_numpy()
    is_delete = tagged.column(TAG_IS_DELETE).to_numpy()
    part = tagged.column(TAG_PARTITION).combine_chunks()
    old_part = tagged.column(TAG_OLD_PARTITION).combine_chunks()
    moved = is_update & ~is_delete & pc.fill_null(pc.not_equal(part, old_part), False).to_numpy(zero_copy_only=False)
    ops = np.full(tagged.num_rows, None, dtype=object)
    ops[~is_update & ~is_delete] = OP_INSERT
    ops[is_update & is_delete] = OP_DELETE
    ops[moved] = OP_MOVE
    keep = np.not_equal(ops, None)
    idx = pa.array(np.flatnonzero(keep))
    return pa.table({
        "op": pa.array(ops[keep].tolist(), pa.string()),
        "key": options.keys_of(tagged).take(idx),
        "partition": part.take(idx),
        "file_group": tagged.column(TAG_FILE_GROUP).combine_chunks().take(idx),
        "old_partition": old_part.take(idx),
        "old_file_group": tagged.column(TAG_OLD_FILE_GROUP).combine_chunks().take(idx),
    }, schema=ENTRY_SCHEMA)


def pack_result(shard: int, attempt: int, result: dict[str, Any]) -> pa.RecordBatch:
    """The one-row Arrow batch a task returns to the driver."""
    payload = msgpack.packb(result, use_bin_type=True)
    return pa.RecordBatch.from_pydict({"shard": pa.array([shard], pa.int32()), "attempt": pa.array([attempt]),
                                       "payload": pa.array([payload], pa.binary())})


def unpack_result(payload: bytes) -> tuple[list[datafiles.DataFile], pa.Table, list[dict[str, Any]]]:
    """Inverse of pack_result's payload: (data files, index entries, shard metrics)."""
    result = msgpack.unpackb(payload, raw=False)
    files = [datafiles.DataFile(**f) for f in result["files"]]
    entries = _from_ipc(result["entries"]) if result["entries"] else ENTRY_SCHEMA.empty_table()
    return files, entries, result["metrics"]


def _to_ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _from_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()
