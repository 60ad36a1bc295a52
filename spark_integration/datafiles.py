"""Data files of an upsert: one Parquet file per (partition, file group, task attempt), each announced by a marker.

A task announces every file before writing it (storage/markers.py); the commit lists the files of the winning attempts
only, with their size and checksum, and everything else a marker names is deleted after the commit (or all of it
after a rollback). Readers only read files a completed commit lists, and verify their bytes first, so an orphan or
a damaged file is never read as table data.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbidx.arrays import one_chunk
from dbidx.cache.base_dir import prepare_dir
from dbidx.cache.record_cache import RecordIndexCache
from dbidx.config import CacheConfig
from dbidx.data.key_files import KEY_FILES_DIR, KeyFiles
from dbidx.data.files import DELETED_COLUMN, INSTANT_COLUMN, data_file_path, write_data_file
from dbidx.errors import ConfigError, DbidxError
from dbidx.spark_integration.grouping import runs
from dbidx.storage import markers
from dbidx.storage.fileio import FileIO
from dbidx.storage.leftovers import settled_files
from dbidx.storage.records import DataFileRecord

log = logging.getLogger(__name__)


def write_groups(
    io: FileIO,
    rows: pa.Table,
    deleted: pa.Array,
    partitions: pa.Array,
    file_groups: pa.Array,
    instant: str,
    attempt: int,
    key: str | None = None,
    written_rows: list[tuple[DataFileRecord, pa.Array, np.ndarray]] | None = None,
) -> list[DataFileRecord]:
    """Split rows (the user's columns) by (partition, file group) and write one file per group, each with its
    instant and deleted columns appended; rows with no file group are skipped.

    Memory: groups are found by integer codes (no per-row string is built) and each file's instant column is
    made for that file alone, so a bulk task's peak stays near its input (a 5 M-row task holds ~5 M rows).
    written_rows: if given, gets each file's record, keys (as strings) and delete flags (for its deletion vectors).
    """
    written: list[DataFileRecord] = []
    if rows.num_rows == 0:
        return written
    # 1. One int64 code per row: partition code x file-group count + file-group code (nulls: no group).
    parts = pc.dictionary_encode(partitions)
    groups = pc.dictionary_encode(file_groups)
    part_names, group_names = parts.dictionary.to_pylist(), groups.dictionary.to_pylist()
    codes = parts.indices.to_numpy(zero_copy_only=False).astype(np.int64) * (len(group_names) + 1)
    codes += pc.fill_null(groups.indices, len(group_names)).to_numpy(zero_copy_only=False)
    # 2. Every file about to be written announced by one list marker (one write, not one per file), then the rows
    #    of one group together, in arrival order within it.
    width = len(group_names) + 1
    targets = [
        (part_names[code // width], group_names[code % width], positions)
        for code, positions in runs(codes)
        if code % width != len(group_names)
    ]
    paths = [data_file_path(part, group, instant, attempt) for part, group, _ in targets]
    markers.announce_all(io, instant, paths)
    for rel, (partition, file_group, positions) in zip(paths, targets):
        take = pa.array(positions)
        group = rows.take(take)
        # The instant column from one scalar (a Python list of the same string was 1.2 s per 5 M rows).
        group = group.append_column(INSTANT_COLUMN, pa.repeat(pa.scalar(instant, pa.string()), len(positions)))
        group = group.append_column(DELETED_COLUMN, deleted.take(take))
        written.append(write_data_file(io, rel, group, partition, file_group, key))
        if written_rows is not None and key is not None:
            written_rows.append(
                (
                    written[-1],
                    one_chunk(pc.cast(group.column(key), pa.string())),
                    pc.fill_null(group.column(DELETED_COLUMN), False).to_numpy(zero_copy_only=False),
                )
            )
    return written


def withdraw_if_settled(io: FileIO, timeline: Any, instant: str, written: Iterable[str]) -> bool:
    """Run by a task after writing: if the instant already completed or was rolled back (this attempt lost a race
    or outlived its job), delete this attempt's unpublished files and markers. True if it did so.

    Together with the driver's cleanup this leaves no orphan whatever the timing: either the task's marker existed
    when the driver listed markers (after settling), or the task sees the settled instant here.
    """
    timeline.refresh()
    listed = settled_files(timeline.record_of(instant))
    if listed is None:
        return False
    markers.withdraw(io, instant, written, listed)
    return True


def key_files_for(table: Any, shard: int, config: CacheConfig) -> KeyFiles | None:
    """The executor's key files of a table's data files (data/key_files.py), in a private directory beside its shard
    caches; None when key.files.mb is 0, or with a warning when the directory is not usable (never needed)."""
    if not config.key_files_mb:
        return None
    root = RecordIndexCache.for_table(table, shard, config).path.parent / KEY_FILES_DIR
    try:
        if root.is_symlink():  # the sweep and the saver never follow one: refused here, not silently half-used
            raise ConfigError(f"{root} is a symbolic link; key files are only kept in a real directory")
        prepare_dir(root)  # private (0700) like the caches, ours alone, writable, not full
    except (OSError, DbidxError) as exc:
        log.warning("dbidx keeps no key files for %s this task: %s", table.uri, exc)
        return None
    return KeyFiles.shared(root, config.key_files_mb << 20)
