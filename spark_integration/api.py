"""The Spark entry points: `tag`, `upsert` and `read_table`. pyspark is imported lazily, inside the functions.

`upsert` is one instant: the driver starts it, one Spark job tags and writes the data files (one task per key shard,
each with its executor-local cache), the driver collects the index entries of the winning task attempts, writes
them through the MDT CommitWriter and publishes data and index in one completion record. Any failure rolls the
instant back and deletes every file any attempt announced. Callable from `foreachBatch`.
"""
from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Mapping

import pyarrow as pa
import pyarrow.compute as pc

from dbidx import errors
from dbidx.buckets.assigner import BucketSpec
from dbidx.config import CacheConfig
from dbidx.errors import ConfigError, DbidxError, InvalidInputError
from dbidx.mdt.table import Table
from dbidx.mdt.timeline import ACTION_COMMIT
from dbidx.spark_integration import datafiles, task
from dbidx.spark_integration.tagger import ROW_ID, TAG_FIELDS, TagOptions

UPSERT_EXTRA = "upsert"
TaskHook = Callable[[int, int], None]
_TASK_ERROR = re.compile(r"dbidx\.errors\.(\w+): (.+)")


@dataclass
class CommitSummary(task.TaskCounts):
    """What one upsert did (F30): the instant, row kinds, files, timings and per-shard cache metrics."""

    instant: str = ""
    seq: int = 0
    partitions: list[str] = field(default_factory=list)
    data_files: int = 0
    data_bytes: int = 0
    index_entries: int = 0
    orphans_deleted: int = 0
    seconds: float = 0.0
    per_shard: list[dict[str, Any]] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Share of looked-up keys found in the cache (updates, deletes and moves over all rows looked up)."""
        looked = self.hits + self.misses
        return self.hits / looked if looked else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (also stored, without per_shard, in the commit's metadata)."""
        data = asdict(self)
        data["hit_rate"] = round(self.hit_rate, 4)
        return data


def make_options(table: Table, key: str, partition: str, ordering: str | None, delete_column: str | None,
                 hive_style: bool, buckets: BucketSpec | None, cache_options: Mapping[str, Any] | None,
                 cache_config: CacheConfig | None, spark_conf: Any = None) -> TagOptions:
    """TagOptions from the call's arguments, the Spark conf and the environment (in that order of precedence)."""
    if cache_config is None:
        cache_config = CacheConfig.from_sources(mapping=cache_options, spark_conf=spark_conf)
    elif cache_options:
        raise ConfigError("pass either cache_config or cache_options, not both")
    spec = buckets or recorded_buckets(table) or BucketSpec()
    return TagOptions(key=key, partition=partition, ordering=ordering, delete_column=delete_column,
                      hive_style=hive_style, buckets=spec, cache=cache_config)


def recorded_buckets(table: Table) -> BucketSpec | None:
    """The bucket spec the table's last upsert used (a table must keep routing new keys the same way)."""
    table.refresh()
    for record in reversed(table.timeline.completed()):
        spec = record.extra.get(UPSERT_EXTRA, {}).get("buckets") if record.action == ACTION_COMMIT else None
        if spec:
            return BucketSpec(**spec)
    return None


def _check_buckets(table: Table, spec: BucketSpec) -> None:
    recorded = recorded_buckets(table)
    if recorded is not None and recorded.to_dict() != spec.to_dict():
        raise ConfigError(f"table {table.uri} routes new keys with buckets {recorded.to_dict()}, but this upsert "
                          f"asked for {spec.to_dict()}; changing the bucket mode of a written table would put keys "
                          "of one bucket in two layouts")


def _by_shard(df: Any, table: Table, options: TagOptions) -> Any:
    """Repartition so Spark partition i holds exactly the keys of shard i (pmod(hash(key), n) == shard_of)."""
    from pyspark.sql import functions as F

    return df.repartition(table.num_shards, F.col(options.key).cast("string"))


def retyped(exc: BaseException) -> BaseException:
    """A dbidx error raised inside a Spark task comes back as a Py4J/Python exception: raise it as its own type."""
    if isinstance(exc, DbidxError):
        return exc
    match = _TASK_ERROR.search(str(exc))
    if match:
        kind = getattr(errors, match.group(1), None)
        if isinstance(kind, type) and issubclass(kind, DbidxError):
            return kind(f"{match.group(2).strip()} (raised in a Spark task)")
    return exc


def tag(df: Any, table: Table, key: str = "id", partition: str = "dt", ordering: str | None = None,
        delete_column: str | None = "_dbidx_delete", hive_style: bool = True, buckets: BucketSpec | None = None,
        cache_options: Mapping[str, Any] | None = None, cache_config: CacheConfig | None = None,
        use_rdd: bool = False) -> Any:
    """The rows of `df` with their tag columns (see tagger.TAG_FIELDS), computed against executor-local caches.

    Lazy like any transformation. Rows are tagged against the index as of the latest commit when the task runs;
    a key repeated in the batch gets one location (use `upsert` to also collapse the repeats). use_rdd=True runs
    the same tagger through `mapPartitions` for pipelines built on RDDs.
    """
    options = make_options(table, key, partition, ordering, delete_column, hive_style, buckets, cache_options,
                           cache_config, df.sparkSession.conf)
    options.check_columns(df.columns, "the DataFrame to tag")
    from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

    schema = from_arrow_schema(pa.schema(list(to_arrow_schema(df.schema)) + TAG_FIELDS))
    shuffled = _by_shard(df, table, options)
    if use_rdd:
        body = partial(_tag_rows, table=table, options=options, names=df.columns)
        return shuffled.rdd.mapPartitions(body).toDF(schema)
    return shuffled.mapInArrow(partial(task.tag_batches, table=table, options=options), schema)


def _tag_rows(rows: Iterable[Any], table: Table, options: TagOptions, names: list[str]) -> Iterator[tuple]:
    """mapPartitions body: Rows -> Arrow batches of 10 000 -> tagger -> tuples."""
    def batches() -> Iterator[pa.RecordBatch]:
        chunk: list[Any] = []
        for row in rows:
            chunk.append(row)
            if len(chunk) == 10_000:
                yield pa.RecordBatch.from_pylist([r.asDict() for r in chunk])
                chunk = []
        if chunk:
            yield pa.RecordBatch.from_pylist([r.asDict() for r in chunk])

    for tagged in task.tag_batches(batches(), table, options):
        yield from zip(*(tagged.column(i).to_pylist() for i in range(tagged.num_columns)))


def _upsert_partition(batches: Iterator[pa.RecordBatch], table: Table, options: TagOptions, instant: str,
                      on_task_written: TaskHook | None = None) -> Iterator[pa.RecordBatch]:
    """mapInArrow body of `upsert`: one result row per task attempt."""
    from pyspark import TaskContext

    context = TaskContext.get()
    attempt = context.taskAttemptId() if context is not None else 0
    result = task.upsert_batches(batches, table, options, instant, attempt)
    if on_task_written is not None and context is not None:
        on_task_written(context.partitionId(), context.attemptNumber())
    yield task.pack_result(context.partitionId() if context is not None else -1, attempt, result)


def upsert(df: Any, table: Table, key: str = "id", partition: str = "dt", ordering: str | None = None,
           delete_column: str | None = "_dbidx_delete", hive_style: bool = True, buckets: BucketSpec | None = None,
           cache_options: Mapping[str, Any] | None = None, cache_config: CacheConfig | None = None,
           on_task_written: TaskHook | None = None) -> CommitSummary:
    """Insert, update and delete the rows of `df` in `table` as one atomic instant; returns its summary.

    on_task_written(spark partition id, attempt number) runs in each task after its data files are written and
    before it reports back: an instrumentation hook (fault injection in tests, progress in tools).
    """
    started = time.perf_counter()
    options = make_options(table, key, partition, ordering, delete_column, hive_style, buckets, cache_options,
                           cache_config, df.sparkSession.conf)
    options.check_columns(df.columns, "the upsert DataFrame")
    _check_buckets(table, options.buckets)
    from pyspark.sql import functions as F

    datafiles.sweep_settled(table.io, table.timeline)  # leftovers of attempts killed after their job ended
    writer = table.new_commit()
    instant = writer.instant
    try:
        # 1. One job: tag and write data files per shard; Spark returns the result of one winning attempt per task.
        shuffled = _by_shard(df.withColumn(ROW_ID, F.monotonically_increasing_id()), table, options)
        rows = shuffled.mapInArrow(partial(_upsert_partition, table=table, options=options, instant=instant,
                                           on_task_written=on_task_written),
                                   task.RESULT_DDL).collect()
        # 2. The winning attempts' index entries and data files, published as one instant.
        record, summary, files = commit_results(writer, [row.payload for row in rows], options)
    except BaseException as exc:
        writer.rollback()
        datafiles.discard_unlisted(table.io, instant, keep=())
        raise retyped(exc) from exc
    # 3. Files of failed or losing attempts were never listed, so never visible; now they go.
    summary.orphans_deleted = len(datafiles.discard_unlisted(table.io, instant, keep=[f.path for f in files]))
    summary.seq = record.seq
    summary.seconds = time.perf_counter() - started
    return summary


def commit_results(writer: Any, payloads: list[bytes], options: TagOptions) -> tuple[Any, CommitSummary,
                                                                                   list[datafiles.DataFile]]:
    """Publish the task results of the winning attempts as the writer's instant: index entries through the
    CommitWriter, data files listed in the same completion record. Raises (and rolls back) on conflict."""
    # 1. Index entries of the winning attempts go through the MDT writer; data files ride in the same record.
    files, entries, per_shard = [], [], []
    for payload in payloads:
        f, e, m = task.unpack_result(payload)
        files += f
        entries.append(e)
        per_shard += m
    all_entries = pa.concat_tables(entries) if entries else task.ENTRY_SCHEMA.empty_table()
    _add_entries(writer, all_entries)
    summary = _summarize(writer.instant, files, all_entries, per_shard)
    writer.extra[UPSERT_EXTRA] = {"key": options.key, "partition": options.partition,
                                  "hive_style": options.hive_style, "ordering": options.ordering,
                                  "buckets": options.buckets.to_dict()}
    writer.extra["data_files"] = [f.path for f in files]
    writer.extra["metrics"] = {k: v for k, v in summary.to_dict().items() if k != "per_shard"}
    # 2. Publish: data and index become visible together, or not at all.
    return writer.commit(), summary, files


def _add_entries(writer: Any, entries: pa.Table) -> None:
    """Feed index entries to the CommitWriter grouped the way it takes them."""
    if entries.num_rows == 0:
        return
    ops = entries.column("op")
    for op in (task.OP_INSERT, task.OP_DELETE, task.OP_MOVE):
        rows = entries.filter(pc.equal(ops, op))
        if rows.num_rows == 0:
            continue
        group_cols = ["partition"] if op != task.OP_MOVE else ["old_partition", "partition"]
        for group in rows.select(group_cols).group_by(group_cols).aggregate([]).to_pylist():
            mask = None
            for col, value in group.items():
                m = pc.equal(rows.column(col), value)
                mask = m if mask is None else pc.and_(mask, m)
            part = rows.filter(mask)
            if op == task.OP_INSERT:
                writer.insert(group["partition"], part.column("key"), part.column("file_group"))
            elif op == task.OP_DELETE:
                writer.delete(group["partition"], part.column("key"), part.column("file_group"))
            else:
                writer.move(part.column("key"), group["old_partition"], part.column("old_file_group"),
                            group["partition"], part.column("file_group"))


def _summarize(instant: str, files: list[datafiles.DataFile], entries: pa.Table,
               per_shard: list[dict[str, Any]]) -> CommitSummary:
    summary = CommitSummary(instant=instant, seq=0, per_shard=sorted(per_shard, key=lambda m: m["shard"]))
    for m in per_shard:
        for name in task.TAG_COUNTS + task.CACHE_COUNTERS:
            setattr(summary, name, getattr(summary, name) + m[name])
    summary.partitions = sorted({f.partition for f in files})
    summary.data_files = len(files)
    summary.data_bytes = sum(f.size for f in files)
    summary.index_entries = entries.num_rows
    return summary


def commit_history(table: Table, last: int = 20) -> list[dict[str, Any]]:
    """The last `last` completions (all actions), newest first, with the metrics upserts stored in them (F30)."""
    table.refresh()
    out = []
    for rec in list(reversed(table.timeline.completed()))[:max(last, 0)]:
        out.append({"seq": rec.seq, "instant": rec.instant, "action": rec.action,
                    "completed_at_ms": rec.completed_at_ms, "rolled_back": rec.rolled_back,
                    "metrics": rec.extra.get("metrics")})
    return out


def committed_data_files(table: Table) -> list[tuple[str, int, str]]:
    """(path, completion seq, instant) of every data file a completed upsert published, oldest first."""
    table.refresh()
    return [(path, rec.seq, rec.instant) for rec in table.timeline.completed()
            if rec.action == ACTION_COMMIT for path in rec.extra.get("data_files", [])]


def read_table(spark: Any, table: Table, ordering: str | None = None) -> Any:
    """The table's current rows: per record the latest version (commit order; `ordering` first if given),
    deleted records dropped. One row per key (global mode) or per (partition, key)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    files = committed_data_files(table)
    layout_info = next((rec.extra[UPSERT_EXTRA] for rec in reversed(table.timeline.completed())
                        if UPSERT_EXTRA in rec.extra), None)
    if not files or layout_info is None:
        raise InvalidInputError(f"table {table.uri} has no data written by upsert yet")
    key, partition = layout_info["key"], layout_info["partition"]
    seqs = spark.createDataFrame(sorted({(instant, seq) for _, seq, instant in files}),
                                 f"{datafiles.INSTANT_COLUMN} string, _dbidx_seq long")
    data = spark.read.option("recursiveFileLookup", "true").parquet(*[table.io.path(p) for p, _, _ in files])
    data = data.join(F.broadcast(seqs), datafiles.INSTANT_COLUMN)
    ident = [key] if table.global_index else [partition, key]
    order = ([F.col(ordering).desc_nulls_last()] if ordering else []) + [F.col("_dbidx_seq").desc()]
    latest = data.withColumn("_dbidx_rank", F.row_number().over(Window.partitionBy(*ident).orderBy(*order)))
    return (latest.filter((F.col("_dbidx_rank") == 1) & ~F.col(datafiles.DELETED_COLUMN))
            .drop("_dbidx_rank", "_dbidx_seq", datafiles.DELETED_COLUMN, datafiles.INSTANT_COLUMN))
