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
    CorruptFileError, DeltaFeatureError, InvalidInputError, InvalidPartitionError, SchemaError,
)
from dbidx.mdt.build_index import build_index
from dbidx.mdt.table import Table
from dbidx.spark_integration.local import upsert_arrow

from tests.delta_readers import assert_readers_agree


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


def test_upsert_columns_whose_names_differ_only_in_case_are_refused_before_the_instant(tmp_path: Path) -> None:
    """`id` and `ID`: delta-rs cannot write such a schema, so the upsert used to publish and then fail to write its
    Delta version (a RuntimeWarning), leaving the table unreadable to Delta readers."""
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    log = _log_files(tmp_path / "t")
    with pytest.raises(SchemaError, match=r"the upsert table has columns 'id' and 'ID'.*differ only in case"):
        upsert_arrow(pa.table({"id": ["a"], "ID": ["b"], "dt": ["d"]}), table, key="id", partition="dt",
                     cache_config=_config(tmp_path))
    assert _actions(tmp_path / "t") == [] and _log_files(tmp_path / "t") == log
    upsert_arrow(pa.table({"id": ["a"], "dt": ["d"], "v": [1]}), table, key="id", partition="dt",
                 cache_config=_config(tmp_path))
    log = _log_files(tmp_path / "t")
    with pytest.raises(SchemaError, match=r"'v' and 'V'"):  # a new column clashing with one of the table's
        upsert_arrow(pa.table({"id": ["a"], "dt": ["d"], "v": [2], "V": [3]}), table, key="id", partition="dt",
                     cache_config=_config(tmp_path))
    assert _actions(tmp_path / "t") == ["commit"] and _log_files(tmp_path / "t") == log
    assert reads.read_arrow(table).column("v").to_pylist() == [1]


def test_build_index_refuses_parquet_columns_whose_names_differ_only_in_case(tmp_path: Path) -> None:
    """In one file, between a file and its hive directory, and between two files: refused before the build's
    instant starts (no rollback record, no Delta version)."""
    cases = {
        "one": {"dt=a/x.parquet": pa.table({"id": ["a"], "ID": ["b"]})},
        "hive": {"dt=a/x.parquet": pa.table({"id": ["a"], "DT": ["b"]})},
        "two": {"dt=a/x.parquet": pa.table({"id": ["a"], "v": [1]}),
                "dt=b/y.parquet": pa.table({"id": ["b"], "V": [1]})},
    }
    expected = {"one": r"x.parquet has columns 'id' and 'ID'", "hive": r"x.parquet has columns 'DT' and 'dt'",
                "two": r"y.parquet has column 'V' and data file .*x.parquet has 'v'"}
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


def test_clean_refuses_a_negative_or_non_integer_retention(tmp_path: Path) -> None:
    """A negative count used to clean as 0 does (every replaced file, however recent)."""
    path = tmp_path / "t"
    table = Table.create(str(path), num_shards=1)
    for v in range(2):
        upsert_arrow(pa.table({"id": ["a"], "dt": ["d"], "v": [v]}), table, key="id", partition="dt",
                     cache_config=_config(tmp_path))
    compaction = table.compact_data()  # the two data files replaced by one
    assert compaction.files_replaced == 2 and compaction.record is not None
    replaced = [path / rel for rel in compaction.record.replaced]
    before, log = _actions(path), _log_files(path)
    for bad in (-1, -10, 1.5, "3", True, None):
        with pytest.raises(InvalidInputError, match=rf"retain_completions must be a whole number >= 0.*{bad!r}"):
            table.clean(retain_completions=bad)
    with pytest.raises(InvalidInputError, match="delete_migrated must be True or False"):
        table.clean(retain_completions=0, delete_migrated="yes")
    assert _actions(path) == before and _log_files(path) == log and all(p.exists() for p in replaced)
    assert table.clean(retain_completions=0) is not None
    assert not any(p.exists() for p in replaced)


def _json_actions(path: Path, version: int) -> list[dict]:
    text = (path / "_delta_log" / f"{version:020d}.json").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _append_version(path: Path, version: int, actions: list[dict]) -> None:
    (path / "_delta_log" / f"{version:020d}.json").write_text("".join(json.dumps(a) + "\n" for a in actions))


def _with_vector(path: Path, version: int, add: dict, dv: dict) -> None:
    """Another engine's DELETE by deletion vector, written by hand as the next version: the file's entry removed and
    added back with the descriptor `dv`."""
    remove = {"path": add["path"], "dataChange": True, "deletionTimestamp": 1, "extendedFileMetadata": True,
              "partitionValues": add["partitionValues"], "size": add["size"]}
    _append_version(path, version, [{"remove": remove}, {"add": {**add, "deletionVector": dv}}])


def _vector_table(path: Path) -> dict:
    """A one-file Delta table with deletion vectors enabled; returns its file's `add` action."""
    write_deltalake(str(path), pa.table({"id": ["a", "b", "c"], "v": pa.array([1, 2, 3], pa.int64())}),
                    configuration={"delta.enableDeletionVectors": "true"})
    return next(a["add"] for a in _json_actions(path, 0) if "add" in a)


def _dv_file(directory: Path, rows: list[int]) -> tuple[str, dict]:
    """A valid DV file (deleting `rows`) in `directory`; the Z85 uuid Delta names it by, and the slot's fields."""
    file_uuid, builder = uuid.uuid4(), DvFileBuilder()
    slot = builder.add(BitMap(rows))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"deletion_vector_{file_uuid}.bin").write_bytes(builder.to_bytes())
    return z85_encode(file_uuid.bytes), {"offset": slot.offset, "sizeInBytes": slot.size, "cardinality": len(rows)}


def _adopted(path: Path, partition_by: list[str] | None) -> Table:
    """A deltalake table (id, dt, region, v) adopted by build-index."""
    data = pa.table({"id": ["a", "b", "c"], "dt": ["d1", "d1", "d2"], "region": ["eu", "us", "eu"],
                     "v": pa.array([1, 2, 3], pa.int64())})
    write_deltalake(str(path), data, partition_by=partition_by)
    table = Table.create(str(path), num_shards=2)
    build_index(table, "id")
    return Table.open(str(path))
