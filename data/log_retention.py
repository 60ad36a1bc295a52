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

With the table feature v2Checkpoint a checkpoint may keep its adds in sidecar files (`_delta_log/_sidecars/`) that
another checkpoint may name too: the cut-off checkpoint must have every sidecar it names (else it is no starting
point and an older one is taken), UUID-named checkpoints below it go like classic ones, and a sidecar goes only when
no checkpoint left names it and it is older than a day as of midnight UTC (PROTOCOL.md "Metadata Cleanup" 4-5: a
checkpoint being written has written its sidecars first).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from dbidx.data.delta_checkpoint_files import (
    SIDECAR_DIR,
    Checkpoint,
    listed_checkpoints,
    parse_name,
    sidecars_of,
)
from dbidx.data.delta_log import DELTA_LOG_DIR, checkpoint_floor
from dbidx.errors import CorruptFileError
from dbidx.storage.fileio import FileEntry, FileIO

# <version>.json, <version>.crc and <from>.<to>.compacted.json (log compaction); checkpoints of every kind (classic,
# multi-part, UUID-named V2): data/delta_checkpoint_files.py.
_COMMIT = re.compile(r"^(\d{20})\.(json|crc)$")
_COMPACTED = re.compile(r"^(\d{20})\.(\d{20})\.compacted\.json$")
DAY_MS = 86_400_000


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
    m = _COMMIT.match(name)
    if m:
        return int(m.group(1))
    parsed = parse_name(name)
    if parsed is not None:
        return parsed[0]
    m = _COMPACTED.match(name)
    return int(m.group(2)) if m else None


def complete_checkpoints(entries: list[FileEntry]) -> dict[int, list[FileEntry]]:
    """The checkpoints of a log listing, by version, with their files (the preferred one of a version: classic,
    UUID-named, multi-part): a multi-part checkpoint only when every part is there (a partly written one is no
    checkpoint). A V2 checkpoint's sidecars are not among the files: `expire_log` checks them apart."""
    by_name = {e.path.rsplit("/", 1)[-1]: e for e in entries}
    return {v: [by_name[n] for n in cps[0].names] for v, cps in listed_checkpoints(by_name).items()}


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
    by_name = {e.path.rsplit("/", 1)[-1]: e for e in entries}
    listed = {v: cps for v, cps in listed_checkpoints(by_name).items() if v <= newest}
    old_enough = {
        v: cp
        for v, cps in listed.items()
        for cp in reversed(cps)  # (the preferred one of its version wins)
        if all((t := by_name[n].mtime_ms) is not None and t <= cutoff for n in cp.names)
    }
    younger = [[by_name[n] for n in cps[0].names] for v, cps in sorted(listed.items()) if v not in old_enough]
    if younger and all(f.mtime_ms is not None for f in younger[0]):
        report.waits_on = tuple(f.path for f in younger[0])
        report.next_due_ms = max(f.mtime_ms or 0 for f in younger[0]) + retention_ms
    # The cut-off checkpoint: the newest old enough that a reader can start from (a V2 one's sidecars all there).
    keep_from = next((v for v in sorted(old_enough, reverse=True) if _whole(io, old_enough[v])), None)
    if keep_from is None:
        return report
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
    # 4. The sidecar files no checkpoint left names, once older than a day (PROTOCOL.md "Metadata Cleanup" 4-5).
    gone = {p.rsplit("/", 1)[-1] for p in report.deleted}
    _expire_sidecars(io, [n for n in by_name if n not in gone], now_ms, report)
    return report


def _whole(io: FileIO, checkpoint: Checkpoint) -> bool:
    """Whether a reader can start from the checkpoint: its spec is sound and every sidecar it names is there with
    the size it names (a classic V1 checkpoint costs a read of its footer)."""
    try:
        sidecars = sidecars_of(io, checkpoint)
    except CorruptFileError:
        return False
    sizes = io.sizes([s.path for s in sidecars])
    return all(sizes.get(s.path) == s.size for s in sidecars)


def _expire_sidecars(io: FileIO, names_left: list[str], now_ms: int, report: LogExpiry) -> None:
    """Delete the files of `_delta_log/_sidecars/` that no checkpoint left in the log names and that are older
    than a day as of midnight UTC (a V2 checkpoint being written names sidecars written before it). Every
    checkpoint left is read for the sidecars it names (only when an old sidecar exists: a table another engine gave
    V2 checkpoints); one that cannot be read keeps them all, as it may name any of them."""
    old = [
        e
        for e in io.list_entries(SIDECAR_DIR)
        if e.mtime_ms is not None and e.mtime_ms < now_ms // DAY_MS * DAY_MS - DAY_MS
    ]
    if not old:
        return
    named: set[str] = set()
    for cps in listed_checkpoints(names_left).values():
        for cp in cps:
            try:
                named |= {s.path for s in sidecars_of(io, cp)}
            except CorruptFileError:
                return
    for entry in old:
        if entry.path not in named and io.delete(entry.path):
            report.deleted.append(entry.path)
            report.bytes += entry.size


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
