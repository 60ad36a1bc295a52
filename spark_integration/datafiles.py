"""Data files of an upsert: one Parquet file per (partition, file group, task attempt), each announced by a marker.

Why markers: a task attempt that dies, or a speculative duplicate that loses, leaves files the driver never hears
of. Before writing a data file, the task creates `.dbidx/markers/<instant>/<quoted path>`; the commit lists the
files of the winning attempts only, and everything else a marker names is deleted after the commit (or all of it
after a rollback). Readers only read files a completed commit lists, so an orphan is never visible, even before
it is cleaned.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable
from urllib.parse import quote, unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dbidx.mdt import layout
from dbidx.mdt.fileio import FileIO
from dbidx.mdt.timeline import ACTION_COMMIT

MARKERS_DIR = f"{layout.META_DIR}/markers"
INSTANT_COLUMN = "_dbidx_instant"
DELETED_COLUMN = "_dbidx_deleted"


@dataclass(frozen=True)
class DataFile:
    """One written data file: where, for which file group, how many rows and bytes."""

    path: str
    partition: str
    file_group: str
    rows: int
    size: int


def data_file_path(partition: str, file_group: str, instant: str, attempt: int) -> str:
    """`<partition>/<file group>_<instant>_<attempt>.parquet` (build_index recognises the file group in it)."""
    return f"{partition}/{file_group}_{instant}_{attempt}.parquet"


def marker_dir(instant: str) -> str:
    """Where the markers of one instant live."""
    return f"{MARKERS_DIR}/{layout.validate_instant(instant)}"


def write_group(io: FileIO, rel: str, rows: pa.Table, instant: str) -> DataFile:
    """Write one file group's rows of an instant: the marker first, so no file is ever written unannounced."""
    io.write_atomic(marker_of(instant, rel), b"")
    with io.open_output_stream(rel) as out:
        pq.write_table(rows, out, compression="zstd")
    partition, name = rel.rsplit("/", 1)
    return DataFile(path=rel, partition=partition, file_group=name.split("_", 1)[0], rows=rows.num_rows,
                    size=io.size(rel))


def write_groups(io: FileIO, rows: pa.Table, partitions: pa.Array, file_groups: pa.Array, instant: str,
                 attempt: int) -> list[DataFile]:
    """Split rows by (partition, file group) and write one file per group; rows with no file group are skipped."""
    written: list[DataFile] = []
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
        written.append(write_group(io, data_file_path(partition, file_group, instant, attempt), group, instant))
    return written


def announced_files(io: FileIO, instant: str) -> list[str]:
    """Every data file some attempt of an instant announced (it may or may not exist)."""
    return sorted(unquote(name) for name in io.list_names(marker_dir(instant)) if not name.startswith(".tmp-"))


def marker_of(instant: str, rel: str) -> str:
    """The marker path announcing one data file."""
    return f"{marker_dir(instant)}/{quote(rel, safe='')}"


def settled_files(record: Any) -> set[str] | None:
    """The data files a settled instant published (empty for a rollback); None while it is unsettled."""
    if record is None:
        return None
    return set(record.extra.get("data_files", [])) if record.action == ACTION_COMMIT else set()


def withdraw_if_settled(io: FileIO, timeline: Any, instant: str, written: Iterable[DataFile]) -> bool:
    """Run by a task after writing: if the instant already completed or was rolled back (this attempt lost a race
    or outlived its job), delete this attempt's unpublished files and markers. True if it did so.

    Together with the driver's cleanup this leaves no orphan whatever the timing: either the task's marker existed
    when the driver listed markers (after settling), or the task sees the settled instant here.
    """
    timeline.refresh()
    listed = settled_files(timeline.record_of(instant))
    if listed is None:
        return False
    for f in written:
        if f.path not in listed:
            io.delete(f.path)
            io.delete(marker_of(instant, f.path))
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


def discard_unlisted(io: FileIO, instant: str, keep: Iterable[str]) -> list[str]:
    """Delete the announced files of an instant that are not in `keep`, then its markers; returns the deleted."""
    keep_set = set(keep)
    deleted = [rel for rel in announced_files(io, instant) if rel not in keep_set and io.delete(rel)]
    io.delete_dir(marker_dir(instant))
    return deleted
