"""Reading the table without Spark (Arrow, DuckDB) and with it, per file group; the recorded data schema."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from dbidx.config import CacheConfig
from dbidx.data import reads
from dbidx.errors import SchemaError
from dbidx.table.facade import Table
from dbidx.spark_integration.local import upsert_arrow


def rows(ids: list[str], dt: str, v: int, delete: bool = False) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(ids),
            "dt": pa.array([dt] * len(ids)),
            "v": pa.array([v] * len(ids), pa.int64()),
            "_dbidx_delete": pa.array([delete] * len(ids)),
        }
    )


def write(table: Table, data: pa.Table, tmp_path: Path) -> None:
    upsert_arrow(data, table, key="id", partition="dt", cache_config=CacheConfig(base_path=str(tmp_path / "cache")))


def as_set(data: pa.Table, *columns: str) -> set[tuple]:
    return set(zip(*(data.column(c).to_pylist() for c in columns)))


@pytest.fixture()
def table(tmp_path: Path) -> Table:
    return Table.create(str(tmp_path / "t"), num_shards=2)


def test_arrow_read_latest_commit_wins_and_deletes_drop(table: Table, tmp_path: Path) -> None:
    write(table, pa.concat_tables([rows([f"k{i}" for i in range(20)], "d1", 1), rows(["x"], "d2", 1)]), tmp_path)
    write(table, rows([f"k{i}" for i in range(5)], "d1", 2), tmp_path)  # updates
    write(table, rows(["k19"], "d1", 0, delete=True), tmp_path)  # a delete
    write(table, rows(["k0"], "d1", 3), tmp_path)  # a second update of the same key
    expected = (
        {(f"k{i}", "d1", 1) for i in range(5, 19)}
        | {(f"k{i}", "d1", 2) for i in range(1, 5)}
        | {("k0", "d1", 3), ("x", "d2", 1)}
    )
    current = reads.read_arrow(table)
    assert current.num_rows == len(expected) and as_set(current, "id", "dt", "v") == expected
    assert current.schema.names == ["id", "dt", "v"]  # no _dbidx_ column, the delete flag neither
    # Partition and column pruning; the file group and the instant that wrote each row on request.
    only = reads.read_arrow(table, partitions=["dt=d2"], columns=["id", "v"], with_meta=True)
    assert only.schema.names == ["id", "v", "_dbidx_file_group", "_dbidx_instant"]
    assert only.column("id").to_pylist() == ["x"]
    assert only.column("_dbidx_instant")[0].as_py() == table.timeline.completed()[0].instant
    # Streaming: the same rows, one file group at a time.
    streamed = reads.record_batch_reader(table).read_all()
    assert as_set(streamed, "id", "dt", "v") == expected
    with pytest.raises(Exception, match="not in the table"):
        reads.read_arrow(table, columns=["nope"])


def test_duckdb_reads_the_arrow_snapshot(table: Table, tmp_path: Path) -> None:
    duckdb = pytest.importorskip("duckdb", reason="duckdb (dev extra) is not installed")
    write(table, rows(["a", "b", "c"], "d1", 1), tmp_path)
    write(table, rows(["a"], "d1", 5), tmp_path)
    snapshot = reads.read_arrow(table)  # noqa: F841 - DuckDB finds the Arrow table by its variable name
    assert duckdb.sql("select sum(v) as s, count(*) as n from snapshot").fetchone() == (7, 3)


def test_empty_table_reads_empty_with_the_schema(table: Table, tmp_path: Path) -> None:
    assert reads.read_arrow(table).num_rows == 0  # never written: no columns known yet, nothing raised
    write(table, rows(["a"], "d1", 1), tmp_path)
    write(table, rows(["a"], "d1", 1, delete=True), tmp_path)
    empty = reads.read_arrow(table)
    assert empty.num_rows == 0 and empty.schema.names == ["id", "dt", "v"]


def test_schema_is_recorded_and_checked_before_anything_is_written(table: Table, tmp_path: Path) -> None:
    write(table, rows(["a", "b"], "d1", 1), tmp_path)
    assert table.data_schema() == pa.schema([("id", pa.string()), ("dt", pa.string()), ("v", pa.int64())])
    seq = table.timeline.latest_seq
    # A payload of another type, a key of another type, a missing column: SchemaError, nothing published.
    bad_v = rows(["a"], "d1", 1).set_column(2, "v", pa.array(["1"]))
    with pytest.raises(SchemaError, match=r"column 'v' is string, the table's schema says int64"):
        write(table, bad_v, tmp_path)
    bad_key = rows(["a"], "d1", 1).set_column(0, "id", pa.array([7], pa.int64()))
    with pytest.raises(SchemaError, match=r"column 'id' is int64"):
        write(table, bad_key, tmp_path)
    with pytest.raises(SchemaError, match=r"no column 'v'"):
        write(table, rows(["a"], "d1", 1).drop_columns(["v"]), tmp_path)
    table.refresh()
    assert table.timeline.latest_seq == seq and not table.timeline.pending()
    # string and large_string are one type (Polars and pandas may hand over either)
    write(table, rows(["a"], "d1", 1).set_column(0, "id", pa.array(["a"], pa.large_string())), tmp_path)
    # A new column evolves the schema: older rows read it as null, newer ones carry it.
    evolved = rows(["b"], "d1", 2).append_column("note", pa.array(["hi"]))
    write(table, evolved, tmp_path)
    assert table.data_schema().names == ["id", "dt", "v", "note"]
    current = reads.read_arrow(table)
    assert as_set(current, "id", "v", "note") == {("a", 1, None), ("b", 2, "hi")}
    # From now on the new column belongs to the table like the others.
    with pytest.raises(SchemaError, match=r"no column 'note'"):
        write(table, rows(["a"], "d1", 3), tmp_path)


def test_a_long_key_table_reads_back(tmp_path: Path) -> None:
    """A table whose first write had a long key keeps it: its files and reads stay consistent."""
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    data = pa.table({"id": pa.array([1, 2, 3], pa.int64()), "dt": ["d"] * 3, "v": pa.array([1, 1, 1], pa.int64())})
    write(table, data, tmp_path)
    write(table, data.set_column(2, "v", pa.array([1, 9, 1], pa.int64())).slice(1, 1), tmp_path)
    current = reads.read_arrow(table)
    assert current.schema.field("id").type == pa.int64()
    assert sorted(as_set(current, "id", "v")) == [(1, 1), (2, 9), (3, 1)]
    assert pc.sum(current.column("v")).as_py() == 11


@pytest.mark.spark
def test_spark_read_table_empty_pruned_and_schema_error(spark, tmp_path: Path) -> None:
    from dbidx.spark_integration.api import upsert
    from dbidx.spark_integration.reads import read_table

    table = Table.create(str(tmp_path / "t"), num_shards=2)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    assert read_table(spark, table).count() == 0
    schema = "id string, dt string, v long, _dbidx_delete boolean"
    upsert(
        spark.createDataFrame([("a", "d1", 1, False), ("b", "d2", 2, False)], schema),
        table,
        key="id",
        partition="dt",
        cache_config=config,
    )
    upsert(
        spark.createDataFrame([("a", "d1", 3, False), ("b", "d2", 0, True)], schema),
        table,
        key="id",
        partition="dt",
        cache_config=config,
    )
    assert read_table(spark, table).count() == 1
    assert [tuple(r) for r in read_table(spark, table, columns=["id", "v"]).collect()] == [("a", 3)]
    meta = read_table(spark, table, partitions=["dt=d1"], with_meta=True).collect()
    assert len(meta) == 1 and meta[0]._dbidx_file_group and meta[0]._dbidx_instant
    assert read_table(spark, table, partitions=["dt=d2"]).count() == 0
    first = sorted(tuple(r) for r in read_table(spark, table, columns=["id", "v"], version=1).collect())
    assert first == [("a", 1), ("b", 2)]  # time travel: the Delta version of the first upsert
    seq = table.timeline.latest_seq
    with pytest.raises(SchemaError, match="column 'v' is string"):
        upsert(
            spark.createDataFrame([("a", "d1", "x", False)], "id string, dt string, v string, _dbidx_delete boolean"),
            table,
            key="id",
            partition="dt",
            cache_config=config,
        )
    table.refresh()
    assert table.timeline.latest_seq == seq  # raised on the driver before a job: not even a rollback


@pytest.mark.spark
def test_a_migrated_table_is_table_data(spark, tmp_path: Path) -> None:
    """build-index lists the source files as the table's data: reads return them, upserts update and delete them."""
    import pandas as pd
    import pyarrow.parquet as pq

    from dbidx.table.build_index import build_index
    from dbidx.spark_integration.api import upsert
    from dbidx.spark_integration.reads import read_table

    # 1. A hive-partitioned data set as a pipeline left it: dt only in the directory names, two files per day,
    #    names that differ only after their first dot.
    root = tmp_path / "events"
    source = []
    for day in ("2026-11-22", "2026-11-23"):
        (root / f"dt={day}").mkdir(parents=True)
        for part in range(2):
            ids = [f"{day}-{part}-{i}" for i in range(50)]
            pq.write_table(
                pa.table({"id": ids, "v": pa.array(range(50), pa.int64())}),
                root / f"dt={day}" / f"events.{day}.{part}.parquet",
            )
            source += [(k, day, i) for i, k in enumerate(ids)]
    table = Table.create(str(root), num_shards=2)
    result = build_index(table, "id", ["dt"])
    assert result.keys == 200
    assert table.data_schema() == pa.schema([("id", pa.string()), ("v", pa.int64()), ("dt", pa.string())])
    # 2. Five updates, five deletes of migrated keys, five inserts.
    schema = "id string, dt string, v long, _dbidx_delete boolean"
    updates = [(k, day, 1000 + i, False) for i, (k, day, _) in enumerate(source[:5])]
    deletes = [(k, day, 0, True) for k, day, _ in source[100:105]]
    inserts = [(f"new-{i}", "2026-11-23", i, False) for i in range(5)]
    summary = upsert(
        spark.createDataFrame(updates + deletes + inserts, schema),
        table,
        key="id",
        partition="dt",
        cache_config=CacheConfig(base_path=str(tmp_path / "cache")),
    )
    assert (summary.updates, summary.deletes, summary.inserts) == (5, 5, 5)
    # 3. The expected table, computed independently with pandas.
    frame = pd.DataFrame(source, columns=["id", "dt", "v"])
    change = pd.DataFrame(updates + deletes + inserts, columns=["id", "dt", "v", "gone"])
    merged = pd.concat([frame.assign(gone=False, order=0), change.assign(order=1)])
    merged = merged.sort_values("order").drop_duplicates(["dt", "id"], keep="last")
    expected = {tuple(r) for r in merged[~merged.gone][["id", "dt", "v"]].itertuples(index=False)}
    assert len(expected) == 200
    got = {(r.id, r.dt, r.v) for r in read_table(spark, table).select("id", "dt", "v").collect()}
    assert got == expected
    assert as_set(reads.read_arrow(table), "id", "dt", "v") == expected
    # The source files were listed by reference, not copied; each is its own file group, named by its whole name.
    groups = {s for s in reads.read_arrow(table, with_meta=True).column("_dbidx_file_group").to_pylist()}
    assert {"events.2026-11-22.0", "events.2026-11-22.1", "events.2026-11-23.0"} <= groups


def test_the_layout_and_dbidx_names_are_checked_before_anything_runs(table: Table, tmp_path: Path) -> None:
    from dbidx.errors import ConfigError

    write(table, rows(["a"], "d1", 1), tmp_path)
    seq = table.timeline.latest_seq
    data = rows(["a"], "d1", 2).append_column("name", pa.array(["n"]))
    with pytest.raises(ConfigError, match=r"written with key='id', but this upsert passes key='name'"):
        upsert_arrow(data, table, key="name", partition="dt", cache_config=CacheConfig(base_path=str(tmp_path / "c")))
    with pytest.raises(SchemaError, match=r"\['_dbidx_note'\] in dbidx's own"):
        write(table, rows(["a"], "d1", 2).append_column("_dbidx_note", pa.array(["x"])), tmp_path)
    table.refresh()
    assert table.timeline.latest_seq == seq


def test_two_upserts_that_change_the_schema_at_once_do_not_both_publish(
    table: Table, tmp_path: Path, monkeypatch
) -> None:
    """B adds column y and publishes while A (which adds x, checked against the schema before y) runs: A must not
    publish a schema without y."""
    from dbidx.errors import ConflictError
    from dbidx.spark_integration import task

    write(table, rows(["a"], "d1", 1), tmp_path)
    real = task.upsert_batches
    once = []

    def meanwhile(*args, **kwargs):
        if not once:
            once.append(1)
            write(Table.open(table.uri), rows(["b"], "d1", 1).append_column("y", pa.array(["why"])), tmp_path)
        return real(*args, **kwargs)

    monkeypatch.setattr(task, "upsert_batches", meanwhile)
    with pytest.raises(ConflictError, match="changed the table's data schema"):
        write(table, rows(["c"], "d1", 1).append_column("x", pa.array(["ex"])), tmp_path)
    monkeypatch.undo()
    assert table.data_schema().names == ["id", "dt", "v", "y"]
    assert as_set(reads.read_arrow(table), "id", "y") == {("a", None), ("b", "why")}
    # The retry is checked against the new schema: it must carry y now.
    with pytest.raises(SchemaError, match="no column 'y'"):
        write(table, rows(["c"], "d1", 1).append_column("x", pa.array(["ex"])), tmp_path)


def test_schema_types_equal_up_to_what_does_not_change_a_value() -> None:
    from dbidx.data.schema import same_type

    assert same_type(pa.timestamp("us", tz="UTC"), pa.timestamp("us", tz="Etc/UTC"))
    assert not same_type(pa.timestamp("us", tz="UTC"), pa.timestamp("us"))
    assert not same_type(pa.timestamp("us", tz="UTC"), pa.timestamp("ns", tz="UTC"))
    assert same_type(pa.struct([pa.field("a", pa.int64(), nullable=False)]), pa.struct([("a", pa.int64())]))
    assert same_type(pa.list_(pa.large_string()), pa.large_list(pa.string()))
    assert not same_type(pa.int32(), pa.int64())


@pytest.mark.spark
def test_spark_upsert_with_a_timestamp_column(spark, tmp_path: Path) -> None:
    import datetime as dt

    from dbidx.spark_integration.api import upsert
    from dbidx.spark_integration.reads import read_table

    table = Table.create(str(tmp_path / "t"), num_shards=2)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    schema = "id string, dt string, ts timestamp"
    when = dt.datetime(2026, 11, 23, 12, 0, 0)
    for minutes in (0, 5):
        upsert(
            spark.createDataFrame([("a", "d1", when + dt.timedelta(minutes=minutes))], schema),
            table,
            key="id",
            partition="dt",
            cache_config=config,
        )
    assert [r.ts for r in read_table(spark, table).collect()] == [when + dt.timedelta(minutes=5)]
    assert pa.types.is_timestamp(table.data_schema().field("ts").type)
