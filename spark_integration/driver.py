"""The driver's side of an upsert instant, without Spark: the options and the checks before any task runs, and the
publish of the tasks' results (every task reported, every file there, no conflict with commits since) or the rollback
of everything announced. `api.upsert` (Spark) and `local.upsert_arrow` (in-process) both run `run_upsert`.
"""

from __future__ import annotations

import functools
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Mapping

import pyarrow as pa

from dbidx.buckets.assigner import BucketSpec
from dbidx.config import CacheConfig
from dbidx.counters import gauge
from dbidx.data import reads
from dbidx.data.column_mapping import schema_string_in_force, schema_string_to_record
from dbidx.data.not_null import required_paths
from dbidx.data.schema import data_columns, encode_schema, evolve, recorded_schema
from dbidx.errors import (
    CommitError,
    ConfigError,
    ConflictError,
    CorruptFileError,
    HistoryCompactedError,
    SchemaError,
)
from dbidx.table.service_settings import read_settings
from dbidx.table.services import run_services
from dbidx.table.facade import Table
from dbidx.progress import Progress, Steps
from dbidx.runner import IN_PROCESS, BySize, WorkRunner, check_written
from dbidx.spark_integration.job_report import SHARD_FIELDS, TASK_KEY, JobResults, SparkJobReport, TaskAttempt
from dbidx.spark_integration.task_result import ShardMetrics, TaskCounts, TaskResult
from dbidx.spark_integration.tagger import TagOptions
from dbidx.spark_integration.task_errors import (
    retyped,
)
from dbidx.storage import leftovers
from dbidx.storage.data_view import LAYOUT_EXTRA, SCHEMA_EXTRA, SCHEMA_STRING_EXTRA, DataView
from dbidx.storage.records import DataFileRecord, FileRecord


# The phases of an upsert call, in order: the checks and the start of the instant; the job (the shard tasks); the
# check and publish of their results; the delete of unlisted files after it; the table services after the publish.
PHASES = ("prepare", "job", "commit", "cleanup", "services")


@dataclass
class CommitSummary(TaskCounts):
    """What one upsert did (docs/DESIGN.md section 6): instant, row kinds, files, timings, per-shard cache metrics.

    input_rows counts the rows the DataFrame held; rows counts the records written after repeats of a key were
    collapsed (input_rows - duplicates_dropped). seconds is the whole call; the copy stored in the completion
    record (`dbidx commits`) runs from the start to the publish.
    """

    instant: str = ""
    seq: int = gauge()
    partitions: list[str] = field(default_factory=list)
    data_files: int = 0
    data_bytes: int = 0
    index_entries: int = 0
    orphans_deleted: int = 0
    # Other writers' unfinished attempts this upsert found before it started, and the abandoned ones it rolled back
    # (table.pending.AbandonedReport).
    abandoned: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    per_shard: list[dict[str, Any]] = field(default_factory=list)
    # What Spark did to run the upsert's job (task attempts, retries, speculation, kills, executors lost:
    # job_report.SparkJobReport); None for an upsert run in process (`upsert_arrow`).
    spark: dict[str, Any] | None = None
    # What the table services did after the publish (table.services.ServicesReport.to_dict(); {"error": ...} when they
    # failed, which never fails the committed upsert); None when `after_commit` is off. Returned only: the services
    # run after the completion record was written, so `dbidx commits` does not show them (their own instants do).
    services: dict[str, Any] | None = None
    # Wall seconds of the call's phases in the driver (PHASES): where an upsert's time went. Returned only, as
    # services: the completion record is written before the last of them end.
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        """Share of looked-up keys found in the cache (updates, deletes and moves over all rows looked up)."""
        looked = self.hits + self.misses
        return self.hits / looked if looked else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (also stored, without per_shard, in the commit's metadata)."""
        data = super().to_dict()
        data["hit_rate"] = round(self.hit_rate, 4)
        return data


def make_options(
    table: Table,
    key: str,
    partition: str,
    ordering: str | None,
    delete_column: str | None,
    hive_style: bool,
    buckets: BucketSpec | None,
    cache_options: Mapping[str, Any] | None,
    cache_config: CacheConfig | None,
    spark_conf: Any = None,
) -> TagOptions:
    """TagOptions from the call's arguments, the Spark conf and the environment (in that order of precedence)."""
    if cache_config is None:
        cache_config = CacheConfig.from_sources(mapping=cache_options, spark_conf=spark_conf)
    elif cache_options:
        raise ConfigError("pass either cache_config or cache_options, not both")
    spec = buckets or recorded_buckets(table) or BucketSpec()
    view = table.data_view()
    return TagOptions(
        key=key,
        partition=partition,
        ordering=ordering,
        delete_column=delete_column,
        hive_style=hive_style,
        buckets=spec,
        cache=cache_config,
        partition_columns=recorded_partition_columns(view, reads.layout_of(table, view)),
    )


def recorded_partition_columns(view: DataView, recorded: dict[str, Any] | None) -> tuple[str, ...] | None:
    """The hive partition columns a table's layout fixes, which every upsert's partition paths must name exactly:
    an adopted Delta table's (its metaData's partitionColumns, none for an unpartitioned one) and those build-index
    was told (`--partition-col`); None where nothing fixes them (no write yet, an upsert's own layout, a build-index
    that declared no columns: its directories are whatever the data set had)."""
    columns = (recorded or {}).get("partition_columns")
    if columns is None:
        return None
    if not isinstance(columns, list) or not all(isinstance(c, str) and c for c in columns):
        where = f"completion {view.layout.seq} ({view.layout.instant})" if view.layout is not None else "a completion"
        raise CorruptFileError(
            f"{where} records partition columns {columns!r} in its {LAYOUT_EXTRA!r} extra, not a list of column names"
        )
    return tuple(columns) if columns or view.delta_adopted is not None else None


def recorded_buckets(table: Table) -> BucketSpec | None:
    """The bucket spec the table's last upsert used (a table must keep routing new keys the same way)."""
    recorded = table.data_view().buckets
    if recorded is None:
        return None
    try:
        return BucketSpec(**recorded.value)
    except (TypeError, ConfigError) as exc:
        raise CorruptFileError(
            f"completion {recorded.seq} ({recorded.instant}) of {table.uri} records an invalid "
            f"bucket spec {recorded.value!r}: {exc}"
        ) from exc


def _check_buckets(table: Table, spec: BucketSpec) -> None:
    recorded = recorded_buckets(table)
    if recorded is not None and recorded.to_dict() != spec.to_dict():
        raise ConfigError(
            f"table {table.uri} routes new keys with buckets {recorded.to_dict()}, but this upsert "
            f"asked for {spec.to_dict()}; changing the bucket mode of a written table would put keys "
            "of one bucket in two layouts"
        )


def run_upsert(
    table: Table,
    options: TagOptions,
    job: Callable[[str], list[tuple[int, int, bytes]]],
    input_schema: pa.Schema,
    where: str,
    progress: Progress | None = None,
    tags: Mapping[str, str] | None = None,
    services_runner: WorkRunner = IN_PROCESS,
) -> CommitSummary:
    """One upsert instant around a job that runs the shard tasks and returns their results (Spark, or in-process
    for `upsert_arrow`): start, publish after the checks, or roll back and delete every announced file.

    input_schema: the input's Arrow schema, checked against the table's data schema before anything runs
    (SchemaError); a first write or a new column records the schema in this instant's completion.
    progress: told of each task result as it is checked (one step per shard).
    tags: what else identifies this writer in its claim (the Spark application id), shown if it is left unfinished.
    services_runner: where the table services after the publish run their compactions' pieces (a Spark upsert's are
    Spark jobs).
    """
    started = time.perf_counter()
    marks = [started]  # perf_counter at the end of each phase (PHASES)
    # Other engines' versions first (their schema changes among them): checked against below, not found at the claim
    # (which would make this upsert conflict with a change that was in the log before it started).
    table.follow_delta_log()
    with table.pinned():  # the checks before the start read one state (the start and the publish read anew)
        _check_buckets(table, options.buckets)
        new_schema, schema_seq = _check_layout_and_schema(table, options, input_schema, where)
    leftovers.sweep_settled(table.io, table.timeline)  # what writers that died after settling left
    abandoned = table.roll_back_abandoned()  # what writers that died before settling left (heartbeat expired)
    writer = table.new_commit(tags=tags)
    instant = writer.instant
    guard = partial(
        _schema_unchanged, instant=instant, required=required_paths(schema_string_in_force(table.data_view()))
    )
    writer.checks.append(guard)  # also at publish: the schema this upsert was checked against still stands
    try:
        guard(table.timeline.completed(after_seq=schema_seq))
        marks.append(time.perf_counter())
        # 1. One job: tag and write data and index files per shard; one result per task, of its winning attempt.
        results = job(instant)
        marks.append(time.perf_counter())
        # 2. Check that every task reported and every listed file is there, then publish data and index together.
        if new_schema is not None:
            writer.extra[SCHEMA_EXTRA] = encode_schema(new_schema)
            writer.extra.update(schema_string_to_record(table.data_view()))
        record, summary = commit_results(
            writer,
            results,
            options,
            expected_tasks=table.num_shards,
            started=started,
            progress=progress,
            abandoned=abandoned.to_dict(),
        )
    except BaseException as exc:
        # Rolled back unless published, which also deletes every file any attempt announced; a rollback that fails
        # too is a note on `exc` (storage/instant_life.py).
        writer.fail(exc)
        error = retyped(exc)
        if error is exc:
            raise  # as it is, with its own cause (`raise exc from exc` would replace that cause by itself)
        raise error from exc
    marks.append(time.perf_counter())
    # 3. Files of failed or losing attempts (and the touched-key files) were never listed; now they go.
    scratch = {t.path for t in writer.touched() if t.path}
    deleted = writer.finish()
    summary.orphans_deleted = len([rel for rel in deleted if rel not in scratch])
    leftovers.sweep_after_write(table.io, record)  # dead writers' temp files where this batch wrote
    summary.seq = record.seq
    summary.seconds = time.perf_counter() - started  # returned: the whole call, cleanup of orphans included
    marks.append(started + summary.seconds)
    # 4. The table services, after the publish: the batch is committed whatever they do (their time is their own).
    summary.services = services_after_commit(table, services_runner)
    marks.append(time.perf_counter())
    summary.phases = {name: round(end - begin, 6) for name, begin, end in zip(PHASES, marks, marks[1:])}
    return summary


def services_after_commit(table: Table, runner: WorkRunner = IN_PROCESS) -> dict[str, Any] | None:
    """Run the table services within the table's budget if its settings say so (`after_commit`); an error becomes a
    warning and the report's `error`, never a failed upsert: the batch was published before they started."""
    try:
        settings = read_settings(table.io)
        if not settings.after_commit:
            return None
        # Spark jobs for the compactions reading enough to win back a job's fixed cost; the rest in the driver.
        runner = BySize(runner, settings.spark_jobs_min_mb << 20) if settings.spark_jobs else IN_PROCESS
        return run_services(table, settings, runner=runner).to_dict()
    except Exception as exc:  # noqa: BLE001 - maintenance must never fail a committed upsert; the next run retries
        message = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"table services after the upsert into {table.uri} failed (the upsert is committed; the next "
            f"run tries again): {message}",
            RuntimeWarning,
            stacklevel=2,
        )
        return {"error": message}


def _check_layout_and_schema(
    table: Table, options: TagOptions, input_schema: pa.Schema, where: str
) -> tuple[pa.Schema | None, int]:
    """The driver's checks before any task: the same key/partition layout as the table's earlier writes, no input
    column in dbidx's own `_dbidx_` namespace, and the data schema (data/schema.py). Returns the schema to
    record (None if unchanged) and the seq it was checked at."""
    view = table.data_view()  # refreshed: schema, layout and seq agree
    recorded, seq = recorded_schema(view.schema), view.applied_seq
    layout = reads.layout_of(table, view)
    if layout is not None:
        for name, mine in (("key", options.key), ("partition", options.partition), ("hive_style", options.hive_style)):
            if name in layout and layout[name] != mine:
                raise ConfigError(
                    f"table {table.uri} was written with {name}={layout[name]!r}, but this upsert "
                    f"passes {name}={mine!r}: records would be merged or placed under another identity "
                    "than before"
                )
        _check_partition_columns(table, view, layout, options)
    own = [f.name for f in input_schema if f.name.startswith("_dbidx_") and f.name != options.delete_column]
    if own:
        raise SchemaError(
            f"{where} has column(s) {own} in dbidx's own `_dbidx_` namespace (data files use such "
            "names for the writing instant and the delete flag); rename them"
        )
    consumed = [c for c in (options.delete_column,) if c]
    new_schema = evolve(recorded, data_columns(input_schema, consumed), where, consumed)
    mapped = table.io.column_names
    if new_schema is not None and recorded is not None and mapped is not None:
        added = [n for n in new_schema.names if n not in recorded.names]
        raise SchemaError(
            f"{where} adds column(s) {added} to a table that maps its columns (delta.columnMapping.mode=name): a new "
            "column needs a physical name and id dbidx does not assign. Add it with Delta Spark first (ALTER TABLE "
            "delta.`<uri>` ADD COLUMNS (...)), then upsert"
        )
    return new_schema, seq


def _check_partition_columns(table: Table, view: DataView, layout: dict[str, Any], options: TagOptions) -> None:
    """The partition columns the table's layout fixes (recorded_partition_columns) against the upsert's: with
    hive_style its paths are `<partition>=<value>`, so its column must be the table's one partition column (paths
    without hive_style are checked per value in the tasks, TagOptions.partition_columns). Why: another layout puts
    every updated record in a partition its old version is not in (an insert of a second copy, not an update), and
    gives the Delta log files without the table's partition values, which Delta readers cannot read."""
    columns = recorded_partition_columns(view, layout)
    if columns is not None and columns != options.partition_columns:  # recorded since make_options read the layout
        raise ConflictError(
            f"table {table.uri} recorded partition columns {list(columns)} while this upsert was "
            "being prepared (its tasks would not check them); nothing was written: run it again"
        )
    if columns is None or not options.hive_style or [options.partition] == list(columns):
        return
    how = "adopted from a Delta table" if view.delta_adopted is not None else "indexed by build-index"
    recorded = view.layout
    assert recorded is not None  # a layout was read from it
    hint = (
        'pass hive_style=False and a partition column whose values are all "" (the table has no partitions)'
        if not columns
        else f"pass partition={columns[0]!r}"
        if len(columns) == 1
        else f"pass hive_style=False and a partition column holding each row's whole path "
        f"{'/'.join(c + '=<value>' for c in columns)!r}"
    )
    raise SchemaError(
        f"table {table.uri} was {how} (completion {recorded.seq}, {recorded.instant}) with key "
        f"{layout.get('key')!r} and partition columns {list(columns)}, but this upsert asks for "
        f"partition={options.partition!r} with hive_style=True, which writes "
        f"{options.partition}=<value> directories: records would be updated in partitions their "
        f"versions are not in (inserted twice) and the Delta log would lose its partition values; "
        f"{hint}"
    )


def _schema_unchanged(news: list[Any], instant: str, required: set[str]) -> None:
    """Publish check: no completion since the upsert's schema check recorded another data schema, or a Delta schema
    with a NOT NULL the upsert's rows were not checked against (`required`: data/not_null.required_paths)."""
    for rec in news:
        added = required_paths(rec.extra.get(SCHEMA_STRING_EXTRA)) - required
        if added:
            raise ConflictError(
                f"instant {instant}: {rec.action} {rec.instant} (seq {rec.seq}) made {sorted(added)} NOT NULL while "
                "this upsert ran; nothing was published: run it again (its rows are checked against it)"
            )
        if SCHEMA_EXTRA in rec.extra:
            raise ConflictError(
                f"instant {instant}: {rec.action} {rec.instant} (seq {rec.seq}) changed the table's "
                "data schema while this upsert ran; nothing was published: run it again (it is "
                "checked against the new schema)"
            )


def commit_results(
    writer: Any,
    results: list[tuple[int, int, bytes]],
    options: TagOptions,
    expected_tasks: int,
    started: float | None = None,
    progress: Progress | None = None,
    abandoned: dict[str, Any] | None = None,
) -> tuple[Any, CommitSummary]:
    """Publish the task results of the winning attempts as the writer's instant, or raise and publish nothing.

    started: the upsert's perf_counter start; the completion record then stores the seconds from there to the
    publish (what `dbidx commits` shows), measured just before the record is written.
    abandoned: what the upsert found of other writers' unfinished attempts (AbandonedReport.to_dict()), kept in the
    summary and the record.

    The driver holds per task only the records of the files it wrote (a few hundred bytes per file), its
    touched-key ranges and its metrics. It publishes only what it has checked is complete: exactly one result per
    task of the job, and every listed file present with its recorded size.
    """
    # 1. Exactly one result per task: a lost result (a driver-side failure while collecting) must never become
    #    a smaller commit.
    seen = sorted(shard for shard, _, _ in results)
    if seen != list(range(expected_tasks)):
        missing = sorted(set(range(expected_tasks)) - set(seen))
        repeated = sorted({s for s in seen if seen.count(s) > 1})
        raise CommitError(
            f"instant {writer.instant}: the job returned {len(results)} task results for "
            f"{expected_tasks} shard tasks (missing {missing[:10]}, repeated {repeated[:10]}, others "
            f"{sorted(set(seen) - set(range(expected_tasks)))[:10]}); the driver may have failed "
            "while collecting them (out of memory?). Nothing was published; run the upsert again."
        )
    # 2. Parse every record strictly (task results are input like any other) and check the files exist.
    files, index_files, touched, shards = [], [], [], []
    report = results.spark if isinstance(results, JobResults) else None
    winners: list[tuple[int, int, TaskAttempt]] = []  # each Spark task's winning attempt: shard, id, own figures
    owners: list[tuple[int, dict[str, Any]]] = []  # each shard's metrics as sent, by the task that sent them
    writer.table.refresh()  # tasks tagged against seqs up to the latest; none can be newer
    steps = Steps(progress, len(results))
    try:
        for shard, attempt, payload in results:
            result = TaskResult.parse(payload, writer.started.start_seq, writer.table.timeline.latest_seq)
            if report is not None:  # a Spark task says which attempt it is, where it ran
                if result.attempt is None:
                    raise KeyError(f"{TASK_KEY} (the attempt figures every Spark task sends)")
                winners.append((shard, attempt, result.attempt))
            writer.add_written(result.index_files, result.files, result.changes, result.touched)
            writer.add_superseded(result.superseded_seq, result.superseded)
            files += result.files
            index_files += result.index_files
            touched += result.touched
            # Each shard's parsed metrics, kept beside the dict as sent (completed below with Spark's figures).
            task_metrics = list(zip(result.metrics, result.sent_metrics))
            shards += task_metrics
            owners += [(shard, sent) for _, sent in task_metrics]
            steps.step(f"shard {shard} checked", sum(parsed.input_rows for parsed, _ in task_metrics))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CommitError(
            f"instant {writer.instant}: a task result is malformed ({exc}); nothing was published"
        ) from exc
    # What Spark did to run the job, beside each shard's figures: read from Spark's status store, a report that
    # never fails the commit (unknown figures are None). Its Py4J round trips run on a thread beside the checks
    # and the publish's own work, and are joined as the record is built.
    spark = _SparkFigures(report, winners)
    check_written(
        writer.table.io,
        f"instant {writer.instant}",
        [(f.path, f.size) for f in files + index_files] + [(t.path, t.size) for t in touched if t.path],
    )
    summary = _summarize(writer.instant, files, index_files, shards)
    summary.abandoned = dict(abandoned or {})
    writer.extra[LAYOUT_EXTRA] = {
        "key": options.key,
        "partition": options.partition,
        "hive_style": options.hive_style,
        "ordering": options.ordering,
        "buckets": options.buckets.to_dict(),
    }
    if options.partition_columns is not None and not options.hive_style:
        # Paths checked against the table's fixed partition columns (tagger): kept, so later upserts are checked
        # against them too and the Delta log's partitionValues keep naming them (layout_partition_columns).
        writer.extra[LAYOUT_EXTRA]["partition_columns"] = list(options.partition_columns)

    def metrics() -> dict[str, Any]:
        summary.spark, figures = spark.result()
        for task_shard, sent in owners:
            sent.update(figures.get(task_shard) or dict.fromkeys(SHARD_FIELDS))
        if started is not None:
            summary.seconds = time.perf_counter() - started  # stored: start to publish (cleanup after is not in it)
        return {"metrics": {k: v for k, v in summary.to_dict().items() if k not in ("per_shard", "services", "phases")}}

    writer.late_extra = metrics
    # 3. Publish: data and index become visible together, or not at all.
    return writer.commit(), summary


class _SparkFigures:
    """SparkJobReport.summarize on the driver's report thread (started at once), its result awaited by `result()`.
    One long-lived thread: in pinned-thread mode each new Python thread would open its own Py4J connection."""

    def __init__(self, report: SparkJobReport | None, winners: list[tuple[int, int, TaskAttempt]]) -> None:
        self._future: Future | None = None
        if report is not None:
            self._future = _report_thread().submit(report.summarize, winners)

    def result(self) -> tuple[dict[str, Any] | None, dict[int, dict[str, Any]]]:
        """The report's figures (summarize never raises: unknown figures are None)."""
        return self._future.result() if self._future is not None else (None, {})


@functools.cache
def _report_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="dbidx-spark-report")


def _summarize(
    instant: str,
    files: list[DataFileRecord],
    index_files: list[FileRecord],
    shards: list[tuple[ShardMetrics, dict[str, Any]]],
) -> CommitSummary:
    """The commit's counts (the shards' sum) and files; shards: each shard's parsed metrics and the dict as sent."""
    ordered = sorted(shards, key=lambda pair: pair[0].shard)
    summary = CommitSummary(instant=instant, seq=0, per_shard=[sent for _, sent in ordered])
    summary.add(*(parsed for parsed, _ in ordered))
    summary.partitions = sorted({f.partition for f in files})
    summary.data_files = len(files)
    summary.data_bytes = sum(f.size for f in files)
    summary.index_entries = sum(f.rows for f in index_files)
    return summary


def commit_history(table: Table, last: int = 20) -> list[dict[str, Any]]:
    """The last `last` completions (all actions), newest first, with the metrics upserts stored in them."""
    table.refresh()
    out = []
    try:
        records = table.timeline.completed(after_seq=max(table.timeline.latest_seq - max(last, 0), 0))
    except HistoryCompactedError:  # some of them are below the history floor (archive retention): what is kept
        records = table.timeline.kept()[-last:] if last > 0 else []
    for rec in reversed(records):
        out.append(
            {
                "seq": rec.seq,
                "instant": rec.instant,
                "action": rec.action,
                "completed_at_ms": rec.completed_at_ms,
                "rolled_back": rec.rolled_back,
                "metrics": rec.extra.get("metrics"),
            }
        )
    return out
