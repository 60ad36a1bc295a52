"""Archive retention: delete archive bundles whose records are all older than the table's log retention.

Why: the completion log keeps every record, moved into archive bundles once two newer checkpoints exist (FORMAT.md
7a). At ~4 KB per completion, a pipeline committing every minute keeps ~2 GB of bundles a year that only history
ever reads. Delta keeps its log for `delta.logRetentionDuration` (default 30 days); dbidx keeps its own history as
long: a bundle goes once every record in it is older than that AND it lies wholly below the oldest checkpoint kept
(so opening the table, and every process that opened it from that checkpoint, never needs it).

What still asks for old records, and its answer once they are gone (the floor, storage/history_floor.py):
- opening / refreshing: starts from the newest checkpoint, never below the oldest kept one: unaffected. A process
  that last read a record the floor has passed must open the table again (HistoryCompactedError).
- a fold from seq 1 (`verify`, time travel): folds from the floor's saved state instead (`views_at`); as of a seq
  below the floor: HistoryCompactedError naming the floor and `delta.logRetentionDuration`.
- history (`dbidx commits`, `Timeline.kept()`): the kept records; asking `completed()` for expired ones raises.
- instant-id allocation: the newest checkpoint's `max_instant` covers every id; the floor keeps the expired ids' max.
- the seq of an expired instant, or rolling it back: HistoryCompactedError (whether it completed is not known any
  more, so nothing is deleted). The floor never passes an instant whose claim or markers are still on storage
  (a settled writer's leftovers the next sweep removes, or a pending writer), so sweeps and rollbacks never meet one.
- a gap ABOVE the floor is still a CorruptFileError: only records up to the floor are gone on purpose.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any

from dbidx.errors import CorruptFileError, InvalidInputError
from dbidx.storage import checkpoint, layout, markers
from dbidx.storage.data_view import DataView
from dbidx.storage.index_view import IndexView
from dbidx.storage.history_floor import HistoryFloor, current_floor, floor_file, floor_seqs, write_floor
from dbidx.storage.records import CompletedInstant


@dataclass
class ArchiveExpiry:
    """What one run of archive retention did (and, when it stopped short, why)."""

    floor_before: int = 0  # records up to here were expired before this run
    floor: int = 0  # records up to here are expired now
    retention_ms: int | None = None
    records_expired: int = 0
    deleted: list[str] = field(default_factory=list)  # bundles, record files and old floors (table-relative)
    bytes: int = 0
    stopped: str = ""  # why the floor did not move further (empty: every bundle below the oldest checkpoint went)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (what the services report shows)."""
        return {
            "floor_before": self.floor_before,
            "floor": self.floor,
            "retention_ms": self.retention_ms,
            "records_expired": self.records_expired,
            "deleted": len(self.deleted),
            "bytes": self.bytes,
            "stopped": self.stopped,
        }


def expire_archive(table: Any, retention_ms: int, now_ms: int | None = None) -> ArchiveExpiry:
    """Delete the archive bundles below the oldest kept checkpoint whose records are all older than `retention_ms`,
    after recording the new floor with the table state at it. Safe beside readers, writers and another expirer.

    retention_ms: the table's `delta.logRetentionDuration` (`table.delta_properties.retention_of(
    table.data_view().configuration()).log_retention_ms`, what the log cleanup service holds), so that dbidx keeps
    its history exactly as long as Delta keeps time travel; the caller skips the call when
    `delta.enableExpiredLogCleanup` is false (the Delta properties live above this layer)."""
    timeline, io, table_id = table.timeline, table.io, table.props.table_id
    report = ArchiveExpiry()
    # 1. The retention, checked before anything is read.
    if isinstance(retention_ms, bool) or not isinstance(retention_ms, Integral) or retention_ms < 0:
        raise InvalidInputError(
            f"archive retention of {table.uri}: retention_ms must be a whole number >= 0, got {retention_ms!r}"
        )
    report.retention_ms = int(retention_ms)
    cutoff = (int(time.time() * 1000) if now_ms is None else int(now_ms)) - int(retention_ms)
    table.refresh()
    # 2. The limit: the oldest checkpoint kept (readers that opened from it read only what follows it).
    kept = [s for s in checkpoint.checkpoint_seqs(io) if s >= timeline.first_checkpoint]
    floor = current_floor(io, table_id)
    report.floor_before = report.floor = floor.seq if floor is not None else 0
    if not kept:
        report.stopped = "no checkpoint"
        return report
    limit = kept[0]
    # 3. The state at the current floor, then bundle by bundle (in seq order) while every condition holds.
    index, data = _base_views(floor)
    moved = _advance(table, index, data, report, limit, cutoff, floor.max_instant if floor is not None else "")
    if moved is None:
        return report
    max_instant, newest_ms, count = moved
    # 4. The new floor first (durable, checked by every reader), then what it makes unnecessary.
    new = HistoryFloor(
        report.floor,
        max_instant,
        int(time.time() * 1000),
        int(retention_ms),
        newest_ms,
        index.to_dict(),
        data.to_dict(),
        io.path(floor_file(report.floor)),
    )
    if not write_floor(io, table_id, new) and current_floor(io, table_id) is None:
        raise CorruptFileError(f"history floor {new.where} could not be written")
    report.records_expired = count
    _delete_below(io, report)
    return report


def views_at(timeline: Any, seq: int) -> tuple[IndexView, DataView]:
    """The index and data views right after completion `seq`, folded from the retention floor's saved state (or
    from record 1 if nothing was expired); HistoryCompactedError if seq is below the floor. What time travel and
    `verify` fold with instead of `completed(upto_seq=seq)` from an empty view."""
    floor = timeline.history_floor()
    if floor is not None and seq < floor.seq:
        raise floor.refusal(f"the table as of completion {seq}")
    index, data = _base_views(floor)
    records = timeline.completed(after_seq=floor.seq if floor is not None else 0, upto_seq=seq)
    index.apply(records)
    data.apply(records)
    return index, data


def data_view_at(timeline: Any, seq: int) -> DataView:
    """The data view right after completion `seq` (views_at's; what data/reads.py time travel needs)."""
    return views_at(timeline, seq)[1]


def _base_views(floor: HistoryFloor | None) -> tuple[IndexView, DataView]:
    """Empty views, or the floor's saved ones (checked: both at the floor's seq)."""
    if floor is None:
        return IndexView(), DataView()
    index, data = IndexView.from_dict(floor.index, floor.where), DataView.from_dict(floor.data, floor.where)
    if index.applied_seq != floor.seq or data.applied_seq != floor.seq:
        raise CorruptFileError(
            f"history floor {floor.where} holds views at seqs {index.applied_seq} / "
            f"{data.applied_seq}, not at its own seq {floor.seq}"
        )
    return index, data


def _advance(
    table: Any, index: IndexView, data: DataView, report: ArchiveExpiry, limit: int, cutoff: int, max_instant: str
) -> tuple[str, int, int] | None:
    """Fold whole bundles past the floor while they are below `limit`, all older than `cutoff`, and name no instant
    up to their largest id that has a claim or markers on storage (pending, or settled and not swept yet: either way
    a sweep or rollback must still place it); moves report.floor. Returns (max instant, newest completion time, records
    folded), or None if the floor did not move (report.stopped says why)."""
    io, timeline = table.io, table.timeline
    listed = checkpoint.listed_seqs(io, io.list_names(layout.COMPLETED_DIR))
    claims = _claimed_instants(io)  # not looked up in the history (that would read all of it): any claim holds
    newest_ms, count = 0, 0
    ends = sorted({last for _first, last in checkpoint.archive_ranges(io) if report.floor < last <= limit})
    if not ends:
        report.stopped = (
            f"no archive bundle between the floor (seq {report.floor}) and the oldest checkpoint (seq {limit})"
        )
        return None
    for last in ends:
        # 1. Every record up to the bundle's end, each checked (a gap above the floor is damage, never expired).
        records: list[CompletedInstant] = checkpoint.read_records(
            io, table.props.table_id, range(report.floor + 1, last + 1), listed, timeline.legacy_upto
        )
        # 2. Only when all of them are older than the retention and none is still claimed on storage.
        too_new = [r.seq for r in records if r.completed_at_ms >= cutoff]
        if too_new:
            report.stopped = f"completion {too_new[0]} is newer than the retention"
            break
        upto_instant = max([max_instant] + [r.instant for r in records])
        held = sorted(c for c in claims if c <= upto_instant or any(c == r.rolled_back for r in records))
        if held:
            report.stopped = f"instant {held[0]} still has claim or marker files (the next sweep settles them)"
            break
        # 3. Fold them: the floor's state moves with it.
        index.apply(records)
        data.apply(records)
        max_instant, report.floor = upto_instant, last
        newest_ms = max([newest_ms] + [r.completed_at_ms for r in records])
        count += len(records)
    if report.floor == report.floor_before:
        return None
    return max_instant, newest_ms, count


def _claimed_instants(io: Any) -> set[str]:
    """Instants with a requested / inflight file or a marker folder on storage."""
    out = {
        name.split(".")[0]
        for name in io.list_names(layout.TIMELINE_DIR)
        if name.endswith((".requested", ".inflight")) and layout.is_instant(name.split(".")[0])
    }
    return out | {name for name in io.list_dirs(markers.MARKERS_DIR) if layout.is_instant(name)}


def _delete_below(io: Any, report: ArchiveExpiry) -> None:
    """After the new floor is on storage: bundles wholly at or below it, record files at or below it (a crashed
    archiver's leftovers), and older floor files. Oldest first, so a crash leaves a contiguous kept history."""
    doomed = [layout.archive_file(first, last) for first, last in checkpoint.archive_ranges(io) if last <= report.floor]
    doomed += [
        layout.completed_file(s)
        for s in sorted(checkpoint.listed_seqs(io, io.list_names(layout.COMPLETED_DIR)))
        if s <= report.floor
    ]
    doomed += [floor_file(s) for s in floor_seqs(io) if s < report.floor]
    for rel in doomed:
        size = io.size(rel)  # 0 if another expirer deleted it already
        if io.delete(rel):
            report.deleted.append(rel)
            report.bytes += size
