"""The life of one instant, written once: claimed, worked on, then published or rolled back.

Why one place: every writer (an upsert, both compactions, a clean, a properties change, a build-index) goes through
the same steps, and the decisions between them are where a copy goes wrong: after a failure, was the instant
published already (then it must never be rolled back: its Delta version and record are there), and which files did
it write that no record lists (a losing task attempt's, a retried piece's, a publish pass that lost its seq)?
`InstantLife` guarantees, whatever the caller's work raises:

- every instant it starts ends published or rolled back (a rollback that fails in turn is a note on the error that
  caused it: the instant is then left pending, for the next writer to roll back once its heartbeat expires);
- a failure before the publish rolls it back, which deletes every file it declared or announced;
- a failure after the publish is not rolled back: the record stands. That includes the publish's own
  ForeignCommitAfterPublishError (another engine took the completion's Delta version after dbidx published it);
- once published, the files it wrote and its record does not list are deleted, with its markers.

The block form is the usual one (`with InstantLife(timeline, action) as life: ... life.publish(build, check)`);
`CommitWriter` (table/writer.py) is one, and ends through `commit` / `fail` / `finish` where its caller needs more
than a block. Two instants live otherwise, on purpose: an absorb's claims (table/absorb.py: they publish another
engine's versions at exact seqs) and the format upgrade's (table/upgrade.py: never rolled back into a format-3 log;
a crashed run's instant is discarded by the next run, a lost race reverted).
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any, Callable, Iterable, Mapping

from dbidx.errors import ForeignCommitAfterPublishError, InstantStateError
from dbidx.storage import leftovers, markers
from dbidx.storage.records import CompletedInstant
from dbidx.storage.timeline import StartedInstant, Timeline

__all__ = ["InstantLife"]


class InstantLife:
    """One instant from its claim to its end (published, or rolled back); the module docstring says what it ensures."""

    def __init__(self, timeline: Timeline, action: str, tags: Mapping[str, str] | None = None) -> None:
        self.timeline = timeline
        self.started: StartedInstant = timeline.start(action, tags=tags)
        self.planned: tuple[str, ...] = ()  # the files declared before they were written (`declare`)
        self.record: CompletedInstant | None = None  # its completion record, once published
        self.rolled_back: CompletedInstant | None = None  # the rollback record that ended it, if one did
        self.deleted: list[str] = []  # files it wrote that its record does not list, deleted after the publish
        self.ended = False  # its end ran: rolled back (or tried to), or its unlisted files deleted

    @property
    def instant(self) -> str:
        """This instant's id."""
        return self.started.instant

    @property
    def start_seq(self) -> int:
        """The last completion this instant had seen when it started."""
        return self.started.start_seq

    @property
    def published(self) -> bool:
        """Whether its completion record is published (whatever failed after that)."""
        return self.record is not None

    def __enter__(self) -> "InstantLife":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.finish()
        else:
            self.fail(exc)

    def completion(self, seq: int, table_id: str, **fields: Any) -> CompletedInstant:
        """Its completion record at `seq`: the instant, its action, the seq it started from and the time filled in,
        `fields` the rest (what a `publish` build returns)."""
        return CompletedInstant(
            seq=seq,
            instant=self.instant,
            action=self.started.action,
            table_id=table_id,
            completed_at_ms=int(time.time() * 1000),
            start_seq=self.start_seq,
            **fields,
        )

    # ---- the steps --------------------------------------------------------------------------------------------
    def declare(self, files: Iterable[str]) -> None:
        """Declare the files the instant is about to write under planned names (its inflight file), so a rollback
        finds them after a crash, and the end deletes any of them its record does not list."""
        self.planned = tuple(sorted(set(files)))
        self.timeline.mark_inflight(self.started, self.planned)

    def publish(
        self,
        build: Callable[[int], CompletedInstant],
        check: Callable[[list[CompletedInstant]], None] | None = None,
        keep_claim: bool = False,
    ) -> CompletedInstant:
        """Publish the instant's completion record (Timeline.publish: `check` over what completed meanwhile, `build`
        the record for a seq, `keep_claim` for a caller with work left after the publish)."""
        if self.ended or self.record is not None:
            raise InstantStateError(f"instant {self.instant} is already finished")
        try:
            self.record = self.timeline.publish(self.started, build, check, keep_claim)
        except ForeignCommitAfterPublishError as exc:
            self.record = exc.published  # published, then another engine took its Delta version: committed
            raise
        return self.record

    def rollback(self) -> None:
        """Abort the instant and delete whatever it wrote (idempotent; nothing once it is published)."""
        if self.ended or self.record is not None:
            return
        self.ended = True
        self.rolled_back = self.timeline.rollback(self.instant)

    # ---- the end ----------------------------------------------------------------------------------------------
    def fail(self, exc: BaseException) -> None:
        """The end after `exc`: rolled back unless published (then only its unlisted files go). What fails here is
        a note on `exc`, which the caller raises: the error that stopped the instant is the one to act on."""
        if self.ended:
            return
        try:
            if self.record is None:
                self.rollback()
            else:
                self._discard_unlisted()
        except Exception as cleanup:  # noqa: BLE001 - reported with the error that caused the end
            what = "rolling back" if self.record is None else "deleting the unlisted files of"
            exc.add_note(f"{what} instant {self.instant} failed too: {type(cleanup).__name__}: {cleanup}")
        finally:
            self.ended = True

    def finish(self) -> list[str]:
        """The end after the work: the files the published instant wrote and does not list are deleted (returned);
        an instant left unpublished is rolled back (nothing of it may stay pending)."""
        if self.ended:
            return self.deleted
        if self.record is None:
            self.rollback()
            return []
        self.ended = True
        return self._discard_unlisted()

    def _discard_unlisted(self) -> list[str]:
        """Delete the declared and announced files its record does not list (a losing attempt's, a retried piece's,
        a lost publish pass's DV file), then its markers."""
        assert self.record is not None
        listed = leftovers.settled_files(self.record) or set()
        self.deleted = markers.discard_losing_tries(self.timeline.io, self.instant, self.planned, listed)
        return self.deleted
