"""Delta column mapping in `name` mode (PROTOCOL.md "Column Mapping"), as dbidx keeps it as a writer: the physical
names and field ids of the table's columns, read from the Delta schema in force.

What dbidx does on such a table: its data files name their columns by physical name and carry the field ids
(storage/column_names.py, applied where every data file is read and written), its `add`s key partition values and
statistics by physical name (data/delta_derive.py), and the partition values of other engines' `add`s are read by
physical name (absorption, adoption). What it refuses by name (data/delta_features.py): `id` mode (files resolved
by field id), nested columns whose physical names differ from their names, and a new column from an upsert (a
physical name and id must be assigned and `delta.columnMapping.maxColumnId` moved, which Delta Spark's `ALTER TABLE
... ADD COLUMNS` does: add it there, then upsert). A rename or a drop by another engine is refused at absorption as
any dropped column is (re-adopt the table).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from dbidx.errors import CorruptFileError
from dbidx.storage.column_names import ColumnNames
from dbidx.storage.data_view import SCHEMA_STRING_EXTRA, DataView

MODE = "delta.columnMapping.mode"
PHYSICAL_NAME = "delta.columnMapping.physicalName"
ID = "delta.columnMapping.id"


def mapping_mode(configuration: dict[str, str]) -> str:
    return str(configuration.get(MODE, "none")).lower()


def schema_string_to_record(view: DataView) -> dict[str, str]:
    """The extra a completion that writes a metaData carries on a table adopted before dbidx recorded the
    schemaString in force (its columns' NOT NULL and metadata then stay: data/delta_derive._current_metadata)."""
    if view.delta_schema_string is not None or view.delta_adopted is None:
        return {}
    value = view.delta_adopted.value["metaData"].get("schemaString")
    return {SCHEMA_STRING_EXTRA: value} if isinstance(value, str) and value else {}


def schema_string_in_force(view: DataView) -> str | None:
    """The Delta schemaString in force as another engine wrote it: recorded (adoption, absorbed metaData), else the
    adopted table's."""
    if view.delta_schema_string is not None:
        return str(view.delta_schema_string.value)
    if view.delta_adopted is not None:
        value = view.delta_adopted.value["metaData"].get("schemaString")
        return value if isinstance(value, str) else None
    return None


def column_names_of(view: DataView) -> ColumnNames | None:
    """The data files' column names for the table as `view` has it; None without column mapping in `name` mode."""
    if mapping_mode(view.configuration()) != "name":
        return None
    schema = schema_string_in_force(view)
    if schema is None:
        raise CorruptFileError(
            "the table maps its columns (delta.columnMapping.mode=name) but dbidx has no Delta schema recorded for "
            "it: re-adopt it (`dbidx build-index URI --key COLUMN --readopt`)"
        )
    return _parsed(schema)


def mapped_names(schema: str) -> ColumnNames:
    """The physical names and ids of a schemaString's top-level columns (each must have both)."""
    return _parsed(schema)


@lru_cache(maxsize=64)
def _parsed(schema: str) -> ColumnNames:
    try:
        fields = json.loads(schema)["fields"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptFileError(f"the Delta schema in force is not a struct schemaString: {schema[:200]!r}") from exc
    columns: dict[str, tuple[str, int]] = {}
    for f in fields if isinstance(fields, list) else []:
        meta = f.get("metadata") if isinstance(f, dict) else None
        physical = meta.get(PHYSICAL_NAME) if isinstance(meta, dict) else None
        column_id = meta.get(ID) if isinstance(meta, dict) else None
        if not isinstance(f.get("name"), str) or not isinstance(physical, str) or not physical:
            raise CorruptFileError(f"a column of the Delta schema in force has no physical name: {f!r:.200}")
        if isinstance(column_id, bool) or not isinstance(column_id, int):
            raise CorruptFileError(f"column {f['name']!r} of the Delta schema in force has no column id: {f!r:.200}")
        columns[f["name"]] = (physical, column_id)
    return ColumnNames(columns)


def nested_renames(schema: str) -> list[str]:
    """Nested fields whose physical name differs from their name (dbidx maps top-level columns only)."""
    try:
        root = json.loads(schema)
    except (TypeError, ValueError):
        return []
    found: list[str] = []

    def walk(node: Any, prefix: str, top: bool) -> None:
        if not isinstance(node, dict):
            return
        for f in node.get("fields") or []:
            if not isinstance(f, dict):
                continue
            name = f"{prefix}{f.get('name')}"
            meta = f.get("metadata") or {}
            physical = meta.get(PHYSICAL_NAME) if isinstance(meta, dict) else None
            if not top and physical is not None and physical != f.get("name"):
                found.append(name)
            walk(f.get("type"), name + ".", False)
        for inner in ("elementType", "valueType", "keyType"):
            walk(node.get(inner), prefix, False)

    walk(root, "", True)
    return sorted(found)
