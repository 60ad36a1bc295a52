"""NOT NULL of a Delta schema (data/not_null.py): read from a schemaString (a damaged one names none here), and
enforced on the rows an upsert writes, delete rows aside, at the top level and below it (struct fields, array
elements, map values)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from dbidx.data.not_null import check_not_null, required_paths
from dbidx.errors import InvalidInputError


def _schema(*fields: dict) -> str:
    return json.dumps({"type": "struct", "fields": list(fields)})


def _field(name: str, delta_type: object, nullable: bool = True) -> dict:
    return {"name": name, "type": delta_type, "nullable": nullable, "metadata": {}}


def test_not_null_paths_of_a_schema_string() -> None:
    point = {"type": "struct", "fields": [_field("x", "long", False), _field("y", "long")]}
    tags = {"type": "array", "elementType": "string", "containsNull": False}
    attrs = {"type": "map", "keyType": "string", "valueType": "long", "valueContainsNull": False}
    schema = _schema(_field("id", "string", False), _field("p", point), _field("t", tags), _field("a", attrs))
    assert required_paths(schema) == {"id", "p.x", "t[]", "a{}"}  # the top-level column, and below the others
    for damaged in (None, "", "[", "[]", '{"fields": 3}', json.dumps({"fields": [1, {"nullable": False}]})):
        assert required_paths(damaged) == set()


def test_rows_to_write_fill_the_not_null_columns() -> None:
    schema = _schema(_field("id", "string", False), _field("v", "long", False))
    rows = pa.table({"id": ["a", "b", "c"], "v": [1, None, None], "_dbidx_delete": [False, True, None]})
    check_not_null(rows.slice(0, 2), schema, "_dbidx_delete", "here")  # the null row is a delete
    with pytest.raises(InvalidInputError, match=r"here: 'v' is NOT NULL .*1 value\(s\)"):
        check_not_null(rows, schema, "_dbidx_delete", "here")  # a null flag is no delete
    with pytest.raises(InvalidInputError, match=r"2 value\(s\)"):
        check_not_null(rows.drop_columns(["_dbidx_delete"]), schema, None, "here")
    check_not_null(rows.select(["id"]), schema, None, "here")  # (a missing column is the schema check's)


def test_nested_not_null_is_enforced_where_the_parent_holds_a_value() -> None:
    point = {"type": "struct", "fields": [_field("x", "long", False)]}
    tags = {"type": "array", "elementType": "string", "containsNull": False}
    schema = _schema(_field("p", point), _field("t", tags))
    struct = pa.StructArray.from_arrays([pa.array([1, None, None])], names=["x"], mask=pa.array([False, True, False]))
    rows = pa.table({"p": struct, "t": pa.array([["a"], None, ["b"]])})
    with pytest.raises(InvalidInputError, match=r"'p.x' is NOT NULL .*1 value\(s\)"):
        check_not_null(rows, schema, None, "here")  # row 2's p is null (fine), row 3's p.x is not
    check_not_null(rows.slice(0, 2), schema, None, "here")
    bad = pa.table({"p": struct.slice(0, 2), "t": pa.array([["a", None], None])})
    with pytest.raises(InvalidInputError, match=r"'t\[\]' is NOT NULL"):
        check_not_null(bad, schema, None, "here")
