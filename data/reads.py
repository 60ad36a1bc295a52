"""Reads of a version of the table, planned by file group, in pure Arrow (one file's rows: data/file_rows.py).

What a read returns: each live data file's rows minus its deletion vector, exactly what every Delta reader returns
from `_delta_log/` (a superseded version of a record, a deleted record and a delete row are all in the vectors), so
no merge by key, no shuffle: any number of file groups are read in parallel by any engine. Hive partition columns
of string type come from the partition path, as Delta readers take them from `partitionValues`, instead of
being decoded from every row of every file.

Every file is read through the table's FileIO (any pyarrow filesystem: local, S3, GCS, HDFS) and verified against
the size and checksum its commit recorded before a byte of it is used.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa

from dbidx.data.file_rows import FILE_GROUP_COLUMN, file_rows, shape_of
from dbidx.data.files import DELETED_COLUMN, INSTANT_COLUMN, read_data_file
from dbidx.data.schema import recorded_schema
from dbidx.errors import CorruptFileError, InvalidInputError
from dbidx.storage.archive_retention import data_view_at
from dbidx.storage.data_view import LAYOUT_EXTRA, DataView, DvRef, LiveDataFile
from dbidx.storage.fileio import FileIO
from dbidx.storage.layout import hive_values, layout_partition_columns
from dbidx.storage.records import DataFileRecord

__all__ = ["read_arrow", "record_batch_reader"]

MAX_READ_THREADS = 8


@dataclass(frozen=True)
class ReadUnit:
    """One file group's live data files, oldest first, each with its completion seq, instant and deletion vector."""

    partition: str
    file_group: str
    files: tuple[DataFileRecord, ...]
    seqs: tuple[int, ...]
    instants: tuple[str, ...]
    vectors: tuple[DvRef | None, ...] = ()
    # The hive partition columns' values in the unit's partition path (what Delta readers take from
    # `partitionValues`): string columns among them are built from these, not decoded from every file.
    path_values: tuple[tuple[str, str], ...] = ()

    @property
    def bytes(self) -> int:
        """What reading the unit costs (for balancing units over tasks)."""
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class ReadPlan:
    """What a read of the table's current state must merge: its units, key column and output schema."""

    seq: int
    key: str | None  # None: nothing written yet
    schema: pa.Schema  # the table's data columns (no _dbidx_ columns)
    units: tuple[ReadUnit, ...]


def layout_of(table: Any, view: DataView | None = None) -> dict[str, Any] | None:
    """The key/partition layout the latest writing commit recorded (None before the first write); `view`: the
    table's data view when the caller refreshed it already."""
    recorded = (view or table.data_view()).layout
    if recorded is None:
        return None
    layout = recorded.value
    if not isinstance(layout, dict) or not isinstance(layout.get("key"), str) or not layout["key"]:
        raise CorruptFileError(
            f"completion {recorded.seq} ({recorded.instant}) of {table.uri} records no valid key "
            f"column in its {LAYOUT_EXTRA!r} extra: {layout!r}"
        )
    return layout


def view_at(table: Any, as_of: int | str | None = None, version: int | None = None) -> DataView:
    """The data view right after a completion (`as_of`: a completion seq or a completed instant id) or at a Delta
    version (`version`: what `_delta_log/` and Delta readers number; the completion seq for a table dbidx created);
    neither: the current one. An older state is replayed from the completion log (archive bundles included), so a
    time-travel read sees exactly the files and vectors of that version; files a clean removed since then make the
    read a HistoryCompactedError."""
    if as_of is not None and version is not None:
        raise InvalidInputError("give as_of (a completion seq or instant) or version (a Delta version), not both")
    follow = getattr(table, "follow_delta_log", None)
    if follow is not None:
        follow()  # versions other engines wrote since the index's last are read too (their records first)
    current = table.data_view()
    if version is not None:
        if isinstance(version, bool) or not isinstance(version, int):
            raise InvalidInputError(f"version must be a Delta version number, got {version!r}")
        first = current.delta_first_seq + current.delta_offset
        if version < first and current.delta_adopted is None:
            raise InvalidInputError(f"Delta version {version} does not exist (versions of {table.uri} start at 0)")
        if version < first:
            raise InvalidInputError(
                f"Delta version {version} of {table.uri} predates dbidx (the table was adopted "
                f"at version {first}); read it with a Delta reader, e.g. "
                f"deltalake.DeltaTable(uri, version={version})"
            )
        as_of = version - current.delta_offset
        if as_of > table.timeline.latest_seq:
            raise InvalidInputError(
                f"Delta version {version} of {table.uri} does not exist yet (latest: "
                f"{table.timeline.latest_seq + current.delta_offset})"
            )
    if as_of is None:
        return current
    seq = table.seq_at(as_of)
    if seq < table.props.upgraded_at_seq:
        raise InvalidInputError(
            f"completion {seq} of {table.uri} predates its upgrade to format 4 (completion "
            f"{table.props.upgraded_at_seq}): its rows were merged by key then and are not read "
            "as of that time"
        )
    if seq >= current.applied_seq:
        return current
    return data_view_at(table.timeline, seq)  # from the history floor when archive retention expired older records


def plan_read(
    table: Any, partitions: Iterable[str] | None = None, as_of: int | str | None = None, version: int | None = None
) -> ReadPlan:
    """Group the live data files by (partition, file group), in commit order; `partitions` prunes; `as_of` or
    `version` reads an older state (view_at)."""
    view = view_at(table, as_of, version)
    wanted = None if partitions is None else set(partitions)
    live = view.live()
    groups: dict[tuple[str, str], list[LiveDataFile]] = {}
    for f in live:
        if wanted is None or f.record.partition in wanted:
            groups.setdefault((f.record.partition, f.record.file_group), []).append(f)
    layout = layout_of(table, view)
    columns = layout_partition_columns(layout)
    schema = recorded_schema(view.schema)
    if schema is None:
        schema = _newest_file_schema(table.io, live)
    units = []
    for (p, fg), entries in sorted(groups.items()):
        entries.sort(key=lambda e: e.order)
        units.append(
            ReadUnit(
                p,
                fg,
                tuple(e.record for e in entries),
                tuple(e.seq for e in entries),
                tuple(e.instant for e in entries),
                tuple(view.vector_of(e.record.path) for e in entries),
                tuple(sorted(hive_values(p, columns).items())),
            )
        )
    return ReadPlan(view.applied_seq, layout["key"] if layout else None, schema, tuple(units))


def _newest_file_schema(io: FileIO, live: Sequence[LiveDataFile]) -> pa.Schema:
    """The data columns of the newest live data file (tables written before schemas were recorded)."""
    if not live:
        return pa.schema([])
    newest = read_data_file(io, max(live, key=lambda e: e.order).record)
    return pa.schema([f for f in newest.schema.remove_metadata() if f.name not in (INSTANT_COLUMN, DELETED_COLUMN)])


def output_schema(plan: ReadPlan, columns: Sequence[str] | None = None, with_meta: bool = False) -> pa.Schema:
    """The columns a read returns: the table's (or the chosen ones, in the table's order), then optional metadata."""
    fields = list(plan.schema)
    if columns is not None:
        unknown = [c for c in columns if c not in plan.schema.names]
        if unknown:
            raise InvalidInputError(f"column(s) {unknown} are not in the table (columns: {plan.schema.names})")
        fields = [f for f in fields if f.name in set(columns)]
    if with_meta:
        fields += [pa.field(FILE_GROUP_COLUMN, pa.string()), pa.field(INSTANT_COLUMN, pa.string())]
    return pa.schema(fields)


def read_unit(
    io: FileIO,
    unit: ReadUnit,
    key: str,
    schema: pa.Schema,
    table: Any = None,
    origins: list[tuple[DataFileRecord, np.ndarray]] | None = None,
) -> pa.Table:
    """The live rows of one file group: each file's rows minus its deletion vector (what every Delta reader does;
    superseded versions and delete rows are in the vectors, so no merge by key is needed).

    schema: the output columns (output_schema); files lacking a column (written before it was added) read nulls.
    table: the table the plan came from; with it, a file a clean removed after the read was planned is a
    HistoryCompactedError (plan the read again) instead of a damaged table.
    origins: if given, gets (file, row positions kept) per file, in output order (a data compaction maps rows).
    """
    shape = shape_of(dict(unit.path_values), key, schema)
    dv_files: dict[str, bytes] = {}
    pieces = []
    for record, instant, vector in _files(unit):
        rows, kept = file_rows(io, record, instant, vector, shape, table, dv_files)
        if origins is not None:
            origins.append((record, np.arange(record.rows) if kept is None else kept))
        pieces.append(rows)
    return pa.concat_tables(pieces).select(schema.names)


def _files(unit: ReadUnit) -> Iterator[tuple[DataFileRecord, str, DvRef | None]]:
    """A unit's files, oldest first, each with its instant and deletion vector."""
    return zip(unit.files, unit.instants, unit.vectors or (None,) * len(unit.files))


class _FileReads:
    """The reads of one table read on a thread pool, one job per data file (not per file group: a group is as slow
    as its largest file, and a few groups of large files left a core idle; data/file_rows.py says more). DV files
    are read once per read (one DV file holds the vectors of a whole commit, for many file groups)."""

    def __init__(
        self, pool: ThreadPoolExecutor, io: FileIO, key: str, schema: pa.Schema, table: Any, inner_threads: bool
    ) -> None:
        self.pool, self.io, self.key, self.schema, self.table = pool, io, key, schema, table
        self.inner_threads = inner_threads  # pyarrow's per-column threads: when the pool cannot fill the cores
        self.dv_files: dict[str, bytes] = {}  # dict get/set are atomic: at worst two threads read one DV file

    def submit(self, unit: ReadUnit) -> list[Future[tuple[pa.Table, np.ndarray | None]]]:
        """Start reading a unit's files; their rows come in the unit's order from the futures."""
        shape = shape_of(dict(unit.path_values), self.key, self.schema)
        return [
            self.pool.submit(
                file_rows, self.io, record, instant, vector, shape, self.table, self.dv_files, self.inner_threads
            )
            for record, instant, vector in _files(unit)
        ]


def _pool(files: int) -> tuple[ThreadPoolExecutor, bool]:
    """A pool for a read of `files` data files (one thread per core, decoding is CPU-bound, at most
    MAX_READ_THREADS), and whether each file should also be decoded on pyarrow's threads (fewer files than cores)."""
    cores = os.cpu_count() or 1
    workers = max(1, min(files, cores, MAX_READ_THREADS))
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dbidx-read"), files < cores


def read_units(
    io: FileIO, units: Iterable[ReadUnit], key: str, schema: pa.Schema, table: Any = None
) -> Iterator[pa.RecordBatch]:
    """The live rows of several units as record batches (what a Spark task or a dataset scan yields), in order,
    one unit at a time: a unit's files are read on threads, and the next unit's are read while the caller takes
    the current one's batches, so at most two units' rows are held."""
    units = list(units)
    if not units:
        return
    pool, inner = _pool(sum(len(u.files) for u in units))
    try:
        reads = _FileReads(pool, io, key, schema, table, inner)
        pending = reads.submit(units[0])
        for i in range(len(units)):
            current, pending = pending, reads.submit(units[i + 1]) if i + 1 < len(units) else []
            for future in current:
                yield from future.result()[0].to_batches()
    finally:  # a failure, or a caller that stops early, leaves at most the files already started to finish
        pool.shutdown(wait=True, cancel_futures=True)


def read_arrow(
    table: Any,
    partitions: Iterable[str] | None = None,
    columns: Sequence[str] | None = None,
    with_meta: bool = False,
    as_of: int | str | None = None,
    version: int | None = None,
) -> pa.Table:
    """The table's current rows as one `pyarrow.Table` (for DuckDB, Polars, pandas): one row per record, in plan
    order (file groups by partition and group, each group's files oldest first).

    partitions: partition paths to read (e.g. ["dt=2025-01-15"]), default all; columns: data columns to return,
    default all; with_meta: add `_dbidx_file_group` and `_dbidx_instant` (the commit that wrote the row);
    as_of (a completion seq or instant id) or version (a Delta version): the rows of that older version.
    """
    plan = plan_read(table, partitions, as_of, version)
    schema = output_schema(plan, columns, with_meta)
    if plan.key is None or not plan.units:
        return schema.empty_table()
    # Every data file of every group is one job on the pool (Parquet decoding releases the GIL).
    pool, inner = _pool(sum(len(u.files) for u in plan.units))
    try:
        reads = _FileReads(pool, table.io, plan.key, schema, table, inner)
        futures = [future for unit in plan.units for future in reads.submit(unit)]
        pieces = [future.result()[0] for future in futures]
    finally:  # a file that fails ends the read: the files not started yet are not read
        pool.shutdown(wait=True, cancel_futures=True)
    return pa.concat_tables(pieces).cast(schema)


def record_batch_reader(
    table: Any,
    partitions: Iterable[str] | None = None,
    columns: Sequence[str] | None = None,
    with_meta: bool = False,
    as_of: int | str | None = None,
    version: int | None = None,
) -> pa.RecordBatchReader:
    """Like read_arrow, streamed one file group at a time (memory bounded by the two largest file groups: the
    next group is read while the current one is taken)."""
    plan = plan_read(table, partitions, as_of, version)
    schema = output_schema(plan, columns, with_meta)
    units = plan.units if plan.key is not None else ()
    return pa.RecordBatchReader.from_batches(schema, read_units(table.io, units, plan.key or "", schema, table))
