"""Issue 29, point 7 after the audit: key columns of a type with no exact text form (float, bool, list, struct,
map) are the same typed InvalidKeyError, naming the column and its type, in upsert_arrow, the batch path and
build_index; nothing is written."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dbidx.config import CacheConfig
from dbidx.errors import InvalidKeyError
from dbidx.table.build_index import build_index
from dbidx.table.facade import Table
from dbidx.spark_integration.local import upsert_arrow
from dbidx.spark_integration.tagger import TagOptions

UNFIT = [
    (pa.array([True, False]), r"bool: a boolean key holds two records at most"),
    (pa.array([[1], [2]]), r"list<(item|element): int64>: a list, struct or map key"),
    (pa.array([{"a": 1}, {"a": 2}]), r"struct<a: int64>: a list, struct or map key"),
    (pa.array([[("k", 1)], [("k", 2)]], pa.map_(pa.string(), pa.int64())), r"map<string, int64.*>: a list, struct"),
    (pa.array([1.0, 2.0]), r"double: a floating-point key is not exact"),
]
IDS = ["bool", "list", "struct", "map", "float"]


@pytest.mark.parametrize("keys, match", UNFIT, ids=IDS)
def test_upsert_arrow_refuses_a_key_column_of_an_unfit_type(tmp_path: Path, keys: pa.Array, match: str) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    data = pa.table({"id": keys, "dt": ["2025-03-01"] * 2})
    with pytest.raises(InvalidKeyError, match=f"key column 'id' of the upsert table is {match}"):
        upsert_arrow(data, table, key="id", partition="dt", cache_config=CacheConfig(base_path=str(tmp_path / "c")))
    assert table.latest() is None and table.timeline.pending() == []


@pytest.mark.parametrize("keys, match", UNFIT, ids=IDS)
def test_the_batch_path_refuses_a_key_column_of_an_unfit_type(keys: pa.Array, match: str) -> None:
    options = TagOptions(key="id", partition="dt")
    with pytest.raises(InvalidKeyError, match=f"key column 'id' of the batch is {match}"):
        options.keys_of(pa.table({"id": keys, "dt": ["2025-03-01"] * 2}))


@pytest.mark.parametrize("keys, match", UNFIT, ids=IDS)
def test_build_index_refuses_a_key_column_of_an_unfit_type(tmp_path: Path, keys: pa.Array, match: str) -> None:
    (tmp_path / "t" / "dt=1").mkdir(parents=True)
    pq.write_table(pa.table({"id": keys}), tmp_path / "t" / "dt=1" / "f.parquet")
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    with pytest.raises(InvalidKeyError, match=f"key column 'id' of data file .*f.parquet is {match}"):
        build_index(table, "id")
    table.timeline.refresh()
    assert {r.action for r in table.timeline.completed()} <= {"rollback"} and table.timeline.pending() == []
