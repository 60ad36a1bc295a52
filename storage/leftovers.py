"""Leftovers of writers that died or were cut short, and the sweeps that remove them.

What a crash can leave: a `.tmp-<hex>` file (killed between a temp write and its rename, on stores where
`write_atomic` goes through a temp name), and of an instant that settled (completed or rolled back) without its own
housekeeping: its `.requested` / `.inflight` timeline files, its markers with the unlisted files they announce
(touched-key files, losing attempts' data and index files), its writer-presence files and its heartbeat. None of them is
ever read as table data (readers read only what a completion lists), but they cost space and listings, for ever.

A clean publishes its record first and deletes the files it lists after; it keeps its claim (`.requested`) until
they are all gone. A clean killed between the two leaves a settled instant with its claim still there: the sweep of
settled instants finishes its deletions before it removes the claim (`cleaned_files`). Each path a clean record
lists is read back, so untrusted: it is deleted only if it is a table-relative path inside the table, a kind of file
a clean deletes (an index file a compaction replaced, a data file a data compaction replaced, never one another
engine removed from the Delta log, or a DV file a completion wrote), and no part of the current view (live or
replaced-not-cleaned files, tracked DV files) references it. `dbidx repair` checks every clean record so (one
listing per directory they name), for cleans that died before this rule (their claim was removed first).

Who sweeps: every upsert sweeps settled instants before it starts (cheap: two listings), and after it publishes the
temp files of the directories its files went to (one listing each: the partitions the batch touched, never the
whole table); clean, both compactions and `dbidx repair` sweep temp files over the whole table, and roll back the
unfinished instants of writers that are gone (`rolled_back`), as every upsert does before it starts. Every temp
sweep takes only files older than `min_age_s`, so that a live writer's temp file (seconds old) is never taken from
under it.
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable

import pyarrow.fs as pafs

from dbidx.errors import DbidxError
from dbidx.storage import layout, markers, writer_presence
from dbidx.storage.fileio import FileIO
from dbidx.storage.heartbeat import read_heartbeat
from dbidx.storage.pending import pending_attempts, roll_back_abandoned
from dbidx.storage.records import (
    ACTION_ABSORB,
    ACTION_CLEAN,
    ACTION_COMPACTION,
    ACTION_DATA_COMPACTION,
    CompletedInstant,
)

TEMP_PREFIX = ".tmp-"
DEFAULT_TEMP_AGE_S = 3600.0  # a temp file lives for one write (seconds); an hour-old one belongs to a dead writer


@dataclass
class SweepReport:
    """What a sweep deleted (table-relative paths)."""

    settled_files: list[str] = field(default_factory=list)  # unlisted files announced by settled instants' markers
    timeline_files: list[str] = field(default_factory=list)  # .requested / .inflight of settled instants
    temp_files: list[str] = field(default_factory=list)  # .tmp-<hex> older than the age guard
    cleaned_files: list[str] = field(default_factory=list)  # listed by a published clean that died before deleting
    rolled_back: list[str] = field(default_factory=list)  # unfinished instants of writers that are gone (not files)

    @property
    def total(self) -> int:
        """How many files the sweep deleted."""
        return len(self.settled_files) + len(self.timeline_files) + len(self.temp_files) + len(self.cleaned_files)

    def counts(self) -> dict[str, int]:
        """Per category, how many files (instants for rolled_back) the sweep took: what `dbidx repair` prints."""
        return {
            "settled_files": len(self.settled_files),
            "timeline_files": len(self.timeline_files),
            "temp_files": len(self.temp_files),
            "cleaned_files": len(self.cleaned_files),
            "rolled_back": len(self.rolled_back),
        }


def settled_files(record: Any) -> set[str] | None:
    """The files a settled instant published (empty for a rollback); None while it is unsettled."""
    if record is None:
        return None
    # Every action's own files (a build-index's or data compaction's DV files too: a sweep of their markers after a
    # crash must not delete them); a rollback lists none.
    return {f.path for f in record.data_files} | {f.path for f in record.files} | {f.path for f in record.dv_files}


def sweep_settled(io: FileIO, timeline: Any, report: SweepReport | None = None) -> SweepReport:
    """Delete what settled instants left: the unlisted files their markers announce, the markers, their timeline
    files and presence files. An unsettled (pending) instant is a live or crashed writer's: left to it or to
    `dbidx rollback`."""
    report = report if report is not None else SweepReport()
    timeline.refresh()
    # 1. Markers of settled instants (files of attempts killed after their job ended, touched-key files).
    for instant in io.list_dirs(markers.MARKERS_DIR):
        listed = settled_files(timeline.record_of(instant))
        if listed is not None:
            report.settled_files += markers.discard_unlisted(io, instant, listed)
    # 2. Timeline files of settled instants (their writer died between publishing and forgetting them). A clean
    #    keeps its claim until it has deleted what it lists: a clean that died before that is finished first (only
    #    where the current view can be checked; else its claim stays for a sweep that can).
    settled: set[str] = set()
    claimed: set[str] = set()
    referenced = getattr(timeline, "referenced", None)
    for name in io.list_names(layout.TIMELINE_DIR):
        instant, _, kind = name.partition(".")
        if kind in ("requested", "inflight"):
            claimed.add(instant)
        record = timeline.record_of(instant) if kind in ("requested", "inflight") else None
        if record is not None:
            if record.action == ACTION_CLEAN and record.rolled_back is None and record.instant == instant:
                if referenced is None:
                    continue
                finish_cleans(io, timeline, [record], referenced(), report)
            if io.delete(f"{layout.TIMELINE_DIR}/{name}"):
                report.timeline_files.append(f"{layout.TIMELINE_DIR}/{name}")
            settled.add(instant)
    for instant in settled:
        writer_presence.forget(io, instant)
    # 3. Heartbeats of settled instants, and expired ones of instants with no claim left (their writer was renewing
    #    while a rollback took the claim away).
    for name in io.list_names(layout.HEARTBEAT_DIR):
        instant = name[: -len(".json")] if name.endswith(".json") else ""
        if not layout.is_instant(instant):
            continue
        # The record (in memory) first: a running writer's heartbeat costs no read here.
        if timeline.record_of(instant) is not None or (instant not in claimed and _stale(io, instant)):
            if io.delete(layout.heartbeat_file(instant)):
                report.timeline_files.append(layout.heartbeat_file(instant))
    # 4. Staged records that can never be published.
    sweep_staged(io, timeline, report)
    return report


def _stale(io: FileIO, instant: str) -> bool:
    """A heartbeat nobody renews any more: unreadable, or expired."""
    beat = read_heartbeat(io, instant)
    return beat is None or beat.expired


def finish_cleans(
    io: FileIO,
    timeline: Any,
    cleans: list[CompletedInstant],
    referenced: set[str],
    report: SweepReport,
    listed_only: bool = False,
) -> SweepReport:
    """Delete the files these published clean records list that are still on storage, each only if a clean may
    delete it (`clean_may_delete`: checked against the log before the clean) and `referenced` (the current view's
    files) does not name it. listed_only: look for them with one listing per directory instead of one existence
    check per path (`dbidx repair`, over every clean record)."""
    if not cleans:
        return report
    eligible = clean_may_delete(timeline, max(c.seq for c in cleans))
    doomed = [
        path
        for rec in sorted(cleans, key=lambda r: r.seq)
        for path in rec.deleted
        if path not in referenced and eligible(path, rec.seq)
    ]
    present = _present(io, doomed) if listed_only else None
    for path in dict.fromkeys(doomed):
        try:
            if (present is None or path in present) and io.delete(path):
                report.cleaned_files.append(path)
        except DbidxError as exc:  # the guard: it resolves outside the table (a symlink on the way)
            warnings.warn(f"a clean record lists {path!r}, which is not deleted: {exc}", RuntimeWarning, stacklevel=2)
    return report


def sweep_cleaned(io: FileIO, timeline: Any, report: SweepReport | None = None) -> SweepReport:
    """Every published clean record's files that are still on storage (what `dbidx repair` runs; needs the table's
    current view: `timeline.referenced`)."""
    report = report if report is not None else SweepReport()
    referenced = getattr(timeline, "referenced", None)
    timeline.refresh()
    cleans = [r for r in timeline.kept() if r.action == ACTION_CLEAN]  # cleans below a history floor are done
    if referenced is None or not cleans:
        return report
    return finish_cleans(io, timeline, cleans, referenced(), report, listed_only=True)


def clean_may_delete(timeline: Any, upto_seq: int) -> Any:
    """A test `(path, clean seq) -> bool`: whether a clean at that seq may delete the path, by the log before it. An
    index file under `.dbidx/rli/` whose last removal was a compaction's; a DV file (`.dbidx/dv/` or the root,
    `deletion_vector_*`) some completion wrote; any other path outside `.dbidx/` and `_delta_log/` whose last
    removal was a dbidx data compaction's (a file another engine removed is that engine's to VACUUM). The path must
    also be a valid table-relative path (records are parsed strictly; checked again here)."""
    removed: dict[str, list[tuple[int, str]]] = {}  # path -> (seq, action) of each removal or (seq, "add")
    written_dv: dict[str, int] = {}
    # The kept records only: a path last removed below a history floor is never confirmed, so it stays (a leak that
    # vacuum takes, never a wrong deletion).
    for rec in (r for r in timeline.kept() if r.seq <= upto_seq):
        if rec.action in (ACTION_COMPACTION, ACTION_DATA_COMPACTION, ACTION_ABSORB):
            for path in rec.replaced:
                removed.setdefault(path, []).append((rec.seq, rec.action))
        for f in rec.data_files:
            removed.setdefault(f.path, []).append((rec.seq, "add"))
        for d in rec.dv_files:
            written_dv.setdefault(d.path, rec.seq)

    def last_event(path: str, before: int) -> str | None:
        events = [action for seq, action in removed.get(path, ()) if seq < before]
        return events[-1] if events else None

    def may_delete(path: str, seq: int) -> bool:
        try:
            layout.validate_table_path(path)
        except DbidxError:
            return False
        name = path.rsplit("/", 1)[-1]
        if path.startswith(layout.RLI_DIR + "/"):
            return last_event(path, seq) == ACTION_COMPACTION
        if name.startswith("deletion_vector_") and path in (name, f"{layout.DV_DIR}/{name}"):
            return written_dv.get(path, seq) < seq
        if path.startswith((layout.META_DIR + "/", "_delta_log/")):
            return False
        return last_event(path, seq) == ACTION_DATA_COMPACTION

    return may_delete


def _present(io: FileIO, paths: Iterable[str]) -> set[str]:
    """Which of these paths exist, by one listing of each directory they are in."""
    by_dir: dict[str, list[str]] = {}
    for path in paths:
        parent, _, name = path.rpartition("/")
        by_dir.setdefault(parent, []).append(name)
    out: set[str] = set()
    for parent, names in by_dir.items():
        there = set(io.list_names(parent))
        out.update(f"{parent}/{n}" if parent else n for n in names if n in there)
    return out


def sweep_staged(io: FileIO, timeline: Any, report: SweepReport | None = None) -> SweepReport:
    """Staged records (docs/FORMAT.md section 12) of settled instants (redundant once published, garbage once
    rolled back), and of instants whose seq another completion took (their writer died before its Delta put: the
    record can never be published). Any other stays: its Delta version may be on storage already, and the next
    reader publishes the record from it. Runs before every upsert and after every publish (one listing of a
    directory that is empty but for a moment)."""
    report = report if report is not None else SweepReport()
    for name in io.list_names(layout.STAGED_DIR):
        instant = name[: -len(".json")] if name.endswith(".json") else ""
        if not layout.is_instant(instant):
            continue
        if timeline.record_of(instant) is not None or _staged_seq(io, name) <= timeline.latest_seq:
            if io.delete(f"{layout.STAGED_DIR}/{name}"):
                report.timeline_files.append(f"{layout.STAGED_DIR}/{name}")
    return report


def _staged_seq(io: FileIO, name: str) -> float:
    """The seq a staged record was built for (read back: untrusted; an unreadable one counts as not yet taken)."""
    try:
        seq = json.loads(io.read_bytes(f"{layout.STAGED_DIR}/{name}")).get("seq")
    except (ValueError, AttributeError, OSError):
        return float("inf")
    return seq if isinstance(seq, int) and not isinstance(seq, bool) else float("inf")


def sweep_dead_absorbs(
    io: FileIO, timeline: Any, min_age_s: float = DEFAULT_TEMP_AGE_S, report: SweepReport | None = None
) -> SweepReport:
    """Claims of absorbing processes that died before publishing (table/absorb.py), older than min_age_s: their index
    and DV files, markers and claim. An absorb never needs a rollback record (it publishes nothing until its one
    create), and absorbing takes seconds: an hour-old unpublished absorb claim is a dead process's."""
    report = report if report is not None else SweepReport()
    cutoff_ms = (time.time() - min_age_s) * 1000
    for name in io.list_names(layout.TIMELINE_DIR):
        instant, _, kind = name.partition(".")
        if kind != "requested" or not layout.is_instant(instant) or timeline.record_of(instant) is not None:
            continue
        try:
            claim = json.loads(io.read_bytes(f"{layout.TIMELINE_DIR}/{name}"))
        except (ValueError, OSError):
            continue
        if (
            not isinstance(claim, dict)
            or claim.get("action") != "absorb"
            or not isinstance(claim.get("started_at_ms"), int)
            or claim["started_at_ms"] > cutoff_ms
        ):
            continue
        for rel in timeline.planned_files(instant):
            if io.delete(rel):
                report.settled_files.append(rel)
        report.settled_files += markers.discard_unlisted(io, instant, keep=())
        for rel in (layout.inflight_file(instant), layout.requested_file(instant)):
            if io.delete(rel):
                report.timeline_files.append(rel)
    return report


def sweep_temp_files(
    io: FileIO, min_age_s: float = DEFAULT_TEMP_AGE_S, report: SweepReport | None = None, now: float | None = None
) -> SweepReport:
    """Delete every `.tmp-*` file in the table older than min_age_s (one recursive listing)."""
    report = report if report is not None else SweepReport()
    if not _has_temp_files(io):
        return report
    selector = pafs.FileSelector(io.root, allow_not_found=True, recursive=True)
    _delete_old_temps(io, io.fs.get_file_info(selector), min_age_s, report, now)
    return report


def sweep_temp_dirs(
    io: FileIO,
    rel_dirs: Iterable[str],
    min_age_s: float = DEFAULT_TEMP_AGE_S,
    report: SweepReport | None = None,
    now: float | None = None,
) -> SweepReport:
    """Delete the `.tmp-*` files older than min_age_s directly inside these table-relative directories (one
    non-recursive listing each): what an upsert runs over the directories its files went to."""
    report = report if report is not None else SweepReport()
    if not _has_temp_files(io):
        return report
    for rel_dir in sorted(set(rel_dirs)):
        selector = pafs.FileSelector(io.path(rel_dir), allow_not_found=True, recursive=False)
        _delete_old_temps(io, io.fs.get_file_info(selector), min_age_s, report, now)
    return report


def sweep_after_write(io: FileIO, record: Any, min_age_s: float = DEFAULT_TEMP_AGE_S) -> SweepReport:
    """What an upsert runs after it publishes: old temp files in the directories of the files its record lists
    (the partitions and index shards the batch touched). The instant is committed: a failure is a warning."""
    try:
        return sweep_temp_dirs(io, record_dirs(record), min_age_s)
    except Exception as exc:  # noqa: BLE001 - clean, compaction and `dbidx repair` sweep again
        warnings.warn(
            f"instant {record.instant} completed at seq {record.seq}, but sweeping old temp files of the "
            f"directories it wrote to failed: {exc}",
            RuntimeWarning,
            stacklevel=2,
        )
        return SweepReport()


def record_dirs(record: Any) -> set[str]:
    """The directories (table-relative, "" for the root) of every file a completion record lists."""
    return {rel.rsplit("/", 1)[0] if "/" in rel else "" for rel in settled_files(record) or ()}


def _has_temp_files(io: FileIO) -> bool:
    """Object stores write whole objects (no temp names): only local filesystems and HDFS have temp files."""
    return io.is_local or io.fs.type_name == "hdfs"


def _delete_old_temps(
    io: FileIO, infos: Iterable[pafs.FileInfo], min_age_s: float, report: SweepReport, now: float | None
) -> None:
    cutoff = (time.time() if now is None else now) - min_age_s
    prefix = io.root.rstrip("/") + "/"
    for info in infos:
        if info.type != pafs.FileType.File or not info.base_name.startswith(TEMP_PREFIX):
            continue
        modified = info.mtime.timestamp() if info.mtime is not None else 0.0
        rel = info.path[len(prefix) :] if info.path.startswith(prefix) else info.path
        if modified <= cutoff and io.delete(rel):
            report.temp_files.append(rel)


def sweep_leftovers(
    io: FileIO, timeline: Any, min_age_s: float = DEFAULT_TEMP_AGE_S, all_cleans: bool = False
) -> SweepReport:
    """Every sweep: unfinished instants of writers that are gone (rolled back), settled instants' leftovers (a dead
    clean's deletions finished), dead absorbs' claims, then temp files older than min_age_s; all_cleans: also every
    clean record's files still on storage (`dbidx repair`)."""
    report = SweepReport()
    # 1. Unfinished instants of writers that are gone (as every upsert does before it starts): their planned and
    #    announced files go with them.
    abandoned = roll_back_abandoned(timeline, pending_attempts(io, timeline, with_files=False))
    report.rolled_back = list(abandoned.rolled_back)
    sweep_settled(io, timeline, report)
    sweep_dead_absorbs(io, timeline, min_age_s, report)
    if all_cleans:
        sweep_cleaned(io, timeline, report)
    return sweep_temp_files(io, min_age_s, report)
