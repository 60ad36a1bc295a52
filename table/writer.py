"""CommitWriter: one instant that adds index entries (inserts, deletes, moves) and publishes them atomically.

Entries come from two places. The library API (`insert`, `delete`, `move`) collects them in an `EntryBuffer` and
writes one sorted delta file per (partition, shard) at commit. An upsert's Spark tasks write their groups' delta
files themselves (each task owns its shard's groups) with the same `EntryBuffer`, and the driver registers the
files they report with `add_written`; its memory then never holds a key.

Steps of `commit()`: write the buffered groups -> check every commit that completed since the keys were tagged for
a key this instant touched (index/conflicts.py) -> publish the completion record. Any failure rolls the instant back,
so nothing half-written is ever visible.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyroaring import BitMap

from dbidx.arrays import one_chunk
from dbidx.data.superseded import vectors_for_commit
from dbidx.errors import CommitError, DuplicateKeyError, InstantStateError, InvalidKeyError
from dbidx.index import rli_files
from dbidx.index.conflicts import GroupKey, TouchedKeys, check_conflicts, touched_in_memory
from dbidx.storage import layout, markers
from dbidx.storage.data_view import LAYOUT_EXTRA, DataView
from dbidx.storage.fileio import FileIO
from dbidx.storage.keys import normalize_keys
from dbidx.storage.records import (
    ACTION_ABSORB,
    ACTION_COMMIT,
    CompletedInstant,
    DataFileRecord,
    DeletionVectorRecord,
    DvFileRecord,
    FileRecord,
    PartitionChange,
)
from dbidx.storage.instant_life import InstantLife
from dbidx.storage.state import TableState

Keys = Sequence[str] | pa.Array | pa.ChunkedArray


def as_key_array(keys: Keys, what: str = "key") -> pa.Array:
    """Validate record keys (storage/keys.py: strings, not null, not empty, not a bare string) as one Arrow array."""
    return normalize_keys(keys, what)


def _as_values(values: Keys | str, n: int, what: str) -> pa.Array:
    """A per-row string column from a scalar or a sequence of n values."""
    if isinstance(values, str):
        return pa.repeat(pa.scalar(values, pa.string()), n)
    array = as_key_array(values, what)
    if len(array) != n:
        raise InvalidKeyError(f"got {len(array)} {what}s for {n} keys")
    return array


class EntryBuffer:
    """Index entries of one instant grouped by (partition, shard), with the partition stats they change.

    Pure Arrow until `write`: used by the library writer on the committing process and by upsert tasks on executors.
    """

    def __init__(self, table: TableState, instant: str) -> None:
        self.table = table
        self.instant = instant
        self._groups: dict[GroupKey, list[pa.Table]] = defaultdict(list)
        self._changes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._live: dict[str, int] = defaultdict(int)

    def insert(self, partition: str, keys: Keys, file_groups: Keys | str) -> None:
        """New keys of a partition with their file group."""
        self.add(partition, keys, file_groups, deleted=False, live=+1)

    def add(
        self,
        partition: str,
        keys: Keys,
        file_groups: Keys | str,
        deleted: bool,
        live: int,
        shards: np.ndarray | None = None,
    ) -> None:
        """Entries (inserts or tombstones) of one partition; `live` is +1 / -1 per entry for the stats. `shards`:
        each key's shard when the caller computed it already (a task's keys are hashed once, not once per group)."""
        layout.validate_partition(partition)
        array = as_key_array(keys)
        if len(array) == 0:
            return
        fgs = _as_values(file_groups, len(array), "file group")
        self.count(partition, fgs, live)
        columns: dict[str, pa.Array] = {rli_files.KEY: array}
        # The constant columns from one scalar each (a Python list of n equal strings costs ~0.25 s per 5 M keys).
        if self.table.global_index:
            columns[rli_files.PARTITION] = pa.repeat(pa.scalar(partition, pa.string()), len(array))
        columns[rli_files.FILE_GROUP] = fgs
        columns[rli_files.INSTANT] = pa.repeat(pa.scalar(self.instant, pa.string()), len(array))
        columns[rli_files.DELETED] = pa.array(np.full(len(array), deleted))
        entries = pa.Table.from_pydict(columns, schema=self.table.schema)
        if shards is None:
            shards = self.table.shard_of(array)
        elif len(shards) != len(array):
            raise ValueError(f"{len(shards)} shards given for {len(array)} keys of partition {partition!r}")
        group_partition = None if self.table.global_index else partition
        distinct = np.unique(shards)
        if len(distinct) == 1:  # one shard (an upsert task's rows): the entries as they are, no copy
            self._groups[(group_partition, int(distinct[0]))].append(entries)
            return
        for s in distinct:
            self._groups[(group_partition, int(s))].append(entries.filter(pa.array(shards == s)))

    def count(self, partition: str, file_groups: pa.Array, sign: int) -> None:
        """Account entries (or a global-mode move's old location) in the partition stats."""
        self._live[partition] += sign * len(file_groups)
        counts = pc.value_counts(file_groups)
        for fg, n in zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist()):
            self._changes[partition][fg] += sign * n

    def changes(self) -> dict[str, PartitionChange]:
        """Per-partition live and fill deltas of the buffered entries."""
        return {
            p: PartitionChange(live=self._live[p], fills={fg: n for fg, n in sorted(fills.items()) if n})
            for p, fills in sorted(self._changes.items())
        }

    def sorted_groups(self) -> dict[GroupKey, pa.Table]:
        """One key-sorted table per group; a key may appear only once per instant and group."""
        return dict(self._each_sorted(release=False))

    def write_each(
        self,
        io: FileIO,
        attempt: int | None = None,
        announce: bool = False,
        on_written: Callable[[FileRecord, pa.Table], None] | None = None,
    ) -> list[FileRecord]:
        """Sort, check and write one group at a time, letting go of its buffered entries before the next: what an
        upsert task does, so a bulk task holds one sorted group beside its buffer, not a second copy of it all.
        on_written(record, sorted entries) runs after each file is written, before its entries are let go.
        announce: every group's file is announced first, by one list marker (a task's files; storage/markers.py)."""
        if announce:
            markers.announce_all(
                io,
                self.instant,
                [layout.delta_file(partition, shard, self.instant, attempt) for partition, shard in self._groups],
            )
        files = []
        for group, entries in self._each_sorted(release=True):
            written = self.write(io, {group: entries}, attempt=attempt)
            if on_written is not None:
                for record in written:
                    on_written(record, entries)
            files += written
        return files

    def _each_sorted(self, release: bool) -> Iterator[tuple[GroupKey, pa.Table]]:
        """(group, its entries key-sorted and checked for repeats), groups in (partition, shard) order; `release`
        drops each group's buffered parts as it is yielded."""
        for group in sorted(self._groups, key=lambda g: ("" if g[0] is None else g[0], g[1])):
            parts = self._groups.pop(group) if release else self._groups[group]
            entries = rli_files.sort_entries(pa.concat_tables(parts))
            _reject_repeated_keys(entries, group[0], group[1], self.instant)
            yield group, entries

    def write(self, io: FileIO, groups: dict[GroupKey, pa.Table], attempt: int | None = None) -> list[FileRecord]:
        """Write one delta file per group (a task's are announced first, by `write_each`)."""
        files = []
        for (partition, shard), entries in groups.items():
            rel = layout.delta_file(partition, shard, self.instant, attempt)
            files.append(
                rli_files.write_rli_file(io, rel, entries, self.table.props.row_group_size, partition, shard, "delta")
            )
        return files


class CommitWriter(InstantLife):
    """Collects the index entries of one instant and commits or rolls them back as a unit."""

    def __init__(self, table: TableState, action: str = ACTION_COMMIT, tags: Mapping[str, str] | None = None) -> None:
        super().__init__(table.timeline, action, tags=tags)  # the instant's life: storage/instant_life.py
        self.table = table
        self.buffer = EntryBuffer(table, self.started.instant)
        self._written: list[FileRecord] = []
        self._data_files: list[DataFileRecord] = []
        self._written_changes: dict[str, PartitionChange] = {}
        self._touched: dict[GroupKey, TouchedKeys] = {}
        self._fresh: list[tuple[int, dict[str, BitMap]]] = []  # tasks' superseded rows: (view seq, positions)
        self.adopted_vectors: tuple[tuple[DvFileRecord, ...], tuple[DeletionVectorRecord, ...]] | None = None
        self.extra: dict[str, Any] = {}
        # Extra fields known only as the record is built (each time it is: a lost race builds it again), merged over
        # `extra`: what the caller computes beside the publish (the upsert's Spark report).
        self.late_extra: Callable[[], dict[str, Any]] | None = None
        # More publish checks over the completions that landed meanwhile (e.g. the data schema an upsert relies on);
        # each raises ConflictError to publish nothing.
        self.checks: list[Callable[[list[CompletedInstant]], None]] = []

    def __enter__(self) -> "CommitWriter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Commit when the block ends normally (`finish` deletes what the instant wrote and did not list, for a
        caller whose tasks announced files); on an error, the instant's end (`InstantLife.fail`)."""
        if exc is not None:
            self.fail(exc)
        elif not (self.ended or self.published):
            self.commit()

    # ---- collecting entries --------------------------------------------------------------------------------
    def insert(self, partition: str, keys: Keys, file_groups: Keys | str) -> None:
        """Add new keys of a partition with their file group.

        The keys must not be live in the partition (not checked here: the upsert path knows it from its lookups, a
        migration from an empty table). The partition stats and every shard cache's counters count each insert as
        one more key at its file group; a key inserted again would be counted twice (its lookups stay right).
        """
        self._check_open()
        self.buffer.add(partition, keys, file_groups, deleted=False, live=+1)

    def delete(self, partition: str, keys: Keys, file_groups: Keys | str | None = None) -> int:
        """Tombstone existing keys of a partition. Returns the count.

        Without `file_groups` each key's location is looked up and keys without a live entry are skipped. With them,
        the caller states where each key lives (the upsert path, from its lookups): they are written as given, and
        the stats and the caches' counters take one key off each named file group.
        """
        self._check_open()
        array = as_key_array(keys)
        if file_groups is None:
            # Resolve locations so tombstones only hit live keys and the fill counts stay exact.
            found = self.table.lookup(array, partition)
            array, file_groups = found.column(rli_files.KEY), found.column(rli_files.FILE_GROUP)
        self.buffer.add(partition, array, file_groups, deleted=True, live=-1)
        return len(array)

    def move(
        self,
        keys: Keys,
        from_partition: str,
        from_file_groups: Keys | str,
        to_partition: str,
        to_file_groups: Keys | str,
    ) -> None:
        """Move existing keys to another partition (global mode: one new entry; partitioned: tombstone + insert).
        As for `insert` and `delete`: the keys live at `from_file_groups` and are not live in `to_partition`."""
        self._check_open()
        array = as_key_array(keys)
        if not self.table.global_index:
            self.buffer.add(from_partition, array, from_file_groups, deleted=True, live=-1)
            self.buffer.add(to_partition, array, to_file_groups, deleted=False, live=+1)
            return
        old = _as_values(from_file_groups, len(array), "file group")
        self.buffer.count(layout.validate_partition(from_partition), old, -1)
        self.buffer.add(to_partition, array, to_file_groups, deleted=False, live=+1)

    def add_written(
        self,
        files: Iterable[FileRecord],
        data_files: Iterable[DataFileRecord],
        changes: dict[str, PartitionChange],
        touched: Iterable[TouchedKeys],
    ) -> None:
        """Register index and data files other processes wrote for this instant (an upsert's tasks), with the
        partition stats they change and the keys they touched; all are published with the instant."""
        self._check_open()
        self._written += list(files)
        self._data_files += list(data_files)
        self._written_changes = merge_changes(self._written_changes, changes)
        for t in touched:
            group = (t.partition, t.shard)
            if group in self._touched:
                raise CommitError(
                    f"instant {self.instant}: two task results touched index group {group}; each "
                    "group must be written by exactly one task"
                )
            self._touched[group] = t

    def add_superseded(self, basis_seq: int, fresh: dict[str, BitMap]) -> None:
        """Rows a task found its data files supersede (data/superseded.superseded_rows), against the table as of
        `basis_seq`; used at publish when nothing committed since changed the groups involved."""
        self._check_open()
        self._fresh.append((basis_seq, fresh))

    def touched(self) -> list[TouchedKeys]:
        """The touched-key records registered with add_written."""
        return list(self._touched.values())

    def _check_open(self) -> None:
        if self.ended or self.published:
            raise InstantStateError(f"instant {self.instant} is already finished")

    # ---- finishing -----------------------------------------------------------------------------------------
    def commit(self) -> CompletedInstant:
        """Write the delta files and publish the instant; on any error the instant is rolled back (unless it was
        published: InstantLife.fail) and the error re-raised."""
        self._check_open()
        try:
            return self._commit()
        except BaseException as exc:
            self.fail(exc)
            raise

    def _commit(self) -> CompletedInstant:
        table, io = self.table, self.table.io
        # 1. The buffered entries: one sorted delta per group, declared (inflight) before they are written.
        groups = self.buffer.sorted_groups()
        _reject_repeated_groups(list(groups) + [(f.partition, f.shard) for f in self._written], self.instant)
        paths = [layout.delta_file(g[0], g[1], self.instant) for g in groups]
        self.declare(paths)
        files = self.buffer.write(io, groups) + self._written
        changes = merge_changes(self.buffer.changes(), self._written_changes)
        touched = dict(self._touched)
        touched.update(
            touched_in_memory(
                {g: one_chunk(t.column(rli_files.KEY)) for g, t in groups.items()}, self.started.start_seq
            )
        )

        def build(seq: int) -> CompletedInstant:
            dv_files, vectors = self._deletion_vectors()
            return self.completion(
                seq,
                table.props.table_id,
                files=tuple(files),
                data_files=tuple(self._data_files),
                dv_files=dv_files,
                deletion_vectors=vectors,
                partitions=changes,
                extra={**self.extra, **(self.late_extra() if self.late_extra is not None else {})},
            )

        # 2. Conflict check against everything completed meanwhile, then the atomic publish.
        def check(news: list[CompletedInstant]) -> None:
            view = table.refresh()
            check_conflicts(io, self.instant, news, touched, cleaned=view.is_cleaned)
            for extra_check in self.checks:
                extra_check(news)

        return self.publish(build, check)

    def _deletion_vectors(self) -> tuple[tuple[DvFileRecord, ...], tuple[DeletionVectorRecord, ...]]:
        """The rows this commit's data files supersede or delete, as deletion vectors against the table exactly as
        it stands right before the seq being published (data/superseded.py). A build-index adds the first data of
        an empty table: nothing to supersede."""
        if self.adopted_vectors is not None:  # a build-index adopting a Delta table: the table's existing vectors
            return self.adopted_vectors
        if not self._data_files or self.started.action != ACTION_COMMIT:
            return (), ()
        view = self.table.data_view()
        layout_value = self.extra.get(LAYOUT_EXTRA) or (view.layout.value if view.layout is not None else None)
        key = layout_value.get("key") if isinstance(layout_value, dict) else None
        if not isinstance(key, str):
            raise CommitError(f"instant {self.instant} adds data files but names no key column; nothing published")
        return vectors_for_commit(self.table.io, view, self._data_files, key, self.instant, self._tasks_fresh(view))

    def _tasks_fresh(self, view: DataView) -> dict[str, BitMap] | None:
        """The tasks' superseded rows, united, if they still hold for `view`: every data file reported by some task
        and no completion since the oldest task's view added files to, or changed a vector in, a group this commit
        writes. Otherwise None: the publisher computes them against `view` itself."""
        if not self._fresh:
            return None
        basis = min(seq for seq, _f in self._fresh)
        groups = {(f.partition, f.file_group) for f in self._data_files}
        for rec in self.table.timeline.completed(after_seq=basis, upto_seq=view.applied_seq):
            changed = {(f.partition, f.file_group) for f in rec.data_files}
            if rec.action == ACTION_ABSORB and rec.replaced:  # another engine removed files (groups not looked up)
                changed.add(None)
            for dv in rec.deletion_vectors:
                live = view.get(dv.path)
                changed.add((live.record.partition, live.record.file_group) if live is not None else None)
            if changed & groups or (None in changed):
                return None
        # Only rows of this commit's files or of live files in its groups: anything else in a task result is wrong.
        allowed = {f.path for f in self._data_files} | {
            f.record.path for f in view.live() if (f.record.partition, f.record.file_group) in groups
        }
        stray = sorted({p for _seq, fresh in self._fresh for p in fresh} - allowed)
        if stray:
            raise CommitError(
                f"instant {self.instant}: a task reported superseded rows of {stray[0]!r}, which is "
                "neither a file of this commit nor a live file of its file groups; nothing published"
            )
        united: dict[str, BitMap] = {}
        for _seq, fresh in self._fresh:
            for path, positions in fresh.items():
                united[path] = united[path] | positions if path in united else positions
        return united


def merge_changes(a: dict[str, PartitionChange], b: dict[str, PartitionChange]) -> dict[str, PartitionChange]:
    """Per-partition stats changes summed (fill deltas per file group; zero entries dropped)."""
    out = dict(a)
    for partition, change in b.items():
        old = out.get(partition, PartitionChange())
        fills = dict(old.fills)
        for fg, n in change.fills.items():
            fills[fg] = fills.get(fg, 0) + n
        out[partition] = PartitionChange(old.live + change.live, {fg: n for fg, n in sorted(fills.items()) if n})
    return dict(sorted(out.items()))


def _reject_repeated_groups(groups: list[GroupKey], instant: str) -> None:
    """At most one delta per group and instant (buffered here or written by a task): two would make the merge
    order inside the instant ambiguous. Checked before anything is written."""
    seen: set[GroupKey] = set()
    for partition, shard in groups:
        if (partition, shard) in seen:
            raise CommitError(
                f"instant {instant} has two index files for partition {partition!r}, shard "
                f"{shard}: every group is written by exactly one task"
            )
        seen.add((partition, shard))


def _reject_repeated_keys(entries: pa.Table, partition: str | None, shard: int, instant: str) -> None:
    """A key may have one entry per instant and group: two would make its location ambiguous. Also checks the
    entries are in key order (an RLI file's lookups depend on it): strictly ascending keys are both at once."""
    keys = one_chunk(entries.column(rli_files.KEY))
    if len(keys) < 2:
        return
    ascending = pc.less(keys[:-1], keys[1:])
    if pc.all(ascending).as_py():
        return
    same = pc.equal(keys[1:], keys[:-1])
    where = "the global index" if partition is None else f"partition {partition!r}"
    if pc.any(same).as_py():
        key = keys[pc.index(same, True).as_py()].as_py()
        raise DuplicateKeyError(f"key {key!r} appears more than once in instant {instant} for {where}")
    first = pc.index(ascending, False).as_py()
    raise CommitError(
        f"instant {instant}: the index entries for {where}, shard {shard}, are not in key order "
        f"({keys[first].as_py()!r} before {keys[first + 1].as_py()!r}); nothing was written"
    )
