"""Table: open or create a dbidx table at a base URI and read its record-level index.

Writes live in `writer.py` (commits), `compaction.py` (compact, clean) and `build_index.py` (migration); this module
holds the table identity and the read paths: snapshot, incremental, lookup and partition stats.
"""
from __future__ import annotations

import os
import threading
import time
import uuid
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from dbidx.data.compaction import DataCompactionResult, compact_data
from dbidx.data.delta_actions import VersionActions, read_version
from dbidx.data.delta_log import (
    DeltaLogWriter,
    TableShape,
    checkpoint_pointer,
    initial_version,
    last_checkpoint_version,
    listed_versions,
    put_version,
    version_file,
    version_for,
)
from dbidx.data.schema import recorded_schema
from dbidx.errors import (
    CorruptFileError,
    FormatUpgradeError,
    HistoryCompactedError,
    InvalidInputError,
    TableExistsError,
    TableNotFoundError,
)
from dbidx.mdt import rli_files
from dbidx.mdt.absorb import absorb_run, collect_run, reread_run, run_in_progress
from dbidx.mdt.compaction import CompactionResult, clean, compact
from dbidx.mdt.point_lookup import lookup
from dbidx.mdt.service_settings import ServiceSettings, read_settings, write_settings
from dbidx.data.delta_checkpoint import write_delta_checkpoint
from dbidx.mdt.delta_properties import retention_of, set_delta_properties
from dbidx.mdt.services import ServicesReport, run_services
from dbidx.mdt.writer import CommitWriter
from dbidx.progress import Progress
from dbidx.runner import WorkRunner
from dbidx.table import layout
from dbidx.table.checkpoint import Checkpoint, archive_before, write_checkpoint
from dbidx.table.commit_lock import CommitLock
from dbidx.table.data_view import DELTA_ADOPTED_EXTRA, DataView, check_adopted
from dbidx.table.file_view import FileView, PartitionStats
from dbidx.table.fileio import FileIO
from dbidx.table.format_switch import finish_upgrade
from dbidx.table.keyhash import HASH_NAME, shard_of
from dbidx.table.leftovers import DEFAULT_TEMP_AGE_S, SweepReport, sweep_leftovers
from dbidx.table.properties import (
    DEFAULT_CHECKPOINT_INTERVAL,
    FORMAT_VERSION,
    INDEX_GLOBAL,
    INDEX_PARTITIONED,
    TableProperties,
    parse_properties,
    properties_json,
)
from dbidx.table.pending import AbandonedReport, PendingAttempt, pending_attempts, roll_back_abandoned
from dbidx.table.records import ACTION_BUILD_INDEX, ACTION_CLEAN, CompletedInstant, FileRecord
from dbidx.table.timeline import Timeline

__all__ = ["Table"]


class Table:
    """A dbidx table: FileIO + properties + timeline; picklable, so Spark tasks can receive it."""

    def __init__(self, io: FileIO, props: TableProperties) -> None:
        self.io = io
        self.props = props
        self.timeline = Timeline(io, props.table_id)
        self.timeline.legacy_upto = self.timeline.first_checkpoint = max(props.upgraded_at_seq - 1, 0)
        if props.upgraded_at_seq:
            self.timeline.first_checkpoint = props.upgraded_at_seq
        self.timeline.after_publish.append(self._after_publish)
        self.timeline.before_start.append(self.sync_delta_log)
        self.timeline.catch_up.append(self.absorb_delta_log)
        self.timeline.commit_point = self._commit_point
        self.timeline.referenced = self._referenced_paths
        self._view = FileView()
        self._data = DataView()
        self._view_lock = threading.RLock()
        self._pins = threading.local()  # per thread: inside `pinned()`, whether the one refresh has been made
        self._delta: DeltaLogWriter | None = None  # set once this process writes: it then derives Delta versions
        self.adopting_delta = False  # a build-index adopting a Delta table: no version is written until it publishes
        # Per thread: inside absorb_delta_log (its publishes run the hooks that would call it again). Another thread
        # waits for the view lock instead, and then finds the versions absorbed.
        self._absorbing = threading.local()

    # ---- identity ----------------------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        uri: str,
        num_shards: int = 4,
        global_index: bool = False,
        row_group_size: int = 8192,
        fs: pafs.FileSystem | None = None,
        storage_options: Mapping[str, Any] | None = None,
        commit_lock: CommitLock | None = None,
        checkpoint_interval: int = DEFAULT_CHECKPOINT_INTERVAL,
    ) -> "Table":
        """Create an empty table (its metadata folder) at `uri`; fails if one exists there.

        checkpoint_interval: every this many completions the publishing writer saves the folded table state, so
        opening the table reads a checkpoint and the records after it instead of the whole log (0: never).

        storage_options: endpoint, region, credentials, allow_http, ... for object stores (delta-rs style names;
        the environment is read for anything not given). commit_lock: for filesystems with neither an exclusive
        create nor a conditional put (see table/commit_lock.py); every writer of the table must use the same one.
        """
        if not isinstance(num_shards, int) or not 1 <= num_shards <= 65536:
            raise InvalidInputError(f"num_shards must be an integer in 1..65536, got {num_shards!r}")
        if not isinstance(row_group_size, int) or row_group_size < 64:
            raise InvalidInputError(f"row_group_size must be an integer >= 64, got {row_group_size!r}")
        if not isinstance(checkpoint_interval, int) or isinstance(checkpoint_interval, bool) or checkpoint_interval < 0:
            raise InvalidInputError(f"checkpoint_interval must be an integer >= 0, got {checkpoint_interval!r}")
        io = FileIO.from_uri(uri, fs, storage_options, commit_lock)
        io.check_not_a_file()
        props = TableProperties(
            table_id=uuid.uuid4().hex, num_shards=num_shards,
            index_mode=INDEX_GLOBAL if global_index else INDEX_PARTITIONED, key_hash=HASH_NAME,
            row_group_size=row_group_size, created_at_ms=int(time.time() * 1000),
            checkpoint_interval=checkpoint_interval,
        )
        if not io.create_exclusive(layout.PROPERTIES_FILE, properties_json(props)):
            raise TableExistsError(f"a dbidx table already exists at {io.path(layout.PROPERTIES_FILE)}")
        io.makedirs(layout.COMPLETED_DIR)
        io.create_exclusive(layout.latest_file(0), b"")
        if not listed_versions(io):  # else a Delta table is there: `build-index` adopts it (data/delta_adopt.py)
            put_version(io, 0, initial_version(props.table_id, props.created_at_ms))
        return cls(io, props)

    @classmethod
    def open(cls, uri: str, fs: pafs.FileSystem | None = None, storage_options: Mapping[str, Any] | None = None,
             commit_lock: CommitLock | None = None) -> "Table":
        """Open an existing table; a missing or unreadable table is a clear error naming the path (storage_options
        and commit_lock as in `create`)."""
        io = FileIO.from_uri(uri, fs, storage_options, commit_lock)
        io.check_not_a_file()
        if not io.exists(layout.PROPERTIES_FILE):
            raise TableNotFoundError(
                f"no dbidx table at {io.root} ({layout.PROPERTIES_FILE} not found): check the URI (the table's "
                "base directory, not one of its partitions), or create one with `dbidx init URI`, `dbidx build-index "
                "URI --key COL` (existing Parquet or Delta data) or Table.create()"
            )
        raw = io.read_bytes(layout.PROPERTIES_FILE)
        props = parse_properties(raw, io.path(layout.PROPERTIES_FILE))
        if props.format_version == 3 and props.key_hash == HASH_NAME:
            raise FormatUpgradeError(f"the table at {io.root} is in format 3 (data merged by key); this dbidx reads "
                                     f"format {FORMAT_VERSION} (a Delta Lake table): upgrade it in place with "
                                     "`dbidx upgrade URI` (stop its writers first)")
        if props.format_version != FORMAT_VERSION or props.key_hash != HASH_NAME:
            raise CorruptFileError(
                f"table at {io.root} uses format {props.format_version} / hash {props.key_hash}; this dbidx reads "
                f"format {FORMAT_VERSION} / hash {HASH_NAME}"
            )
        if props.upgraded_at_seq:
            finish_upgrade(io, props)  # a crash between the flip of table.json and the publish: publish it now
        return cls(io, props)

    @classmethod
    def open_or_create(cls, uri: str, **create_args: Any) -> "Table":
        """Open the table at `uri`, creating it with `create_args` if none exists."""
        try:
            return cls.create(uri, **create_args)
        except TableExistsError:
            return cls.open(uri, fs=create_args.get("fs"), storage_options=create_args.get("storage_options"),
                            commit_lock=create_args.get("commit_lock"))

    def __getstate__(self) -> dict[str, Any]:
        return {"io": self.io, "props": self.props}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["io"], state["props"])  # type: ignore[misc]

    @property
    def uri(self) -> str:
        """The table's URI with its scheme (`s3://bucket/t`; a plain absolute path for a local table): what
        Table.open takes back. `io.root` is the path inside the filesystem."""
        return self.io.uri or self.io.root

    @property
    def location(self) -> str:
        """Where the table lives, as `<filesystem type>://[<endpoint>/]<root>`, local paths with symlinks resolved
        (one table, one location however its path is spelled): with the table id, what caches are keyed by."""
        if self.io.is_local:
            return f"local://{os.path.realpath(self.io._local_root or self.io.root)}"
        endpoint = f"{self.io.endpoint}/" if self.io.endpoint else ""
        return f"{self.io.fs.type_name}://{endpoint}{self.io.root}"

    @property
    def num_shards(self) -> int:
        """Number of key shards (fixed at creation)."""
        return self.props.num_shards

    @property
    def global_index(self) -> bool:
        """True in global index mode."""
        return self.props.global_index

    @property
    def schema(self) -> pa.Schema:
        """Schema of this table's RLI entries."""
        return rli_files.schema_for(self.global_index)

    def shard_of(self, keys: Any) -> np.ndarray:
        """Shard of each key (Spark-compatible hash; see keyhash.py)."""
        return shard_of(keys, self.num_shards)

    # ---- timeline view -----------------------------------------------------------------------------------
    @contextmanager
    def pinned(self, refreshed: bool = False) -> Iterator["Table"]:
        """Inside the block, this thread refreshes the table once: its later `refresh` calls (and every read that
        refreshes first) list nothing and use the view as it is. Not a snapshot: another thread's refresh (a loader
        thread, a second writer in the same worker) still moves the shared view forward in place.

        Why: a task reads the table state through several layers (catch-up, planning, on-demand loads, superseded
        rows), each of which refreshes; on an object store each refresh is two LIST requests. Nothing in a task
        needs a state newer than the one it started from: its rows are tagged against the seq it caught up to,
        and the driver checks every later completion at publish. A check that must see the newest state (has my
        instant settled?) reads the timeline itself. Nested blocks share the outer block's refresh.
        refreshed=True: the caller has just refreshed; the block makes none.
        """
        pins = self._pins
        depth = getattr(pins, "depth", 0)
        if depth == 0:
            pins.fresh = refreshed
        pins.depth = depth + 1
        try:
            yield self
        finally:
            pins.depth = depth

    def unpin_thread(self) -> None:
        """End any `pinned()` block this thread left open (a generator abandoned mid-iteration exits its block only
        when collected): the next refresh lists again."""
        self._pins.depth = 0

    def refresh(self, force: bool = False) -> FileView:
        """Bring the timeline and the index and data views up to date with everything completed so far (from the
        newest checkpoint on the first call, then record by record). Inside `pinned()`, only the first call does,
        unless `force` (a caller that must not act on a state older than what it just met elsewhere)."""
        pins = self._pins
        with self._view_lock:  # also when pinned: another thread's refresh may be half done (timeline read, view not)
            if getattr(pins, "depth", 0) and pins.fresh and not force:
                return self._view
            self._refresh_views()
            if getattr(pins, "depth", 0):
                pins.fresh = True
            return self._view

    def _refresh_views(self) -> None:
        self.timeline.refresh()
        cp = self.timeline.checkpoint
        if cp is not None and self._view.applied_seq < cp.seq:
            self._view, self._data = self._views_of(cp)
            self.timeline.checkpoint = None  # consumed: its dict form is not kept twice
        news = self.timeline.completed(after_seq=self._view.applied_seq)
        for rec in news:
            self._check_files(rec.files, self.io.path(layout.completed_file(rec.seq)))
        self._view.apply(news)
        self._data.apply(news, before=self._delta.derive if self._delta is not None else None)

    def data_view(self) -> DataView:
        """The data files of the current state, with the recorded schema and layout (refreshed first). The object is
        this table's own: another thread's refresh advances it in place (see `held_data_view`)."""
        with self._view_lock:
            self.refresh()
            return self._data

    @contextmanager
    def held_data_view(self) -> Iterator[DataView]:
        """The data view, refreshed, that no other thread's refresh changes while the block runs (a computation
        whose result is stamped with the view's `applied_seq` must see exactly that state)."""
        with self._view_lock:
            self.refresh()
            yield self._data

    def _views_of(self, cp: Checkpoint) -> tuple[FileView, DataView]:
        """Index and data views rebuilt from a checkpoint, checked like records are."""
        view, data = FileView.from_dict(cp.index, cp.where), DataView.from_dict(cp.data, cp.where)
        if view.applied_seq != cp.seq or data.applied_seq != cp.seq:
            raise CorruptFileError(f"{cp.where} holds views at seqs {view.applied_seq} / {data.applied_seq}, not at "
                                   f"its own seq {cp.seq}")
        self._check_files(view.all_files(), cp.where)
        return view, data

    # ---- checkpoints -------------------------------------------------------------------------------------
    def checkpoint(self) -> int | None:
        """Save the folded table state at the latest completion as a checkpoint (FORMAT.md 7a); returns its seq,
        or None if the table is empty or that checkpoint exists already. Writers call this every
        `checkpoint_interval` completions; then older records are bundled into an archive and old checkpoints go."""
        with self._view_lock:
            self.refresh()
            seq = self._view.applied_seq
            if seq == 0:
                return None
            index, data = self._view.to_dict(), self._data.to_dict()
        created = write_checkpoint(self.io, self.props.table_id, seq, self.timeline.max_instant(seq), index, data)
        archive_before(self.io, self.props.table_id, seq)
        return seq if created else None

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
            if self._data.schema is not None and (newest < 0 or self.delta_version() - newest
                                                  >= retention_of(self._data.configuration()).checkpoint_interval):
                write_delta_checkpoint(self.io)

    def sync_delta_log(self) -> int:
        """Bring dbidx up to the Delta log and the log up to dbidx: absorb every version other engines wrote since
        the index's last (mdt/absorb.py), publish records whose writer put their version but died before publishing,
        and write the versions of completions an older dbidx published without one (a crash between its two steps).
        Runs before this process claims an instant and after each publish. Returns the number of versions written."""
        with self._view_lock:
            self._delta_writer()
            self.refresh()
            if self.adopting_delta and self._data.delta_adopted is None:
                return 0
            self.absorb_delta_log()
            return self._delta.sync(self.io, self.timeline.latest_seq, self.timeline.completed, self._refreshed_seq,
                                    self._data.delta_offset, self._data.delta_first_seq, self.timeline.in_memory)

    def _delta_writer(self) -> DeltaLogWriter:
        if self._delta is None:
            # Versions of completions this view folded already are derived again only if they are missing.
            self._delta = DeltaLogWriter(TableShape(self.props.table_id, self.props.created_at_ms or 0,
                                                    self.props.upgraded_at_seq), self.io)
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
                    if seq < self._data.delta_first_seq or not (version <= floor
                                                                or self.io.exists(version_file(version))):
                        return out
                    published = self._next_version_record(version, seq)
                    out += published
                    self.refresh(force=True)
                    stalled = 0 if published or self.timeline.latest_seq >= seq else stalled + 1
                    if stalled >= 3:  # never a silent spin: something keeps the version from getting its record
                        raise CorruptFileError(f"Delta version {version} of {self.uri} gets no completion record "
                                               f"(seq {seq}) after {stalled} attempts; `dbidx verify URI` says why")
            finally:
                self._absorbing.on = False

    def delta_version(self) -> int:
        """The Delta version of the index's latest completion (what Delta readers call the table's version)."""
        view = self.data_view()
        return self.timeline.latest_seq + view.delta_offset

    def follow_delta_log(self) -> None:
        """What every user-facing read does first (read_arrow, read_table, lookup, stats, verify): describe the latest
        Delta version, whoever wrote it. Absorbing writes the index's records of other engines' versions, so a reader
        needs write access to the table once another engine has committed."""
        self.absorb_delta_log()

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
        return actions.dbidx_instant is not None and layout.is_instant(actions.dbidx_instant) \
            and self.io.exists(layout.staged_file(actions.dbidx_instant))

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

    def _check_files(self, files: Iterable[FileRecord], where: str) -> None:
        """What a record (or checkpoint) may only say about this table: shards in range, a partition exactly in
        partitioned mode."""
        for f in files:
            if f.shard >= self.num_shards or (f.partition is None) != self.global_index:
                raise CorruptFileError(
                    f"{where} lists {f.path} for shard "
                    f"{f.shard} / partition {f.partition!r}, impossible in this {self.props.index_mode} table of "
                    f"{self.num_shards} shards")

    def latest(self) -> CompletedInstant | None:
        """The newest completion record (None for an empty table)."""
        self.refresh()
        done = self.timeline.completed(after_seq=self.timeline.latest_seq - 1)
        return done[-1] if done else None

    def seq_at(self, point: int | str | None) -> int:
        """Resolve an instant id or a completion seq (None = latest) to a completion seq."""
        self.refresh()
        if point is None:
            return self.timeline.latest_seq
        if isinstance(point, int):
            if not 0 <= point <= self.timeline.latest_seq:
                raise InvalidInputError(f"completion seq {point} is outside 0..{self.timeline.latest_seq}")
            return point
        return self.timeline.seq_of(layout.validate_instant(point))

    # ---- reads -------------------------------------------------------------------------------------------
    def snapshot(self, partition: str | None, shard: int | None = None, as_of: int | str | None = None) -> pa.Table:
        """Live entries of a partition (or, in global mode with partition None, the whole index) at an instant.

        `as_of` is a completed instant id or a completion seq: the table as it was right after that completion.
        """
        shards = self._shards(shard)
        if partition is not None:
            layout.validate_partition(partition)
        elif not self.global_index:
            raise InvalidInputError("snapshot of a partitioned index needs a partition path")
        # 1. The seq and every shard's file list from one state of the view: another thread's refresh moves the
        #    timeline first and then folds the records in, so a seq read outside the lock can be ahead of the view
        #    (a compaction half folded: replaced files gone, its base not there yet).
        with self._view_lock:
            upto = self.seq_at(as_of)
            listed = [self._view.files(None if self.global_index else partition, s, upto) for s in shards]
        # 2. The files are read without the lock (slow; the view is not needed for them).
        pieces = []
        for files in listed:
            merged = rli_files.resolve_latest([self.read_index_file(f) for f in files], self.schema)
            if self.global_index and partition is not None:
                merged = merged.filter(pc.equal(merged.column(rli_files.PARTITION), partition))
            pieces.append(merged)
        return pa.concat_tables(pieces) if pieces else self.schema.empty_table()

    def incremental(
        self,
        start_exclusive: int | str | None,
        end_inclusive: int | str | None = None,
        partitions: Iterable[str] | None = None,
        shard: int | None = None,
    ) -> pa.Table:
        """Entries (inserts and tombstones) committed in (start, end], in commit order, with `partition` and `seq`.

        What a cache applies to catch up. Raises HistoryCompactedError if cleaning removed a needed file.
        """
        wanted = None if partitions is None else {layout.validate_partition(p) for p in partitions}
        return self.read_incremental(self.incremental_files(start_exclusive, end_inclusive, wanted, shard), wanted)

    def incremental_files(self, start_exclusive: int | str | None, end_inclusive: int | str | None = None,
                          partitions: Iterable[str] | None = None,
                          shard: int | None = None) -> list[tuple[int, FileRecord]]:
        """The (seq, record) of each delta file `incremental` reads, in commit order (a global file holds every
        partition: it is listed whatever `partitions` says)."""
        wanted = None if partitions is None else set(partitions)
        shards = set(self._shards(shard))
        # The seqs and the listing under the view lock: another thread's refresh folds records into the same view
        # in place (a listing beside it fails with "dictionary changed size during iteration"), and a seq read
        # outside the lock can be ahead of the records folded so far (the newest files would be missing).
        with self._view_lock:
            start = self.seq_at(start_exclusive) if start_exclusive is not None else 0
            end = self.seq_at(end_inclusive)
            between = self._view.delta_files_between(start, end)
        return [(seq, record) for seq, record in between
                if record.shard in shards
                and (wanted is None or record.partition is None or record.partition in wanted)]

    def read_incremental(self, files: list[tuple[int, FileRecord]],
                         partitions: Iterable[str] | None = None) -> pa.Table:
        """Read listed delta files (verified) into one table with `partition` and `seq`, a global file's rows cut to
        `partitions`. Needs no refresh: a reader thread can run it beside its caller (cache catch-up does)."""
        wanted = None if partitions is None else sorted(set(partitions))
        pieces = []
        for seq, record in files:
            table = self.read_index_file(record)
            if record.partition is not None:
                table = table.add_column(1, rli_files.PARTITION, pa.repeat(pa.scalar(record.partition, pa.string()),
                                                                          table.num_rows))
            elif wanted is not None:
                table = table.filter(pc.is_in(table.column(rli_files.PARTITION), pa.array(wanted, pa.string())))
            pieces.append(table.append_column("seq", pa.array(np.full(table.num_rows, seq, dtype=np.int64))))
        if not pieces:
            return rli_files.GLOBAL_SCHEMA.append(pa.field("seq", pa.int64())).empty_table()
        return pa.concat_tables(pieces)

    def incremental_plan(
        self, start_exclusive: int, end_inclusive: int, shard: int | None = None
    ) -> dict[str | None, tuple[int, bool]]:
        """Per partition (None in global mode): (entries committed in (start, end], whether cleaning removed
        some of that history). Lets a cache decide, per partition and before reading, to catch up or reload."""
        shards = set(self._shards(shard))
        plan: dict[str | None, tuple[int, bool]] = {}
        with self._view_lock:  # the view as one refresh left it (see incremental_files); no file is read here
            self.refresh()
            stale = self.history_before(start_exclusive)
            for _seq, record in self._view.delta_files_between(start_exclusive, end_inclusive, strict=False):
                if record.shard in shards:
                    rows, cleaned = plan.get(record.partition, (0, False))
                    plan[record.partition] = (rows + record.rows,
                                              cleaned or stale or self._view.is_cleaned(record.path))
        return plan

    def history_before(self, seq: int) -> bool:
        """True if history after `seq` is incomplete in this reader (as of its last refresh): it opened from a
        checkpoint that left out files replaced and cleaned after seq. Every partition behind it must reload
        (incremental_plan says so for the partitions it lists; a caller asks this for the others). The floor only
        comes from the checkpoint a reader starts from, so no refresh is needed to answer."""
        with self._view_lock:  # the first refresh may swap in the view a checkpoint holds
            return seq < self._view.history_floor

    def lookup(
        self,
        keys: Sequence[str] | pa.Array,
        partition: str | None = None,
        mode: str = "auto",
        seek_threshold: float = rli_files.DEFAULT_SEEK_THRESHOLD,
        plan: dict[str, int] | None = None,
    ) -> pa.Table:
        """Live entries for the given keys (absent keys are simply not in the result): mdt/point_lookup.py.

        Partitioned mode needs the partition; global mode searches the whole index. `mode` is "seek" (read only
        the row groups whose key range contains a lookup key), "scan" (read whole files) or "auto" (seek unless
        more than `seek_threshold` of a file's row groups are touched). `plan`, if given, counts files per method.
        """
        return lookup(self, keys, partition, mode, seek_threshold, plan)

    def new_commit(self, tags: Mapping[str, str] | None = None) -> CommitWriter:
        """Start a new instant that adds index entries; use as a context manager or call commit()/rollback().
        `tags`: what else identifies this writer in its claim (shown if it is left unfinished)."""
        return CommitWriter(self, tags=tags)

    def pending_attempts(self) -> list[PendingAttempt]:
        """Unfinished instants (crashed or running writers) with their writer, age, files and what to run."""
        return pending_attempts(self.io, self.timeline)

    def roll_back_abandoned(self) -> AbandonedReport:
        """Roll back the unfinished attempts whose writers are gone (heartbeat expired, or pid gone on this host):
        what every upsert runs before it starts. Live ones are left alone; a failure is a warning, never an error."""
        return roll_back_abandoned(self.timeline, pending_attempts(self.io, self.timeline, with_files=False))

    def rollback_pending(self, force: bool = False) -> tuple[list[str], list[str]]:
        """Roll back every unfinished instant whose writer is not provably alive (all of them with force=True);
        returns (rolled back, skipped as alive). What `dbidx rollback --all-pending` runs."""
        attempts = self.pending_attempts()
        alive = [a.instant for a in attempts if a.alive and not force]
        targets = [a.instant for a in attempts if a.instant not in alive]
        return [self.rollback(t, also_dead=targets).rolled_back for t in targets], alive

    def rollback(self, instant: str, also_dead: Iterable[str] = ()) -> CompletedInstant:
        """Roll back an unfinished instant (e.g. of a crashed writer) and delete its files. `also_dead`: other
        pending instants the caller knows are dead (e.g. all of them, when no writer runs), which then do not count
        as active writers on a filesystem without an exclusive create."""
        return self.timeline.rollback(instant, ignore=also_dead)

    def compact(self, partitions: Iterable[str] | None = None, min_files: int = 2,
                progress: Progress | None = None, runner: WorkRunner | None = None,
                base_share: float | None = None) -> CompactionResult:
        """Merge each (partition, shard) with at least `min_files` index files into one base without tombstones,
        as one compaction instant; concurrent commits are not in conflict with it (see mdt.compaction). `runner`:
        where the merges run (dbidx.runner; default here; `spark_integration.service_jobs` as a Spark job).
        base_share: size-tiered, the base is rewritten only once the files after it hold this share of its entries,
        before that a group's newest files are merged into one merged file (None: always into a new base)."""
        result = compact(self, partitions, min_files=min_files, progress=progress, runner=runner,
                         base_share=base_share)
        self._sweep_after("index compaction")
        return result

    def compact_data(self, partitions: Iterable[str] | None = None, min_files: int = 2,
                     deleted_share: float | None = 0.2, target_file_bytes: int | None = 64 << 20,
                     progress: Progress | None = None, runner: WorkRunner | None = None,
                     base_share: float | None = None) -> DataCompactionResult:
        """Rewrite, per file group, its small data files (under `target_file_bytes`) when there are at least
        `min_files` of them, and every file with at least `deleted_share` of its rows deleted, into one base of their
        live rows, as one data compaction instant that concurrent upserts do not conflict with (see
        data.compaction). `runner`: where the rewrites run (as for `compact`). base_share: a group's largest small
        file stays while the rest hold less than this share of its bytes (None: one file per group results)."""
        result = compact_data(self, partitions, min_files=min_files, deleted_share=deleted_share,
                              target_file_bytes=target_file_bytes, progress=progress, runner=runner,
                              base_share=base_share)
        self._sweep_after("data compaction")
        return result

    def clean(self, retain_completions: int = 10, delete_migrated: bool = False) -> CompletedInstant | None:
        """Delete index and data files that compactions replaced at least `retain_completions` completions ago
        (the user's source files build-index listed only with delete_migrated=True); returns the clean's record,
        or None when nothing was old enough. Caches behind it reload (`dbidx cache sync`)."""
        record = clean(self, retain_completions=retain_completions, delete_migrated=delete_migrated)
        self._sweep_after("clean")
        return record

    def delta_properties(self) -> dict[str, str]:
        """The Delta table properties in force (metaData.configuration; other engines' changes absorbed first)."""
        self.follow_delta_log()
        return self.data_view().configuration()

    def set_delta_properties(self, changes: Mapping[str, str | None]) -> CompletedInstant | None:
        """Set (None: remove) Delta table properties, e.g. {"delta.logRetentionDuration": "interval 7 days"}, as one
        completion every engine sees (mdt/delta_properties.py says which keys); None if nothing changed."""
        return set_delta_properties(self, changes)

    def vacuum(self, retention_hours: int = 168, dry_run: bool = False) -> Any:
        """Delete files no Delta version references any more that were removed (or, never referenced, written)
        longer than `retention_hours` ago: Delta's VACUUM, checked against dbidx's own view (mdt/vacuum.py)."""
        from dbidx.mdt.vacuum import vacuum

        return vacuum(self, retention_hours=retention_hours, dry_run=dry_run)

    def service_settings(self) -> ServiceSettings:
        """What the table services do by themselves (`.dbidx/services.json`; defaults when never set)."""
        return read_settings(self.io)

    def configure_services(self, **changes: Any) -> ServiceSettings:
        """Change table service settings by key (mdt.service_settings.KEYS; None resets a key to its default),
        checked before anything is written (ConfigError); returns the settings now in force."""
        return write_settings(self.io, changes)

    def maintain(self, budget_seconds: float | None = None, budget_files: int | None = None,
                 progress: Progress | None = None, runner: WorkRunner | None = None) -> ServicesReport:
        """Run the table services the table needs now (data compaction, index compaction, clean, log cleanup,
        vacuum), within the budget (the settings' unless given); what the budget leaves is in the report, for the
        next run. `runner`: where the compactions' pieces run (`spark_integration.maintain` passes Spark's)."""
        return run_services(self, self.service_settings(), budget_seconds, budget_files, progress, runner)

    def sweep_leftovers(self, min_age_s: float = DEFAULT_TEMP_AGE_S, all_cleans: bool = False) -> SweepReport:
        """Delete what dead writers left (table/leftovers.py): the unfinished instants of writers that are gone
        (rolled back, as every upsert does first), settled instants' timeline files, markers and unlisted files,
        what a clean killed after publishing had still to delete, and `.tmp-*` files older than min_age_s. Clean
        and both compactions run it; so does `dbidx repair`, with all_cleans=True (every clean record's files still
        on storage, also of cleans that died before their claim told the sweep)."""
        return sweep_leftovers(self.io, self.timeline, min_age_s, all_cleans=all_cleans)

    def _referenced_paths(self) -> set[str]:
        """Every path the current view names (index, data and DV files not cleaned): what no sweep may delete."""
        with self._view_lock:
            return self.refresh(force=True).referenced_paths() | self.data_view().referenced_paths()

    def _sweep_after(self, what: str) -> None:
        """The sweep after a maintenance instant: that instant is done, so a failing sweep is a warning."""
        try:
            self.sweep_leftovers()
        except Exception as exc:  # noqa: BLE001 - the maintenance instant completed; the sweep runs again next time
            warnings.warn(f"{what} of {self.uri} completed, but sweeping leftovers failed: {exc}", RuntimeWarning,
                          stacklevel=3)


    def data_schema(self) -> pa.Schema | None:
        """The data columns the table's writes recorded (data/schema.py); None before the first write."""
        return recorded_schema(self.data_view().schema)

    def partitions(self) -> list[PartitionStats]:
        """Every partition with its last commit instant and time, live key count and file-group fills (as of the
        latest Delta version: other engines' versions are absorbed first)."""
        self.follow_delta_log()
        with self._view_lock:  # folded by another thread's refresh in place; partition_stats returns copies
            return self.refresh().partition_stats()

    def read_index_file(self, record: FileRecord, read: Callable[[], Any] | None = None) -> Any:
        """Read one index file (verified); a file that a clean removed since this reader planned the read is
        HistoryCompactedError (reload from a newer snapshot), any other missing or damaged file CorruptFileError."""
        try:
            return read() if read is not None else rli_files.read_rli_file(self.io, record)
        except CorruptFileError as exc:
            if not self.io.exists(record.path) and self._cleaned_now(record.path):
                raise HistoryCompactedError(f"index file {record.path} was removed by a clean while it was being "
                                            "read; read a newer snapshot (caches reload the partition)") from exc
            raise

    def _cleaned_now(self, path: str) -> bool:
        """Whether a clean has deleted `path`, as of a refresh made now (and read from that refresh's view)."""
        with self._view_lock:
            return self.refresh(force=True).is_cleaned(path)

    def _shards(self, shard: int | None) -> list[int]:
        if shard is None:
            return list(range(self.num_shards))
        if not isinstance(shard, (int, np.integer)) or not 0 <= shard < self.num_shards:
            raise InvalidInputError(f"shard {shard!r} is out of range 0..{self.num_shards - 1} for {self.uri}")
        return [int(shard)]
