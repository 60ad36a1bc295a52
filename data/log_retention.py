"""Delta log retention: delete the log files a checkpoint made unnecessary once they are older than the table's
`delta.logRetentionDuration` (Delta's "metadata cleanup", PROTOCOL.md).

Why: every Delta version is a JSON file that is never read again once a checkpoint sums it up, except by time
travel to it. A dbidx upsert's version carries a remove + add per file whose deletion vector changed, so at a
million keys a version is about half a megabyte, and a pipeline committing every minute grows the log by
gigabytes a day. Delta's rule keeps time travel within the retention: find the newest checkpoint that is itself
older than the cutoff, and delete every commit, checkpoint and checksum file below its version. Every version
from that checkpoint on stays readable (the checkpoint plus the JSON after it), and so does every version newer
than the cutoff.

Files are deleted oldest first, so that a crash (or a failing delete) at any point leaves the log a contiguous run
of versions from some point up; the next run takes the rest. The modification time is the file's (the clock Delta
Spark and delta-rs use for this); a file whose time the store does not report is never deleted.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from dbidx.data.delta_log import DELTA_LOG_DIR, checkpoint_floor
from dbidx.storage.fileio import FileEntry, FileIO

# <version>.json, <version>.crc, <version>.checkpoint.parquet, <version>.checkpoint.<part>.<parts>.parquet,
# <version>.checkpoint.<uuid>.(json|parquet) (V2), <from>.<to>.compacted.json (log compaction).
_COMMIT = re.compile(r"^(\d{20})\.(json|crc)$")
_CHECKPOINT = re.compile(r"^(\d{20})\.checkpoint(?:\.(\d{10})\.(\d{10})|\.[0-9a-fA-F-]{36})?\.(parquet|json)$")
_COMPACTED = re.compile(r"^(\d{20})\.(\d{20})\.compacted\.json$")


@dataclass
class LogExpiry:
    """What a log cleanup did: the checkpoint it kept the log from, and the files it deleted."""

    kept_from: int | None = None  # the checkpoint version every version from which stays readable
    deleted: list[str] = field(default_factory=list)
    bytes: int = 0
    # The files of the oldest checkpoint still younger than the cutoff, and when they turn old enough (None: no such
    # checkpoint, or a time the store does not report): until then a run can delete nothing, so a caller asks for
    # their times (`still_young`) instead of listing the whole log again.
    waits_on: tuple[str, ...] = ()
    next_due_ms: int | None = None

    def to_dict(self) -> dict[str, object]:
        """JSON form (a services report's details)."""
        return {"kept_from": self.kept_from, "files_deleted": len(self.deleted), "bytes": self.bytes}


def _version_of(name: str) -> int | None:
    """The version a log file belongs to for retention (a compacted range: its last), None for any other name."""
    for pattern in (_COMMIT, _CHECKPOINT):
        m = pattern.match(name)
        if m:
            return int(m.group(1))
    m = _COMPACTED.match(name)
    return int(m.group(2)) if m else None


def complete_checkpoints(entries: list[FileEntry]) -> dict[int, list[FileEntry]]:
    """The checkpoints of a log listing, by version, with their files: a multi-part checkpoint only when every
    part is there (a partly written one is no checkpoint)."""
    found: dict[int, dict[tuple[str, str], list[FileEntry]]] = {}
    for e in entries:
        m = _CHECKPOINT.match(e.path.rsplit("/", 1)[-1])
        if m:
            group = ("multi", m.group(3)) if m.group(2) else ("single", e.path)
            found.setdefault(int(m.group(1)), {}).setdefault(group, []).append(e)
    out: dict[int, list[FileEntry]] = {}
    for version, kinds in found.items():
        for (kind, parts), files in kinds.items():
            if kind == "single" or len(files) == int(parts):
                out[version] = files
                break
    return out


def expire_log(io: FileIO, retention_ms: int, now_ms: int | None = None) -> LogExpiry:
    """Delete the Delta log files below the newest checkpoint that is older than `retention_ms` (see the module
    docstring); nothing without such a checkpoint."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    cutoff = now_ms - retention_ms
    # 1. One listing of the log, with times; the pointer to the newest checkpoint, checked (a damaged pointer or a
    #    missing checkpoint stops the cleanup: CorruptFileError).
    entries = io.list_entries(DELTA_LOG_DIR)
    names = [e.path.rsplit("/", 1)[-1] for e in entries]
    newest = checkpoint_floor(io, names)
    report = LogExpiry()
    if newest < 0:
        return report
    # 2. The newest complete checkpoint at or below the pointer's whose every file is older than the cutoff; and
    #    when the oldest younger one will be, so the caller need not list the log again before then.
    checkpoints = {v: files for v, files in complete_checkpoints(entries).items() if v <= newest}
    old_enough = [
        v for v, files in checkpoints.items() if all(f.mtime_ms is not None and f.mtime_ms <= cutoff for f in files)
    ]
    younger = [files for v, files in sorted(checkpoints.items()) if v not in old_enough]
    if younger and all(f.mtime_ms is not None for f in younger[0]):
        report.waits_on = tuple(f.path for f in younger[0])
        report.next_due_ms = max(f.mtime_ms or 0 for f in younger[0]) + retention_ms
    if not old_enough:
        return report
    keep_from = max(old_enough)
    report.kept_from = keep_from
    # 3. Every log file of a lower version, oldest first; stop at the first one that is not older than the cutoff
    #    (a clock step or a file copied in later): what stays is a contiguous run up to the newest version.
    doomed = sorted(
        ((v, e) for e in entries if (v := _version_of(e.path.rsplit("/", 1)[-1])) is not None and v < keep_from),
        key=lambda item: (item[0], item[1].path),
    )
    for _version, entry in doomed:
        if entry.mtime_ms is None or entry.mtime_ms > cutoff:
            break
        if io.delete(entry.path):
            report.deleted.append(entry.path)
            report.bytes += entry.size
    return report


def still_young(io: FileIO, files: tuple[str, ...], retention_ms: int, now_ms: int | None = None) -> bool:
    """Whether a checkpoint's files (a LogExpiry's `waits_on`) are all there and younger than the retention: then
    no log file can expire yet (every file below an old-enough checkpoint is older than it), at the cost of a stat
    per file instead of a listing of the log."""
    if not files:
        return False
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    found = io.entries(list(files))
    return len(found) == len(files) and all(
        e.mtime_ms is not None and e.mtime_ms > now_ms - retention_ms for e in found.values()
    )
