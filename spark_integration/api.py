"""The Spark entry points `tag` and `upsert` (and `read_table`, from reads.py). pyspark is imported lazily.

`upsert` is one instant: the driver starts it, one Spark job tags and writes the data files and the index delta
files (one task per key shard, each with its executor-local cache), the driver collects the file records of the
winning task attempts, checks that every task reported and every file is there, checks the keys the tasks touched
against commits that completed meanwhile, and publishes data and index in one completion record. Any failure rolls
the instant back and deletes every file any attempt announced. Callable from `foreachBatch`. Errors raised in tasks
come back with their own type (task_errors.py).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any, Iterable, Iterator, Mapping

import pyarrow as pa

from dbidx.buckets.assigner import BucketSpec
from dbidx.config import CacheConfig
from dbidx.table.facade import Table
from dbidx.progress import Progress, null_progress
from dbidx.spark_integration import task
from dbidx.spark_integration.bulk import empty_table_seq, new_partitions_seq
from dbidx.spark_integration.driver import CommitSummary, make_options, run_upsert
from dbidx.spark_integration.service_jobs import SparkWorkRunner, maintain
from dbidx.spark_integration.job_report import JobResults, SparkJobReport, TaskAttempt
from dbidx.spark_integration.tagger import ROW_ID, TAG_FIELDS, TagOptions
from dbidx.spark_integration.task_result import RESULT_DDL, pack_result
from dbidx.spark_integration.task_errors import (
    TaskHook,
    hook_error,
    run_hook,
)

__all__ = ["bulk_insert", "maintain", "tag", "upsert", "upsert_with_options"]


def arrow_schema_of(df: Any) -> pa.Schema:
    """The Arrow schema Spark hands tasks for `df` (timestamps carry the session's time zone, as in mapInArrow)."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(df.schema, timezone=df.sparkSession.conf.get("spark.sql.session.timeZone"))


def _by_shard(df: Any, table: Table, options: TagOptions) -> Any:
    """Repartition so Spark partition i holds exactly the keys of shard i (pmod(hash(key), n) == shard_of)."""
    from pyspark.sql import functions as F

    return df.repartition(table.num_shards, F.col(options.key).cast("string"))


def _boolean_columns(df: Any) -> dict[str, bool]:
    """Column name -> whether its Spark type is boolean (read from the schema on the driver, no job)."""
    from pyspark.sql.types import BooleanType

    return {f.name: isinstance(f.dataType, BooleanType) for f in df.schema.fields}


def _unfit_key_columns(df: Any) -> dict[str, tuple[str, str] | None]:
    """Column name -> (its Spark type's name, kind) if it cannot be a key (table.keys.unfit_key_kind: floating
    point, boolean, array/struct/map), else None (from the schema, no job)."""
    from pyspark.sql import types as T

    kinds = (
        ((T.FloatType, T.DoubleType), "floating"),
        ((T.BooleanType,), "boolean"),
        ((T.ArrayType, T.StructType, T.MapType), "nested"),
    )
    return {
        f.name: next(
            ((f.dataType.simpleString(), kind) for classes, kind in kinds if isinstance(f.dataType, classes)), None
        )
        for f in df.schema.fields
    }


def tag(
    df: Any,
    table: Table,
    *,
    key: str,
    partition: str,
    ordering: str | None = None,
    delete_column: str | None = "_dbidx_delete",
    hive_style: bool = True,
    buckets: BucketSpec | None = None,
    cache_options: Mapping[str, Any] | None = None,
    cache_config: CacheConfig | None = None,
    use_rdd: bool = False,
) -> Any:
    """The rows of `df` with their tag columns (see tagger.TAG_FIELDS), computed against executor-local caches.

    Lazy like any transformation. Rows are tagged against the index as of the latest commit when the task runs;
    a key repeated in the batch gets one location (use `upsert` to also collapse the repeats). use_rdd=True runs
    the same tagger through `mapPartitions` for pipelines built on RDDs. `key` and `partition` name the record-key
    and partition columns, as keywords and without defaults, as for `upsert`.
    """
    options = make_options(
        table,
        key,
        partition,
        ordering,
        delete_column,
        hive_style,
        buckets,
        cache_options,
        cache_config,
        df.sparkSession.conf,
    )
    options.check_columns(df.columns, "the DataFrame to tag", _boolean_columns(df), _unfit_key_columns(df))
    from pyspark.sql.pandas.types import from_arrow_schema

    schema = from_arrow_schema(pa.schema(list(arrow_schema_of(df)) + TAG_FIELDS))
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


def _upsert_partition(
    batches: Iterator[pa.RecordBatch],
    table: Table,
    options: TagOptions,
    instant: str,
    on_task_written: TaskHook | None = None,
) -> Iterator[pa.RecordBatch]:
    """mapInArrow body of `upsert`: one result row per task attempt, with the attempt's own figures (its attempt
    number, stage and host: job_report.TaskAttempt)."""
    from pyspark import TaskContext

    context = TaskContext.get()
    attempt = context.taskAttemptId() if context is not None else 0
    result = task.upsert_batches(batches, table, options, instant, attempt)
    if on_task_written is not None and context is not None:
        run_hook(on_task_written, context.partitionId(), context.attemptNumber())
    if context is not None:
        result.attempt = TaskAttempt.of_task(context)
    yield pack_result(context.partitionId() if context is not None else -1, attempt, result)


def _collect_results(results: Any) -> list[tuple[int, int, bytes]]:
    """Run the upsert job and bring back its task results: (Spark partition id, attempt id, payload) per task.

    A separate function so tests can interfere with what the driver receives (a lost or repeated result).
    """
    return [(row.shard, row.attempt, row.payload) for row in results.collect()]


def upsert(
    df: Any,
    table: Table,
    *,
    key: str,
    partition: str,
    ordering: str | None = None,
    delete_column: str | None = "_dbidx_delete",
    hive_style: bool = True,
    buckets: BucketSpec | None = None,
    cache_options: Mapping[str, Any] | None = None,
    cache_config: CacheConfig | None = None,
    on_task_written: TaskHook | None = None,
    progress: Progress | None = None,
) -> CommitSummary:
    """Insert, update and delete the rows of `df` in `table` as one atomic instant; returns its summary.

    `key` and `partition` name the record-key and partition columns. They are required keywords: a guessed default
    such as "id" (or a swapped positional pair) may name a column that exists but is not the one meant, and the rows
    would be written under the wrong identity or layout without any error.
    on_task_written(spark partition id, attempt number) runs in each task after its files are written and
    before it reports back: an instrumentation hook (fault injection in tests, progress in tools). If it raises in
    the task attempt Spark gives up on, upsert raises that exception's type with its message (a HookError naming the
    type if the driver cannot import or build it), after rolling the instant back.
    progress (dbidx.progress): told when the Spark job is submitted (step 0) and of each shard task's result as the
    driver checks it (rows: input rows so far); the tasks themselves run on executors, out of its sight.
    Raises ConflictError if a commit that completed meanwhile touched one of the batch's keys (nothing is
    published: run the upsert again), CommitError if the job's results are incomplete.
    """
    options = make_options(
        table,
        key,
        partition,
        ordering,
        delete_column,
        hive_style,
        buckets,
        cache_options,
        cache_config,
        df.sparkSession.conf,
    )
    options.check_columns(df.columns, "the upsert DataFrame", _boolean_columns(df), _unfit_key_columns(df))
    # A table's first write cannot update anything: it takes the bulk path (tasks skip the caches).
    return upsert_with_options(df, table, replace(options, bulk_seq=empty_table_seq(table)), on_task_written, progress)


def bulk_insert(
    df: Any,
    table: Table,
    *,
    key: str,
    partition: str,
    ordering: str | None = None,
    delete_column: str | None = "_dbidx_delete",
    hive_style: bool = True,
    buckets: BucketSpec | None = None,
    cache_options: Mapping[str, Any] | None = None,
    cache_config: CacheConfig | None = None,
    on_task_written: TaskHook | None = None,
) -> CommitSummary:
    """Load rows into partitions the table has never had (any partition of an empty table), as one upsert instant
    that skips the caches: the initial load of a table or a backfill of new days.

    Contract: every partition of `df` is new to the table (checked: InvalidInputError names the ones that are not;
    in global mode the table must be empty). Within `df`, repeats of a key collapse as in `upsert` (`ordering`,
    then arrival) and delete rows delete nothing. Arguments as for `upsert`; `upsert` itself takes this path on a
    table's first write.
    """
    options = make_options(
        table,
        key,
        partition,
        ordering,
        delete_column,
        hive_style,
        buckets,
        cache_options,
        cache_config,
        df.sparkSession.conf,
    )
    options.check_columns(df.columns, "the bulk_insert DataFrame", _boolean_columns(df), _unfit_key_columns(df))
    values = [row[0] for row in df.select(partition).distinct().collect()]
    paths = options.partitions_of(pa.table({partition: pa.array(values)})).to_pylist() if values else []
    seq = new_partitions_seq(table, paths)
    return upsert_with_options(df, table, replace(options, bulk_seq=seq), on_task_written)


def upsert_with_options(
    df: Any,
    table: Table,
    options: TagOptions,
    on_task_written: TaskHook | None = None,
    progress: Progress | None = None,
) -> CommitSummary:
    """`upsert` with its options made (and checked) already: what `upsert` and `bulk_insert` run."""
    from pyspark.sql import functions as F

    input_schema = arrow_schema_of(df)

    def job(instant: str) -> JobResults:
        shuffled = _by_shard(df.withColumn(ROW_ID, F.monotonically_increasing_id()), table, options)
        (progress or null_progress)(0, table.num_shards, f"Spark job of {instant}: tagging and writing", 0)
        try:
            # Tagged, so the driver can read afterwards what Spark did to run it (retries, speculation, executors
            # lost): job_report.SparkJobReport, read when the results are checked.
            with SparkJobReport.watching(df.sparkSession, instant) as report:
                return JobResults(
                    _collect_results(
                        shuffled.mapInArrow(
                            partial(
                                _upsert_partition,
                                table=table,
                                options=options,
                                instant=instant,
                                on_task_written=on_task_written,
                            ),
                            RESULT_DDL,
                        )
                    ),
                    report,
                )
        except Exception as exc:
            # Only a run with a hook looks for its marker: without one, row data quoted in an error's text cannot
            # pass for a hook's failure.
            error = hook_error(exc) if on_task_written is not None else None
            if error is None:
                raise
            raise error from exc

    # The claim names the Spark application, so an attempt its driver left unfinished says whose it was.
    context = df.sparkSession.sparkContext
    tags = {"spark_app_id": context.applicationId, "spark_app_name": context.appName[:256]}
    return run_upsert(
        table,
        options,
        job,
        input_schema,
        "the upsert DataFrame",
        progress,
        tags=tags,
        services_runner=SparkWorkRunner(df.sparkSession),
    )
