"""CommitWriter: one instant that adds index entries (inserts, deletes, moves) and publishes them atomically.

Steps of `commit()`: group entries per (partition, shard) -> record the planned files (inflight) -> write one sorted
delta file per group -> check every commit that completed since this instant started for overlapping keys
(optimistic concurrency on keys, not files) -> publish the completion record. Any failure rolls the instant back,
so nothing half-written is ever visible.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbidx.errors import ConflictError, DuplicateKeyError, InstantStateError, InvalidKeyError
from dbidx.mdt import layout, rli_files
from dbidx.mdt.table import Table
from dbidx.mdt.timeline import (
    ACTION_BUILD_INDEX,
    ACTION_COMMIT,
    CompletedInstant,
    FileRecord,
    PartitionChange,
    StartedInstant,
)

Keys = Sequence[str] | pa.Array | pa.ChunkedArray
GroupKey = tuple[str | None, int]


def as_key_array(keys: Keys, what: str = "key") -> pa.Array:
    """Validate record keys (strings, not null, not empty) and return them as one Arrow string array."""
    array = keys if isinstance(keys, (pa.Array, pa.ChunkedArray)) else pa.array(list(keys), pa.string())
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if not pa.types.is_string(array.type):
        array = array.cast(pa.string()) if pa.types.is_large_string(array.type) else array
    if not pa.types.is_string(array.type):
        raise InvalidKeyError(f"{what}s must be strings, got Arrow type {array.type}")
    if array.null_count:
        raise InvalidKeyError(f"{what} at position {pc.index(pc.is_null(array), True).as_py()} is null")
    empty = pc.equal(pc.utf8_length(array), 0)
    if pc.any(empty).as_py():
        raise InvalidKeyError(f"{what} at position {pc.index(empty, True).as_py()} is empty")
    return array


def _as_values(values: Keys | str, n: int, what: str) -> pa.Array:
    """A per-row string column from a scalar or a sequence of n values."""
    if isinstance(values, str):
        return pa.array([values] * n, pa.string())
    array = as_key_array(values, what)
    if len(array) != n:
        raise InvalidKeyError(f"got {len(array)} {what}s for {n} keys")
    return array


class CommitWriter:
    """Collects the index entries of one instant and commits or rolls them back as a unit."""

    def __init__(self, table: Table, action: str = ACTION_COMMIT) -> None:
        self.table = table
        self.started: StartedInstant = table.timeline.start(action)
        self._groups: dict[GroupKey, list[pa.Table]] = defaultdict(list)
        self._changes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._live: dict[str, int] = defaultdict(int)
        self._done = False
        self.extra: dict[str, Any] = {}

    @property
    def instant(self) -> str:
        """This writer's instant id."""
        return self.started.instant

    def __enter__(self) -> "CommitWriter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._done:
            return
        if exc_type is None:
            self.commit()
        else:
            self.rollback()

    # ---- collecting entries --------------------------------------------------------------------------------
    def insert(self, partition: str, keys: Keys, file_groups: Keys | str) -> None:
        """Add new keys of a partition with their file group (keys must not exist in the index yet)."""
        self._add(partition, keys, file_groups, deleted=False, live=+1)

    def delete(self, partition: str, keys: Keys, file_groups: Keys | str | None = None) -> int:
        """Tombstone existing keys of a partition; keys without a live entry are skipped. Returns the count."""
        array = as_key_array(keys)
        if file_groups is None:
            # Resolve locations so tombstones only hit live keys and the fill counts stay exact.
            found = self.table.lookup(array, partition)
            array, file_groups = found.column(rli_files.KEY), found.column(rli_files.FILE_GROUP)
        self._add(partition, array, file_groups, deleted=True, live=-1)
        return len(array)

    def move(self, keys: Keys, from_partition: str, from_file_groups: Keys | str, to_partition: str,
             to_file_groups: Keys | str) -> None:
        """Move existing keys to another partition (global mode: one new entry; partitioned: tombstone + insert)."""
        array = as_key_array(keys)
        if not self.table.global_index:
            self._add(from_partition, array, from_file_groups, deleted=True, live=-1)
            self._add(to_partition, array, to_file_groups, deleted=False, live=+1)
            return
        old = _as_values(from_file_groups, len(array), "file group")
        self._count(layout.validate_partition(from_partition), old, -1)
        self._add(to_partition, array, to_file_groups, deleted=False, live=+1)

    def _add(self, partition: str, keys: Keys, file_groups: Keys | str, deleted: bool, live: int) -> None:
        if self._done:
            raise InstantStateError(f"instant {self.instant} is already finished")
        layout.validate_partition(partition)
        array = as_key_array(keys)
        if len(array) == 0:
            return
        fgs = _as_values(file_groups, len(array), "file group")
        self._count(partition, fgs, live)
        columns: dict[str, pa.Array] = {rli_files.KEY: array}
        if self.table.global_index:
            columns[rli_files.PARTITION] = pa.array([partition] * len(array), pa.string())
        columns[rli_files.FILE_GROUP] = fgs
        columns[rli_files.INSTANT] = pa.array([self.instant] * len(array), pa.string())
        columns[rli_files.DELETED] = pa.array(np.full(len(array), deleted))
        entries = pa.Table.from_pydict(columns, schema=self.table.schema)
        shards = self.table.shard_of(array)
        group_partition = None if self.table.global_index else partition
        for s in np.unique(shards):
            self._groups[(group_partition, int(s))].append(entries.filter(pa.array(shards == s)))

    def _count(self, partition: str, file_groups: pa.Array, sign: int) -> None:
        self._live[partition] += sign * len(file_groups)
        counts = pc.value_counts(file_groups)
        for fg, n in zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist()):
            self._changes[partition][fg] += sign * n

    # ---- finishing -----------------------------------------------------------------------------------------
    def commit(self) -> CompletedInstant:
        """Write the delta files and publish the instant; on any error the instant is rolled back and re-raised."""
        if self._done:
            raise InstantStateError(f"instant {self.instant} is already finished")
        try:
            record = self._commit()
        except BaseException:
            self.rollback()
            raise
        self._done = True
        return record

    def _commit(self) -> CompletedInstant:
        table, io = self.table, self.table.io
        # 1. One sorted table per (partition, shard); a key may appear only once per instant and group.
        groups = {g: rli_files.sort_entries(pa.concat_tables(parts)) for g, parts in sorted(
            self._groups.items(), key=lambda item: ("" if item[0][0] is None else item[0][0], item[0][1]))}
        for (partition, shard), entries in groups.items():
            _reject_repeated_keys(entries, partition, shard, self.instant)
        paths = {g: layout.delta_file(g[0], g[1], self.instant) for g in groups}
        # 2. Declare the files before writing them: a crash from here on leaves a rollback plan.
        table.timeline.mark_inflight(self.started, paths.values())
        files = []
        for g, entries in groups.items():
            written = rli_files.write_rli_file(io, paths[g], entries, table.props.row_group_size)
            files.append(FileRecord(path=paths[g], partition=g[0], shard=g[1], kind="delta", rows=written.rows,
                                    inserts=written.inserts, tombstones=written.tombstones,
                                    min_key=written.min_key, max_key=written.max_key, size=written.size))
        changes = {
            p: PartitionChange(live=self._live[p], fills={fg: n for fg, n in sorted(fills.items()) if n})
            for p, fills in sorted(self._changes.items())
        }

        def build(seq: int) -> CompletedInstant:
            return CompletedInstant(seq=seq, instant=self.instant, action=self.started.action,
                                    completed_at_ms=int(time.time() * 1000), start_seq=self.started.start_seq,
                                    files=tuple(files), partitions=changes, extra=dict(self.extra))

        # 3. Conflict check against everything completed meanwhile, then the atomic publish.
        return table.timeline.publish(self.started, build, lambda news: self._check_conflicts(news, groups))

    def _check_conflicts(self, news: list[CompletedInstant], groups: dict[GroupKey, pa.Table]) -> None:
        """Fail if a commit that completed after this instant started wrote any of the same keys in the same group."""
        for rec in news:
            if rec.action not in (ACTION_COMMIT, ACTION_BUILD_INDEX):
                continue
            for f in rec.files:
                mine = groups.get((f.partition, f.shard))
                if mine is None or f.min_key is None:
                    continue
                keys = mine.column(rli_files.KEY)
                if keys[-1].as_py() < f.min_key or keys[0].as_py() > f.max_key:
                    continue
                theirs = rli_files.read_rli_file(self.table.io, f, columns=[rli_files.KEY]).column(rli_files.KEY)
                clash = keys.filter(pc.is_in(keys, value_set=theirs))
                if len(clash):
                    where = "the global index" if f.partition is None else f"partition {f.partition!r}"
                    sample = ", ".join(repr(k) for k in clash.slice(0, 5).to_pylist())
                    raise ConflictError(
                        f"instant {self.instant} conflicts with instant {rec.instant} (completed at seq {rec.seq} "
                        f"while this one ran): both wrote {len(clash)} key(s) in {where}, shard {f.shard}, e.g. "
                        f"{sample}. Nothing was published; re-tag the batch against the new index and retry."
                    )

    def rollback(self) -> None:
        """Abort the instant and delete whatever it wrote (idempotent)."""
        if self._done:
            return
        self._done = True
        self.table.timeline.rollback(self.instant)


def _reject_repeated_keys(entries: pa.Table, partition: str | None, shard: int, instant: str) -> None:
    """A key may have one entry per instant and group: two would make its location ambiguous."""
    keys = entries.column(rli_files.KEY).combine_chunks()
    if len(keys) < 2:
        return
    same = pc.equal(keys[1:], keys[:-1])
    if pc.any(same).as_py():
        key = keys[pc.index(same, True).as_py()].as_py()
        where = "the global index" if partition is None else f"partition {partition!r}"
        raise DuplicateKeyError(f"key {key!r} appears more than once in instant {instant} for {where}")
