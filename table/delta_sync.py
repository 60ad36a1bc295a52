"""The Table's side of the Delta log: every completion's commit point (its record staged, then its Delta
version put), the sync after each publish and before each claim, and the absorption of other engines' versions
(docs/FORMAT.md section 12). A mixin of `table.facade.Table`, kept apart so the facade stays small."""

from __future__ import annotations

import errno

from dbidx.data.delta_actions import VersionActions, read_version
from dbidx.data.delta_derive import TableShape, version_for
from dbidx.data.delta_log import (
    DeltaLogWriter,
    checkpoint_pointer,
    last_checkpoint_version,
    version_file,
)
from dbidx.errors import (
    CorruptFileError,
    ReadOnlyTableError,
)
from dbidx.table.absorb import absorb_run, collect_run, reread_run, run_in_progress
from dbidx.data.delta_checkpoint import write_delta_checkpoint
from dbidx.table.delta_properties import retention_of
from dbidx.table.vector_storage import VectorsMoved, match_vector_storage
from dbidx.storage import layout
from dbidx.storage.data_view import DELTA_ADOPTED_EXTRA, check_adopted
from dbidx.storage.instant_life import InstantLife
from dbidx.storage.records import ACTION_BUILD_INDEX, ACTION_CLEAN, ACTION_COMMIT, CompletedInstant

LOG_CATCH_UP_EXTRA = "log_catch_up"  # the catch-up commit's extra: the files whose log vector it brought in line


class DeltaLogSync:
    """Table methods that keep the index and the Delta log one: commit point, sync, absorb, checkpoints."""

    def _after_publish(self, record: CompletedInstant) -> None:
        self.sync_delta_log()
        interval = self.props.checkpoint_interval
        if interval and record.seq % interval == 0:
            self.checkpoint()
            # Delta readers then start from it too (delta-rs writes Delta's checkpoint format; it refuses a table
            # whose schema is still empty: an index written through the library writer has no data yet), unless a
            # Delta checkpoint (the log cleanup service's, another engine's) is fewer than delta.checkpointInterval
            # versions old: a second one so close adds bytes to the log and saves readers nothing.
            newest = checkpoint_pointer(self.io)
            if self._data.schema is not None and (
                newest < 0
                or self.delta_version() - newest >= retention_of(self._data.configuration()).checkpoint_interval
            ):
                write_delta_checkpoint(self.io)

    def sync_delta_log(self) -> int:
        """Bring dbidx up to the Delta log and the log up to dbidx: absorb every version other engines wrote since
        the index's last (table/absorb.py), publish records whose writer put their version but died before publishing,
        and write the versions of completions an older dbidx published without one (a crash between its two steps).
        Runs before this process claims an instant and after each publish. Returns the number of versions written."""
        with self._view_lock:
            self._delta_writer()
            self.refresh()
            if self.adopting_delta and self._data.delta_adopted is None:
                return 0
            self.absorb_delta_log()
            written = self._delta.sync(
                self.io,
                self.timeline.latest_seq,
                self.timeline.completed,
                self._refreshed_seq,
                self._data.delta_offset,
                self._data.delta_first_seq,
                self.timeline.in_memory,
            )
            self.catch_up_log_vectors()
            return written

    def catch_up_log_vectors(self) -> CompletedInstant | None:
        """Give the Delta log the deletion vectors an absorb masked rows with (a stale rewrite's copies: table/
        absorb_stale.py): one dbidx version (a commit of no rows) whose remove + add pairs bring every lagging file in
        line (data/delta_derive.py). Any later dbidx version would carry them too; this one does it at once, so Delta
        readers read each row once again right after the absorb. None: nothing lagged."""
        if (
            getattr(self._absorbing, "catching_up", False)
            or getattr(self._absorbing, "on", False)  # inside an absorb: the sync after it catches up
            or not self._data.log_behind()
        ):
            return None
        self._absorbing.catching_up = True
        try:
            with InstantLife(self.timeline, ACTION_COMMIT) as life:

                def build(seq: int) -> CompletedInstant:  # (an empty list: another version carried them meanwhile)
                    return life.completion(
                        seq, self.props.table_id, extra={LOG_CATCH_UP_EXTRA: self._data.log_behind()}
                    )

                return life.publish(build)
        finally:
            self._absorbing.catching_up = False

    def match_vector_storage(self) -> VectorsMoved:
        """Give every deletion vector of the Delta log the form `dbidx.deletionVectors.storage` asks for (inline,
        the default, or in files), in one version (table/vector_storage.py); nothing to move: nothing is written."""
        return match_vector_storage(self)

    def _delta_writer(self) -> DeltaLogWriter:
        if self._delta is None:
            # Versions of completions this view folded already are derived again only if they are missing.
            self._delta = DeltaLogWriter(
                TableShape(self.props.table_id, self.props.created_at_ms or 0, self.props.upgraded_at_seq), self.io
            )
        return self._delta

    def absorb_delta_log(self) -> list[CompletedInstant]:
        """Give every Delta version beyond the index's latest completion its record: a version a dbidx writer put
        and staged its record for is published from that record; any other is another engine's commit, absorbed
        into the index (docs/FORMAT.md section 12c). Returns the records this call published."""
        if getattr(self._absorbing, "on", False):
            return []
        out: list[CompletedInstant] = []
        with self._view_lock:
            if self.adopting_delta and self._data.delta_adopted is None:
                return out
            self._absorbing.on = True
            try:
                floor = last_checkpoint_version(self.io)  # versions up to it exist, their JSON may be expired
                stalled = 0
                self.refresh(force=True)
                while True:
                    seq = self.timeline.latest_seq + 1
                    version = seq + self._data.delta_offset
                    if seq < self._data.delta_first_seq or not (
                        version <= floor or self.io.exists(version_file(version))
                    ):
                        return out
                    published = self._next_version_record(version, seq)
                    out += published
                    self.refresh(force=True)
                    stalled = 0 if published or self.timeline.latest_seq >= seq else stalled + 1
                    if stalled >= 3:  # never a silent spin: something keeps the version from getting its record
                        raise CorruptFileError(
                            f"Delta version {version} of {self.uri} gets no completion record "
                            f"(seq {seq}) after {stalled} attempts; `dbidx verify URI` says why"
                        )
            finally:
                self._absorbing.on = False

    def delta_version(self) -> int:
        """The Delta version of the index's latest completion (what Delta readers call the table's version)."""
        view = self.data_view()
        return self.timeline.latest_seq + view.delta_offset

    def follow_delta_log(self) -> None:
        """What every user-facing read does first (read_arrow, read_table, lookup, stats, verify): describe the latest
        Delta version, whoever wrote it. Absorbing writes the index's records of other engines' versions, so a reader
        needs write access to the table once another engine has committed: a reader without it gets a
        ReadOnlyTableError naming the versions and `dbidx sync` (a read as of the last absorbed version would miss
        rows every Delta reader reads)."""
        try:
            self.absorb_delta_log()
            self.catch_up_log_vectors()
        except OSError as exc:
            if not _denied(exc):
                raise
            self.refresh(force=True)
            raise ReadOnlyTableError(
                f"{self.uri}: other engines committed Delta versions after {self.delta_version()} that the index "
                f"has not absorbed, and absorbing them needs write access to {self.io.path(layout.META_DIR)} "
                f"({exc}). Run `dbidx sync {self.uri}` as a writer of the table, then read again"
            ) from exc

    def _next_version_record(self, version: int, seq: int) -> list[CompletedInstant]:
        """Publish the record(s) of Delta version `version` onward, `version` being completion `seq`'s: a dbidx
        version from its staged record; a run of other engines' versions as one absorbed run ([]: another process
        published first)."""
        run = run_in_progress(self.timeline.in_memory(seq - 1))
        if run is not None:  # a run another absorber started and did not finish: exactly that run
            first, last = run
            return absorb_run(self, reread_run(self, first, last), seq, published=version - first)
        if self.io.exists(version_file(version)):
            staged = self._staged_of(read_version(self.io, version), seq)
            if staged is not None:
                return staged
        # Other engines' versions, up to the next one a dbidx writer staged (or a dbidx version whose staged record
        # is gone: absorbed from its actions like any other).
        self._delta_writer()
        return absorb_run(self, collect_run(self, version, self._has_staged), seq)

    def _has_staged(self, actions: VersionActions) -> bool:
        return (
            actions.dbidx_instant is not None
            and layout.is_instant(actions.dbidx_instant)
            and self.io.exists(layout.staged_file(actions.dbidx_instant))
        )

    def _staged_of(self, actions: VersionActions, seq: int) -> list[CompletedInstant] | None:
        """A version a dbidx writer put: its staged record published ([] if someone else did), None if it is not
        one (or its staged record is gone)."""
        instant = actions.dbidx_instant
        if instant is None or not layout.is_instant(instant):
            return None
        staged = layout.staged_file(instant)
        try:
            raw = self.io.read_bytes(staged) if self.io.exists(staged) else None
        except CorruptFileError:  # its writer published and removed it between the two calls
            raw = None
        if raw is not None:
            record = self.timeline.publish_staged(raw, self.io.path(staged))
            if record is not None and record.instant == instant:
                if record.action == ACTION_CLEAN:  # its deletions may not have run: its claim tells the sweep
                    self.io.delete(staged)
                else:
                    self.timeline.delete_claim_files(instant)  # staged copy, claim and heartbeat of its dead writer
                return [record]
        self.timeline.refresh()
        if self.timeline.latest_seq >= seq:  # its writer published (and removed the staged copy) meanwhile
            return []
        return None

    def _commit_point(self, record: CompletedInstant) -> bool:
        """The commit point of every completion (docs/FORMAT.md section 12): stage the record, then put its Delta
        version if absent. True: the version is this record's (the record is published next; if this process dies
        first, the next reader publishes it from the staged copy). False: the version was taken by another writer
        (dbidx or not); the staged copy goes and the publish loop looks again."""
        adopted = record.extra.get(DELTA_ADOPTED_EXTRA) if record.action == ACTION_BUILD_INDEX else None
        if self.adopting_delta and self._data.delta_adopted is None and adopted is None:
            return True  # a rollback during an adoption: the log is still the other engine's alone
        with self._view_lock:
            self.refresh(force=True)
            if self._data.applied_seq != record.seq - 1:
                return False  # a completion landed since the checks: they run again on it
            delta = self._delta_writer()
            if adopted is not None:
                version = check_adopted(adopted, f"instant {record.instant}")["version"] + 1
            else:
                version = record.seq + self._data.delta_offset
            if version <= last_checkpoint_version(self.io):
                return False  # a checkpoint past it: the version exists for Delta readers (its JSON expired)
            data = version_for(delta.shape, record, self._data, delta.body())
            staged = layout.staged_file(record.instant)
            self.io.write_atomic(staged, record.to_json())
            path = version_file(version)
            if self.io.create_exclusive(path, data) or self.io.read_bytes(path) == data:
                delta.mark_written(record.seq)
                return True
            self.io.delete(staged)
            return False

    def _refreshed_seq(self) -> int:
        self.refresh()
        return self.timeline.latest_seq


def _denied(exc: OSError) -> bool:
    """An error that says this process may not write there (a local permission, a read-only mount, an object
    store's access denial), as opposed to a failure worth retrying or a bug."""
    if isinstance(exc, PermissionError) or exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return True
    text = str(exc).replace(" ", "").replace("_", "").lower()
    return "accessdenied" in text or "forbidden" in text
