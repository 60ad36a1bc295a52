"""The table's data schema: recorded at the first write, checked on every later one, evolved by new columns only.

Why recorded and checked before writing: a data file whose column has another type than the table's other files
(a `long` key, a `string` payload in a `long` column) is accepted by Parquet and breaks every later read of the
whole table. The writer compares its input with the record on the driver, before any task runs, and raises
SchemaError naming the column and both types; nothing is written.

Rules (docs/FORMAT.md, "Data schema"): the same type for every existing column (the key column included); a new
column is allowed and must be nullable in effect (older files read it as null); a column of the table missing from
the input is an error (its rows would silently lose the value). The schema is stored as an Arrow IPC schema
message, base64, in the `schema` extra of the completion that first wrote it or changed it.
"""

from __future__ import annotations

import base64
from typing import Any, Sequence

import pyarrow as pa

from dbidx.errors import CorruptFileError, SchemaError

from dbidx.storage.data_view import Recorded


def encode_schema(schema: pa.Schema) -> str:
    """The record's form: an Arrow IPC schema message, base64 (exact types, timezones and all)."""
    return base64.b64encode(schema.remove_metadata().serialize().to_pybytes()).decode("ascii")


def decode_schema(text: Any, where: str) -> pa.Schema:
    """Inverse of encode_schema; anything else is a CorruptFileError naming the record."""
    try:
        return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text, validate=True)))
    except (TypeError, ValueError, pa.ArrowException) as exc:
        raise CorruptFileError(f"{where}: the recorded data schema is unreadable ({exc})") from exc


def recorded_schema(recorded: Recorded | None) -> pa.Schema | None:
    """The schema the newest schema-setting completion recorded (DataView.schema; None before the first write)."""
    if recorded is None:
        return None
    return decode_schema(recorded.value, f"completion {recorded.seq} ({recorded.instant})")


def data_columns(schema: pa.Schema, drop: Sequence[str] = ()) -> pa.Schema:
    """The user's columns of an input schema: without dbidx's own `_dbidx_*` columns and the named ones."""
    return pa.schema([f for f in schema if f.name not in drop and not f.name.startswith("_dbidx_")])


_LARGE = {pa.large_string(): pa.string(), pa.large_binary(): pa.binary()}


def same_type(a: pa.DataType, b: pa.DataType) -> bool:
    """Equal types up to what does not change a value: string vs large_string (binary vs large_binary, list vs
    large_list), the time zone label of a zoned timestamp (the instant is stored in UTC either way; Spark labels it
    with the session's zone), and nullability at any nesting level (Spark's plans differ in it)."""
    return canonical_type(a) == canonical_type(b)


def canonical_type(t: pa.DataType) -> pa.DataType:
    """One representative per class of types same_type treats as equal (also what data/delta_types.py maps to
    Delta's terms: delta-rs has no Delta type for a timestamp zoned other than UTC)."""
    if t in _LARGE:
        return _LARGE[t]
    if pa.types.is_timestamp(t) and t.tz is not None:
        return pa.timestamp(t.unit, tz="UTC")
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.list_(canonical_type(t.value_type))
    if pa.types.is_map(t):
        return pa.map_(canonical_type(t.key_type), canonical_type(t.item_type))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, canonical_type(f.type), nullable=True) for f in t])
    return t


def evolve(
    recorded: pa.Schema | None, incoming: pa.Schema, where: str, consumed: Sequence[str] = ()
) -> pa.Schema | None:
    """Check an input's data columns against the table's schema; the schema to record, or None if unchanged.

    consumed: columns this write uses up and does not store (its delete flag); a table column of that name may be
    absent from the input (its rows read null there). Raises SchemaError for a column whose type differs, another
    table column the input lacks, or two input columns whose names differ only in case (check_distinct_names; the
    input must hold every table column, so a new column cannot clash with one of the table's without that).
    """
    incoming = pa.schema([f.with_nullable(True) for f in incoming])
    check_distinct_names(incoming, where)
    if recorded is None:
        return incoming
    # 1. Every existing column, with its type.
    for field_ in recorded:
        if field_.name not in incoming.names and field_.name in consumed:
            continue
        if field_.name not in incoming.names:
            raise SchemaError(
                f"{where} has no column {field_.name!r} ({field_.type}), which the table has; "
                "add it (null where unknown): an upsert replaces whole rows"
            )
        got = incoming.field(field_.name).type
        if not same_type(got, field_.type):
            raise SchemaError(
                f"{where}: column {field_.name!r} is {got}, the table's schema says {field_.type}; "
                f"cast it (e.g. df.withColumn({field_.name!r}, col({field_.name!r}).cast(...)))"
            )
    # 2. New columns are appended (schema evolution): older files read them as null.
    added = [f for f in incoming if f.name not in recorded.names]
    return pa.schema(list(recorded) + added) if added else None


def check_distinct_names(schema: pa.Schema, where: str) -> None:
    """Column names must differ other than in case. Why: Delta (and Spark, Hive, every engine reading the table's
    Delta log) resolves column names case-insensitively; delta-rs refuses a schema with `id` and `ID`, so a write
    holding both would publish and then fail to write its Delta version, leaving the table unreadable to them."""
    seen: dict[str, str] = {}
    for name in schema.names:
        other = seen.setdefault(name.lower(), name)
        if other != name:
            raise SchemaError(
                f"{where} has columns {other!r} and {name!r}, whose names differ only in case; Delta "
                "readers resolve column names case-insensitively: rename or drop one of them"
            )
