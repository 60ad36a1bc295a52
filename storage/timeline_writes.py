"""The Timeline's writes: claiming an instant (with its heartbeat), publishing its completion record in the one
total order (the optimistic-concurrency loop of the module docstring of `storage/timeline.py`), rolling an unfinished
instant back, and the housekeeping after a publish. A mixin of `storage.timeline.Timeline`, kept apart so the
timeline's reads (refresh, history, lookups) stand alone; `StartedInstant`, what a writer holds, lives here with
the methods that make and settle it.
"""

from __future__ import annotations

import json
import os
import socket
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from dbidx.errors import (
    CorruptFileError,
    ForeignCommitAfterPublishError,
    ForeignCommitError,
    InstantStateError,
    StoreUnavailableError,
)
from dbidx.storage import instant_range, layout, leftovers, markers, writer_presence
from dbidx.storage.heartbeat import Heartbeat
from dbidx.storage.fileio import EXCLUSIVE_LOCK, EXCLUSIVE_NONE
from dbidx.storage.records import (
    ACTION_ROLLBACK,
    ACTIONS,
    CompletedInstant,
)


@dataclass(frozen=True)
class StartedInstant:
    """An instant a writer owns: its id, its action, and the last completion it had seen when it started."""

    instant: str
    action: str
    start_seq: int


class TimelineWrites:
    """Timeline methods that write: start, mark_inflight, publish, publish_exact, publish_staged, rollback, the
    heartbeats of the instants this process started, and delete_claim_files."""

    # ---- writing -----------------------------------------------------------------------------------------
    def start(
        self, action: str, ignore: Iterable[str] = (), hooks: bool = True, tags: Mapping[str, str] | None = None
    ) -> StartedInstant:
        """Claim a new instant id, unique among all writers, and record it as requested, with a heartbeat this
        process renews until the instant settles (or the returned StartedInstant is dropped unsettled).

        On a filesystem without an exclusive create (no link, no conditional put, no commit lock) the writer also
        announces itself and refuses to run beside another active writer (`ignore`: instants a rollback ends).
        hooks=False: without the `before_start` hooks (an absorb, which those hooks run themselves).
        tags: what else identifies the writer in its claim (e.g. the Spark application id), shown with pending
        attempts.
        """
        tags = _checked_tags(tags)
        if action not in ACTIONS:
            raise InstantStateError(f"unknown action {action!r}; expected one of {ACTIONS}")
        self.refresh()
        for hook in self.before_start if hooks else ():
            hook()
        candidate = max(layout.now_instant(), self._max_known_instant() + 1)
        while True:
            if layout.instant_out_of_range(candidate):  # only a typo's or a crafted id is that far ahead
                raise instant_range.allocation_error(self.io, self)
            # 1. Exclusive create of the requested marker: two writers in the same millisecond get different ids.
            claim = {
                "action": action,
                "start_seq": self.latest_seq,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started_at_ms": int(time.time() * 1000),
            } | ({"tags": tags} if tags else {})
            marker = json.dumps(claim).encode()
            instant = layout.format_instant(candidate)
            if self.io.create_exclusive(layout.requested_file(instant), marker):
                self.refresh()
                # 2. Ids of finished instants are never reused, even if their marker was removed meanwhile.
                if instant not in self._by_instant:
                    if self.io.exclusive_create == EXCLUSIVE_LOCK:
                        # so a writer without the lock sees this one and refuses
                        writer_presence.announce(self.io, instant)
                    if self.io.exclusive_create == EXCLUSIVE_NONE:
                        writer_presence.refuse_second(self.io, instant, set(ignore), self.record_of)
                    return self._with_heartbeat(
                        StartedInstant(instant=instant, action=action, start_seq=claim["start_seq"]), claim
                    )
                self.io.delete(layout.requested_file(instant))
            candidate = max(candidate + 1, self._max_known_instant() + 1)

    def _with_heartbeat(self, started: StartedInstant, claim: dict[str, Any]) -> StartedInstant:
        """Start the instant's heartbeat (its claim withdrawn if even the first beat cannot be written), stopped when
        the instant settles, or, without deleting it, when the caller drops `started` unsettled (it is abandoned
        then: the expired heartbeat lets the next writer roll it back)."""
        try:
            beat = Heartbeat(
                self.io,
                started.instant,
                self.heartbeat_interval_s,
                {k: claim[k] for k in ("host", "pid", "tags") if k in claim},
            )
        except BaseException:
            self.io.delete(layout.requested_file(started.instant))
            raise
        self._heartbeats[started.instant] = beat
        weakref.finalize(started, self.stop_heartbeat, started.instant, False)
        return started

    def stop_heartbeat(self, instant: str, delete: bool = True) -> None:
        """Stop renewing an instant's heartbeat (if this process does) and delete it (unless `delete` is False)."""
        beat = self._heartbeats.pop(instant, None)
        if beat is not None:
            beat.stop(delete)
        elif delete:
            self.io.delete(layout.heartbeat_file(instant))

    def mark_inflight(self, started: StartedInstant, files: Iterable[str]) -> None:
        """Record the files the instant is about to write, so a rollback can find them after a crash."""
        payload = json.dumps({"action": started.action, "files": sorted(set(files))}).encode()
        self.io.write_atomic(layout.inflight_file(started.instant), payload)

    def publish(
        self,
        started: StartedInstant,
        build: Callable[[int], CompletedInstant],
        check: Callable[[list[CompletedInstant]], None] | None = None,
        keep_claim: bool = False,
    ) -> CompletedInstant:
        """Append the instant's completion record atomically, after checking every completion it has not seen.

        `check` receives the completions published since the instant started (only the ones not checked yet on a
        retry) and raises ConflictError to abort; nothing is published then. keep_claim: leave the instant's claim
        files (the caller removes them with `delete_claim_files` when its work after the publish is done: a clean's
        deletions; a claim left by a crash tells the sweep to finish that work).
        """
        checked = started.start_seq
        while True:
            # 1. Look at everything that completed since we last looked (other engines' Delta versions included).
            self.refresh()
            for hook in self.catch_up:
                hook()
            news = self.completed(after_seq=checked)
            for rec in news:
                if rec.action == ACTION_ROLLBACK and rec.rolled_back == started.instant:
                    raise InstantStateError(
                        f"instant {started.instant} was rolled back (completion {rec.seq}) by another process; "
                        "its files are gone and it cannot be committed"
                    )
                if rec.instant == started.instant:
                    raise InstantStateError(f"instant {started.instant} already completed at seq {rec.seq}")
            if check is not None and news:
                check(news)
            checked = self.latest_seq
            # 2. Try to take the next sequence number; losing the race means someone else completed: look again.
            record = build(checked + 1)
            for hook in self.before_publish:
                hook(record)
            # 3. The commit point: the record's Delta version, put if absent. Losing it: someone else committed.
            if self.commit_point is not None and not self.commit_point(record):
                continue
            try:
                created = self.io.create_exclusive(layout.completed_file(record.seq), record.to_json())
            except Exception as exc:
                # The request failed in a way that leaves it unknown whether the record was stored: read it back.
                self.refresh()
                mine = self._by_instant.get(started.instant)
                if mine is not None and mine.action == started.action:
                    self._after_publish(mine, started.instant, keep_claim)
                    return mine
                if self.commit_point is None:
                    raise
                # The Delta version is on storage: the instant committed, whatever happens to its record. Never
                # roll it back: its staged copy is there, and the next reader or writer publishes it.
                warnings.warn(
                    f"instant {started.instant} committed (Delta version of seq {record.seq} written), but "
                    f"its completion record could not be written ({exc}); the next reader or writer of "
                    "the table publishes it from the staged copy",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return record
            if created:
                self._after_publish(record, started.instant, keep_claim)
                return record
            if self.commit_point is not None:
                # Our Delta version is on storage, so the record is ours: a reader that met the version first
                # published it from the staged copy (the same bytes).
                return self._published_by_other(record, started.instant, keep_claim)

    def publish_exact(self, started: StartedInstant, record: CompletedInstant) -> bool:
        """Publish `record` at exactly its seq, with no checks and no commit point (an absorbed Delta version, which
        is on storage already); False if another process published that seq first."""
        try:
            created = self.io.create_exclusive(layout.completed_file(record.seq), record.to_json())
        except StoreUnavailableError:
            self.refresh()
            if self._by_instant.get(started.instant) is None:
                raise
            created = True
        if created:
            self._after_publish(record, started.instant)
        return created

    def publish_staged(self, raw: bytes, where: str) -> CompletedInstant | None:
        """Publish a record another writer staged and whose Delta version is on storage (its writer died or is slow
        between the two steps); None if the seq is taken by something else. The bytes are checked as any record."""
        record = CompletedInstant.from_json(raw, where)
        if record.table_id != self.table_id:
            raise CorruptFileError(f"{where} is a record of table {record.table_id}, not of {self.table_id}")
        if record.seq != self.latest_seq + 1:
            return None
        self.io.create_exclusive(layout.completed_file(record.seq), raw)
        self.refresh()
        mine = self._by_instant.get(record.instant)
        if mine is None or mine.seq != record.seq:
            return None
        self._advance_latest(record.seq)
        return mine

    def _published_by_other(self, record: CompletedInstant, instant: str, keep_claim: bool = False) -> CompletedInstant:
        self.refresh()
        mine = self._by_instant.get(instant)
        if mine is None or mine.seq != record.seq or mine.action != record.action:
            raise CorruptFileError(
                f"completion {self.io.path(layout.completed_file(record.seq))} is not instant {instant}'s record, "
                "although that instant's Delta version is on storage: the timeline and the Delta log disagree"
            )
        self._after_publish(mine, instant, keep_claim)
        return mine

    def rollback(self, instant: str, action_files: Iterable[str] = (), ignore: Iterable[str] = ()) -> CompletedInstant:
        """Abort an unfinished instant: publish a rollback record first (so it can never complete), then delete its
        files."""
        layout.validate_instant(instant)
        self.refresh()
        existing = self.record_of(instant)
        if existing is not None:
            if existing.action == ACTION_ROLLBACK:
                return existing
            raise InstantStateError(
                f"instant {instant} completed at seq {existing.seq}; a completed instant cannot be rolled back"
            )
        if self._expired_instant(instant):
            # It may have completed in the expired history: rolling it back would delete a committed instant's files.
            raise self._refusal(
                f"rolling back instant {instant} (its files are kept; remove its timeline files "
                "by hand once you know it is not running)"
            )
        if not (self.io.exists(layout.requested_file(instant)) or self.io.exists(layout.inflight_file(instant))):
            # A typo or another table's id: a record naming it would claim an instant this table never started.
            raise InstantStateError(
                f"instant {instant} was never started on {self.io.path('')} (it has no requested "
                "or inflight file) and did not complete: there is nothing to roll back; "
                "`dbidx commits URI` lists the table's instants"
            )
        files = sorted(set(self.planned_files(instant)) | set(action_files))
        me = self.start(ACTION_ROLLBACK, ignore={instant, *ignore})
        # Claiming ran the table's catch-up, which publishes a record whose Delta version is on storage (its writer
        # died between its commit point and its record): the instant may have completed right there.
        done = self.record_of(instant)
        if done is not None and done.action != ACTION_ROLLBACK:
            self.delete_claim_files(me.instant)
            raise InstantStateError(
                f"instant {instant} completed at seq {done.seq} (its Delta version was on "
                "storage: it committed before its writer died); a completed instant cannot be "
                "rolled back"
            )

        def check(news: list[CompletedInstant]) -> None:
            for rec in news:
                if rec.instant == instant and rec.action != ACTION_ROLLBACK:
                    raise InstantStateError(f"instant {instant} completed at seq {rec.seq} before the rollback")

        def build(seq: int) -> CompletedInstant:
            return CompletedInstant(
                seq=seq,
                instant=me.instant,
                action=ACTION_ROLLBACK,
                start_seq=me.start_seq,
                table_id=self.table_id,
                completed_at_ms=int(time.time() * 1000),
                rolled_back=instant,
                deleted=tuple(files),
            )

        record = self.publish(me, build, check)
        self._by_instant.setdefault(instant, record)
        # The rollback record is published: the instant can never complete now, so its files are garbage, both
        # the planned ones and whatever its tasks announced with markers.
        for rel in files:
            self.io.delete(rel)
        markers.discard_unlisted(self.io, instant, keep=())
        self.delete_claim_files(instant)
        return record

    # ---- helpers -----------------------------------------------------------------------------------------
    def _after_publish(self, record: CompletedInstant, instant: str, keep_claim: bool = False) -> None:
        """Housekeeping once a record is published. The instant has completed whatever happens here, so a failure
        is a warning, never an error that would make the caller roll back (and fail to roll back) a committed
        instant. One exception: another engine took this completion's Delta version between the check before the
        publish and the publish (a ForeignCommitError). That is raised once every step ran, as a
        ForeignCommitAfterPublishError carrying the record, so the caller neither rolls back nor reports success:
        Delta readers and dbidx disagree until the table is re-indexed, and every later dbidx write refuses (the
        version differs)."""
        steps = [lambda: self._advance_latest(record.seq), self.refresh]
        steps += [] if keep_claim else [lambda: self.delete_claim_files(instant)]
        steps += [lambda: leftovers.sweep_staged(self.io, self)]
        steps += [lambda hook=hook: hook(record) for hook in self.after_publish]
        foreign: ForeignCommitError | None = None
        for step in steps:
            try:
                step()
            except ForeignCommitError as exc:
                foreign = exc
            except Exception as exc:  # noqa: BLE001 - the instant is committed; nothing here may say otherwise
                warnings.warn(
                    f"instant {instant} completed at seq {record.seq}, but a housekeeping step failed: {exc}",
                    RuntimeWarning,
                    stacklevel=3,
                )
        if foreign is not None:
            raise ForeignCommitAfterPublishError(
                f"instant {instant} completed at seq {record.seq} in dbidx's completion log, but {foreign}",
                published=record,
            ) from foreign

    def delete_claim_files(self, instant: str) -> None:
        """A settled instant's claim on the timeline: its requested and inflight files (and, where writers notice
        each other by presence files, its presence file). Its markers are the writer's to discard."""
        self.io.delete(layout.inflight_file(instant))
        self.io.delete(layout.requested_file(instant))
        self.io.delete(layout.staged_file(instant))
        self.stop_heartbeat(instant)
        if self.io.exclusive_create in (EXCLUSIVE_NONE, EXCLUSIVE_LOCK):
            writer_presence.forget(self.io, instant)

    def _max_known_instant(self) -> int:
        ids = [self._records_max_instant, int(self._base_max_instant or 0)]
        ids += [int(n.split(".")[0]) for n in self.io.list_names(layout.TIMELINE_DIR) if n[:17].isdigit()]
        return max(ids, default=0)


def _checked_tags(tags: Mapping[str, str] | None) -> dict[str, str]:
    """A claim's tags: short strings by short names (they are shown to operators, never interpreted)."""
    out = dict(tags or {})
    for name, value in out.items():
        if not (isinstance(name, str) and isinstance(value, str) and 0 < len(name) <= 64 and len(value) <= 256):
            raise InstantStateError(
                f"writer tag {name!r}={value!r} is not a name of 1-64 characters with a string value of at most 256"
            )
    return out
