"""When completions were published, by seq: what the clean's retention rule compares with (index/clean.py).

A data file a data compaction replaced leaves the Delta log in that completion's version, whose commit time (and the
remove's `deletionTimestamp`) is the record's `completed_at_ms`; Delta's contract keeps the file for
`delta.deletedFileRetentionDuration` after that time. So the clean needs the time of each completion that replaced
something, not of every record: it walks the replacements oldest first and stops at the first one still within the
retention, which costs the times of the replacements old enough plus one.

Records after the checkpoint the timeline started from are in memory. An older one is read on its own (its file, or
the archive bundle that holds it: then every time in the bundle is kept), once per process, since records never
change; never the whole history, which an open does not read either. A record archive retention expired is no newer
than the floor's `newest_expired_ms`, which stands for it.
"""

from __future__ import annotations

import threading
import weakref

from dbidx.errors import CorruptFileError
from dbidx.storage import checkpoint, layout
from dbidx.storage.timeline import Timeline

# Per timeline: seq -> completed_at_ms of the records read here (those in the timeline's memory are not copied).
_KNOWN: "weakref.WeakKeyDictionary[Timeline, dict[int, int]]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def completed_at(timeline: Timeline, seq: int) -> int:
    """completed_at_ms of completion `seq` (1 <= seq <= the timeline's latest), or for a record archive retention
    expired the newest time among the expired ones (an upper bound: what a retention rule may compare with). A
    record that is nowhere (a gap above the floor) is a CorruptFileError naming it."""
    record = timeline.in_memory(seq)
    if record is not None:
        return record.completed_at_ms
    with _LOCK:
        known = _KNOWN.setdefault(timeline, {})
        if seq in known:
            return known[seq]
    found = _read_times(timeline, seq)
    with _LOCK:
        _KNOWN.setdefault(timeline, {}).update(found)
    return found[seq]


def _read_times(timeline: Timeline, seq: int) -> dict[int, int]:
    """The time of record `seq` read from storage, with those of its archive bundle's other records if it is bundled."""
    io = timeline.io
    rel = layout.completed_file(seq)
    try:
        if io.exists(rel):  # read_records takes the bundle if it is archived between this look and the read
            found = checkpoint.read_records(io, timeline.table_id, range(seq, seq + 1), {seq}, timeline.legacy_upto)
            return {r.seq: r.completed_at_ms for r in found}
        for first, last in checkpoint.archive_ranges(io):
            if first <= seq <= last:
                bundle = checkpoint.read_records(
                    io, timeline.table_id, range(first, last + 1), set(), timeline.legacy_upto
                )
                return {r.seq: r.completed_at_ms for r in bundle}
        failure: CorruptFileError | None = None
    except CorruptFileError as exc:
        failure = exc  # expired meanwhile (the floor says so) or damage (raised below)
    floor = timeline.history_floor()
    if floor is not None and seq <= floor.seq:
        return {seq: floor.newest_expired_ms}
    if failure is not None:
        raise failure
    raise CorruptFileError(
        f"completion log gap at {io.path(rel)}: seq {seq} is neither in the completion folder, nor in an archive "
        "bundle, nor below the history floor (when it was published is unknown, so no file it replaced is deleted)"
    )
