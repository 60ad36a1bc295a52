"""Table services that run by themselves: data compaction, index compaction, clean, Delta log cleanup and vacuum,
each when its trigger says the table needs it, within a budget of seconds and files (`run_services`;
`Table.maintain`, `dbidx maintain`, and the writer after each upsert).

Why triggers from the folded views: the views are in memory after the refresh every writer does anyway, so deciding
costs no I/O; a run that finds nothing to do publishes nothing. Why a budget: a writer that maintains its table after
each batch must not stall the pipeline; what the budget leaves is reported and taken by the next run (the worst
partitions first, so the table's worst spots are always the next ones fixed).

Every service commit is an ordinary completion and Delta version (data compaction: remove + add with
dataChange=false; index compaction and clean: commitInfo only). None of them conflicts with an upsert (docs/DESIGN.md
section 3); a ConflictError can only come from another maintenance run on the same files (two writers, or a writer
and `dbidx maintain --loop`): the service yields, the report says so, and the next run tries again. Log cleanup and
vacuum publish nothing: they write a Delta checkpoint (delta-rs) and delete files no version needs any more, by the
retention the table's Delta properties give (table/delta_properties.py), so every engine sharing the table agrees.
The clean keeps the data and DV files it would delete for the same `delta.deletedFileRetentionDuration` (Delta
readers of older versions read them); only the index files it deletes go by `clean_retain_completions` alone.
"""

from __future__ import annotations

import json
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol

from dbidx.data.compaction import DataCompactionResult
from dbidx.data.delta_checkpoint import write_delta_checkpoint
from dbidx.data.delta_log import checkpoint_pointer
from dbidx.data.log_retention import expire_log, still_young
from dbidx.errors import ConflictError, CorruptFileError
from dbidx.table.delta_properties import DeltaRetention, retention_of
from dbidx.index.clean import plan_clean
from dbidx.index.compaction import CompactionResult
from dbidx.table.service_settings import ServiceSettings
from dbidx.table.vector_storage import misplaced_vectors
from dbidx.progress import Progress
from dbidx.runner import IN_PROCESS, WorkRunner
from dbidx.storage.records import ACTION_CLEAN, CompletedInstant
from dbidx.storage import layout
from dbidx.storage.fileio import FileIO
from dbidx.storage.archive_retention import expire_archive
from dbidx.storage.state import TableState

SERVICES = ("data_compaction", "index_compaction", "clean", "log_cleanup", "vacuum")
VACUUM_STATE_FILE = f"{layout.META_DIR}/vacuum.json"  # when the last automatic vacuum ran
ROUND_PARTITIONS = 8  # data compaction partitions per instant: the seconds budget is checked between rounds
# Per table object: the newest checkpoint this process expired the log below (one listing per new checkpoint), and
# the files of the oldest checkpoint too young to expire anything below it (a stat of them instead of a listing).
_EXPIRED_AT: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
_WAITS_ON: "weakref.WeakKeyDictionary[Any, tuple[str, ...]]" = weakref.WeakKeyDictionary()


class MaintainedTable(TableState, Protocol):
    """A table whose services can run (implemented by `Table`)."""

    def compact(
        self,
        partitions: Iterable[str] | None = None,
        min_files: int = 2,
        progress: Progress | None = None,
        runner: WorkRunner | None = None,
        base_share: float | None = None,
    ) -> CompactionResult: ...

    def compact_data(
        self,
        partitions: Iterable[str] | None = None,
        min_files: int = 2,
        deleted_share: float | None = 0.2,
        target_file_bytes: int | None = 64 << 20,
        progress: Progress | None = None,
        runner: WorkRunner | None = None,
        base_share: float | None = None,
    ) -> DataCompactionResult: ...

    def clean(self, retain_completions: int = 10, delete_migrated: bool = False) -> CompletedInstant | None: ...

    def delta_version(self) -> int: ...

    def vacuum(self, retention_hours: int = 168, dry_run: bool = False) -> Any: ...

    def match_vector_storage(self) -> Any: ...


@dataclass
class ServiceRun:
    """One service instant a run published (or tried to)."""

    service: str  # data_compaction, index_compaction, clean
    instant: str | None
    seconds: float
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class ServicesReport:
    """What a services run did: what ran, what it yielded to, what the budget left for later, and how long it took."""

    ran: list[ServiceRun] = field(default_factory=list)
    yielded: list[dict[str, str]] = field(default_factory=list)  # {service, error}: conflicts, retried next run
    left: list[dict[str, Any]] = field(default_factory=list)  # {service, reason, ...}: work for the next run
    disabled: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON form (`dbidx maintain --json`, an upsert summary's `services`)."""
        return {
            "ran": [vars(r) for r in self.ran],
            "yielded": list(self.yielded),
            "left": list(self.left),
            "disabled": list(self.disabled),
            "seconds": round(self.seconds, 4),
        }


@dataclass(frozen=True)
class DataNeeds:
    """Per partition, how many live data files a data compaction would rewrite now."""

    files: dict[str, int]

    def worst_first(self) -> list[str]:
        """Partitions by files to rewrite, most first (ties by name, so runs are repeatable)."""
        return sorted(self.files, key=lambda p: (-self.files[p], p))


def data_needs(table: TableState, settings: ServiceSettings) -> DataNeeds:
    """Files to rewrite per partition, from the data view alone: per file group, its small files when there are at
    least `data_min_small_files`, and any large file whose vector hides `data_deleted_share` of its rows (the rule
    data.compaction applies). Why only large ones trigger by share: a small file's share moves with every update
    batch, and rewriting it each time is the churn the count rule exists to batch; it waits for its group's count."""
    small_bytes = settings.data_small_file_mb << 20
    view = table.data_view()
    groups: dict[tuple[str, str], list[tuple[bool, bool]]] = {}
    for live in view.live():
        rec = live.record
        ref = view.vector_of(rec.path)
        small = rec.size < small_bytes
        heavy = (
            not small
            and ref is not None
            and rec.rows > 0
            and ref.vector.cardinality / rec.rows >= settings.data_deleted_share
        )
        groups.setdefault((rec.partition, rec.file_group), []).append((small, heavy))
    files: dict[str, int] = {}
    for (partition, _), flags in groups.items():
        chosen = sum(1 for small, heavy in flags if small or heavy)
        if chosen < settings.data_min_small_files:
            chosen = sum(1 for _, heavy in flags if heavy)
        if chosen:
            files[partition] = files.get(partition, 0) + chosen
    return DataNeeds(files)


def index_needs(table: TableState, settings: ServiceSettings) -> dict[str | None, int]:
    """Index groups (partition, shard) with at least `index_min_files` live files, counted per partition (None:
    the global index)."""
    view = table.refresh()
    out: dict[str | None, int] = {}
    for partition, shard in view.groups():
        if len(view.files(partition, shard)) >= settings.index_min_files:
            out[partition] = out.get(partition, 0) + 1
    return out


def clean_due(table: TableState, settings: ServiceSettings, now_ms: int | None = None) -> str | None:
    """Why a clean is not due now (None: it is): a clean ran within the last `clean_interval` completions (each
    clean is a commit of its own; cleaning every batch would double the log), or nothing is old enough to delete:
    no index file replaced `clean_retain_completions` completions ago, and no data or DV file replaced longer ago
    than the table's `delta.deletedFileRetentionDuration` as well (index/clean.py: the same plan the clean runs, so
    a table whose replaced files are all within the retention never starts a clean that deletes nothing)."""
    timeline = table.timeline
    latest = timeline.latest_seq
    after = max(latest - settings.clean_interval, timeline.base_seq)
    if any(rec.action == ACTION_CLEAN for rec in timeline.completed(after_seq=after)):
        return f"a clean ran within the last {settings.clean_interval} completions"
    plan = plan_clean(table, settings.clean_retain_completions, now_ms=now_ms)
    return plan.nothing_to_do() if not plan.doomed else None


def run_services(
    table: MaintainedTable,
    settings: ServiceSettings,
    budget_seconds: float | None = None,
    budget_files: int | None = None,
    progress: Progress | None = None,
    runner: WorkRunner | None = None,
) -> ServicesReport:
    """Run what the table needs now, within the budget (the settings' unless given): data compaction of the worst
    partitions, then index compaction, then clean. A ConflictError makes that service yield (reported; the next
    run tries again); any other error propagates (the caller decides: the writer turns it into a warning).
    `runner` runs the compactions' file-group rewrites and index-group merges (dbidx.runner; default: in this
    process; a Spark writer passes a Spark job runner); each run's report says where (`ran_on`)."""
    started = time.monotonic()
    seconds = settings.budget_seconds if budget_seconds is None else budget_seconds
    files_left = settings.budget_files if budget_files is None else budget_files
    report = ServicesReport(disabled=[s for s in SERVICES if not getattr(settings, s)])
    runner = runner or IN_PROCESS

    def out_of_time() -> bool:
        return time.monotonic() - started >= seconds

    # 1. Data compaction, worst partitions first, in rounds of ROUND_PARTITIONS within the files budget.
    if settings.data_compaction:
        needs = data_needs(table, settings)
        todo = needs.worst_first()
        while todo and not out_of_time() and files_left > 0:
            batch: list[str] = []
            for partition in todo[:ROUND_PARTITIONS]:
                if batch and needs.files[partition] > files_left:
                    break
                batch.append(partition)
                files_left -= needs.files[partition]
            todo = todo[len(batch) :]
            if not _step(report, "data_compaction", lambda: _compact_data(table, settings, batch, progress, runner)):
                todo = []  # yielded: the rest waits for the next run
        if todo:
            reason = "budget_files" if files_left <= 0 else "budget_seconds"
            report.left.append(
                {
                    "service": "data_compaction",
                    "reason": reason,
                    "partitions": len(todo),
                    "files": sum(needs.files[p] for p in todo),
                }
            )
    # 2. Index compaction of the groups with too many files.
    if settings.index_compaction:
        groups = index_needs(table, settings)
        if groups and out_of_time():
            report.left.append(
                {"service": "index_compaction", "reason": "budget_seconds", "groups": sum(groups.values())}
            )
        elif groups:
            wanted = None if None in groups else sorted(p for p in groups if p is not None)
            _step(report, "index_compaction", lambda: _compact_index(table, settings, wanted, progress, runner))
    # 3. Clean of what compactions replaced long enough ago (data and DV files: delta.deletedFileRetentionDuration).
    if settings.clean and clean_due(table, settings) is None:
        if out_of_time():
            report.left.append({"service": "clean", "reason": "budget_seconds"})
        else:
            _step(report, "clean", lambda: _clean(table, settings))
    # 4. The Delta log: a checkpoint once the newest lags by delta.checkpointInterval versions, then expiry of the
    #    log files it made unnecessary that are older than delta.logRetentionDuration.
    if settings.log_cleanup or settings.vacuum:
        retention = retention_of(table.data_view().configuration())
        if settings.log_cleanup:
            _step(report, "vector_storage", lambda: _vector_storage(table))
            _step(report, "log_cleanup", lambda: _log_cleanup(table, retention))
        # 5. Vacuum, at most once per vacuum_interval_hours (it lists the whole table).
        if settings.vacuum and vacuum_wait(table.io, settings) is None:
            if out_of_time():
                report.left.append({"service": "vacuum", "reason": "budget_seconds"})
            else:
                _step(report, "vacuum", lambda: _vacuum(table, retention))
    report.seconds = time.monotonic() - started
    return report


def _step(report: ServicesReport, service: str, run: Any) -> bool:
    """Run one service instant into the report; False when it yielded to a conflicting maintenance run."""
    began = time.monotonic()
    try:
        instant, details = run()
    except ConflictError as exc:
        report.yielded.append({"service": service, "error": str(exc)})
        return False
    if instant is not None or details:
        report.ran.append(ServiceRun(service, instant, round(time.monotonic() - began, 4), details))
    return True


def _compact_data(
    table: MaintainedTable,
    settings: ServiceSettings,
    partitions: list[str],
    progress: Progress | None,
    runner: WorkRunner,
) -> tuple[str | None, dict[str, Any]]:
    result = table.compact_data(
        partitions,
        min_files=settings.data_min_small_files,
        deleted_share=settings.data_deleted_share,
        target_file_bytes=settings.data_small_file_mb << 20,
        progress=progress,
        runner=runner,
        base_share=settings.data_base_share or None,
    )
    # runner.where is read after the run: a runner.BySize says there where this run went.
    details = {
        "ran_on": runner.where,
        "partitions": partitions,
        "file_groups": result.file_groups,
        "files_replaced": result.files_replaced,
        "rows_written": result.rows_written,
        "bytes_before": result.bytes_before,
        "bytes_after": result.bytes_after,
    }
    return (result.record.instant if result.record else None), details


def _compact_index(
    table: MaintainedTable,
    settings: ServiceSettings,
    partitions: list[str] | None,
    progress: Progress | None,
    runner: WorkRunner,
) -> tuple[str | None, dict[str, Any]]:
    result = table.compact(
        partitions,
        min_files=settings.index_min_files,
        progress=progress,
        runner=runner,
        base_share=settings.index_base_share or None,
    )
    details = {
        "ran_on": runner.where,
        "groups": result.groups,
        "bases": result.bases,
        "files_replaced": result.files_replaced,
        "entries_written": result.entries_written,
    }
    return (result.record.instant if result.record else None), details


def _clean(table: MaintainedTable, settings: ServiceSettings) -> tuple[str | None, dict[str, Any]]:
    """The clean: index files by `clean_retain_completions`, data and DV files by that and the table's
    delta.deletedFileRetentionDuration (index/clean.py)."""
    record = table.clean(retain_completions=settings.clean_retain_completions)
    return (record.instant if record else None), {"files_deleted": len(record.deleted) if record else 0}


def _vector_storage(table: MaintainedTable) -> tuple[str | None, dict[str, Any]]:
    """Log every deletion vector in the table's form (table/vector_storage.py) when some are not: on a table left
    inline, the file-backed vectors another engine wrote (Delta Spark's DELETE, MERGE, UPDATE), on which delta-rs
    readers deadlock once there are hundreds. A cheap look at the data view when none is ({} then)."""
    if not misplaced_vectors(table):
        return None, {}
    moved = table.match_vector_storage()
    return None, {"vectors_moved": moved.moved, "form": moved.form, "version": moved.version}


def _log_cleanup(table: MaintainedTable, retention: DeltaRetention) -> tuple[str | None, dict[str, Any]]:
    """A Delta checkpoint when due (delta-rs writes it, dbidx slims it and publishes it once:
    data/delta_checkpoint.py), then expiry of the log below the newest checkpoint old enough, whenever the newest
    checkpoint changed since this process last expired the log: also one another writer wrote (the publisher's every
    checkpoint_interval completions, another engine's), else a table whose checkpoints others write would keep its
    log for ever. {} when nothing was done."""
    details: dict[str, Any] = {}
    pointer = checkpoint_pointer(table.io)
    if (
        table.delta_version() - max(pointer, 0) >= retention.checkpoint_interval
        and table.data_view().schema is not None
    ):
        written = write_delta_checkpoint(table.io)
        if written is not None:  # None: a table on an injected filesystem, which delta-rs cannot reach
            details = {
                "checkpoint": written.version,
                "tombstones_dropped": written.tombstones_dropped,
                "vectors_stripped": written.vectors_stripped,
                "checkpoint_bytes": written.bytes_after,
            }
            if not written.published:  # another writer's checkpoint of that version was there: left as it is
                details["published"] = False
            pointer = written.version
    if (
        retention.expired_log_cleanup
        and pointer >= 0
        and _EXPIRED_AT.get(table) != pointer
        and not still_young(table.io, _WAITS_ON.get(table, ()), retention.log_retention_ms)
    ):
        expiry = expire_log(table.io, retention.log_retention_ms)
        _WAITS_ON[table] = expiry.waits_on
        # dbidx's own history goes by the same retention (storage/archive_retention.py): time travel reaches as far
        # back in dbidx as in Delta.
        archive = expire_archive(table, retention.log_retention_ms)
        _EXPIRED_AT[table] = pointer
        if expiry.deleted or details:
            details.update(expiry.to_dict())
        if archive.deleted:
            details["archive"] = archive.to_dict()
    return None, details


def vacuum_wait(io: FileIO, settings: ServiceSettings, now_ms: int | None = None) -> str | None:
    """Why a vacuum is not due now (None: it is): one ran within the last vacuum_interval_hours
    (`.dbidx/vacuum.json`, written after each automatic vacuum; read back strictly)."""
    if not io.exists(VACUUM_STATE_FILE):
        return None
    raw = io.read_bytes(VACUUM_STATE_FILE)
    try:
        data = json.loads(raw)
        last = data["last_run_ms"]
        if (
            set(data) != {"format", "last_run_ms", "files_deleted"}
            or data["format"] != 1
            or isinstance(last, bool)
            or not isinstance(last, int)
            or last < 0
        ):
            raise ValueError(str(data)[:200])
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptFileError(
            f"{io.path(VACUUM_STATE_FILE)} is not a vacuum record ({exc}); delete it to let the next run vacuum"
        ) from exc
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    if now_ms - last < settings.vacuum_interval_hours * 3_600_000:
        return f"a vacuum ran within the last {settings.vacuum_interval_hours:g} hours"
    return None


def _vacuum(table: MaintainedTable, retention: DeltaRetention) -> tuple[str | None, dict[str, Any]]:
    """Vacuum by delta.deletedFileRetentionDuration, never younger than an hour (a file another engine is still
    writing is unreferenced until its commit), and remember when (vacuum_wait)."""
    hours = max(1, math.ceil(retention.deleted_file_retention_ms / 3_600_000))
    result = table.vacuum(retention_hours=hours)
    table.io.write_atomic(
        VACUUM_STATE_FILE,
        json.dumps(
            {"format": 1, "last_run_ms": int(time.time() * 1000), "files_deleted": len(result.deleted)}
        ).encode(),
    )
    if not result.deleted:
        return None, {}  # nothing to delete: not reported as a run
    return None, {"retention_hours": hours, "files_deleted": len(result.deleted), "bytes": result.bytes}
