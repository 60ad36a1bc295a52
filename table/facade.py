"""Table: open or create a dbidx table at a base URI and read its record-level index.

Writes live in `writer.py` (commits), index/compaction.py and data/compaction.py (compact, clean) and
`build_index.py` (migration); this module holds the table identity, its views, checkpoints and partition stats. Its
index reads (snapshot, incremental, lookup) are the `IndexReads` mixin (`index_reads.py`), its side of the Delta log
the `DeltaLogSync` mixin (`delta_sync.py`), its maintenance entry points (rollback, compactions, clean, properties,
vacuum, services, sweep) the `TableMaintenance` mixin (`maintenance.py`).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from dbidx.data.delta_derive import initial_version
from dbidx.data.delta_log import (
    DeltaLogWriter,
    listed_versions,
    put_version,
)
from dbidx.data.column_mapping import column_names_of
from dbidx.data.schema import recorded_schema
from dbidx.errors import (
    CorruptFileError,
    FormatUpgradeError,
    HistoryCompactedError,
    InvalidInputError,
    TableExistsError,
    TableNotFoundError,
)
from dbidx.index import rli_files
from dbidx.table.delta_sync import DeltaLogSync
from dbidx.table.index_reads import IndexReads
from dbidx.table.maintenance import TableMaintenance
from dbidx.table.writer import CommitWriter
from dbidx.storage import layout
from dbidx.storage.checkpoint import Checkpoint, archive_before, write_checkpoint
from dbidx.storage.commit_lock import CommitLock
from dbidx.storage.data_view import DataView
from dbidx.storage.index_view import IndexView, PartitionStats
from dbidx.storage.instant_life import InstantLife
from dbidx.storage.fileio import FileIO
from dbidx.storage.format_switch import finish_upgrade
from dbidx.storage.keyhash import HASH_NAME, shard_of
from dbidx.storage.properties import (
    DEFAULT_CHECKPOINT_INTERVAL,
    FORMAT_VERSION,
    INDEX_GLOBAL,
    INDEX_PARTITIONED,
    TableProperties,
    parse_properties,
    properties_json,
)
from dbidx.storage.records import CompletedInstant, FileRecord
from dbidx.storage.timeline import Timeline

__all__ = ["Table"]


class Table(IndexReads, DeltaLogSync, TableMaintenance):
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
        self._view = IndexView()
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
        create nor a conditional put (see storage/commit_lock.py); every writer of the table must use the same one.
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
            table_id=uuid.uuid4().hex,
            num_shards=num_shards,
            index_mode=INDEX_GLOBAL if global_index else INDEX_PARTITIONED,
            key_hash=HASH_NAME,
            row_group_size=row_group_size,
            created_at_ms=int(time.time() * 1000),
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
    def open(
        cls,
        uri: str,
        fs: pafs.FileSystem | None = None,
        storage_options: Mapping[str, Any] | None = None,
        commit_lock: CommitLock | None = None,
    ) -> "Table":
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
            raise FormatUpgradeError(
                f"the table at {io.root} is in format 3 (data merged by key); this dbidx reads "
                f"format {FORMAT_VERSION} (a Delta Lake table): upgrade it in place with "
                "`dbidx upgrade URI` (stop its writers first)"
            )
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
            return cls.open(
                uri,
                fs=create_args.get("fs"),
                storage_options=create_args.get("storage_options"),
                commit_lock=create_args.get("commit_lock"),
            )

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

    def refresh(self, force: bool = False) -> IndexView:
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
        # How the data files name the columns (column mapping); during an adoption, as the adopted log says.
        mapped = column_names_of(self._data)
        self.io.column_names = mapped if mapped is not None or not self.adopting_delta else self.io.column_names

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

    def _views_of(self, cp: Checkpoint) -> tuple[IndexView, DataView]:
        """Index and data views rebuilt from a checkpoint, checked like records are."""
        view, data = IndexView.from_dict(cp.index, cp.where), DataView.from_dict(cp.data, cp.where)
        if view.applied_seq != cp.seq or data.applied_seq != cp.seq:
            raise CorruptFileError(
                f"{cp.where} holds views at seqs {view.applied_seq} / {data.applied_seq}, not at its own seq {cp.seq}"
            )
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

    def _check_files(self, files: Iterable[FileRecord], where: str) -> None:
        """What a record (or checkpoint) may only say about this table: shards in range, a partition exactly in
        partitioned mode."""
        for f in files:
            if f.shard >= self.num_shards or (f.partition is None) != self.global_index:
                raise CorruptFileError(
                    f"{where} lists {f.path} for shard "
                    f"{f.shard} / partition {f.partition!r}, impossible in this {self.props.index_mode} table of "
                    f"{self.num_shards} shards"
                )

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

    # ---- reads: table/index_reads.py (IndexReads) ---------------------------------------------------------

    def new_commit(self, tags: Mapping[str, str] | None = None) -> CommitWriter:
        """Start a new instant that adds index entries; use as a context manager or call commit()/rollback().
        `tags`: what else identifies this writer in its claim (shown if it is left unfinished)."""
        return CommitWriter(self, tags=tags)

    def instant(self, action: str, tags: Mapping[str, str] | None = None) -> InstantLife:
        """Claim an instant of `action` and own its life (storage/instant_life.py): `with table.instant(action) as
        life: life.declare(files); ...; life.publish(build, check)`. A failure before the publish rolls it back with
        the files it declared; one after it never does; the files its record does not list are deleted at its end."""
        return InstantLife(self.timeline, action, tags=tags)

    # ---- maintenance: table/maintenance.py (TableMaintenance) -------------------------------------------

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
                raise HistoryCompactedError(
                    f"index file {record.path} was removed by a clean while it was being "
                    "read; read a newer snapshot (caches reload the partition)"
                ) from exc
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
