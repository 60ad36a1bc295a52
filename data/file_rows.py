"""One live data file's rows as a read returns them: verified, decoded, minus its deletion vector, and shaped as the
read's output schema (data/reads.py plans the read and puts the files' rows together).

Why a function per file, apart from the read of a file group: a full read is mostly Parquet decoding of many files
of very different sizes (a table between compactions holds a few large files per file group and many small ones),
so data/reads.py runs this on a thread pool over all the files of the read, not over file groups (a group is as
slow as its largest file, and a few groups of large files left one core idle). Parquet decoding, the checksum and
Arrow's filter release the GIL or are short; the Python per file is a few hundred microseconds.

A file is decoded on the calling thread (`use_threads=False`) when the read runs on a pool: pyarrow's own
per-column threads only add hand-offs there (measured: more CPU, no less wall time, on 2 cores). And the file's
bytes are in memory (checked against the commit record first), so there is nothing for `pre_buffer` to coalesce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from dbidx.data.files import INSTANT_COLUMN, read_data_file
from dbidx.data.superseded import load_vector
from dbidx.errors import CorruptFileError, HistoryCompactedError, SchemaError
from dbidx.storage.data_view import DvRef
from dbidx.storage.fileio import FileIO
from dbidx.storage.records import DataFileRecord

FILE_GROUP_COLUMN = "_dbidx_file_group"  # optional in reads: the file group a row lives in


@dataclass(frozen=True)
class Shape:
    """What every file of one file group is read as: the output schema, the key column, the columns to decode from
    the files, and the partition values of the group's path (string partition columns come from these, as Delta
    readers take them from `partitionValues`, instead of being decoded from every row of every file)."""

    schema: pa.Schema
    key: str
    columns: tuple[str, ...]
    path_values: dict[str, str]


def shape_of(path_values: dict[str, str], key: str, schema: pa.Schema) -> Shape:
    """The Shape of a file group whose partition path has `path_values`, for a read of `schema` keyed by `key`."""
    from_path = {
        name
        for name in path_values
        if name != key and name in schema.names and _exact_from_text(schema.field(name).type)
    }
    wanted = {f.name for f in schema} - {FILE_GROUP_COLUMN} - from_path | {key}
    # In the schema's order (the key last if it is not in it): what is decoded does not depend on set order.
    columns = tuple(n for n in schema.names if n in wanted) + tuple(n for n in sorted(wanted) if n not in schema.names)
    return Shape(schema, key, columns, path_values)


def file_rows(
    io: FileIO,
    record: DataFileRecord,
    instant: str,
    vector: DvRef | None,
    shape: Shape,
    table: Any = None,
    dv_files: dict[str, bytes] | None = None,
    use_threads: bool = True,
) -> tuple[pa.Table, np.ndarray | None]:
    """The live rows of one data file, as `shape.schema`, and the row positions kept (None: all of them, no vector).

    table: the table the read was planned on; with it, a file a clean removed since is a HistoryCompactedError.
    dv_files: DV file bytes already read (shared by the files of one read: one DV file holds a commit's vectors).
    use_threads: let pyarrow decode the file's columns on its own threads (for a read of one file at a time).
    """
    try:
        data = read_data_file(io, record, shape.columns, use_threads)
        kept = None
        if vector is not None:
            keep = np.ones(data.num_rows, dtype=bool)
            keep[np.asarray(load_vector(io, vector, record.rows, dv_files).to_array(), dtype=np.int64)] = False
            data = data.filter(pa.array(keep))
            kept = np.flatnonzero(keep)
    except CorruptFileError as exc:
        _raise_if_cleaned(io, table, record, vector, exc)
        raise
    return _aligned(data, shape, record, instant, io), kept


def _raise_if_cleaned(
    io: FileIO, table: Any, record: DataFileRecord, vector: DvRef | None, exc: CorruptFileError
) -> None:
    """A data or DV file that is gone because a clean removed it (it is in no current version any more) is
    HistoryCompactedError: the read was planned before the clean, or reads a version older than the retention."""
    if table is None or table.data_view().is_live(record.path) and vector == table.data_view().vector_of(record.path):
        return
    for path in (record.path, vector.file.path if vector is not None else None):
        if path is not None and not io.exists(path):
            raise HistoryCompactedError(
                f"{io.path(path)} was removed by a clean after this read was planned, or the "
                "version read is older than the table retains (its data was compacted "
                "since); read a newer version"
            ) from exc


def _exact_from_text(type_: pa.DataType) -> bool:
    """Whether a partition value's text is the column's value exactly (so it need not be decoded): text columns
    only (a date's directory may spell it otherwise than Arrow parses, and decoding an int32 date is cheap)."""
    return pa.types.is_string(type_) or pa.types.is_large_string(type_)


def _aligned(data: pa.Table, shape: Shape, record: DataFileRecord, instant: str, io: FileIO) -> pa.Table:
    """One file's rows as the output schema; partition columns not read from the file come from the path."""
    if shape.key not in data.column_names:
        raise CorruptFileError(f"data file {io.path(record.path)} has no key column {shape.key!r}")
    n = data.num_rows
    columns = []
    for field_ in shape.schema:
        if field_.name == FILE_GROUP_COLUMN:
            column = pa.repeat(pa.scalar(record.file_group, pa.string()), n)
        elif field_.name == INSTANT_COLUMN:  # the row's own (kept by compaction), else the file's commit
            column = (
                data.column(INSTANT_COLUMN)
                if INSTANT_COLUMN in data.column_names
                else pa.repeat(pa.scalar(instant, pa.string()), n)
            )
        elif field_.name in data.column_names:
            column = data.column(field_.name)
            if column.type != field_.type:
                try:
                    column = column.cast(field_.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                    raise SchemaError(
                        f"column {field_.name!r} of data file {io.path(record.path)} is "
                        f"{column.type}, the table's schema says {field_.type}: {exc}"
                    ) from exc
        elif (value := _path_value(shape.path_values, record.partition, field_.name)) is not None:
            column = _repeat(value, n, field_, record, io)  # from the path (a migrated file has it nowhere else)
        else:
            column = pa.nulls(n, field_.type)  # a column added after this file was written
        columns.append(column)
    return pa.Table.from_arrays(columns, names=shape.schema.names)


def _path_value(path_values: dict[str, str], partition: str, column: str) -> str | None:
    """A column's value from the unit's partition path: the layout's partition columns first, else any
    `<column>=<value>` segment (a migrated file keeps it in its directory name only)."""
    value = path_values.get(column)
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
        raise SchemaError(
            f"partition value {value!r} in the path of {io.path(record.path)} is not a "
            f"{field_.type} (column {field_.name!r}): {exc}"
        ) from exc
