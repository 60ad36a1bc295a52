"""Migration: build the index of an existing Parquet data set (pyarrow- and Spark-written)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dbidx.errors import CorruptFileError, DuplicateKeyError, InvalidInputError, InvalidKeyError
from dbidx.table.build_index import build_index, file_group_of
from dbidx.table.facade import Table

from tests.retention import clean_without_waiting


def write_dataset(root: Path, layout: dict[str, list[list[str]]]) -> dict[tuple[str, str], str]:
    """Write {partition: [keys of file 1, keys of file 2, ...]}; returns (partition, key) -> expected file group."""
    expected = {}
    for partition, files in layout.items():
        folder = root / partition if partition else root
        folder.mkdir(parents=True, exist_ok=True)
        for keys in files:
            name = f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"
            pq.write_table(pa.table({"id": keys, "v": list(range(len(keys)))}), folder / name)
            expected.update({(partition, k): name.removesuffix(".parquet") for k in keys})
    (root / "_SUCCESS").write_text("")
    return expected


def test_build_index_from_a_hive_partitioned_pyarrow_dataset(tmp_path):
    root = tmp_path / "data"
    expected = write_dataset(
        root,
        {
            "dt=2025-01-01": [[f"a{i}" for i in range(100)], [f"b{i}" for i in range(50)]],
            "dt=2025-01-02": [[f"a{i}" for i in range(10)]],  # same keys, other partition: fine (partitioned)
        },
    )
    table = Table.create(str(root), num_shards=3)
    result = build_index(table, "id", ["dt"])
    assert (result.files, result.partitions, result.keys) == (3, 2, 160)
    snap = table.snapshot("dt=2025-01-01")
    got = dict(zip(snap.column("key").to_pylist(), snap.column("file_group").to_pylist()))
    assert got == {k: v for (p, k), v in expected.items() if p == "dt=2025-01-01"}
    assert len(got) == 150
    assert table.snapshot("dt=2025-01-02").num_rows == 10
    assert table.timeline.completed()[0].action == "build_index"
    assert {s.partition: s.live_keys for s in table.partitions()} == {"dt=2025-01-01": 150, "dt=2025-01-02": 10}


def test_integer_keys_are_indexed_as_strings(tmp_path):
    root = tmp_path / "data"
    (root / "dt=1").mkdir(parents=True)
    pq.write_table(pa.table({"id": pa.array([1, 2, 3], pa.int64())}), root / "dt=1" / "f.parquet")
    table = Table.create(str(root), num_shards=2)
    build_index(table, "id")
    assert sorted(table.snapshot("dt=1").column("key").to_pylist()) == ["1", "2", "3"]


def test_duplicate_keys_name_both_files(tmp_path):
    root = tmp_path / "data"
    write_dataset(root, {"dt=2025-01-01": [["x", "y"], ["y", "z"]]})
    table = Table.create(str(root), num_shards=2)
    with pytest.raises(DuplicateKeyError, match=r"'y'.*part-.*part-"):
        build_index(table, "id")
    assert table.snapshot("dt=2025-01-01").num_rows == 0  # nothing published
    assert table.timeline.pending() == []
    assert len(list((root / "dt=2025-01-01").glob("*.parquet"))) == 2  # the source files are never touched


def test_files_of_two_types_for_one_column_are_a_schema_error(tmp_path):
    from dbidx.errors import SchemaError

    root = tmp_path / "data"
    (root / "dt=1").mkdir(parents=True)
    pq.write_table(pa.table({"id": ["a"], "v": pa.array([1], pa.int64())}), root / "dt=1" / "a.parquet")
    pq.write_table(pa.table({"id": ["b"], "v": ["one"]}), root / "dt=1" / "b.parquet")
    table = Table.create(str(root), num_shards=2)
    with pytest.raises(SchemaError, match=r"b.parquet: column 'v' is string, while earlier files have int64"):
        build_index(table, "id")
    assert [r.action for r in table.timeline.completed()] == ["rollback"]  # nothing published
    assert len(list((root / "dt=1").glob("*.parquet"))) == 2


def test_global_mode_rejects_a_key_in_two_partitions(tmp_path):
    root = tmp_path / "data"
    write_dataset(root, {"dt=1": [["k1", "k2"]], "dt=2": [["k2"]]})
    table = Table.create(str(root), num_shards=2, global_index=True)
    with pytest.raises(DuplicateKeyError, match="'k2'"):
        build_index(table, "id")


def test_bad_inputs(tmp_path):
    root = tmp_path / "data"
    write_dataset(root, {"dt=1": [["k1"]]})
    table = Table.create(str(root), num_shards=2)
    with pytest.raises(InvalidInputError, match="no column 'nope'"):
        build_index(table, "nope")
    with pytest.raises(InvalidInputError, match="partition columns"):
        build_index(table, "id", ["region"])
    empty = Table.create(str(tmp_path / "empty"), num_shards=2)
    with pytest.raises(InvalidInputError, match="no Parquet data files"):
        build_index(empty, "id")
    nulls = tmp_path / "nulls"
    (nulls / "dt=1").mkdir(parents=True)
    pq.write_table(pa.table({"id": ["a", None]}), nulls / "dt=1" / "f.parquet")
    with pytest.raises(InvalidKeyError, match="null"):
        build_index(Table.create(str(nulls), num_shards=2), "id")
    broken = tmp_path / "broken"
    (broken / "dt=1").mkdir(parents=True)
    (broken / "dt=1" / "f.parquet").write_bytes(b"PAR1 not really parquet")
    with pytest.raises(CorruptFileError, match="f.parquet"):
        build_index(Table.create(str(broken), num_shards=2), "id")


def test_build_index_refuses_a_non_empty_index(tmp_path):
    root = tmp_path / "data"
    write_dataset(root, {"dt=1": [["k1"]]})
    table = Table.create(str(root), num_shards=2)
    build_index(table, "id")
    with pytest.raises(InvalidInputError, match="already has 1 committed"):
        build_index(table, "id")


def test_file_group_naming():
    """The whole file name (without .parquet): stable, and unique within the directory."""
    assert file_group_of("part-00003-1b2c-c000.snappy.parquet") == "part-00003-1b2c-c000.snappy"
    assert file_group_of("events.2026-11-22.parquet") != file_group_of("events.2026-11-23.parquet")


@pytest.mark.spark
def test_build_index_from_a_spark_written_dataset(spark, tmp_path):
    rows = [(f"key-{i}", f"2025-01-0{1 + i % 3}", i) for i in range(3000)]
    df = spark.createDataFrame(rows, "id string, dt string, v int").repartition(4)
    out = str(tmp_path / "spark-data")
    df.write.partitionBy("dt").parquet(out)
    table = Table.create(out, num_shards=4)
    result = build_index(table, "id", ["dt"])
    assert result.keys == 3000 and result.partitions == 3
    for day in ("2025-01-01", "2025-01-02", "2025-01-03"):
        want = sorted(k for k, d, _ in rows if d == day)
        assert sorted(table.snapshot(f"dt={day}").column("key").to_pylist()) == want
    # Every key's file group is a real data file of its partition that holds it.
    sample = table.lookup(["key-0", "key-1"], "dt=2025-01-02")
    for key, fg in zip(sample.column("key").to_pylist(), sample.column("file_group").to_pylist()):
        files = list((Path(out) / "dt=2025-01-02").glob(f"{fg}*.parquet"))
        assert len(files) == 1 and key in pq.read_table(files[0]).column("id").to_pylist()


def test_sources_that_would_read_wrong_are_refused(tmp_path):
    from dbidx.errors import SchemaError

    root = tmp_path / "escaped"
    (root / "dt=2025-01-01%2010%3A00").mkdir(parents=True)
    pq.write_table(pa.table({"id": ["a"]}), root / "dt=2025-01-01%2010%3A00" / "f.parquet")
    with pytest.raises(InvalidInputError, match="percent-escaped"):
        build_index(Table.create(str(root), num_shards=1), "id")
    own = tmp_path / "own"
    (own / "dt=1").mkdir(parents=True)
    pq.write_table(pa.table({"id": ["a"], "_dbidx_deleted": [True]}), own / "dt=1" / "f.parquet")
    with pytest.raises(SchemaError, match="_dbidx_deleted"):
        build_index(Table.create(str(own), num_shards=1), "id")


def test_clean_keeps_migrated_source_files_unless_asked(tmp_path):
    from dbidx.config import CacheConfig
    from dbidx.spark_integration.local import upsert_arrow

    root = tmp_path / "data"
    (root / "dt=a").mkdir(parents=True)
    source = root / "dt=a" / "part-0.parquet"
    pq.write_table(pa.table({"id": ["k"], "v": pa.array([1], pa.int64())}), source)
    table = Table.create(str(root), num_shards=1)
    build_index(table, "id", ["dt"])
    upsert_arrow(
        pa.table({"id": ["k"], "dt": ["dt=a"], "v": pa.array([2], pa.int64())}),
        table,
        key="id",
        partition="dt",
        hive_style=False,
        cache_config=CacheConfig(base_path=str(tmp_path / "cache")),
    )
    clean_without_waiting(table)
    assert table.compact_data().files_replaced == 2
    table.clean(retain_completions=0)
    assert source.exists()  # the user's file: replaced, but kept
    table.clean(retain_completions=0, delete_migrated=True)
    assert not source.exists()
