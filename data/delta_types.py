"""Column types in Delta's own terms: the table's recorded data schema (Arrow) against a Delta metaData's schema.

Why: every Delta reader reads a column as the type the log's newest metaData gives it, whatever a data file holds;
a file whose column has another type (an int64 file in a column the log says is string) breaks their reads of the
whole table. dbidx writes its files in its recorded schema's types, so that schema and the log's must name the same
Delta type for every column (table/absorb_checks.py refuses a metaData that changes one; table/verify_table.py
reports a table where they differ).

Why Delta's terms and not Arrow's: Arrow spells one Delta type several ways (string, large_string and string_view
are all `string`; a timestamp's unit and zone label are not part of Delta's `timestamp`), and nullability is not a
type at all (a column that becomes nullable changes no value). The Arrow side goes through delta-rs's own mapping,
the one dbidx's own metaData is written with (data/delta_derive.py `_delta_schema`).
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from dbidx.data.schema import canonical_type

DeltaType = Any  # a hashable normal form: a primitive type's name, or a tuple for array, map and struct

# delta-rs's names for a nanosecond timestamp (its `timestampNanos` preview): the same Delta type as a microsecond one
_SPELLINGS = {"timestamp_nanos": "timestamp", "timestamp_nanos_ntz": "timestamp_ntz"}


def log_types(schema_string: str) -> dict[str, DeltaType]:
    """Each top-level column of a metaData `schemaString` with its type's normal form. The string is one delta-rs
    has parsed already (absorb_checks `_arrow_schema`, or delta-rs's own snapshot): nothing here is validated."""
    fields = json.loads(schema_string).get("fields") or []
    return {str(f["name"]): normal(f["type"]) for f in fields if isinstance(f, dict) and "name" in f}


def recorded_types(schema: pa.Schema) -> dict[str, DeltaType]:
    """Each column of an Arrow schema with its Delta type's normal form; a column whose Arrow type has no Delta form
    (float16, a time of day) is left out: no Delta log can hold it, so there is nothing to compare it with."""
    from deltalake import Schema

    out = {}
    for field in schema:
        try:
            text = Schema.from_arrow(pa.schema([pa.field(field.name, canonical_type(field.type))])).to_json()
        except Exception:  # noqa: BLE001 - delta-rs raises a bare Exception for an Arrow type Delta has no form of
            continue
        out[field.name] = normal(json.loads(text)["fields"][0]["type"])
    return out


def type_changes(recorded: pa.Schema, schema_string: str) -> list[tuple[str, str, str]]:
    """(column, recorded type, log type), in Delta's spelling, of every column both have with different types."""
    ours, theirs = recorded_types(recorded), log_types(schema_string)
    return [
        (name, spelled(t), spelled(theirs[name])) for name, t in ours.items() if name in theirs and t != theirs[name]
    ]


def normal(t: Any) -> DeltaType:
    """The normal form of a Delta type (its JSON): nullability (`nullable`, `containsNull`, `valueContainsNull`) and
    field metadata dropped, delta-rs's nanosecond timestamp names folded into Delta's."""
    if isinstance(t, str):
        name = t.replace(" ", "").lower()
        return _SPELLINGS.get(name, name)
    if not isinstance(t, dict):
        return repr(t)  # nothing a Delta log holds: compared as it is
    kind = t.get("type")
    if kind == "array":
        return ("array", normal(t.get("elementType")))
    if kind == "map":
        return ("map", normal(t.get("keyType")), normal(t.get("valueType")))
    if kind == "struct":
        fields = t.get("fields") or []
        return ("struct", tuple((str(f.get("name")), normal(f.get("type"))) for f in fields if isinstance(f, dict)))
    return repr(t)


def spelled(t: DeltaType) -> str:
    """A normal form as Delta's SQL spells it: `long`, `array<string>`, `struct<a: long, b: string>`."""
    if isinstance(t, tuple) and t[0] == "array":
        return f"array<{spelled(t[1])}>"
    if isinstance(t, tuple) and t[0] == "map":
        return f"map<{spelled(t[1])}, {spelled(t[2])}>"
    if isinstance(t, tuple) and t[0] == "struct":
        return "struct<" + ", ".join(f"{name}: {spelled(inner)}" for name, inner in t[1]) + ">"
    return str(t)
