"""The NOT NULL columns of a Delta schema (data/schema.py): read from a schemaString (read back: a damaged one
names none rather than failing here), and enforced on the rows an upsert writes, delete rows aside."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from dbidx.data.schema import check_not_null, not_null_columns
from dbidx.errors import InvalidInputError


def test_not_null_columns_of_a_schema_string() -> None:
    fields = [
        {"name": "id", "type": "string", "nullable": False, "metadata": {}},
        {"name": "v", "type": "long", "nullable": True, "metadata": {}},
        {"name": "a", "type": "long", "nullable": False, "metadata": {}},
    ]
    assert not_null_columns(json.dumps({"type": "struct", "fields": fields})) == ["a", "id"]
    for damaged in (None, "", "[", "[]", '{"fields": 3}', json.dumps({"fields": [1, {"nullable": False}]})):
        assert not_null_columns(damaged) == []


def test_rows_to_write_fill_the_not_null_columns() -> None:
    rows = pa.table({"id": ["a", "b", "c"], "v": [1, None, None], "_dbidx_delete": [False, True, None]})
    check_not_null(rows.slice(0, 2), ["v"], "_dbidx_delete", "here")  # the null row is a delete
    with pytest.raises(InvalidInputError, match=r"here: column 'v' is NOT NULL .*1 row\(s\)"):
        check_not_null(rows, ["v"], "_dbidx_delete", "here")  # a null flag is no delete
    with pytest.raises(InvalidInputError, match=r"2 row\(s\)"):
        check_not_null(rows, ["v", "missing"], None, "here")
    check_not_null(rows, ["id"], None, "here")
