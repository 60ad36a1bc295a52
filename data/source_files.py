"""A Parquet file dbidx indexes by reference (a migrated source file, or a file another engine added to the Delta
table): read once for its bytes' size and checksum (every later read verifies them), its key column and schema.

Shared by build-index (table/build_index.py) and the absorption of other engines' versions (table/absorb.py): both turn
a file dbidx did not write into a `DataFileRecord` of its own file group, with the same checks on its key column.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dbidx.data.files import key_range
from dbidx.errors import CorruptFileError, InvalidInputError, InvalidKeyError
from dbidx.storage.fileio import FileIO, file_checksum
from dbidx.storage.keys import normalize_keys, unfit_key_kind, unfit_key_message
from dbidx.storage.records import DataFileRecord

PARQUET_SUFFIX = ".parquet"


def file_group_of(file_name: str) -> str:
    """The file group of a file dbidx did not write: its whole name without `.parquet` (unique in its directory,
    stable), so `events.2026-11-22.parquet` and `events.2026-11-23.parquet` are two file groups."""
    return file_name[: -len(PARQUET_SUFFIX)] if file_name.endswith(PARQUET_SUFFIX) else file_name


@dataclass(frozen=True)
class SourceFile:
    """One Parquet file dbidx indexes by reference: its record in the table, its keys and its schema."""

    record: DataFileRecord
    keys: pa.Array
    schema: pa.Schema


def read_source(io: FileIO, rel: str, partition: str, key_column: str) -> SourceFile:
    """Read a data file once: its bytes' size and checksum (readers verify them later), row count, key column."""
    where = io.path(rel)
    try:
        data = io.read_buffer(rel)
        handle = pq.ParquetFile(pa.BufferReader(data))
        schema = handle.schema_arrow.remove_metadata()
        if io.column_names is not None:  # Delta column mapping: the file names its columns physically
            schema = pa.schema([f.remove_metadata() for f in io.column_names.to_logical(schema.empty_table()).schema])
        if key_column not in schema.names:
            raise InvalidInputError(f"data file {where} has no column {key_column!r} (columns: {schema.names})")
        physical = key_column if io.column_names is None else io.column_names.physical(key_column)
        keys = handle.read(columns=[physical]).column(0)
    except (pa.ArrowException, OSError) as exc:
        raise CorruptFileError(f"data file {where} is unreadable: {exc}") from exc
    kind = unfit_key_kind(keys.type)  # float, bool, list, struct, map: no exact text form
    if kind is not None:
        raise InvalidKeyError(unfit_key_message(key_column, str(keys.type), kind, f"data file {where}"))
    if not pa.types.is_string(keys.type) and not pa.types.is_large_string(keys.type):
        try:
            keys = pc.cast(keys, pa.string())
        except pa.ArrowInvalid as exc:
            raise InvalidKeyError(
                f"key column {key_column!r} of data file {where} ({keys.type}) is not text: {exc}"
            ) from None
    try:
        keys = normalize_keys(keys, f"key in {where}")
    except InvalidKeyError as exc:
        raise InvalidKeyError(str(exc)) from None
    low, high = key_range(keys)
    record = DataFileRecord(
        path=rel,
        partition=partition,
        file_group=file_group_of(rel.rsplit("/", 1)[-1]),
        rows=len(keys),
        size=len(data),
        checksum=file_checksum(data),
        min_key=low,
        max_key=high,
    )
    return SourceFile(record, keys, schema)
