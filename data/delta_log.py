"""The table's Delta Lake log: `_delta_log/`, derived from the completion log so that every Delta reader sees exactly
the rows dbidx reads.

Why derived and not a second source of truth: the completion log (`.dbidx/timeline/completed/`) is verified,
checksummed and carries every guarantee of the commit protocol (conflicts, all-or-nothing, rollback). The Delta
commit of completion seq S is a pure function of record S and the data view right before it, and Delta version S
belongs to completion S (version 0 is the table's creation). So a writer publishes its completion first and then
writes the Delta version with a put-if-absent; a crash in between leaves a version missing, never a wrong one, and
the next writer (or `dbidx repair`) writes it. Two processes writing the same version write the same bytes; a
version whose bytes differ from the derivation was written by someone else (another Delta writer) and is refused
loudly (ForeignCommitError) before dbidx writes anything on top of it.

This module holds the log on storage (listing, checkpoints, put-if-absent) and the writer that keeps it up to
date; what each version holds is derived by data/delta_derive.py.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Iterable
from urllib.parse import unquote

from dbidx.data.delta_derive import TableShape, commit_stamp, initial_version, version_for

from dbidx.data.superseded import load_vector_bytes
from dbidx.errors import CorruptFileError, ForeignCommitError
from dbidx.storage.data_view import DataView, DvRef
from dbidx.storage.fileio import FileIO
from dbidx.storage.records import ACTION_ABSORB, CompletedInstant

DELTA_LOG_DIR = "_delta_log"


def version_file(version: int) -> str:
    """`_delta_log/<version:020d>.json`."""
    return f"{DELTA_LOG_DIR}/{version:020d}.json"


_URI_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # `file:`, `s3:`: an absolute URI (a relative one has none)


def path_in_table(root: str, raw: str) -> str | None:
    """A Delta `path` (a URI) as the path relative to the table at `root` it names, unquoted and not yet validated;
    None when it names a file outside the table: an absolute URI or path elsewhere, as a shallow clone's log names its
    source's files. Why the scheme check: Spark spells a local absolute path `file:/dir/x.parquet` (one slash), which
    has no `://` and would otherwise read as a relative path whose first directory is `file:`."""
    root = root.rstrip("/")
    plain = unquote(raw)
    for prefix in ("file://" + root + "/", "file:" + root + "/", root + "/"):
        if plain.startswith(prefix):
            return plain[len(prefix) :]
    if _URI_SCHEME.match(raw) or "://" in plain or plain.startswith("/"):
        return None
    return plain


# ---- the log on storage ------------------------------------------------------------------------------------
def listed_versions(io: FileIO, names: list[str] | None = None) -> list[int]:
    """Versions present in `_delta_log/` (commit JSON files; checkpoints and temp files are not versions); `names`:
    the log's listing when the caller has it already."""
    out = []
    for name in io.list_names(DELTA_LOG_DIR) if names is None else names:
        stem = name[:-5] if name.endswith(".json") else ""
        if len(stem) == 20 and stem.isdigit():
            out.append(int(stem))
    return sorted(out)


def stored_versions(io: FileIO) -> tuple[set[int], int]:
    """From one listing of `_delta_log/`: the versions whose JSON is there, and the newest Delta checkpoint's version
    (checkpoint_floor). Every version up to that one counts as stored too (the caller adds the range it needs)."""
    names = io.list_names(DELTA_LOG_DIR)
    return set(listed_versions(io, names)), checkpoint_floor(io, names)


def checkpoint_floor(io: FileIO, names: list[str] | None = None) -> int:
    """The version of the table's newest Delta checkpoint (`_delta_log/_last_checkpoint`), -1 without one. Every
    version up to it is summed up by the checkpoint, so another engine's log cleanup may have deleted their JSON;
    the checkpoint's own Parquet file must then be there (else the log is damaged). `names`: the log's listing."""
    names = io.list_names(DELTA_LOG_DIR) if names is None else names
    if "_last_checkpoint" not in names:
        return -1
    version = _pointer_version(io)
    # classic, multi-part (N.checkpoint.i.n.parquet) or V2 checkpoints
    if not any(n.startswith(f"{version:020d}.checkpoint") or n == f"{version:020d}.json" for n in names):
        raise CorruptFileError(
            f"{io.path(DELTA_LOG_DIR)}/_last_checkpoint names version {version}, whose "
            "checkpoint file and JSON are both missing"
        )
    return version


def read_checkpoint_pointer(io: FileIO) -> dict[str, Any]:
    """`_delta_log/_last_checkpoint` as its JSON object, read back: anything but an object naming a version >= 0 is a
    CorruptFileError."""
    raw = io.read_bytes(f"{DELTA_LOG_DIR}/_last_checkpoint")
    try:
        pointer = json.loads(raw)
        version = pointer["version"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptFileError(
            f"{io.path(DELTA_LOG_DIR)}/_last_checkpoint is not a Delta checkpoint pointer: {raw[:200]!r}"
        ) from exc
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise CorruptFileError(f"{io.path(DELTA_LOG_DIR)}/_last_checkpoint names version {version!r}")
    return pointer


def _pointer_version(io: FileIO) -> int:
    """The version `_delta_log/_last_checkpoint` names (read back: anything else is a CorruptFileError)."""
    return read_checkpoint_pointer(io)["version"]


def checkpoint_pointer(io: FileIO) -> int:
    """The version `_last_checkpoint` names, -1 without one: one read, no listing (how far the newest checkpoint
    lags the log, asked after every batch; `checkpoint_floor` also checks the checkpoint is there)."""
    if not io.exists(f"{DELTA_LOG_DIR}/_last_checkpoint"):
        return -1
    return _pointer_version(io)


def last_checkpoint_version(io: FileIO) -> int:
    """The version `_delta_log/_last_checkpoint` names (-1 without one), read without listing the log (what every
    commit and catch-up asks: versions up to it exist for Delta readers even when a log cleanup deleted their JSON,
    so dbidx must neither put one of them nor wait for it)."""
    if not io.exists(f"{DELTA_LOG_DIR}/_last_checkpoint"):
        return -1
    pointer = read_checkpoint_pointer(io)
    version = pointer["version"]
    # 1. The usual case in two existence checks: a classic checkpoint file (or the UUID-named V2 one the pointer's
    #    `v2Checkpoint.path` names), or the version's JSON still there.
    v2 = pointer.get("v2Checkpoint")
    named = v2.get("path") if isinstance(v2, dict) else None
    if not (isinstance(named, str) and named.startswith(f"{version:020d}.checkpoint.") and "/" not in named):
        named = f"{version:020d}.checkpoint.parquet"
    if io.exists(f"{DELTA_LOG_DIR}/{named}") or io.exists(version_file(version)):
        return version
    # 2. Otherwise a multi-part checkpoint, or a damaged log: the listing decides (CorruptFileError). Why not
    #    always list: this runs at every commit, and the log holds a month of versions by default.
    return checkpoint_floor(io)


def read_stamp(io: FileIO, version: int) -> int | None:
    """The inCommitTimestamp version `version` carries (None: none, or the version is gone with a log cleanup): what
    an absorb or an adoption records of another engine's version (storage/commit_stamps.py)."""
    if version < 0 or not io.exists(version_file(version)):
        return None
    return commit_stamp(io.read_bytes(version_file(version)).split(b"\n", 1)[0])


def put_version(io: FileIO, version: int, data: bytes) -> bool:
    """Create version `version` if absent (True if this call wrote it); an existing version must hold exactly
    these bytes, else another writer committed to the Delta table: ForeignCommitError, nothing written."""
    if io.create_exclusive(version_file(version), data):
        return True
    existing = io.read_bytes(version_file(version))
    if existing != data:
        raise ForeignCommitError(
            f"Delta version {version} of {io.path(DELTA_LOG_DIR)} was not written by dbidx (its content differs "
            "from what dbidx's completion log derives): another engine committed to this table. dbidx refuses to "
            "write on top of it; re-index the table with `dbidx build-index` to adopt its current state"
        )
    return False


def check_no_foreign(present: Iterable[int], latest_seq: int, io: FileIO) -> None:
    """Before a dbidx write: every Delta version above the completion log's latest seq is someone else's."""
    beyond = sorted(v for v in present if v > latest_seq)
    if beyond:
        raise ForeignCommitError(
            f"{io.path(DELTA_LOG_DIR)} has version(s) {beyond[:5]} beyond dbidx's latest completion {latest_seq}: "
            "another engine committed to this Delta table. dbidx refuses to write on top of it; re-index the "
            "table with `dbidx build-index` to adopt its current state"
        )


class DeltaLogWriter:
    """Derives the Delta versions of the completions a writer's table view applies, and writes the missing ones."""

    def __init__(self, shape: TableShape, io: FileIO) -> None:
        self.shape = shape
        self.io = io
        # Derived versions not yet known to be on storage (an error: the version cannot be derived here, because a
        # clean removed a DV file it needs after the version was written; it must then exist).
        self.pending: dict[int, bytes | CorruptFileError] = {}
        self.written_upto = -1  # every version up to this one is known to be on storage
        self.known: set[int] = set()  # versions known on storage above that: put at the commit point, or absorbed

    def mark_written(self, seq: int) -> None:
        """The version of completion `seq` is on storage (this process put it at the commit point)."""
        self.known.add(seq)
        self.pending.pop(seq, None)

    def derive(self, record: CompletedInstant, view: DataView) -> None:
        """DataView.apply's `before` hook: remember the version of a record this writer has not seen written (an
        absorbed record's version is another engine's, on storage by definition)."""
        if record.action == ACTION_ABSORB:
            self.known.add(record.seq)
            return
        if record.seq > self.written_upto and record.seq not in self.known:
            try:
                self.pending[record.seq] = version_for(self.shape, record, view, self.body())
            except CorruptFileError as exc:  # a vector's DV file is gone: fine if the version exists (sync checks)
                self.pending[record.seq] = exc

    def sync(
        self,
        io: FileIO,
        latest_seq: int,
        records: Any,
        recheck: Any,
        offset: int = 0,
        first_seq: int = 0,
        in_memory: Callable[[int], CompletedInstant | None] = lambda _seq: None,
    ) -> int:
        """Write every missing version up to `latest_seq` (put-if-absent, compared if present) and refuse a version
        beyond it that no dbidx completion explains (`recheck()` refreshes the completion log and returns its latest
        seq: a dbidx writer may have published and written meanwhile). The first call of a process lists the log;
        later ones write what they derived and look for the one next version only. `records()` gives the whole
        completion log when a missing version was not derived here (a crash, a new process): the log is then folded
        from its first record. Completion s has Delta version s + offset from s = first_seq on (an adopted Delta
        table: DataView.delta_offset); before it, the versions are the adopted table's own. Returns the number of
        versions this call wrote."""
        # 1. What is on storage: listed once per process, then known from what this process wrote.
        if self.written_upto < 0:
            versions, floor = stored_versions(io)
            # Versions up to a Delta checkpoint may have been expired (Delta's log cleanup): they count as present.
            if first_seq == 0 and not (floor > 0 and 0 not in versions):
                self._check_own_origin(io, versions)
            versions |= set(range(floor + 1))
            present = {v - offset for v in versions if v - offset >= first_seq}
            self._check_newest_own(io, present, latest_seq, in_memory, offset)
        else:
            present = set(range(first_seq, self.written_upto + 1)) | self.known
        # 2. Versions above the latest completion are absorbed (or published from their staged record) by the
        #    table's catch-up before and after this call, never refused here.
        # 3. Versions neither on storage nor derived here are derived from the whole log; then all are written.
        wanted = [v for v in range(first_seq, latest_seq + 1) if v not in present or v in self.pending]
        missing = {v for v in wanted if v not in self.pending}
        if missing:
            self._fold_all(records(), missing)
        written = 0
        for v in wanted:
            data = self.pending.get(v)
            if isinstance(data, CorruptFileError):
                # Written by the process that published it, before a clean removed its DV files: a record is only
                # published once its version exists, so a version this process cannot derive must be there.
                if v in present or io.exists(version_file(v + offset)):
                    continue
                raise CorruptFileError(
                    f"Delta version {v + offset} of {io.path(DELTA_LOG_DIR)} is missing and "
                    f"cannot be derived again: {data}"
                ) from data
            if data is not None:
                written += put_version(io, v + offset, data)
        self.pending = {v: d for v, d in self.pending.items() if v > latest_seq}
        self.written_upto = latest_seq
        self.known = {v for v in self.known if v > latest_seq}
        return written

    def _check_own_origin(self, io: FileIO, versions: set[int]) -> None:
        """A table dbidx created starts its Delta log with its own version 0; any other log is a Delta table that
        must be adopted (build-index) before dbidx writes a version into it."""
        if not versions:
            return
        if 0 in versions and io.read_bytes(version_file(0)) == initial_version(
            self.shape.table_id, self.shape.created_at_ms
        ):
            return
        raise ForeignCommitError(
            f"{io.path(DELTA_LOG_DIR)} is the log of a Delta table dbidx has not adopted (its first version is not "
            "this dbidx table's): dbidx refuses to write into it. Adopt the table with `dbidx build-index URI "
            "--key COLUMN` (it indexes the table's current files, deletion vectors honoured)"
        )

    def _check_newest_own(
        self,
        io: FileIO,
        present: set[int],
        latest_seq: int,
        in_memory: Callable[[int], CompletedInstant | None],
        offset: int,
    ) -> None:
        """The newest version a completion has, when this process did not derive it: its commitInfo must name that
        completion's instant. Another engine that took a version in the instant between dbidx's last check and its
        publish left exactly that version foreign; every later writer refuses here. Skipped when the completion is
        only in the timeline's checkpoint (the publisher, which checked its version, wrote that checkpoint after it)
        or its JSON went with a Delta log cleanup."""
        newest = max((v for v in present if 0 < v <= latest_seq and v not in self.pending), default=None)
        mine = None if newest is None else in_memory(newest)
        if mine is None or mine.action == ACTION_ABSORB or not io.exists(version_file(newest + offset)):
            return
        first_line = io.read_bytes(version_file(newest + offset)).split(b"\n", 1)[0]
        try:
            info = json.loads(first_line)["commitInfo"]["dbidx"]
        except (ValueError, KeyError, TypeError):
            info = None
        if not isinstance(info, dict) or info.get("instant") != mine.instant or info.get("seq") != newest:
            raise ForeignCommitError(
                f"Delta version {newest + offset} of {io.path(DELTA_LOG_DIR)} was not written by dbidx (it does not "
                f"name completion {newest}, the one it belongs to): another engine committed to this table. dbidx "
                "refuses to write on top of it; re-index the table with `dbidx build-index` to adopt its current "
                "state"
            )

    def body(self) -> Callable[[DvRef], bytes]:
        """Vector bytes from their DV files (verified), each file read once per derivation."""
        files: dict[str, bytes] = {}
        return lambda ref: load_vector_bytes(self.io, ref, files)

    def _fold_all(self, records: list[CompletedInstant], missing: set[int]) -> None:
        """Derive the missing versions by replaying the whole completion log into a fresh view."""
        if 0 in missing:
            self.pending[0] = initial_version(self.shape.table_id, self.shape.created_at_ms)
        view, body = DataView(), self.body()

        def keep(rec: CompletedInstant, before: DataView) -> None:
            if rec.seq in missing:
                self.pending[rec.seq] = version_for(self.shape, rec, before, body)

        view.apply(records, before=keep)
