"""Issue 29, point 5 after the audit: `.tmp-*` files of dead writers (older than the hour's age guard) go at the next
upsert (only in the directories the batch writes to), at index compaction and at data compaction; a live writer's
fresh temp file stays."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pytest

from dbidx.config import CacheConfig
from dbidx.data.reads import read_arrow
from dbidx.table.facade import Table
from dbidx.spark_integration.local import upsert_arrow
from dbidx.storage import layout

OLD = 1e9  # 2001: a dead writer's


def rows(ids: list[str], day: str = "2025-03-01", v: int = 1) -> pa.Table:
    return pa.table({"id": ids, "dt": [day] * len(ids), "v": pa.array([v] * len(ids), pa.int64())})


def temp(root: Path, rel_dir: str, name: str, old: bool) -> Path:
    path = root / rel_dir / f".tmp-{name}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"partial")
    if old:
        os.utime(path, (OLD, OLD))
    return path


def test_the_next_upsert_sweeps_old_temp_files_of_the_partitions_it_writes(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "c"))
    upsert_arrow(rows(["a"]), table, key="id", partition="dt", cache_config=config)
    upsert_arrow(rows(["z"], day="2025-03-09"), table, key="id", partition="dt", cache_config=config)
    root = tmp_path / "t"
    old_data = temp(root, "dt=2025-03-01", "0a", old=True)
    old_index = temp(root, layout.rli_dir("dt=2025-03-01", 0), "1b", old=True)
    fresh = temp(root, "dt=2025-03-01", "2c", old=False)  # a live writer's
    untouched = temp(root, "dt=2025-03-09", "3d", old=True)  # a partition this batch does not write: not listed
    upsert_arrow(rows(["a", "b"], v=2), table, key="id", partition="dt", cache_config=config)
    assert not old_data.exists() and not old_index.exists()
    assert fresh.exists() and untouched.exists()
    assert sorted(read_arrow(Table.open(table.uri)).column("id").to_pylist()) == ["a", "b", "z"]


@pytest.mark.parametrize("how", ["index", "data"])
def test_compactions_sweep_old_temp_files_of_the_whole_table(tmp_path: Path, how: str) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "c"))
    for v, ids in ((1, ["a", "b"]), (2, ["b", "c"])):  # a new key: an index delta and a data file more
        upsert_arrow(rows(ids, v=v), table, key="id", partition="dt", cache_config=config)
    root = tmp_path / "t"
    old = [
        temp(root, "dt=2025-03-01", "0a", old=True),
        temp(root, "dt=2025-04-01", "1b", old=True),
        temp(root, layout.rli_dir("dt=2025-03-01", 0), "2c", old=True),
        temp(root, ".dbidx/timeline", "3d", True),
    ]
    fresh = temp(root, "dt=2025-03-01", "4e", old=False)
    result = table.compact(min_files=2) if how == "index" else table.compact_data(min_files=2)
    assert result.record is not None  # the compaction ran
    assert [p for p in old if p.exists()] == [] and fresh.exists()
    assert sorted(read_arrow(Table.open(table.uri)).column("id").to_pylist()) == ["a", "b", "c"]
