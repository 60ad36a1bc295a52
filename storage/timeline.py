"""The commit timeline: instants go requested -> inflight -> completed (or rolled back), in one total order.

Why a completion log instead of per-instant "completed" markers: writers finish out of order (instant 5 may complete
after instant 7), and a cache that remembers "the last instant I applied" would then silently skip instant 5. Here
every completion, rollback, compaction and clean takes the next sequence number by creating
`timeline/completed/<seq>.json` exclusively; a writer only tries seq N+1 after seeing N, so the log has no gaps, and
"everything after seq N" is exactly what a reader has not seen yet. The same loop is where optimistic concurrency
happens: before each publish attempt the writer checks every completion it has not seen since it started.

This module holds the Timeline and its reads; its writes (claiming, publishing, rolling back) are the
`TimelineWrites` mixin of storage/timeline_writes.py.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Callable

from dbidx.errors import CorruptFileError, DbidxError, HistoryCompactedError, InstantStateError
from dbidx.storage import checkpoint, layout
from dbidx.storage import history_floor as floors
from dbidx.storage.heartbeat import DEFAULT_INTERVAL_S, Heartbeat
from dbidx.storage.fileio import FileIO
from dbidx.storage.records import (
    ACTION_ROLLBACK,
    CompletedInstant,
)

# StartedInstant, what a writer holds, is re-exported: callers import it with the Timeline (storage/instant_life.py).
from dbidx.storage.timeline_writes import StartedInstant, TimelineWrites  # noqa: F401

_POINTER_LOOKS = 3  # listings of the latest-seq pointer before a missing one is damage (see refresh)


class Timeline(TimelineWrites):
    """Reads and appends the completion log of one table; caches parsed records (they are immutable)."""

    def __init__(self, io: FileIO, table_id: str = "") -> None:
        self.io = io
        self.table_id = table_id
        self._records: list[CompletedInstant] = []
        # The largest instant id of _records, kept as they are appended: claiming an instant compares against it
        # instead of going through every record this process has read (a list that grows by one per commit for as
        # long as the process keeps the table open).
        self._records_max_instant = 0
        self._by_instant: dict[str, CompletedInstant] = {}
        self._lock = threading.RLock()
        self.checkpoint: checkpoint.Checkpoint | None = None  # the one the first refresh started from
        self.base_seq = 0  # records up to here are summed up by that checkpoint, read only on demand
        self._base_max_instant = ""
        self._history: list[CompletedInstant] | None = None
        # Archive retention (storage/archive_retention.py) may have expired records 1..F: the floor as last read, and
        # the seq the loaded history starts after (records _history_first+1..base_seq; 0 when nothing expired).
        self._floor: floors.HistoryFloor | None = None
        self._history_first = 0
        self._started = False
        # A table upgraded from format 3 (`dbidx upgrade`): records up to legacy_upto are format-3 records, and
        # checkpoints before first_checkpoint hold format-3 views (never read: the log is replayed instead).
        self.legacy_upto = 0
        self.first_checkpoint = 0
        # Run after every publish of this process (housekeeping: a failure is a warning); the table registers
        # its checkpoint writer here.
        self.after_publish: list[Callable[[CompletedInstant], None]] = []
        # Run before this process claims an instant (the table brings its Delta log up to date and checks that no
        # other engine wrote to it; an error here stops the write before anything is claimed).
        self.before_start: list[Callable[[], None]] = []
        # Run right before the atomic create of a completion record, with that record; an error here publishes
        # nothing.
        self.before_publish: list[Callable[[CompletedInstant], None]] = []
        # The table's commit point (docs/FORMAT.md section 12): run with the record about to be published, after the
        # checks; it stages the record and puts the record's Delta version if absent. True: the version is this
        # record's, the record is then published (by this process, or by any reader that finds the version first).
        # False: another writer took the version: the loop reads what it published and tries the next seq.
        self.commit_point: Callable[[CompletedInstant], bool] | None = None
        # Run at the top of every publish attempt (the table absorbs Delta versions other engines wrote, and publishes
        # records other writers staged, so the checks below see them as completions).
        self.catch_up: list[Callable[[], None]] = []
        # Every instant this process starts has a heartbeat renewed at this interval until it settles
        # (storage/heartbeat.py): how other processes tell it from an abandoned one.
        self.heartbeat_interval_s = DEFAULT_INTERVAL_S
        self._heartbeats: dict[str, Heartbeat] = {}
        # The paths the table's current view still names (live and replaced-not-cleaned files, tracked DV files),
        # set by the table: the sweep that finishes a dead clean's deletions never deletes one of them.
        self.referenced: Callable[[], set[str]] | None = None

    # ---- reading -----------------------------------------------------------------------------------------
    def refresh(self) -> list[CompletedInstant]:
        """Load completion records published since the last refresh; returns those loaded (the records after the
        checkpoint the first refresh started from: `completed()` reaches further back on demand)."""
        with self._lock:
            known = self.latest_seq
            # 1. The latest-seq pointer first: it is written after its record, so the listing below must reach it.
            #    A writer moves the pointer by creating the new file and then deleting the older ones, so a listing
            #    that crosses both can see neither: look again (pointer, then log) before calling it damage.
            for _ in range(_POINTER_LOOKS):
                floor = self._read_latest()
                listed = checkpoint.listed_seqs(self.io, self.io.list_names(layout.COMPLETED_DIR))
                if floor is not None or not listed:
                    break
                time.sleep(0.01)
            if floor is None:
                if listed:
                    raise CorruptFileError(
                        f"latest-seq pointer {self.io.path(layout.LATEST_DIR)}/<seq> is missing "
                        "while the completion log has records: the table's metadata was damaged"
                    )
                floor = 0  # a table that never completed anything (or one whose creation was cut short)
            # 2. The first refresh starts from the newest checkpoint (records before it are read only on demand).
            if not self._started:
                self._start_from_checkpoint(listed)
                self._started = True
                known = self.latest_seq
            elif known and known not in listed and not self._archived(known) and not self._expired_since(known):
                raise CorruptFileError(
                    f"completion record {self.io.path(layout.completed_file(known))}, read earlier by this process, "
                    "is gone: the completion log shrank (the table was restored from a backup, or records were "
                    "deleted); open the table again to read it as it is now"
                )
            # 3. Every record after the ones known, from its file or (if archived meanwhile) from its bundle.
            newest = max(listed, default=0)
            if newest < floor:  # records archived since the listing (or lost): the bundles reach further
                newest = max([newest] + [last for _, last in checkpoint.archive_ranges(self.io)])
            try:
                news = self._read_records(range(known + 1, newest + 1), listed)
            except CorruptFileError:
                self._expired_since(known)  # expired by retention since this process read them: that error instead
                raise
            for record in news:
                self._records.append(record)
                self._records_max_instant = max(self._records_max_instant, int(record.instant))
                self._index(record)
            # 4. A log shorter than a pointer once written says records were lost: never a smaller table.
            if self.latest_seq < floor:
                raise CorruptFileError(
                    f"the completion log of {self.io.root} ends at seq {self.latest_seq}, but the pointer "
                    f"{self.io.path(layout.latest_file(floor))} says seq {floor} was published: completion records "
                    f"{self.latest_seq + 1}..{floor} are missing (deleted or not yet visible?); refusing to "
                    "read a shorter history"
                )
            return list(self._records)

    def _start_from_checkpoint(self, listed: set[int]) -> None:
        """Take the newest checkpoint as the base: its seq must be a record the log has (listed or archived)."""
        seqs = [s for s in checkpoint.checkpoint_seqs(self.io) if s >= self.first_checkpoint]
        if not seqs:
            return
        try:
            cp = checkpoint.read_checkpoint(self.io, seqs[-1], self.table_id)
        except CorruptFileError:
            if self.io.exists(layout.checkpoint_file(seqs[-1])):
                raise  # there but damaged
            # Removed since the listing (newer checkpoints were written meanwhile, and old ones go): look again.
            seqs = [s for s in checkpoint.checkpoint_seqs(self.io) if s >= self.first_checkpoint]
            if not seqs:
                return
            cp = checkpoint.read_checkpoint(self.io, seqs[-1], self.table_id)
        if (
            cp.seq not in listed
            and not self._archived(cp.seq)
            and cp.seq > max(listed, default=0)
            and cp.seq > self._floor_seq()
        ):
            raise CorruptFileError(
                f"{cp.where} is for seq {cp.seq}, beyond the end of the completion log; remove "
                "it (the table then opens from an older checkpoint or from the log)"
            )
        self.checkpoint = cp
        self.base_seq = cp.seq
        self._base_max_instant = cp.max_instant
        if layout.instant_out_of_range(cp.max_instant):
            # Older dbidx counted ids rollback records merely name (a typo's 99999999999999999): recompute the
            # largest id from the records the checkpoint sums up (read once; the next checkpoint stores it right).
            history = self._load_history()
            floor = [self._floor.max_instant] if self._history_first and self._floor is not None else []
            self._base_max_instant = max([r.instant for r in history] + floor, default="")

    def _read_records(self, seqs: range, listed: set[int]) -> list[CompletedInstant]:
        return checkpoint.read_records(self.io, self.table_id, seqs, listed, self.legacy_upto)

    def _archived(self, seq: int) -> bool:
        return any(first <= seq <= last for first, last in checkpoint.archive_ranges(self.io))

    def _index(self, record: CompletedInstant) -> None:
        self._by_instant.setdefault(record.instant, record)
        if record.rolled_back:
            # record_of(failed instant) must say "rolled back" in every process, not only the one that did it
            self._by_instant.setdefault(record.rolled_back, record)

    def _load_history(self) -> list[CompletedInstant]:
        """Records before the checkpoint this timeline started from, read once on demand: 1..base_seq, or, once
        archive retention expired records 1..F, F+1..base_seq (`_history_first` says where they start)."""
        with self._lock:
            if self._history is None:
                for look in range(3):
                    # 1. The floor first: records up to it are gone on purpose, the rest must all be there.
                    first = min(self._floor_seq(), self.base_seq)
                    listed = checkpoint.listed_seqs(self.io, self.io.list_names(layout.COMPLETED_DIR))
                    try:
                        history = self._read_records(range(first + 1, self.base_seq + 1), listed)
                        break
                    except CorruptFileError:
                        # 2. A gap: an expiry that moved the floor meanwhile explains it (look again from there);
                        #    a gap above the floor is damage.
                        if look == 2 or min(self._floor_seq(), self.base_seq) <= first:
                            raise
                for record in history:
                    self._index(record)
                self._history_first = first
                self._history = history
            return self._history

    def history_floor(self) -> floors.HistoryFloor | None:
        """The retention floor in force (read now, checked): records up to its seq were expired on purpose. None if
        no record was ever expired."""
        floor = floors.current_floor(self.io, self.table_id)
        if floor is not None and floor.seq > self.latest_seq and self._started:
            self.refresh()
            if floor.seq > self.latest_seq:
                raise CorruptFileError(
                    f"history floor {floor.where} expires records up to seq {floor.seq}, beyond the "
                    f"end of the completion log (seq {self.latest_seq}): it is not this log's"
                )
        self._floor = floor
        return floor

    def _floor_seq(self) -> int:
        floor = self.history_floor()
        return 0 if floor is None else floor.seq

    def _expired_since(self, known: int) -> bool:
        """For a record this process read that is gone now: True if retention expired exactly up to it (the records
        after it are kept: nothing is lost to this process); raises HistoryCompactedError if it expired records this
        process has not read yet (it must open the table again); False if no floor explains it (damage)."""
        floor = floors.current_floor(self.io, self.table_id)
        if floor is None or floor.seq < known:
            return False
        if floor.seq > known:
            raise floor.refusal(
                f"this process, which last read completion {known} of {self.io.root}, "
                "to catch up (open the table again: it then starts from the newest checkpoint)"
            )
        return True

    def kept(self) -> list[CompletedInstant]:
        """Every completion record still kept: all of them, or those after the retention floor. What a caller that
        lists history ("what is there") asks for; a fold that must start from the table's beginning uses
        `completed()`, which refuses to skip expired records."""
        with self._lock:
            if not self._started:
                self.refresh()
            self._load_history()
            return self.completed(after_seq=min(self._history_first, self.base_seq))

    def _read_latest(self) -> int | None:
        """The latest-seq pointer: the largest `timeline/latest/<seq>` marker (a lower bound of the log's length),
        None if there is none (refresh accepts that only while the log is empty).

        Why empty marker files named by seq, created exclusively and never overwritten: the pointer can only move
        forward whatever the race between publishers, and no filesystem (HDFS renames delete the target first)
        ever shows a moment without it.
        """
        return max((int(n) for n in self.io.list_names(layout.LATEST_DIR) if n.isdigit()), default=None)

    def _advance_latest(self, seq: int) -> None:
        """Create the pointer of seq after publishing it, then remove older pointers (best effort: a pointer that
        lags only weakens the check, it never fails a reader)."""
        if self.io.create_exclusive(layout.latest_file(seq), b""):
            for name in self.io.list_names(layout.LATEST_DIR):
                if name.isdigit() and int(name) < seq:
                    self.io.delete(f"{layout.LATEST_DIR}/{name}")

    def in_memory(self, seq: int) -> CompletedInstant | None:
        """Completion `seq` if this timeline holds it without reading (after its checkpoint, or history loaded)."""
        if self.base_seq < seq <= self.latest_seq:
            return self._records[seq - self.base_seq - 1]
        if self._history_first < seq <= self.base_seq and self._history is not None:
            return self._history[seq - self._history_first - 1]
        return None

    def completed(self, after_seq: int = 0, upto_seq: int | None = None) -> list[CompletedInstant]:
        """Completion records with after_seq < seq <= upto_seq (cached; call refresh() for new ones). Records
        before the checkpoint the timeline started from are read (from files or archive bundles) on first use.
        Records archive retention expired are never skipped silently: asking for one is a HistoryCompactedError that
        names the floor and the setting (`kept()` lists what is there)."""
        after_seq = max(after_seq, 0)  # callers ask for "after latest - N" without clamping
        base = self.base_seq
        end = self.latest_seq if upto_seq is None else min(upto_seq, self.latest_seq)
        out: list[CompletedInstant] = []
        if after_seq < base and after_seq < end:
            history = self._load_history()
            first = self._history_first
            if after_seq < first:
                raise self._refusal(f"reading completions {after_seq + 1}..{end} of {self.io.root}")
            out += history[after_seq - first : min(end, base) - first]
        if end > base:
            out += self._records[max(after_seq - base, 0) : end - base]
        return out

    @property
    def latest_seq(self) -> int:
        """Sequence number of the newest known completion (0 for an empty table)."""
        return self.base_seq + len(self._records)

    def max_instant(self, upto_seq: int) -> str:
        """The largest instant id of the records up to upto_seq; what a checkpoint keeps so that new instant ids stay
        above every old one without reading old records. (An instant a rollback ends was claimed before the rollback
        claimed its own, larger id; the id a record merely names never moves allocation.)"""
        after = self.base_seq if upto_seq >= self.base_seq else 0
        ids = [self._base_max_instant] if after else []
        if not after and self.base_seq:
            self._load_history()
            after = self._history_first  # expired records: the floor keeps their largest id
            ids = [self._floor.max_instant] if after and self._floor is not None else []
        for rec in self.completed(after_seq=after, upto_seq=upto_seq):
            ids.append(rec.instant)
        return max(ids, default="")

    def record_of(self, instant: str) -> CompletedInstant | None:
        """The completion record of an instant, if it completed (or was rolled back: then action == rollback)."""
        record = self._by_instant.get(instant)
        if record is None and self.base_seq and self._history is None and instant <= self._base_max_instant:
            self._load_history()  # an instant older than the checkpoint: its record is in the history
            record = self._by_instant.get(instant)
        return record

    def seq_of(self, instant: str) -> int:
        """Sequence number at which a completed instant became visible; raises if it never completed."""
        self.refresh()
        record = self.record_of(instant)
        if record is None and self._expired_instant(instant):
            raise self._refusal(
                f"the seq of instant {instant} (not among the kept completions, and no newer than "
                "the newest expired one)"
            )
        if record is None or record.action == ACTION_ROLLBACK:
            raise InstantStateError(f"instant {instant} is not a completed instant of {self.io.root}")
        return record.seq

    def _expired_instant(self, instant: str) -> bool:
        """True if the instant may have settled in the expired history: no kept record names it and its id is no
        newer than the newest expired record's (whether it completed or was rolled back is no longer known)."""
        floor = self.history_floor()
        return floor is not None and bool(floor.max_instant) and instant <= floor.max_instant

    def _refusal(self, what: str) -> HistoryCompactedError:
        floor = self._floor if self._floor is not None else self.history_floor()
        if floor is None:  # the loaded history started after a floor that is gone now: damage, said as such
            return HistoryCompactedError(f"{what}: the history before seq {self._history_first + 1} is not kept")
        return floor.refusal(what)

    def pending(self) -> list[str]:
        """Instants that were started but neither completed nor rolled back (live or crashed writers)."""
        self.refresh()
        out = []
        for name in self.io.list_names(layout.TIMELINE_DIR):
            if name.endswith(".requested"):
                instant = name.split(".")[0]
                if self.record_of(instant) is None:
                    out.append(instant)
        return out

    def planned_files(self, instant: str) -> list[str]:
        """Files an instant declared before writing them (its inflight marker), [] if it never got that far."""
        rel = layout.inflight_file(instant)
        if not self.io.exists(rel):
            return []
        try:
            data = json.loads(self.io.read_bytes(rel))
            return [layout.validate_instant_file(f, instant) for f in data["files"]]
        except (ValueError, KeyError, TypeError, DbidxError) as exc:
            raise CorruptFileError(f"rollback plan {self.io.path(rel)} is not valid: {exc}") from exc
