"""NOT NULL in a Delta schema, enforced on the rows an upsert writes: a top-level column's `nullable: false`, and
below it a struct field's, an array's `containsNull: false` and a map's `valueContainsNull: false`.

Why: Delta Spark fails every read of a table holding a null where its schema says there is none
(DELTA_NOT_NULL_CONSTRAINT_VIOLATED), so one bad row would take the whole table from every Delta Spark reader.
The schema is the one in force (data/column_mapping.schema_string_in_force); the check runs in the tasks on the rows
they are about to write (deletes aside), before any file is written; a violation is an InvalidInputError naming
the column path and how many values.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from dbidx.errors import InvalidInputError


def required_paths(schema_string: Any) -> set[str]:
    """Every path the schema declares NOT NULL (a column, a struct field, an array's elements `[]`, a map's values
    `{}`): what the publish check compares (an upsert checked against fewer must not publish)."""
    out: set[str] = set()

    def walk(delta_type: Any, nullable: bool, path: str) -> None:
        if not nullable:
            out.add(path)
        if not isinstance(delta_type, dict):
            return
        kind = delta_type.get("type")
        if kind == "struct":
            for child in delta_type.get("fields") or []:
                if isinstance(child, dict) and isinstance(child.get("name"), str):
                    walk(child.get("type"), child.get("nullable") is not False, f"{path}.{child['name']}")
        elif kind == "array":
            walk(delta_type.get("elementType"), delta_type.get("containsNull") is not False, f"{path}[]")
        elif kind == "map":
            walk(delta_type.get("valueType"), delta_type.get("valueContainsNull") is not False, f"{path}{{}}")

    for f in _fields(schema_string):
        walk(f.get("type"), f.get("nullable") is not False, f["name"])
    return out


def check_not_null(rows: pa.Table, schema_string: str | None, delete_column: str | None, where: str) -> None:
    """Refuse rows to write (deletes aside) with a null where the schema in force says there is none."""
    fields = _fields(schema_string)
    if not fields or rows.num_rows == 0:
        return
    if delete_column and delete_column in rows.column_names:
        rows = rows.filter(pc.invert(pc.fill_null(rows.column(delete_column), False)))
    for f in fields:
        if f["name"] not in rows.column_names:
            continue  # (a missing column is the schema check's to name)
        column = rows.column(f["name"])
        found = _violation(
            column.combine_chunks() if column.num_chunks != 1 else column.chunk(0),
            f.get("type"),
            f.get("nullable") is not False,
            f["name"],
        )
        if found is not None:
            path, count = found
            raise InvalidInputError(
                f"{where}: {path!r} is NOT NULL in the table's Delta schema, and {count} value(s) to write are null "
                f"there; no row was written. Fill it, or drop the constraint with Delta Spark (ALTER TABLE "
                f"delta.`<uri>` ALTER COLUMN {f['name']} DROP NOT NULL) and sync"
            )


def _violation(values: pa.Array, delta_type: Any, nullable: bool, path: str) -> tuple[str, int] | None:
    """(path, nulls) of the first place under `values` that holds a null the Delta type forbids; None if none."""
    if not nullable and values.null_count:
        return path, values.null_count
    if not isinstance(delta_type, dict) or len(values) == 0:
        return None
    valid = values.filter(pc.is_valid(values)) if values.null_count else values
    kind = delta_type.get("type")
    if kind == "struct" and isinstance(valid, pa.StructArray):
        for i, child in enumerate(delta_type.get("fields") or []):
            if isinstance(child, dict) and isinstance(child.get("name"), str):
                index = valid.type.get_field_index(child["name"])
                if index >= 0:
                    inner = valid.field(index)
                    found = _violation(
                        inner, child.get("type"), child.get("nullable") is not False, f"{path}.{child['name']}"
                    )
                    if found is not None:
                        return found
    elif kind == "array" and isinstance(valid, (pa.ListArray, pa.LargeListArray)):
        return _violation(
            valid.flatten(), delta_type.get("elementType"), delta_type.get("containsNull") is not False, f"{path}[]"
        )
    elif kind == "map" and isinstance(valid, pa.MapArray):
        return _violation(
            valid.items, delta_type.get("valueType"), delta_type.get("valueContainsNull") is not False, f"{path}{{}}"
        )
    return None


def _fields(schema_string: Any) -> list[dict[str, Any]]:
    """The named top-level fields of a Delta schemaString (read back: a damaged one has none here; the metaData
    checks name it)."""
    try:
        fields = json.loads(schema_string).get("fields") if schema_string else None
    except (TypeError, ValueError, AttributeError):
        return []
    if not isinstance(fields, list):
        return []
    return [f for f in fields if isinstance(f, dict) and isinstance(f.get("name"), str)]
