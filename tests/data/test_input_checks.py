"""Input checks of issue 42 (item 6): each refusal is a typed error naming what and where, raised before anything is
written (no new completion record, no new Delta version), with real files: pyarrow Parquet, deltalake writes,
the shard caches on disk."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from deltalake import DeltaTable, write_deltalake
from pyroaring import BitMap

from dbidx.cli import main
from dbidx.config import CacheConfig
from dbidx.data import reads
from dbidx.data.deletion_vectors import DvFileBuilder, encode_vector, inline_form, z85_encode
from dbidx.errors import (
    CorruptFileError,
    DeltaFeatureError,
    InvalidInputError,
    InvalidPartitionError,
    SchemaError,
)
from dbidx.table.build_index import build_index
from dbidx.table.facade import Table
from dbidx.spark_integration.local import upsert_arrow

from tests.delta_readers import assert_readers_agree
from tests.retention import clean_without_waiting


def _config(tmp_path: Path) -> CacheConfig:
    return CacheConfig(base_path=str(tmp_path / "cache"))


def _actions(path: Path | str) -> list[str]:
    """The actions of the table's completion records, read afresh."""
    table = Table.open(str(path))
    table.refresh()
    return [r.action for r in table.timeline.completed()]


def _log_files(path: Path | str) -> list[str]:
    """Every file of the Delta log directory (versions, checkpoints, _last_checkpoint)."""
    return sorted(p.name for p in (Path(path) / "_delta_log").iterdir())


def _sorted_rows(table: pa.Table, columns: list[str]) -> list[tuple]:
    return sorted(zip(*(table.column(c).to_pylist() for c in columns)), key=repr)


# ---- 1. column names equal up to case --------------------------------------------------------------------------
def test_upsert_columns_whose_names_differ_only_in_case_are_refused_before_the_instant(tmp_path: Path) -> None:
    """`id` and `ID`: delta-rs cannot write such a schema, so the upsert used to publish and then fail to write its
    Delta version (a RuntimeWarning), leaving the table unreadable to Delta readers."""
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    log = _log_files(tmp_path / "t")
    with pytest.raises(SchemaError, match=r"the upsert table has columns 'id' and 'ID'.*differ only in case"):
        upsert_arrow(
            pa.table({"id": ["a"], "ID": ["b"], "dt": ["d"]}),
            table,
            key="id",
            partition="dt",
            cache_config=_config(tmp_path),
        )
    assert _actions(tmp_path / "t") == [] and _log_files(tmp_path / "t") == log
    upsert_arrow(
        pa.table({"id": ["a"], "dt": ["d"], "v": [1]}), table, key="id", partition="dt", cache_config=_config(tmp_path)
    )
    log = _log_files(tmp_path / "t")
    with pytest.raises(SchemaError, match=r"'v' and 'V'"):  # a new column clashing with one of the table's
        upsert_arrow(
            pa.table({"id": ["a"], "dt": ["d"], "v": [2], "V": [3]}),
            table,
            key="id",
            partition="dt",
            cache_config=_config(tmp_path),
        )
    assert _actions(tmp_path / "t") == ["commit"] and _log_files(tmp_path / "t") == log
    assert reads.read_arrow(table).column("v").to_pylist() == [1]


def test_build_index_refuses_parquet_columns_whose_names_differ_only_in_case(tmp_path: Path) -> None:
    """In one file, between a file and its hive directory, and between two files: refused before the build's
    instant starts (no rollback record, no Delta version)."""
    cases = {
        "one": {"dt=a/x.parquet": pa.table({"id": ["a"], "ID": ["b"]})},
        "hive": {"dt=a/x.parquet": pa.table({"id": ["a"], "DT": ["b"]})},
        "two": {
            "dt=a/x.parquet": pa.table({"id": ["a"], "v": [1]}),
            "dt=b/y.parquet": pa.table({"id": ["b"], "V": [1]}),
        },
    }
    expected = {
        "one": r"x.parquet has columns 'id' and 'ID'",
        "hive": r"x.parquet has columns 'DT' and 'dt'",
        "two": r"y.parquet has column 'V' and data file .*x.parquet has 'v'",
    }
    for name, files in cases.items():
        root = tmp_path / name
        for rel, data in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(data, root / rel)
        table = Table.create(str(root), num_shards=1)
        log = _log_files(root)
        with pytest.raises(SchemaError, match=expected[name]):
            build_index(table, "id")
        assert _actions(root) == [] and _log_files(root) == log, name


# ---- 2. an empty partition value ---------------------------------------------------------------------------------
def test_an_empty_hive_partition_value_is_refused_like_a_null(tmp_path: Path) -> None:
    """`dt = ""` would be the directory `dt=`, which Delta readers read back as a null partition value."""
    path = tmp_path / "t"
    table = Table.create(str(path), num_shards=2)
    with pytest.raises(InvalidPartitionError, match=r"partition column 'dt' is null at row"):
        upsert_arrow(
            pa.table({"id": ["a", "b"], "dt": ["d", None]}),
            table,
            key="id",
            partition="dt",
            cache_config=_config(tmp_path),
        )
    before, log = _actions(path), _log_files(path)
    with pytest.raises(InvalidPartitionError, match=r"partition column 'dt' is empty \(\"\"\) at row 1"):
        upsert_arrow(
            pa.table({"id": ["a", "b"], "dt": ["d", ""]}),
            table,
            key="id",
            partition="dt",
            cache_config=_config(tmp_path),
        )
    assert _actions(path) == before and _log_files(path) == log
    assert not (path / "dt=").exists()
    # A table without partitions still writes at the root: "" as the path itself (hive_style=False).
    other = Table.create(str(tmp_path / "flat"), num_shards=1)
    upsert_arrow(
        pa.table({"id": ["a"], "p": [""]}),
        other,
        key="id",
        partition="p",
        hive_style=False,
        cache_config=_config(tmp_path),
    )
    assert _actions(tmp_path / "flat") == ["commit"]


def test_adopting_a_delta_table_with_an_empty_partition_value_is_refused(tmp_path: Path) -> None:
    """Delta reads an empty partitionValues entry as null, which dbidx cannot name a partition by."""
    path = tmp_path / "t"
    write_deltalake(str(path), pa.table({"id": ["a"], "dt": ["d"], "v": [1]}), partition_by=["dt"])
    add = next(a["add"] for a in _json_actions(path, 0) if "add" in a)
    copy = "dt=d/copy.parquet"
    pq.write_table(pa.table({"id": ["b"], "v": [2]}), path / copy)
    _append_version(
        path, 1, [{"add": {**add, "path": copy, "size": (path / copy).stat().st_size, "partitionValues": {"dt": ""}}}]
    )
    log = _log_files(path)
    with pytest.raises(DeltaFeatureError, match=r"copy.parquet has a null, empty or no value \(''\) for partition"):
        build_index(Table.create(str(path), num_shards=1), "id")
    assert _actions(path) == [] and _log_files(path) == log


# ---- 3. clean's retention ------------------------------------------------------------------------------------------
def test_clean_refuses_a_negative_or_non_integer_retention(tmp_path: Path) -> None:
    """A negative count used to clean as 0 does (every replaced file, however recent)."""
    path = tmp_path / "t"
    table = Table.create(str(path), num_shards=1)
    for v in range(2):
        upsert_arrow(
            pa.table({"id": ["a"], "dt": ["d"], "v": [v]}),
            table,
            key="id",
            partition="dt",
            cache_config=_config(tmp_path),
        )
    compaction = table.compact_data()  # the two data files replaced by one
    assert compaction.files_replaced == 2 and compaction.record is not None
    replaced = [path / rel for rel in compaction.record.replaced]
    clean_without_waiting(table)
    before, log = _actions(path), _log_files(path)
    for bad in (-1, -10, 1.5, "3", True, None):
        with pytest.raises(InvalidInputError, match=rf"retain_completions must be a whole number >= 0.*{bad!r}"):
            table.clean(retain_completions=bad)
    with pytest.raises(InvalidInputError, match="delete_migrated must be True or False"):
        table.clean(retain_completions=0, delete_migrated="yes")
    assert _actions(path) == before and _log_files(path) == log and all(p.exists() for p in replaced)
    assert table.clean(retain_completions=0) is not None
    assert not any(p.exists() for p in replaced)


# ---- 4. adopting a Delta table -------------------------------------------------------------------------------------
def _json_actions(path: Path, version: int) -> list[dict]:
    text = (path / "_delta_log" / f"{version:020d}.json").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _append_version(path: Path, version: int, actions: list[dict]) -> None:
    (path / "_delta_log" / f"{version:020d}.json").write_text("".join(json.dumps(a) + "\n" for a in actions))


def _with_vector(path: Path, version: int, add: dict, dv: dict) -> None:
    """Another engine's DELETE by deletion vector, written by hand as the next version: the file's entry removed and
    added back with the descriptor `dv`."""
    remove = {
        "path": add["path"],
        "dataChange": True,
        "deletionTimestamp": 1,
        "extendedFileMetadata": True,
        "partitionValues": add["partitionValues"],
        "size": add["size"],
    }
    _append_version(path, version, [{"remove": remove}, {"add": {**add, "deletionVector": dv}}])


def test_adopting_a_partitioned_delta_table_with_a_delta_rs_checkpoint(tmp_path: Path) -> None:
    """The checkpoint's partitionValues (and the vector's struct) come back from Parquet as pairs and nulls, not as
    the JSON action's object: adoption used to fail with an AttributeError."""
    path = tmp_path / "t"
    days = ["d0", "d1", "d2"]
    for i in range(3):
        write_deltalake(
            str(path),
            pa.table(
                {
                    "id": [f"k{i}{j}" for j in range(3)],
                    "dt": [days[(i + j) % 3] for j in range(3)],
                    "v": pa.array([i * 10 + j for j in range(3)], pa.int64()),
                }
            ),
            partition_by=["dt"],
            mode="append",
            configuration={"delta.enableDeletionVectors": "true"},
        )
    add = next(a["add"] for a in _json_actions(path, 1) if "add" in a)
    body = encode_vector([0])
    _with_vector(
        path,
        3,
        add,
        {"storageType": "i", "pathOrInlineDv": inline_form(body), "sizeInBytes": len(body), "cardinality": 1},
    )
    DeltaTable(str(path)).create_checkpoint()
    assert (path / "_delta_log" / f"{3:020d}.checkpoint.parquet").exists()
    write_deltalake(
        str(path),
        pa.table({"id": ["k00", "z"], "dt": ["d3", "d1"], "v": pa.array([1, 2], pa.int64())}),
        partition_by=["dt"],
        mode="append",
    )
    table = Table.create(str(path), num_shards=2)
    result = build_index(table, "id")
    assert result.files == 11 and result.keys == 10  # a file per partition and append; one row deleted
    columns = ["id", "dt", "v"]
    ours = reads.read_arrow(Table.open(str(path)), columns=columns)
    theirs = pl.read_delta(str(path)).select(columns).to_arrow()
    assert _sorted_rows(ours, columns) == _sorted_rows(theirs, columns)
    assert len(ours) == 10 and "d1" in ours.column("dt").to_pylist()


def test_a_torn_newest_commit_is_a_corrupt_file_naming_it(tmp_path: Path) -> None:
    """The newest commit JSON cut mid-line (a crashed writer on a store without atomic puts): CorruptFileError naming
    the file, exit code 4, instead of delta-rs's DeltaError reported as a bug in dbidx."""
    path = tmp_path / "t"
    for i in range(3):
        write_deltalake(
            str(path), pa.table({"id": [f"k{i}"], "dt": ["d"], "v": [i]}), partition_by=["dt"], mode="append"
        )
    newest = path / "_delta_log" / f"{2:020d}.json"
    newest.write_bytes(newest.read_bytes()[: len(newest.read_bytes()) // 2])
    log = _log_files(path)
    table = Table.create(str(path), num_shards=1)
    with pytest.raises(CorruptFileError, match=rf"Delta version 2 \({newest}\) is unreadable"):
        build_index(table, "id")
    result = CliRunner().invoke(main, ["build-index", str(path), "--key", "id"])
    assert result.exit_code == CorruptFileError.exit_code == 4, result.output
    assert newest.name in result.output and "bug" not in result.output
    assert _actions(path) == [] and _log_files(path) == log


def _vector_table(path: Path) -> dict:
    """A one-file Delta table with deletion vectors enabled; returns its file's `add` action."""
    write_deltalake(
        str(path),
        pa.table({"id": ["a", "b", "c"], "v": pa.array([1, 2, 3], pa.int64())}),
        configuration={"delta.enableDeletionVectors": "true"},
    )
    return next(a["add"] for a in _json_actions(path, 0) if "add" in a)


def _dv_file(directory: Path, rows: list[int]) -> tuple[str, dict]:
    """A valid DV file (deleting `rows`) in `directory`; the Z85 uuid Delta names it by, and the slot's fields."""
    file_uuid, builder = uuid.uuid4(), DvFileBuilder()
    slot = builder.add(BitMap(rows))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"deletion_vector_{file_uuid}.bin").write_bytes(builder.to_bytes())
    return z85_encode(file_uuid.bytes), {"offset": slot.offset, "sizeInBytes": slot.size, "cardinality": len(rows)}


@pytest.mark.parametrize("where", ["parent", "symlink", "absolute"])
def test_a_deletion_vector_outside_the_table_is_refused_before_it_is_read(tmp_path: Path, where: str) -> None:
    """A relative vector whose prefix climbs out (`../`) or goes through a symlink out of the table, and an absolute
    one: refused from the log's own descriptor, before delta-rs (or dbidx) opens a DV file. The DV files outside are
    valid, so only that check stops the adoption of rows another directory's file deletes; the absolute one does not
    exist, so delta-rs reading it first would fail with its own error."""
    path = tmp_path / "t"
    add = _vector_table(path)
    outside = tmp_path / "elsewhere"
    if where == "absolute":
        dv = {
            "storageType": "p",
            "pathOrInlineDv": f"file://{outside}/deletion_vector_x.bin",
            "offset": 1,
            "sizeInBytes": 34,
            "cardinality": 1,
        }
        match = r"stored at an absolute path"
    else:
        encoded, slot = _dv_file(outside, [0])
        prefix = "../elsewhere" if where == "parent" else "link"
        if where == "symlink":
            os.symlink(outside, path / "link")
        dv = {"storageType": "u", "pathOrInlineDv": prefix + encoded, **slot}
        match = rf"names the DV file '{prefix}/deletion_vector_.*\.bin', which is not inside the table"
    _with_vector(path, 1, add, dv)
    log = _log_files(path)
    with pytest.raises(DeltaFeatureError, match=match) as caught:
        build_index(Table.create(str(path), num_shards=1), "id")
    assert add["path"] in str(caught.value) and dv["pathOrInlineDv"] in str(caught.value)
    assert _actions(path) == [] and _log_files(path) == log


def test_a_deletion_vector_in_a_directory_of_the_table_is_adopted(tmp_path: Path) -> None:
    """The check leaves a relative vector with a prefix inside the table alone."""
    path = tmp_path / "t"
    add = _vector_table(path)
    encoded, slot = _dv_file(path / "ab", [1])
    _with_vector(path, 1, add, {"storageType": "u", "pathOrInlineDv": "ab" + encoded, **slot})
    table = Table.create(str(path), num_shards=1)
    assert build_index(table, "id").keys == 2
    assert assert_readers_agree(Table.open(str(path)), ("id", "v"), {("a", 1), ("c", 3)})


# ---- 5. the recorded layout -----------------------------------------------------------------------------------------
def _adopted(path: Path, partition_by: list[str] | None) -> Table:
    """A deltalake table (id, dt, region, v) adopted by build-index."""
    data = pa.table(
        {
            "id": ["a", "b", "c"],
            "dt": ["d1", "d1", "d2"],
            "region": ["eu", "us", "eu"],
            "v": pa.array([1, 2, 3], pa.int64()),
        }
    )
    write_deltalake(str(path), data, partition_by=partition_by)
    table = Table.create(str(path), num_shards=2)
    build_index(table, "id")
    return Table.open(str(path))


@pytest.mark.parametrize(
    "partition_by, partition, match",
    [
        (None, "dt", r"partition columns \[\], but this upsert asks for partition='dt'.*all \"\""),
        (["dt", "region"], "dt", r"partition columns \['dt', 'region'\], but this upsert asks for partition='dt'"),
        (["dt"], "region", r"partition columns \['dt'\], but this upsert asks for partition='region'.*partition='dt'"),
    ],
)
def test_an_upsert_must_keep_the_adopted_partition_columns(
    tmp_path: Path, partition_by: list[str] | None, partition: str, match: str
) -> None:
    """Unpartitioned or (dt, region) adopted, then partition="dt": every update became an insert in a new partition
    (and polars could not read the files' partition values); dt adopted, then partition="region": unopenable."""
    path = tmp_path / "t"
    table = _adopted(path, partition_by)
    before, log = _actions(path), _log_files(path)
    batch = pa.table({"id": ["a"], "dt": ["d1"], "region": ["eu"], "v": pa.array([10], pa.int64())})
    recorded = r"adopted from a Delta table \(completion 1, \d+\) with key 'id' and "
    with pytest.raises(SchemaError, match=recorded + match):
        upsert_arrow(batch, table, key="id", partition=partition, cache_config=_config(tmp_path))
    assert _actions(path) == before and _log_files(path) == log
    assert_readers_agree(Table.open(str(path)), ("id", "dt", "region", "v"))


def test_paths_given_as_values_must_be_hive_paths_of_the_adopted_partition_columns(tmp_path: Path) -> None:
    """hive_style=False: each value is the path, checked against the recorded columns before the instant starts;
    the right paths update the adopted rows in place, and the Delta log keeps its partition values."""
    path = tmp_path / "t"
    table = _adopted(path, ["dt"])
    before, log = _actions(path), _log_files(path)
    for bad, match in (
        ("region=eu", r"'region=eu' \(row 0 .*partitioned by \['dt'\]: every path must be dt=<value>"),
        ("dt=", r"'dt=' \(row 0 of the batch\) with an empty value"),
    ):
        batch = pa.table({"id": ["a"], "dt": ["d1"], "region": ["eu"], "v": pa.array([10], pa.int64()), "where": [bad]})
        with pytest.raises(InvalidPartitionError, match=match):
            upsert_arrow(batch, table, key="id", partition="where", hive_style=False, cache_config=_config(tmp_path))
    assert _actions(path) == before and _log_files(path) == log
    batch = pa.table(
        {
            "id": ["a", "c"],
            "dt": ["d1", "d2"],
            "region": ["eu", "eu"],
            "v": pa.array([10, 30], pa.int64()),
            "where": ["dt=d1", "dt=d2"],
        }
    )
    summary = upsert_arrow(batch, table, key="id", partition="where", hive_style=False, cache_config=_config(tmp_path))
    assert (summary.updates, summary.inserts) == (2, 0)
    assert DeltaTable(str(path)).metadata().partition_columns == ["dt"]
    assert set(assert_readers_agree(Table.open(str(path)), ("id", "dt", "region", "v"))) == {
        ("a", "d1", "eu", 10),
        ("b", "d1", "us", 2),
        ("c", "d2", "eu", 30),
    }


def test_an_unpartitioned_adopted_table_takes_upserts_at_its_root(tmp_path: Path) -> None:
    """The way an unpartitioned table is upserted (hive_style=False, "" paths) updates the adopted records; any
    other path is refused before the instant starts."""
    path = tmp_path / "t"
    table = _adopted(path, None)
    before, log = _actions(path), _log_files(path)
    batch = pa.table({"id": ["b"], "dt": ["d1"], "region": ["us"], "v": pa.array([20], pa.int64()), "p": ["d1"]})
    with pytest.raises(InvalidPartitionError, match=r"partitioned by \[\]: every path must be \"\" \(the table is not"):
        upsert_arrow(batch, table, key="id", partition="p", hive_style=False, cache_config=_config(tmp_path))
    assert _actions(path) == before and _log_files(path) == log
    summary = upsert_arrow(
        batch.set_column(4, "p", pa.array([""])),
        table,
        key="id",
        partition="p",
        hive_style=False,
        cache_config=_config(tmp_path),
    )
    assert (summary.updates, summary.inserts) == (1, 0)
    assert DeltaTable(str(path)).metadata().partition_columns == []
    assert set(assert_readers_agree(Table.open(str(path)), ("id", "dt", "region", "v"))) == {
        ("a", "d1", "eu", 1),
        ("b", "d1", "us", 20),
        ("c", "d2", "eu", 3),
    }
