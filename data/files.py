"""The table's data files: their names, writing one (bytes serialized in memory, so its record's size and checksum
cover exactly what was written) and reading one back verified against its commit record."""

from __future__ import annotations

from typing import Sequence
from urllib.parse import quote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dbidx.errors import CorruptFileError
from dbidx.storage.fileio import DECODE_ERRORS, FileIO, file_checksum
from dbidx.storage.records import DataFileRecord

INSTANT_COLUMN = "_dbidx_instant"  # written in every data file: the instant that wrote the row
DELETED_COLUMN = "_dbidx_deleted"  # written in every data file: the row deletes its record


def data_file_path(partition: str, file_group: str, instant: str, attempt: int) -> str:
    """`<partition>/<file group>_<instant>_<attempt>.parquet`: where an upsert (attempt = the task attempt) or a
    data compaction (attempt 0) writes a file group's file; at the table root for the partition "" of a
    non-partitioned table. Nothing parses the name back: commit records say which file is which."""
    name = f"{file_group}_{instant}_{attempt}.parquet"
    return f"{partition}/{name}" if partition else name


# Characters delta-rs keeps as they are in a Delta `path` (what it writes in the `remove` of a file it rewrites,
# spelled again from the file's location). A dbidx add that escaped one of them (`:` in a timestamp partition) was
# missed by delta-rs's remove, and Delta readers kept both files live.
_DELTA_RS_SAFE = "/=-_.~:@+,!&'();$"


def delta_spelling(rel: str) -> str | None:
    """The `delta_path` a new data file's record carries: delta-rs's spelling of its path when it differs from the
    default one (data/delta_derive.py `delta_path`), else None (the default is then the same)."""
    spelled = quote(rel, safe=_DELTA_RS_SAFE)
    return None if spelled == quote(rel, safe="/=-_.~") else spelled


def write_data_file(
    io: FileIO, rel: str, rows: pa.Table, partition: str, file_group: str, key: str | None = None
) -> DataFileRecord:
    """Write one data file and return its record; the bytes are serialized in memory first, so the recorded size and
    checksum cover exactly what was written (and readers verify them before use). `key`: the key column, whose
    range the record keeps when it is a string column (the Delta log's statistics)."""
    sink = pa.BufferOutputStream()
    names = io.column_names  # the physical names under Delta column mapping (storage/column_names.py)
    pq.write_table(rows if names is None else names.to_physical(rows), sink, compression="zstd")
    data = sink.getvalue()
    io.write_atomic(rel, data)
    low, high = key_range(rows.column(key)) if key is not None and key in rows.column_names else (None, None)
    deletes = pc.sum(rows.column(DELETED_COLUMN)).as_py() or 0 if DELETED_COLUMN in rows.column_names else 0
    return DataFileRecord(
        path=rel,
        partition=partition,
        file_group=file_group,
        rows=rows.num_rows,
        size=data.size,
        checksum=file_checksum(data),
        min_key=low,
        max_key=high,
        deletes=deletes,
        delta_path=delta_spelling(rel),
    )


def key_range(keys: pa.ChunkedArray | pa.Array) -> tuple[str | None, str | None]:
    """(smallest, largest) value of a string key column; (None, None) for other types or no rows."""
    if not (pa.types.is_string(keys.type) or pa.types.is_large_string(keys.type)) or len(keys) == 0:
        return None, None
    bounds = pc.min_max(keys)
    return bounds["min"].as_py(), bounds["max"].as_py()


def read_data_file(
    io: FileIO, record: DataFileRecord, columns: Sequence[str] | None = None, use_threads: bool = True
) -> pa.Table:
    """One published data file (the chosen columns it has; None: all), its bytes verified against the commit record
    first and its row count checked against it after. use_threads: let pyarrow decode its columns on threads of its
    own (False for a read that already runs one file per thread)."""
    data = io.read_verified(record.path, record.size, record.checksum, "data file")
    try:
        handle = pq.ParquetFile(pa.BufferReader(data), pre_buffer=False)  # the bytes are in memory already
        names = handle.schema_arrow.names
        mapped = io.column_names  # the physical names under Delta column mapping (storage/column_names.py)
        wanted = None if columns is None else (list(columns) if mapped is None else mapped.physical_names(columns))
        table = handle.read(
            columns=None if wanted is None else [c for c in wanted if c in names], use_threads=use_threads
        )
        if mapped is not None:
            table = mapped.to_logical(table)
        rows = handle.metadata.num_rows
    except DECODE_ERRORS as exc:
        raise CorruptFileError(f"data file {io.path(record.path)} is unreadable: {exc}") from exc
    if rows != record.rows:
        raise CorruptFileError(
            f"data file {io.path(record.path)} holds {rows} rows but its commit recorded {record.rows}"
        )
    return plain_views(table)


def plain_views(table: pa.Table) -> pa.Table:
    """View-typed columns (`string_view`, `binary_view`: what polars and other Arrow-native engines write into the
    files they add to the table) as their plain types: pyarrow 26 cannot take or filter a view column, and the
    table's recorded schema names the plain types anyway."""
    for i, field in enumerate(table.schema):
        plain = (
            pa.string()
            if pa.types.is_string_view(field.type)
            else pa.binary()
            if pa.types.is_binary_view(field.type)
            else None
        )
        if plain is not None:
            table = table.set_column(i, field.with_type(plain), table.column(i).cast(plain))
    return table
