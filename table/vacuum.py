"""`vacuum`: delete the files the table no longer references once they have been unreferenced for the retention
period (Delta's VACUUM), never a file dbidx or a running writer still needs (`dbidx vacuum URI`).

Why delta-rs proposes and dbidx disposes: which files Delta semantics let go (a file another engine removed from the
log longer than the retention ago, a file no version ever named, such as a crashed writer's orphan) is the log's
answer, and delta-rs gives it from its own replay of the log, tombstone times included. But the log is not all of the
table: dbidx keeps files the log has removed (data compactions' replaced files until `clean`, deletion-vector files,
its index), an in-flight dbidx instant's files are in no version yet, and delta-rs's list is Delta's, not ours (it
names files under hidden directories inside partitions, files long gone, and in full mode every file no live `add`
names, a live file's deletion-vector file included). So delta-rs only lists (a dry run: it never deletes and never
commits), and dbidx deletes only what it finds on storage, old enough, and named by nothing it knows of.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol
from urllib.parse import unquote

from dbidx.data.delta_actions import dv_file_path
from dbidx.data.delta_log import DELTA_LOG_DIR
from dbidx.errors import ConfigError, CorruptFileError, DbidxError, InvalidInputError, StoreUnavailableError
from dbidx.storage import layout, markers
from dbidx.storage.fileio import FileEntry
from dbidx.storage.state import TableState

DEFAULT_RETENTION_HOURS = 168  # Delta's default (delta.deletedFileRetentionDuration = 7 days)
_DV_FILE_PREFIX = "deletion_vector_"  # Delta's name of a deletion-vector file (`<prefix>/deletion_vector_<uuid>.bin`)


@dataclass
class VacuumReport:
    """What a vacuum deleted (with dry_run: would delete) and which files delta-rs named that dbidx kept, and why."""

    retention_hours: int
    dry_run: bool
    deleted: list[str] = field(default_factory=list)  # table-relative paths, oldest first
    bytes: int = 0  # their total size
    protected: list[dict[str, str]] = field(default_factory=list)  # {path, reason}
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON form (`dbidx vacuum --json`)."""
        return asdict(self) | {"seconds": round(self.seconds, 4)}


class VacuumedTable(TableState, Protocol):
    """A table vacuum can run on (implemented by `Table`)."""

    def sync_delta_log(self) -> int: ...


class VacuumIncompleteError(StoreUnavailableError):
    """A delete failed part-way through a vacuum: `report` lists what was deleted before it (those files are gone for
    good); the files not reached stay until the next vacuum, which picks them up again."""

    def __init__(self, message: str, report: VacuumReport) -> None:
        super().__init__(message)
        self.report = report


def vacuum(table: VacuumedTable, retention_hours: int = DEFAULT_RETENTION_HOURS, dry_run: bool = False) -> VacuumReport:
    """Delete the files Delta's VACUUM would (unreferenced for over `retention_hours`, orphans of crashed writers
    included) that dbidx does not need, oldest first; `dry_run` lists them and deletes nothing.

    Why a retention at all: a file another engine is still writing is unreferenced until its commit, and readers of
    older versions (time travel, a long query) still read removed files. A failed delete raises
    VacuumIncompleteError carrying the report of what was deleted before it."""
    started = time.monotonic()
    # 1. The retention: a whole number of hours, at least one (0 would take a file from under a writer about to
    #    commit it).
    if isinstance(retention_hours, bool) or not isinstance(retention_hours, int) or retention_hours < 1:
        raise ConfigError(
            f"retention_hours must be a whole number of hours >= 1, got {retention_hours!r}: a data "
            "file another engine is still writing is unreferenced until its commit, so vacuum only "
            f"takes files unreferenced for longer than that (Delta's default: {DEFAULT_RETENTION_HOURS} "
            "hours, 7 days)"
        )
    report = VacuumReport(retention_hours, dry_run)
    io = table.io
    # 2. delta-rs must reach the table: a local path, or a URI with its storage options.
    if not io.is_local and "://" not in io.uri:
        raise InvalidInputError(
            f"vacuum of {io.root} needs delta-rs to read its Delta log, and delta-rs cannot reach "
            "a table opened on an injected pyarrow filesystem: open it by its URI (a local path, "
            "or s3://... with storage_options)"
        )
    # 3. dbidx up to the log first (other engines' versions absorbed), so its view names what the log names.
    table.sync_delta_log()
    if table.data_view().schema is None:
        report.seconds = time.monotonic() - started
        return report  # nothing written yet: no data file to let go, and delta-rs refuses a log without a schema
    # 4. delta-rs's list of what Delta semantics allow to delete (a dry run: delta-rs deletes and commits nothing).
    from deltalake import DeltaTable

    where = io.path(DELTA_LOG_DIR)
    try:
        delta = DeltaTable(io.path("") if io.is_local else io.uri, storage_options=io.storage_options or None)
        named = delta.vacuum(retention_hours=retention_hours, dry_run=True, enforce_retention_duration=False, full=True)
        partition_columns = list(delta.metadata().partition_columns)
    except Exception as exc:
        raise InvalidInputError(
            f"delta-rs cannot list what VACUUM may delete from {where}: {exc}; nothing was deleted"
        ) from exc
    # 5. What is really there (one listing), and delta-rs's names as table-relative paths on storage.
    now_ms = int(time.time() * 1000)
    present = {e.path: e for e in io.list_entries("", recursive=True)}
    candidates = _on_storage(io, named, present)
    # 6. What dbidx keeps whatever delta-rs says. Markers are read before the view is refreshed: an instant that
    #    settles in between is then in the view (completed) or gone for good (rolled back).
    cutoff_ms = now_ms - retention_hours * 3_600_000
    announced = _announced(table)
    with table.held_data_view() as data:  # no other thread's refresh changes it while it is read
        referenced = data.referenced_paths()
        live_dvs = _live_dv_files(data, where)
    recent_dvs: dict[str, str] | None = None  # read only if a Delta DV file is a candidate
    doomed: list[FileEntry] = []
    for path in sorted(candidates):
        entry = present[path]
        reason = _reason(path, entry, partition_columns, referenced, live_dvs, announced, cutoff_ms, now_ms)
        if reason is None and path.rsplit("/", 1)[-1].startswith(_DV_FILE_PREFIX):
            recent_dvs = _recent_version_dvs(io, present, cutoff_ms) if recent_dvs is None else recent_dvs
            reason = recent_dvs.get(path)
        if reason is None:
            doomed.append(entry)
        else:
            report.protected.append({"path": path, "reason": reason})
    # 7. Delete the rest, oldest first: a run cut short has taken the longest-dead files.
    doomed.sort(key=lambda e: (e.mtime_ms or 0, e.path))
    for done, entry in enumerate(doomed):
        if not dry_run:
            try:
                gone = io.delete(entry.path)
            except (OSError, DbidxError) as exc:
                report.seconds = time.monotonic() - started
                raise VacuumIncompleteError(
                    f"vacuum of {table.uri} stopped at {entry.path}: {exc}. It deleted {len(report.deleted)} files "
                    f"({report.bytes:,} bytes) before that (the error's report lists them); the other "
                    f"{len(doomed) - done} stay until the next vacuum, which takes them",
                    report,
                ) from exc
            if not gone:
                continue  # deleted meanwhile by someone else (another vacuum)
        report.deleted.append(entry.path)
        report.bytes += entry.size
    report.seconds = time.monotonic() - started
    return report


def _on_storage(io: Any, named: list[str], present: dict[str, FileEntry]) -> set[str]:
    """delta-rs's paths as table-relative paths of listed files. delta-rs 1.6.6 gives paths relative to the table as
    they are on storage (a tombstone's log spelling decoded once); an absolute path or URI, or a percent-encoded
    spelling, is also matched (exact first). A path that matches nothing is not there (a file already deleted)."""
    root = io.path("").rstrip("/")
    prefixes = [p for p in ((io.uri or "").rstrip("/") + "/", "file://" + root + "/", root + "/") if p != "/"]
    out = set()
    for raw in named:
        for form in (str(raw), unquote(str(raw))):
            rel = next((form[len(p) :] for p in prefixes if form.startswith(p)), form)
            if rel in present:
                out.add(rel)
                break
    return out


def _announced(table: VacuumedTable) -> dict[str, str]:
    """Every file an unsettled instant announced (markers) or planned (its rollback plan) -> that instant: a dbidx
    writer's files before its commit names them. A damaged marker is a CorruptFileError naming its remedy: without
    it, which files a running writer owns is unknown, and nothing is deleted."""
    out: dict[str, str] = {}
    for instant in table.timeline.pending():
        for rel in markers.announced_files(table.io, instant) + table.timeline.planned_files(instant):
            out[rel] = instant
    return out


def _live_dv_files(data: Any, where: str) -> set[str]:
    """DV files another engine wrote that a live file's Delta descriptor still names (dbidx reads its own copy,
    under `.dbidx/dv/`, but Delta readers read this one): delta-rs's full vacuum lists them as unreferenced."""
    out = set()
    for live in data.live():
        ref = data.vector_of(live.record.path)
        descriptor = ref.vector.delta if ref is not None else None
        if descriptor and descriptor.get("storageType") == "u":
            out.add(dv_file_path(descriptor, where))
    return out


def _reason(
    path: str,
    entry: FileEntry,
    partition_columns: list[str],
    referenced: set[str],
    live_dvs: set[str],
    announced: dict[str, str],
    cutoff_ms: int,
    now_ms: int,
) -> str | None:
    """Why dbidx keeps a file delta-rs named (None: it may go)."""
    first = path.split("/", 1)[0]
    if first == DELTA_LOG_DIR:
        return "the Delta log"
    if first == layout.META_DIR:
        return "dbidx metadata (.dbidx/)"
    if _hidden(path, partition_columns):
        return "a hidden path (a name starting with '_' or '.', e.g. a writer's temp file): Delta readers skip it"
    if path in referenced:
        return "the table still names it (a live data file, a replaced one no clean has deleted yet, or a DV file)"
    if path in live_dvs:
        return "the deletion-vector file of a live data file (Delta readers read it)"
    if path in announced:
        return f"announced by instant {announced[path]}, which has not settled (a running or crashed dbidx writer)"
    if entry.mtime_ms is None:
        return "its modification time is unknown, so its age cannot be checked"
    if entry.mtime_ms > cutoff_ms:
        hours = max(now_ms - entry.mtime_ms, 0) / 3_600_000
        return f"modified {hours:.1f} hours ago, within the retention (a writer may be about to commit it)"
    return None


def _hidden(path: str, partition_columns: list[str]) -> bool:
    """Whether any part of the path starts with `_` or `.` (as Spark's VACUUM judges every level; delta-rs judges
    only the first), a partition directory `<column>=<value>` of a partition column excepted."""
    parts = path.split("/")
    for i, part in enumerate(parts):
        if part.startswith(("_", ".")) and not (
            i < len(parts) - 1 and any(part.startswith(c + "=") for c in partition_columns)
        ):
            return True
    return False


def _recent_version_dvs(io: Any, present: dict[str, FileEntry], cutoff_ms: int) -> dict[str, str]:
    """DV files a Delta version committed within the retention names (in an add, or in a remove: time travel to
    the versions before it reads that vector) -> the reason to keep them. Which versions: those whose JSON was
    modified after the cutoff (a remove's deletionTimestamp is its commit's time). A version that cannot be read is
    a CorruptFileError: which vectors it names is then unknown."""
    out: dict[str, str] = {}
    for path, entry in present.items():
        folder, _, name = path.rpartition("/")
        if folder != DELTA_LOG_DIR or not name.endswith(".json") or not name[:-5].isdigit():
            continue
        if entry.mtime_ms is not None and entry.mtime_ms <= cutoff_ms:
            continue
        where = io.path(path)
        try:
            actions = [json.loads(line) for line in io.read_bytes(path).decode("utf-8").splitlines() if line.strip()]
        except (ValueError, UnicodeDecodeError) as exc:
            raise CorruptFileError(
                f"Delta version {where} is not JSON lines ({exc}): vacuum cannot tell which "
                "deletion-vector files it needs; nothing was deleted"
            ) from exc
        for action in actions:
            for kind in ("add", "remove"):
                body = action.get(kind) if isinstance(action, dict) else None
                descriptor = body.get("deletionVector") if isinstance(body, dict) else None
                if isinstance(descriptor, dict) and descriptor.get("storageType") == "u":
                    out[dv_file_path(descriptor, where)] = (
                        f"Delta version {int(name[:-5])}, committed within the "
                        "retention, names this deletion-vector file (time travel)"
                    )
    return out
