"""Data files of an upsert: one Parquet file per (partition, file group, task attempt), each announced by a marker.

A task announces every file before writing it (mdt/markers.py); the commit lists the files of the winning attempts
only, with their size and checksum, and everything else a marker names is deleted after the commit (or all of it
after a rollback). Readers only read files a completed commit lists, and verify their bytes first, so an orphan or
a damaged file is never read as table data.
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbidx.mdt import markers
from dbidx.mdt.fileio import FileIO
from dbidx.mdt.markers import MARKERS_DIR, announced_files, discard_unlisted, marker_dir, marker_of  # noqa: F401
from dbidx.mdt.data_reader import (  # noqa: F401 - used by tasks and tests
    DELETED_COLUMN, INSTANT_COLUMN, data_file_path, read_data_file, write_data_file,
)
from dbidx.mdt.records import ACTION_COMMIT, DataFileRecord



def write_group(io: FileIO, partition: str, file_group: str, rows: pa.Table, instant: str,
                attempt: int) -> DataFileRecord:
    """Write one file group's rows of an instant: the marker first, so no file is ever written unannounced; the
    bytes are serialized in memory, so the recorded checksum covers exactly what was written."""
    rel = data_file_path(partition, file_group, instant, attempt)
    markers.announce(io, instant, rel)
    return write_data_file(io, rel, rows, partition, file_group)


def write_groups(io: FileIO, rows: pa.Table, partitions: pa.Array, file_groups: pa.Array, instant: str,
                 attempt: int) -> list[DataFileRecord]:
    """Split rows by (partition, file group) and write one file per group; rows with no file group are skipped."""
    written: list[DataFileRecord] = []
    if rows.num_rows == 0:
        return written
    ident = pc.binary_join_element_wise(partitions, pc.fill_null(file_groups, ""), "\x00")
    order = pc.sort_indices(ident)
    sorted_ident = ident.take(order)
    values = sorted_ident.to_numpy(zero_copy_only=False)
    starts = np.flatnonzero(np.concatenate(([True], values[1:] != values[:-1])))
    ends = np.append(starts[1:], len(values))
    for start, end in zip(starts.tolist(), ends.tolist()):
        partition, file_group = values[start].split("\x00", 1)
        if not file_group:
            continue
        group = rows.take(order.slice(start, end - start))
        written.append(write_group(io, partition, file_group, group, instant, attempt))
    return written


def settled_files(record: Any) -> set[str] | None:
    """The files a settled instant published (empty for a rollback); None while it is unsettled."""
    if record is None:
        return None
    if record.action != ACTION_COMMIT:
        return set()
    return {f.path for f in record.data_files} | {f.path for f in record.files}


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


def sweep_settled(io: FileIO, timeline: Any) -> list[str]:
    """Delete leftovers of settled instants (files of attempts killed mid-write after their job ended)."""
    deleted: list[str] = []
    timeline.refresh()
    for instant in io.list_dirs(MARKERS_DIR):
        listed = settled_files(timeline.record_of(instant))
        if listed is not None:
            deleted += discard_unlisted(io, instant, listed)
    return deleted
