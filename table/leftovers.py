"""Leftovers of writers that died or were cut short, and the sweeps that remove them.

What a crash can leave: a `.tmp-<hex>` file (killed between a temp write and its rename, on stores where
`write_atomic` goes through a temp name), and of an instant that settled (completed or rolled back) without its own
housekeeping: its `.requested` / `.inflight` timeline files, its markers with the unlisted files they announce
(touched-key files, losing attempts' data and index files), its writer-presence files and its heartbeat. None of them is ever read
as table data (readers read only what a completion lists), but they cost space and listings, for ever.

Who sweeps: every upsert sweeps settled instants before it starts (cheap: two listings), and after it publishes the
temp files of the directories its files went to (one listing each: the partitions the batch touched, never the
whole table); clean, both compactions and `dbidx repair` sweep temp files over the whole table. Every temp sweep
takes only files older than `min_age_s`, so that a live writer's temp file (seconds old) is never taken from under
it.
"""
from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable

import pyarrow.fs as pafs

from dbidx.table import layout, markers, writer_presence
from dbidx.table.fileio import FileIO
from dbidx.table.heartbeat import read_heartbeat

TEMP_PREFIX = ".tmp-"
DEFAULT_TEMP_AGE_S = 3600.0  # a temp file lives for one write (seconds); an hour-old one belongs to a dead writer


@dataclass
class SweepReport:
    """What a sweep deleted (table-relative paths)."""

    settled_files: list[str] = field(default_factory=list)  # unlisted files announced by settled instants' markers
    timeline_files: list[str] = field(default_factory=list)  # .requested / .inflight of settled instants
    temp_files: list[str] = field(default_factory=list)  # .tmp-<hex> older than the age guard

    @property
    def total(self) -> int:
        """How many files the sweep deleted."""
        return len(self.settled_files) + len(self.timeline_files) + len(self.temp_files)


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
    # 2. Timeline files of settled instants (their writer died between publishing and forgetting them).
    settled: set[str] = set()
    for name in io.list_names(layout.TIMELINE_DIR):
        instant, _, kind = name.partition(".")
        if kind in ("requested", "inflight") and timeline.record_of(instant) is not None:
            if io.delete(f"{layout.TIMELINE_DIR}/{name}"):
                report.timeline_files.append(f"{layout.TIMELINE_DIR}/{name}")
            settled.add(instant)
    for instant in settled:
        writer_presence.forget(io, instant)
    # 3. Heartbeats of settled instants, and expired ones of instants with no claim left (their writer was renewing
    #    while a rollback took the claim away).
    for name in io.list_names(layout.HEARTBEAT_DIR):
        instant = name[:-len(".json")] if name.endswith(".json") else ""
        if not layout.is_instant(instant):
            continue
        beat = read_heartbeat(io, instant)
        unclaimed = not (io.exists(layout.requested_file(instant)) or io.exists(layout.inflight_file(instant)))
        if timeline.record_of(instant) is not None or (unclaimed and (beat is None or beat.expired)):
            if io.delete(layout.heartbeat_file(instant)):
                report.timeline_files.append(layout.heartbeat_file(instant))
    # 4. Staged records that can never be published.
    sweep_staged(io, timeline, report)
    return report


def sweep_staged(io: FileIO, timeline: Any, report: SweepReport | None = None) -> SweepReport:
    """Staged records (docs/FORMAT.md section 12) of settled instants (redundant once published, garbage once
    rolled back), and of instants whose seq another completion took (their writer died before its Delta put: the
    record can never be published). Any other stays: its Delta version may be on storage already, and the next
    reader publishes the record from it. Runs before every upsert and after every publish (one listing of a
    directory that is empty but for a moment)."""
    report = report if report is not None else SweepReport()
    for name in io.list_names(layout.STAGED_DIR):
        instant = name[:-len(".json")] if name.endswith(".json") else ""
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


def sweep_dead_absorbs(io: FileIO, timeline: Any, min_age_s: float = DEFAULT_TEMP_AGE_S,
                       report: SweepReport | None = None) -> SweepReport:
    """Claims of absorbing processes that died before publishing (mdt/absorb.py), older than min_age_s: their index
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
        if not isinstance(claim, dict) or claim.get("action") != "absorb" \
                or not isinstance(claim.get("started_at_ms"), int) or claim["started_at_ms"] > cutoff_ms:
            continue
        for rel in timeline.planned_files(instant):
            if io.delete(rel):
                report.settled_files.append(rel)
        report.settled_files += markers.discard_unlisted(io, instant, keep=())
        for rel in (layout.inflight_file(instant), layout.requested_file(instant)):
            if io.delete(rel):
                report.timeline_files.append(rel)
    return report


def sweep_temp_files(io: FileIO, min_age_s: float = DEFAULT_TEMP_AGE_S, report: SweepReport | None = None,
                     now: float | None = None) -> SweepReport:
    """Delete every `.tmp-*` file in the table older than min_age_s (one recursive listing)."""
    report = report if report is not None else SweepReport()
    if not _has_temp_files(io):
        return report
    selector = pafs.FileSelector(io.root, allow_not_found=True, recursive=True)
    _delete_old_temps(io, io.fs.get_file_info(selector), min_age_s, report, now)
    return report


def sweep_temp_dirs(io: FileIO, rel_dirs: Iterable[str], min_age_s: float = DEFAULT_TEMP_AGE_S,
                    report: SweepReport | None = None, now: float | None = None) -> SweepReport:
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
        warnings.warn(f"instant {record.instant} completed at seq {record.seq}, but sweeping old temp files of the "
                      f"directories it wrote to failed: {exc}", RuntimeWarning, stacklevel=2)
        return SweepReport()


def record_dirs(record: Any) -> set[str]:
    """The directories (table-relative, "" for the root) of every file a completion record lists."""
    return {rel.rsplit("/", 1)[0] if "/" in rel else "" for rel in settled_files(record) or ()}


def _has_temp_files(io: FileIO) -> bool:
    """Object stores write whole objects (no temp names): only local filesystems and HDFS have temp files."""
    return io.is_local or io.fs.type_name == "hdfs"


def _delete_old_temps(io: FileIO, infos: Iterable[pafs.FileInfo], min_age_s: float, report: SweepReport,
                      now: float | None) -> None:
    cutoff = (time.time() if now is None else now) - min_age_s
    prefix = io.root.rstrip("/") + "/"
    for info in infos:
        if info.type != pafs.FileType.File or not info.base_name.startswith(TEMP_PREFIX):
            continue
        modified = info.mtime.timestamp() if info.mtime is not None else 0.0
        rel = info.path[len(prefix):] if info.path.startswith(prefix) else info.path
        if modified <= cutoff and io.delete(rel):
            report.temp_files.append(rel)


def sweep_leftovers(io: FileIO, timeline: Any, min_age_s: float = DEFAULT_TEMP_AGE_S) -> SweepReport:
    """Both sweeps: settled instants' leftovers, then temp files older than min_age_s."""
    report = sweep_settled(io, timeline)
    sweep_dead_absorbs(io, timeline, min_age_s, report)
    return sweep_temp_files(io, min_age_s, report)
