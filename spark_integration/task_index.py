"""The index side of an upsert task: its shard's delta files, its touched keys and its partition stats.

One task serves one key shard, so it owns every index group (partition, shard) its rows fall in: it writes those
groups' sorted delta files itself (through the MDT's EntryBuffer) and reports only their records. The driver then
holds per task a few hundred bytes per file, never a key. Every key the task tagged is also kept, per group, for the
publish-time conflict check (mdt/conflicts.py): the delta file serves when every tagged key of the group has an
entry (an initial load), else a small `touched-*.parquet` file holds them.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbidx.cache.codec import GLOBAL_SEPARATOR
from dbidx.cache.record_cache import GLOBAL_PARTITION, RecordIndexCache
from dbidx.cache.staging import stage
from dbidx.mdt import layout, markers
from dbidx.mdt.conflicts import TouchedKeys, write_touched
from dbidx.mdt.records import FileRecord, PartitionChange
from dbidx.mdt.table import Table
from dbidx.mdt.writer import EntryBuffer
from dbidx.spark_integration.tagger import (
    TAG_FILE_GROUP, TAG_IS_DELETE, TAG_IS_UPDATE, TAG_OLD_FILE_GROUP, TAG_OLD_PARTITION, TAG_PARTITION, TagOptions,
)


def write_task_index(table: Table, tagged: pa.Table, options: TagOptions, instant: str, attempt: int,
                     since_seq: dict[int, int], shard: int | None = None) -> tuple[list[FileRecord],
                                                                                  list[TouchedKeys],
                                                                                  dict[str, PartitionChange]]:
    """Write the delta and touched-keys files of a task's tagged rows; returns their records and the stats change.

    `since_seq[shard]` is the completion seq the shard's rows were tagged against (its cache's watermark).
    `shard`: the one shard every row belongs to, when the caller checked that already (keys are hashed once).
    """
    if tagged.num_rows == 0:
        return [], [], {}
    keys = options.keys_of(tagged)
    shards = table.shard_of(keys) if shard is None else np.full(len(keys), shard, dtype=np.int32)
    buffer = EntryBuffer(table, instant)
    _buffer_entries(buffer, tagged, keys, shards)
    files = buffer.write_each(table.io, attempt=attempt, announce=True)
    by_group = {(f.partition, f.shard): f for f in files}
    # Touched keys per group: every tagged key (updates and deletes of missing keys included).
    touched = []
    # Group codes: one integer per row (its partition in partitioned mode), compared in numpy per group.
    if table.global_index:
        names, codes = [None], np.zeros(len(keys), dtype=np.int64)
    else:
        encoded = pc.dictionary_encode(tagged.column(TAG_PARTITION).combine_chunks())
        names, codes = encoded.dictionary.to_pylist(), encoded.indices.to_numpy(zero_copy_only=False)
    for shard in np.unique(shards).tolist():
        in_shard = shards == shard
        for code in np.unique(codes[in_shard]).tolist():
            partition = names[code]
            mask = in_shard & (codes == code)
            delta = by_group.get((partition, shard))
            # Rows are one per record after latest_per_key, so a group's keys are distinct: when the delta has as
            # many entries as the group has rows, its keys are exactly the touched ones (no touched file needed).
            if delta is not None and delta.rows == int(mask.sum()):
                touched.append(TouchedKeys(partition, shard, delta.min_key or "", delta.max_key or "",
                                           since_seq[shard], delta.path, delta.size, delta.checksum))
                continue
            group_keys = pc.unique(keys.filter(pa.array(mask))).sort()
            rel = layout.touched_file(partition, shard, instant, attempt)
            markers.announce(table.io, instant, rel)
            touched.append(write_touched(table.io, rel, group_keys, partition, shard, since_seq[shard]))
    return files, touched, buffer.changes()


def _buffer_entries(buffer: EntryBuffer, tagged: pa.Table, keys: pa.Array, shards: np.ndarray) -> None:
    """Index entries of a tagged batch: inserts of new keys, tombstones of deleted ones, moves (global mode).

    Updates in place add no entry: a key's location is immutable.
    """
    is_update = tagged.column(TAG_IS_UPDATE).to_numpy()
    is_delete = tagged.column(TAG_IS_DELETE).to_numpy()
    part = tagged.column(TAG_PARTITION).combine_chunks()
    old_part = tagged.column(TAG_OLD_PARTITION).combine_chunks()
    fg = tagged.column(TAG_FILE_GROUP).combine_chunks()
    old_fg = tagged.column(TAG_OLD_FILE_GROUP).combine_chunks()
    moved = is_update & ~is_delete & pc.fill_null(pc.not_equal(part, old_part), False).to_numpy(zero_copy_only=False)
    kinds: list[tuple[np.ndarray, bool, int]] = [(~is_update & ~is_delete, False, +1),
                                                 (is_update & is_delete, True, -1), (moved, False, +1)]
    for rows, deleted, live in kinds:
        if not rows.any():
            continue
        positions = np.flatnonzero(rows)
        if len(positions) == len(rows):  # every row (a bulk load's inserts): no copies
            sub_keys, sub_part, sub_fg, sub_shards = keys, part, fg, shards
        else:
            idx = pa.array(positions)
            sub_keys, sub_part, sub_fg, sub_shards = keys.take(idx), part.take(idx), fg.take(idx), shards[positions]
        if rows is moved:  # the old location loses the key in the stats (the new entry replaces it in the index)
            sub_old_part, sub_old_fg = old_part.take(pa.array(positions)), old_fg.take(pa.array(positions))
            for p in pc.unique(sub_old_part).to_pylist():
                buffer.count(p, sub_old_fg.filter(pc.equal(sub_old_part, p)), -1)
        for p in pc.unique(sub_part).to_pylist():
            mask = pc.equal(sub_part, p)
            buffer.add(p, sub_keys.filter(mask), sub_fg.filter(mask), deleted=deleted, live=live,
                       shards=sub_shards[mask.to_numpy(zero_copy_only=False)])


def stage_bulk_entries(table: Table, tagged: pa.Table, options: TagOptions, instant: str, attempt: int,
                       index_files: list[FileRecord], shard: int) -> int:
    """A bulk load's task stages its shard's new entries beside the shard's cache, one SST per delta file it
    wrote (cache/staging.py: the next catch-up installs them once the completion lists those files), so the first
    batch after the load finds its partitions warm instead of loading them from the index. Returns the entries
    staged.

    Only inserts exist on the bulk path (delete rows delete nothing and add no entry), so a delta file holds exactly
    the group's non-delete rows; a group whose count differs is not staged (nothing is ever staged on a guess).
    """
    live = tagged.filter(pc.invert(pc.fill_null(tagged.column(TAG_IS_DELETE), False)))
    if live.num_rows == 0 or not index_files:
        return 0
    keys = options.keys_of(live)
    part = live.column(TAG_PARTITION).combine_chunks()
    fg = live.column(TAG_FILE_GROUP).combine_chunks()
    groups = []
    for record in index_files:
        if record.shard != shard:
            continue
        if table.global_index:
            group_keys = keys
            locations = pc.binary_join_element_wise(part, fg, GLOBAL_SEPARATOR)
            partition = GLOBAL_PARTITION
        else:
            mask = pc.equal(part, pa.scalar(record.partition, pa.string()))
            group_keys, locations, partition = keys.filter(mask), fg.filter(mask), record.partition
        if len(group_keys) != record.rows:
            continue
        groups.append((record, partition, group_keys, locations))
    if not groups:
        return 0
    cache_path = RecordIndexCache.for_table(table, shard, options.cache).path
    stage(cache_path, instant, attempt, groups, options.cache)
    return sum(r.rows for r, _, _, _ in groups)


def written_paths(data_files: list[Any], index_files: list[FileRecord], touched: list[TouchedKeys]) -> list[str]:
    """Every file a task attempt wrote (what it withdraws if its instant settled without it)."""
    return [f.path for f in data_files] + [f.path for f in index_files] + [t.path for t in touched if t.path]
