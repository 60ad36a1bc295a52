"""The index side of an upsert task: its shard's delta files, its touched keys and its partition stats.

One task serves one key shard, so it owns every index group (partition, shard) its rows fall in: it writes those
groups' sorted delta files itself (through the index's EntryBuffer) and reports only their records. The driver then
holds per task a few hundred bytes per file, never a key. Every key the task tagged is also kept, per group, for the
publish-time conflict check (index/conflicts.py): the delta file serves when every tagged key of the group has an
entry (an initial load), else a small `touched-*.parquet` file holds them.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbidx.arrays import one_chunk
from dbidx.cache.loading import cache_entries
from dbidx.cache.record_cache import GLOBAL_PARTITION
from dbidx.cache.staging import StagedLoad
from dbidx.index.conflicts import TouchedKeys, write_touched_groups
from dbidx.table.facade import Table
from dbidx.table.writer import EntryBuffer
from dbidx.spark_integration.grouping import runs
from dbidx.spark_integration.tagger import (
    TAG_FILE_GROUP,
    TAG_IS_DELETE,
    TAG_IS_UPDATE,
    TAG_OLD_FILE_GROUP,
    TAG_OLD_PARTITION,
    TAG_PARTITION,
    TagOptions,
)
from dbidx.storage import layout, markers
from dbidx.storage.records import FileRecord, PartitionChange


def write_task_index(
    table: Table,
    tagged: pa.Table,
    options: TagOptions,
    instant: str,
    attempt: int,
    since_seq: dict[int, int],
    shard: int | None = None,
    on_written: Callable[[FileRecord, pa.Table], None] | None = None,
) -> tuple[list[FileRecord], list[TouchedKeys], dict[str, PartitionChange]]:
    """Write the delta and touched-keys files of a task's tagged rows; returns their records and the stats change.

    `since_seq[shard]` is the completion seq the shard's rows were tagged against (its cache's watermark).
    `shard`: the one shard every row belongs to, when the caller checked that already (keys are hashed once).
    `on_written(record, sorted entries)`: run after each delta file is written (a bulk load stages its entries).
    """
    if tagged.num_rows == 0:
        return [], [], {}
    keys = options.keys_of(tagged)
    shards = table.shard_of(keys) if shard is None else np.full(len(keys), shard, dtype=np.int32)
    buffer = EntryBuffer(table, instant)
    # Group codes: one integer per row (its partition in partitioned mode), compared in numpy per group.
    names: list[str | None]
    if table.global_index:  # one group per shard gathers every partition's entries: buffered whole, then written
        names, codes = [None], np.zeros(len(keys), dtype=np.int64)
        _buffer_entries(buffer, tagged, keys, shards)
        files = buffer.write_each(table.io, attempt=attempt, announce=True, on_written=on_written)
    else:
        encoded = pc.dictionary_encode(one_chunk(tagged.column(TAG_PARTITION)))
        names, codes = encoded.dictionary.to_pylist(), encoded.indices.to_numpy(zero_copy_only=False)
        files = _write_per_partition(table, buffer, tagged, keys, shards, (names, codes), attempt, on_written)
    by_group = {(f.partition, f.shard): f for f in files}
    # Touched keys per group: every tagged key (updates and deletes of missing keys included). The rows of each
    # (shard, partition) group are found by one sort of a combined integer code, not a pass over every row per group.
    touched = []
    unlisted: dict[int, list[tuple[str | None, pa.Array]]] = {}  # per shard: groups whose touched keys are not
    # exactly their delta's
    for group, positions in runs(shards.astype(np.int64) * len(names) + codes):
        shard, partition = group // len(names), names[group % len(names)]
        delta = by_group.get((partition, shard))
        # Rows are one per record after latest_per_key, so a group's keys are distinct: when the delta has as many
        # entries as the group has rows, its keys are exactly the touched ones (no touched file needed).
        if delta is not None and delta.rows == len(positions):
            touched.append(
                TouchedKeys(
                    partition,
                    shard,
                    delta.min_key or "",
                    delta.max_key or "",
                    since_seq[shard],
                    delta.path,
                    delta.size,
                    delta.checksum,
                )
            )
            continue
        unlisted.setdefault(shard, []).append((partition, pc.unique(keys.take(pa.array(positions))).sort()))
    # The other groups' keys: one file per shard (one write and one marker, not one per partition).
    for shard, groups in unlisted.items():
        rel = layout.touched_file(shard, instant, attempt)
        markers.announce(table.io, instant, rel)
        touched += write_touched_groups(table.io, rel, groups, shard, since_seq[shard])
    return files, touched, buffer.changes()


def _write_per_partition(
    table: Table,
    buffer: EntryBuffer,
    tagged: pa.Table,
    keys: pa.Array,
    shards: np.ndarray,
    partitions: tuple[list[Any], np.ndarray],
    attempt: int,
    on_written: Callable[[FileRecord, pa.Table], None] | None,
) -> list[FileRecord]:
    """A partitioned table's delta files, one partition at a time: its entries built, written (and staged) and let
    go before the next partition's are built. Every file is announced first, by one list marker.

    Why: buffering every group before writing held a second copy of the task's keys and file groups (a 5 M-row
    load: ~0.5 GB more at once), and fresh memory is much of what a bulk task's time goes to. `partitions`: the
    partition names and each row's code among them.
    """
    kinds = _entry_kinds(tagged)
    entry_rows = np.flatnonzero(kinds[0][0] | kinds[1][0] | kinds[2][0])
    names, codes = partitions
    file_groups = one_chunk(tagged.column(TAG_FILE_GROUP))
    # 0. A bad partition name refused before any marker or file (as when every add ran first; a bad file group, which
    #    the tagger never makes, fails its partition's add after earlier files were written, and the rollback removes
    #    them). Moves (none in a partitioned table: a key's partition is part of its identity) leave the stats.
    for code in np.unique(codes[entry_rows]).tolist():
        layout.validate_partition(names[code])
    _count_moves_out(buffer, tagged, kinds[2][0])
    # 1. Each partition's entry rows (arrival order) and the shards among them; every group's file announced by one
    #    list marker before any is written.
    rows_of = {code: entry_rows[at] for code, at in runs(codes[entry_rows])}
    order = sorted(rows_of, key=names.__getitem__)  # (partition, shard) order, as write_each orders its groups
    markers.announce_all(
        table.io,
        buffer.instant,
        [
            layout.delta_file(names[code], int(s), buffer.instant, attempt)
            for code in order
            for s in np.unique(shards[rows_of[code]]).tolist()
        ],
    )
    # 2. Partition by partition: its entries, then its files.
    files: list[FileRecord] = []
    for code in order:
        rows = rows_of.pop(code)
        for mask, deleted, live in kinds:
            positions = rows[mask[rows]]
            if len(positions):
                take = pa.array(positions)
                buffer.add(
                    names[code],
                    keys.take(take),
                    file_groups.take(take),
                    deleted=deleted,
                    live=live,
                    shards=shards[positions],
                )
        files += buffer.write_each(table.io, attempt=attempt, announce=False, on_written=on_written)
    return files


def _entry_kinds(tagged: pa.Table) -> list[tuple[np.ndarray, bool, int]]:
    """Per row, whether it makes an entry of each kind: (insert rows, False, +1), (tombstone rows, True, -1), (move
    rows, False, +1). Updates in place add no entry: a key's location is immutable."""
    is_update = tagged.column(TAG_IS_UPDATE).to_numpy()
    is_delete = tagged.column(TAG_IS_DELETE).to_numpy()
    part = one_chunk(tagged.column(TAG_PARTITION))
    old_part = one_chunk(tagged.column(TAG_OLD_PARTITION))
    moved = is_update & ~is_delete & pc.fill_null(pc.not_equal(part, old_part), False).to_numpy(zero_copy_only=False)
    return [(~is_update & ~is_delete, False, +1), (is_update & is_delete, True, -1), (moved, False, +1)]


def _count_moves_out(buffer: EntryBuffer, tagged: pa.Table, moved: np.ndarray) -> None:
    """Moved keys leave their old location in the stats (their new entry replaces them in the index)."""
    if not moved.any():
        return
    idx = pa.array(np.flatnonzero(moved))
    old_part = one_chunk(tagged.column(TAG_OLD_PARTITION)).take(idx)
    old_fg = one_chunk(tagged.column(TAG_OLD_FILE_GROUP)).take(idx)
    for p in pc.unique(old_part).to_pylist():
        buffer.count(p, old_fg.filter(pc.equal(old_part, p)), -1)


def _buffer_entries(buffer: EntryBuffer, tagged: pa.Table, keys: pa.Array, shards: np.ndarray) -> None:
    """Index entries of a tagged batch: inserts of new keys, tombstones of deleted ones, moves (global mode).

    Updates in place add no entry: a key's location is immutable.
    """
    part = one_chunk(tagged.column(TAG_PARTITION))
    fg = one_chunk(tagged.column(TAG_FILE_GROUP))
    kinds = _entry_kinds(tagged)
    _count_moves_out(buffer, tagged, kinds[2][0])
    for rows, deleted, live in kinds:
        if not rows.any():
            continue
        positions = np.flatnonzero(rows)
        if len(positions) == len(rows):  # every row (a bulk load's inserts): no copies
            sub_keys, sub_part, sub_fg, sub_shards = keys, part, fg, shards
        else:
            idx = pa.array(positions)
            sub_keys, sub_part, sub_fg, sub_shards = keys.take(idx), part.take(idx), fg.take(idx), shards[positions]
        # One group of rows per partition, found by one sort of integer codes (not one comparison pass per
        # partition), in arrival order within it.
        encoded = pc.dictionary_encode(sub_part)
        names = encoded.dictionary.to_pylist()
        for code, positions in runs(encoded.indices.to_numpy(zero_copy_only=False)):
            take = pa.array(positions)
            buffer.add(
                names[code],
                sub_keys.take(take),
                sub_fg.take(take),
                deleted=deleted,
                live=live,
                shards=sub_shards[positions],
            )


def stage_each_delta(load: StagedLoad, global_index: bool) -> Callable[[FileRecord, pa.Table], None]:
    """The `write_each` callback of a bulk load's task: each delta file's entries, already sorted for the file,
    staged as the shard cache's own SST beside the cache (cache/staging.py: the next catch-up installs them once the
    completion lists that file), so the first batch after the load finds its partitions warm. Built right after
    each file is written, so no second copy of the task's keys is held.

    Only inserts are staged (a bulk load adds no other entry; a delta holding a tombstone is left to the index).
    """

    def stage_group(record: FileRecord, entries: pa.Table) -> None:
        if record.tombstones:
            return
        keys, locations = cache_entries(entries, global_index)
        load.add(record, GLOBAL_PARTITION if global_index else record.partition, keys, locations)

    return stage_group


def written_paths(data_files: list[Any], index_files: list[FileRecord], touched: list[TouchedKeys]) -> list[str]:
    """Every file a task attempt wrote (what it withdraws if its instant settled without it)."""
    return [f.path for f in data_files] + [f.path for f in index_files] + [t.path for t in touched if t.path]
