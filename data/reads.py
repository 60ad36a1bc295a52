"""Reads of a version of the table, one file group at a time, in pure Arrow (the files themselves: data/files.py).

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa

from dbidx.data.files import DELETED_COLUMN, INSTANT_COLUMN, read_data_file
from dbidx.data.schema import recorded_schema
from dbidx.data.superseded import load_vector
from dbidx.errors import CorruptFileError, HistoryCompactedError, InvalidInputError, SchemaError
from dbidx.table.data_view import LAYOUT_EXTRA, DataView, DvRef, LiveDataFile
from dbidx.table.fileio import FileIO
from dbidx.table.layout import hive_values, layout_partition_columns
from dbidx.table.records import DataFileRecord

FILE_GROUP_COLUMN = "_dbidx_file_group"  # optional in reads: the file group a row lives in
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
        raise CorruptFileError(f"completion {recorded.seq} ({recorded.instant}) of {table.uri} records no valid key "
                               f"column in its {LAYOUT_EXTRA!r} extra: {layout!r}")
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
            raise InvalidInputError(f"Delta version {version} of {table.uri} predates dbidx (the table was adopted "
                                    f"at version {first}); read it with a Delta reader, e.g. "
                                    f"deltalake.DeltaTable(uri, version={version})")
        as_of = version - current.delta_offset
        if as_of > table.timeline.latest_seq:
            raise InvalidInputError(f"Delta version {version} of {table.uri} does not exist yet (latest: "
                                    f"{table.timeline.latest_seq + current.delta_offset})")
    if as_of is None:
        return current
    seq = table.seq_at(as_of)
    if seq < table.props.upgraded_at_seq:
        raise InvalidInputError(f"completion {seq} of {table.uri} predates its upgrade to format 4 (completion "
                                f"{table.props.upgraded_at_seq}): its rows were merged by key then and are not read "
                                "as of that time")
    if seq >= current.applied_seq:
        return current
    past = DataView()
    past.apply(table.timeline.completed(upto_seq=seq))
    return past


def plan_read(table: Any, partitions: Iterable[str] | None = None, as_of: int | str | None = None,
              version: int | None = None) -> ReadPlan:
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
        units.append(ReadUnit(p, fg, tuple(e.record for e in entries), tuple(e.seq for e in entries),
                              tuple(e.instant for e in entries), tuple(view.vector_of(e.record.path) for e in entries),
                              tuple(sorted(hive_values(p, columns).items()))))
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


def read_unit(io: FileIO, unit: ReadUnit, key: str, schema: pa.Schema, table: Any = None,
              origins: list[tuple[DataFileRecord, np.ndarray]] | None = None) -> pa.Table:
    """The live rows of one file group: each file's rows minus its deletion vector (what every Delta reader does;
    superseded versions and delete rows are in the vectors, so no merge by key is needed).

    schema: the output columns (output_schema); files lacking a column (written before it was added) read nulls.
    table: the table the plan came from; with it, a file a clean removed after the read was planned is a
    HistoryCompactedError (plan the read again) instead of a damaged table.
    origins: if given, gets (file, row positions kept) per file, in output order (a data compaction maps rows).
    """
    path_values = dict(unit.path_values)
    from_path = {name: value for name, value in path_values.items()
                 if name != key and name in schema.names and _exact_from_text(schema.field(name).type)}
    wanted = {f.name for f in schema} - {FILE_GROUP_COLUMN} - set(from_path) | {key}
    pieces = []
    dv_files: dict[str, bytes] = {}
    vectors = unit.vectors or (None,) * len(unit.files)
    for record, instant, vector in zip(unit.files, unit.instants, vectors):
        try:
            data = read_data_file(io, record, list(wanted))
            keep = np.ones(data.num_rows, dtype=bool)
            if vector is not None:
                keep[np.asarray(load_vector(io, vector, record.rows, dv_files).to_array(), dtype=np.int64)] = False
                data = data.filter(pa.array(keep))
        except CorruptFileError as exc:
            _raise_if_cleaned(io, table, record, vector, exc)
            raise
        if origins is not None:
            origins.append((record, np.flatnonzero(keep)))
        pieces.append(_aligned(data, schema, key, record, instant, io, path_values))
    return pa.concat_tables(pieces).select([f.name for f in schema])


def _raise_if_cleaned(io: FileIO, table: Any, record: DataFileRecord, vector: DvRef | None,
                      exc: CorruptFileError) -> None:
    """A data or DV file that is gone because a clean removed it (it is in no current version any more) is
    HistoryCompactedError: the read was planned before the clean, or reads a version older than the retention."""
    if table is None or table.data_view().is_live(record.path) and vector == table.data_view().vector_of(record.path):
        return
    for path in (record.path, vector.file.path if vector is not None else None):
        if path is not None and not io.exists(path):
            raise HistoryCompactedError(f"{io.path(path)} was removed by a clean after this read was planned, or the "
                                        "version read is older than the table retains (its data was compacted "
                                        "since); read a newer version") from exc


def _exact_from_text(type_: pa.DataType) -> bool:
    """Whether a partition value's text is the column's value exactly (so it need not be decoded): text columns
    only (a date's directory may spell it otherwise than Arrow parses, and decoding an int32 date is cheap)."""
    return pa.types.is_string(type_) or pa.types.is_large_string(type_)


def _aligned(data: pa.Table, schema: pa.Schema, key: str, record: DataFileRecord, instant: str,
             io: FileIO, path_values: dict[str, str] | None = None) -> pa.Table:
    """One file's rows as the output schema; partition columns not read from the file come from the path."""
    if key not in data.column_names:
        raise CorruptFileError(f"data file {io.path(record.path)} has no key column {key!r}")
    n = data.num_rows
    columns, names = [], []
    for field_ in schema:
        if field_.name == FILE_GROUP_COLUMN:
            column = pa.array([record.file_group] * n, pa.string())
        elif field_.name == INSTANT_COLUMN:  # the row's own (kept by compaction), else the file's commit
            column = data.column(INSTANT_COLUMN) if INSTANT_COLUMN in data.column_names else \
                pa.array([instant] * n, pa.string())
        elif field_.name in data.column_names:
            column = data.column(field_.name)
            if column.type != field_.type:
                try:
                    column = column.cast(field_.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                    raise SchemaError(f"column {field_.name!r} of data file {io.path(record.path)} is "
                                      f"{column.type}, the table's schema says {field_.type}: {exc}") from exc
        elif (value := _path_value(path_values, record.partition, field_.name)) is not None:
            column = _repeat(value, n, field_, record, io)  # from the path (a migrated file has it nowhere else)
        else:
            column = pa.nulls(n, field_.type)  # a column added after this file was written
        columns.append(column)
        names.append(field_.name)
    return pa.Table.from_arrays(columns, names=names)


def _path_value(path_values: dict[str, str] | None, partition: str, column: str) -> str | None:
    """A column's value from the unit's partition path: the layout's partition columns first, else any
    `<column>=<value>` segment (a migrated file keeps it in its directory name only)."""
    value = (path_values or {}).get(column)
    return value if value is not None else _hive_value(partition, column)


def _hive_value(partition: str, column: str) -> str | None:
    """The value of `column` in a hive partition path (`dt=2025-01-15/region=eu`), if it names it."""
    for segment in partition.split("/") if partition else []:
        name, sep, value = segment.partition("=")
        if sep and name == column:
            return value
    return None


def _repeat(value: str, n: int, field_: pa.Field, record: DataFileRecord, io: FileIO) -> pa.Array:
    """A partition value from the path, typed as the table's schema says."""
    try:
        return pa.repeat(pa.scalar(value, pa.string()), n).cast(field_.type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise SchemaError(f"partition value {value!r} in the path of {io.path(record.path)} is not a "
                          f"{field_.type} (column {field_.name!r}): {exc}") from exc


def read_units(io: FileIO, units: Iterable[ReadUnit], key: str, schema: pa.Schema,
               table: Any = None) -> Iterator[pa.RecordBatch]:
    """The live rows of several units as record batches (what a Spark task or a dataset scan yields)."""
    for unit in units:
        yield from read_unit(io, unit, key, schema, table).to_batches()


def read_arrow(table: Any, partitions: Iterable[str] | None = None, columns: Sequence[str] | None = None,
               with_meta: bool = False, as_of: int | str | None = None, version: int | None = None) -> pa.Table:
    """The table's current rows as one `pyarrow.Table` (for DuckDB, Polars, pandas): one row per record.

    partitions: partition paths to read (e.g. ["dt=2025-01-15"]), default all; columns: data columns to return,
    default all; with_meta: add `_dbidx_file_group` and `_dbidx_instant` (the commit that wrote the row);
    as_of (a completion seq or instant id) or version (a Delta version): the rows of that older version.
    """
    plan = plan_read(table, partitions, as_of, version)
    schema = output_schema(plan, columns, with_meta)
    if plan.key is None or not plan.units:
        return schema.empty_table()
    # File groups are independent: read and merge them on a few threads (Parquet decoding and Arrow's group-by
    # release the GIL), keeping the plan's order in the result.
    workers = max(1, min(len(plan.units), os.cpu_count() or 1, MAX_READ_THREADS))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dbidx-read") as pool:
        parts = list(pool.map(lambda unit: read_unit(table.io, unit, plan.key or "", schema, table), plan.units))
    return pa.concat_tables(parts).cast(schema)


def record_batch_reader(table: Any, partitions: Iterable[str] | None = None, columns: Sequence[str] | None = None,
                        with_meta: bool = False, as_of: int | str | None = None,
                        version: int | None = None) -> pa.RecordBatchReader:
    """Like read_arrow, streamed one file group at a time (memory bounded by the largest file group)."""
    plan = plan_read(table, partitions, as_of, version)
    schema = output_schema(plan, columns, with_meta)
    units = plan.units if plan.key is not None else ()
    return pa.RecordBatchReader.from_batches(schema, read_units(table.io, units, plan.key or "", schema, table))
