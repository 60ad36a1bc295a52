"""Instant ids at the end of the 17-digit range: where they come from, how they are reported and repaired.

An id from year 9999 on (`layout.instant_out_of_range`) is never a writer's clock: it is a typo or another table's
id (`dbidx rollback URI 99999999999999999` published such a record before issue 29 was fixed), or a crafted file.
Allocation claims max(clock, largest id known + 1), so one such id known to the timeline stops every writer. Three
kinds of source, three answers:

- a checkpoint's `max_instant` (older dbidx counted the ids rollback records merely name): the timeline ignores it
  and recomputes the largest id from the records it sums up (storage/timeline.py); nothing to repair.
- a `.requested` / `.inflight` file of an id no completion names: a stray; `dbidx repair URI` removes it (with the
  files its plan and markers announce, which no completion lists, so nothing live is lost).
- a completion record whose own instant is out of range: damage; only a backup of `.dbidx/timeline` restores it.

`verify` reports the last two (exit 4); the writer's error names them and the fix.
"""

from __future__ import annotations

from typing import Any

from dbidx.errors import CorruptFileError, DbidxError
from dbidx.storage import layout, markers, writer_presence
from dbidx.storage.fileio import FileIO

_TIMELINE_KINDS = ("requested", "inflight")


def _stray_names(io: FileIO) -> list[tuple[str, str]]:
    """(file name, instant) of timeline files whose id is out of range."""
    out = []
    for name in io.list_names(layout.TIMELINE_DIR):
        instant = name[:17]
        if instant.isdigit() and len(name) > 17 and name[17] == "." and layout.instant_out_of_range(instant):
            out.append((name, instant))
    return out


def sources(io: FileIO, timeline: Any) -> list[dict[str, str]]:
    """Every place the timeline reads an out-of-range instant id from: {"path", "instant", "problem"} each."""
    found = []
    # 1. Completion records whose own instant is out of range (the whole log kept, archived records included;
    #    records archive retention expired are gone: the newest checkpoint's max_instant still covers their ids).
    kept = getattr(timeline, "kept", None)
    for rec in kept() if kept is not None else timeline.completed():
        if layout.instant_out_of_range(rec.instant):
            found.append(
                {
                    "path": io.path(layout.completed_file(rec.seq)),
                    "instant": rec.instant,
                    "problem": f"completion record seq {rec.seq} has instant id {rec.instant}, at the end of "
                    "the 17-digit range (year 9999: damaged or crafted); no new instant can be "
                    "claimed after it: restore .dbidx/timeline from a backup",
                }
            )
    # 2. Requested / inflight files (of ids no completion names, or left behind by a rollback record naming one).
    for name, instant in _stray_names(io):
        named = "a rollback record names" if timeline.record_of(instant) is not None else "no completion names"
        found.append(
            {
                "path": io.path(f"{layout.TIMELINE_DIR}/{name}"),
                "instant": instant,
                "problem": f"stray timeline file of instant id {instant}, at the end of the 17-digit range "
                f"(year 9999: a typo or another table's id) that {named}; it stops every writer: "
                "`dbidx repair URI` removes it",
            }
        )
    return found


def allocation_error(io: FileIO, timeline: Any) -> CorruptFileError:
    """The error of a writer that cannot claim an instant: what, where (each source) and how to fix it."""
    found = sources(io, timeline) or [
        {
            "path": io.path(layout.TIMELINE_DIR),
            "instant": "?",
            "problem": "an instant id at the end of the 17-digit range",
        }
    ]
    listed = "; ".join(f"{s['path']}: {s['problem']}" for s in found[:5])
    more = f" (and {len(found) - 5} more)" if len(found) > 5 else ""
    return CorruptFileError(
        f"no new instant can be claimed on {io.path('')}: the timeline names an instant id at the "
        f"end of the 17-digit range. {listed}{more}. `dbidx verify URI` lists every "
        "such id"
    )


def remove_strays(io: FileIO, timeline: Any) -> list[str]:
    """Delete the requested/inflight files of out-of-range ids that no completion names, with the files their
    plan and markers announce (never listed by a completion, so never live) and their presence files; returns the
    deleted timeline files (table-relative). What `dbidx repair` runs."""
    timeline.refresh()
    deleted: list[str] = []
    for name, instant in _stray_names(io):
        if timeline.record_of(instant) is not None:
            continue  # settled: the settled-instant sweep owns its files
        # 1. The files the instant planned and announced: no completion lists them.
        try:
            planned = timeline.planned_files(instant)
        except DbidxError:
            planned = []  # a crafted plan: its marker goes, the paths it names are not followed
        for rel in planned:
            io.delete(rel)
        try:
            markers.discard_unlisted(io, instant, keep=())
        except CorruptFileError:
            io.delete_dir(markers.marker_dir(instant))
        writer_presence.forget(io, instant)
        # 2. The timeline file itself, last: a rerun after a crash finds it again.
        rel = f"{layout.TIMELINE_DIR}/{name}"
        if io.delete(rel):
            deleted.append(rel)
    return deleted
