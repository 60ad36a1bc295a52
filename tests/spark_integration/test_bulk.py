"""The bulk path: a table's first write and bulk_insert into new partitions skip the caches, and the table, the
index and later upserts are exactly what the per-key path gives."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from dbidx.config import CacheConfig
from dbidx.data import reads
from dbidx.errors import ConflictError, InvalidInputError
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table
from dbidx.spark_integration import shard_sessions, task
from dbidx.spark_integration.bulk import empty_table_seq, new_partitions_seq
from dbidx.spark_integration.local import upsert_arrow

from tests.data.test_compaction import as_arrow, current


def rows(n: int, day: str, value: int, start: int = 0) -> list[tuple]:
    return [(f"k{i:05d}", day, value, False) for i in range(start, start + n)]


@pytest.mark.parametrize("global_index", [False, True], ids=["partitioned", "global"])
def test_a_first_write_takes_the_bulk_path_and_later_upserts_see_it(
    tmp_path: Path, monkeypatch, global_index: bool
) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=3, global_index=global_index)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    opened = []
    real_session = shard_sessions.shard_session

    def counting_session(*args, **kwargs):
        opened.append(args[1])
        return real_session(*args, **kwargs)

    monkeypatch.setattr(shard_sessions, "shard_session", counting_session)
    first = rows(500, "d1", 1) + rows(300, "d2", 1, start=1000) + [("k00001", "d1", 9, False), ("gone", "d1", 0, True)]
    summary = upsert_arrow(as_arrow(first), table, key="id", partition="dt", ordering="v", cache_config=config)
    # 1. No cache was opened; repeats collapsed by the ordering column; the delete deleted nothing.
    assert opened == []
    assert (summary.inserts, summary.updates, summary.deletes_missing, summary.duplicates_dropped) == (800, 0, 1, 1)
    expected = {(k, d, v) for k, d, v, _ in first[:800]} - {("k00001", "d1", 1)} | {("k00001", "d1", 9)}
    assert current(table) == expected
    assert verify_table(table).ok
    # 2. The next batch is per-key: updates find the bulk-loaded keys, new keys are new, deletes delete.
    second = rows(100, "d1", 2) + rows(50, "d3", 2, start=5000) + [("k01000", "d2", 0, True)]
    summary = upsert_arrow(as_arrow(second), table, key="id", partition="dt", cache_config=config)
    assert opened  # caches in use again
    assert (summary.inserts, summary.updates, summary.deletes) == (50, 100, 1)
    expected = {r for r in expected if not (r[0] in {k for k, *_ in second[:100]} and r[1] == "d1")}
    expected = (expected | {(k, d, v) for k, d, v, _ in second[:150]}) - {("k01000", "d2", 1)}
    assert current(table) == expected
    assert empty_table_seq(table) is None


def test_a_concurrent_write_of_the_same_keys_is_a_conflict(tmp_path: Path, monkeypatch) -> None:
    """Two first loads of one key: the bulk path's keys are checked at publish like any upsert's."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    real = task.upsert_batches

    def other_writer_first(*args, **kwargs):
        with table.new_commit() as writer:
            writer.insert("dt=d1", ["k00003"], "elsewhere")
        return real(*args, **kwargs)

    monkeypatch.setattr(task, "upsert_batches", other_writer_first)
    with pytest.raises(ConflictError):
        upsert_arrow(as_arrow(rows(10, "d1", 1)), table, key="id", partition="dt", cache_config=config)
    monkeypatch.undo()
    assert reads.read_arrow(table).num_rows == 0
    assert table.lookup(["k00003"], "dt=d1").column("file_group").to_pylist() == ["elsewhere"]


def test_bulk_insert_takes_only_partitions_the_table_never_had(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    upsert_arrow(as_arrow(rows(20, "d1", 1)), table, key="id", partition="dt", cache_config=config)
    assert new_partitions_seq(table, ["dt=d2", "dt=d3"]) == table.timeline.latest_seq
    with pytest.raises(InvalidInputError, match=r"\['dt=d1'\]"):
        new_partitions_seq(table, ["dt=d2", "dt=d1"])
    glob = Table.create(str(tmp_path / "g"), num_shards=2, global_index=True)
    assert new_partitions_seq(glob, ["dt=d1"]) == 0
    upsert_arrow(as_arrow(rows(5, "d1", 1)), glob, key="id", partition="dt", cache_config=config)
    with pytest.raises(InvalidInputError, match="empty table"):
        new_partitions_seq(glob, ["dt=d9"])


@pytest.mark.spark
def test_spark_bulk_insert_backfills_new_partitions(spark, tmp_path: Path) -> None:
    from dbidx.spark_integration.api import upsert
    from dbidx.spark_integration.api import bulk_insert

    table = Table.create(str(tmp_path / "t"), num_shards=2)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    schema = "id string, dt string, v long"
    upsert(
        spark.createDataFrame([(f"k{i}", "d1", 1) for i in range(50)], schema),
        table,
        key="id",
        partition="dt",
        cache_config=config,
    )
    backfill = spark.createDataFrame([(f"k{i}", "d2", 2) for i in range(30)] + [("k1", "d2", 3)], schema)
    summary = bulk_insert(backfill, table, key="id", partition="dt", ordering="v", cache_config=config)
    assert (summary.inserts, summary.updates, summary.duplicates_dropped) == (30, 0, 1)
    with pytest.raises(InvalidInputError, match="dt=d1"):
        bulk_insert(
            spark.createDataFrame([("x", "d1", 1)], schema), table, key="id", partition="dt", cache_config=config
        )
    summary = upsert(
        spark.createDataFrame([("k1", "d2", 4), ("k2", "d1", 4)], schema),
        table,
        key="id",
        partition="dt",
        cache_config=config,
    )
    assert (summary.inserts, summary.updates) == (0, 2)
    data = reads.read_arrow(table)
    got = dict(zip(zip(data.column("id").to_pylist(), data.column("dt").to_pylist()), data.column("v").to_pylist()))
    assert len(got) == 80 and got[("k1", "d2")] == 4 and got[("k2", "d1")] == 4 and got[("k0", "d2")] == 2
    assert pa.types.is_int64(data.schema.field("v").type)
