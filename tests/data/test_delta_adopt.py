"""Adopting a Delta table another engine wrote: build-index indexes its current files (deletion vectors honoured,
file-backed and inline), and from then on dbidx's upserts are the table's next Delta versions, read the same by
deltalake, polars and duckdb. Tables dbidx cannot keep, or a log someone else wrote to, are refused loudly."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from deltalake import DeltaTable, write_deltalake
from pyroaring import BitMap

from dbidx.cli import main
from dbidx.config import CacheConfig
from dbidx.data.deletion_vectors import DvFileBuilder, dv_file_name, encode_vector, inline_form, z85_encode
from dbidx.errors import DeltaFeatureError, ForeignCommitError
from dbidx.table.build_index import build_index
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table
from dbidx.spark_integration.local import upsert_arrow

from tests.delta_readers import assert_readers_agree

COLUMNS = ("id", "dt", "v")


def _log(path: Path) -> list[dict]:
    """Every action of every JSON version, in order."""
    out = []
    for f in sorted((path / "_delta_log").glob("*.json")):
        out += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out


def _write_version(path: Path, actions: list[dict]) -> None:
    version = DeltaTable(str(path)).version() + 1
    (path / "_delta_log" / f"{version:020d}.json").write_text("".join(json.dumps(a) + "\n" for a in actions))


def _delete_rows(path: Path, add: dict, rows: list[int], inline: bool) -> None:
    """Another engine's DELETE by deletion vector: remove the file's entry, add it back with a vector."""
    if inline:
        body = encode_vector(rows)
        dv = {
            "storageType": "i",
            "pathOrInlineDv": inline_form(body),
            "sizeInBytes": len(body),
            "cardinality": len(rows),
        }
    else:
        builder, file_uuid = DvFileBuilder(), uuid.uuid4()
        slot = builder.add(BitMap(rows))
        (path / dv_file_name(file_uuid)).write_bytes(builder.to_bytes())
        dv = {
            "storageType": "u",
            "pathOrInlineDv": z85_encode(file_uuid.bytes),
            "offset": slot.offset,
            "sizeInBytes": slot.size,
            "cardinality": len(rows),
        }
    remove = {
        "path": add["path"],
        "dataChange": True,
        "deletionTimestamp": 1,
        "extendedFileMetadata": True,
        "partitionValues": add["partitionValues"],
        "size": add["size"],
    }
    _write_version(path, [{"remove": remove}, {"add": {**add, "deletionVector": dv}}])


def a_delta_rs_table(path: Path) -> set[tuple]:
    """Two delta-rs appends to a table with deletion vectors enabled, then one file loses a row to a file-backed
    vector and another to an inline one (as another engine's DELETE writes them); returns the rows a reader sees.
    (No partition value that needs escaping: polars 2.1 ignores the vectors of such files, in any Delta table.)"""
    first = pa.table(
        {
            "id": [f"k{i}" for i in range(6)],
            "dt": ["d1", "d1", "d1", "d0", "d0", "d2"],
            "v": pa.array(range(6), pa.int64()),
        }
    )
    second = pa.table({"id": ["k6", "k7"], "dt": ["d2", "d3"], "v": pa.array([6, 7], pa.int64())})
    write_deltalake(str(path), first, partition_by=["dt"], configuration={"delta.enableDeletionVectors": "true"})
    write_deltalake(str(path), second, partition_by=["dt"], mode="append")
    adds = {a["add"]["partitionValues"]["dt"]: a["add"] for a in _log(path) if "add" in a}
    rows = {(i, d, v) for i, d, v in zip(*(pa.concat_tables([first, second]).column(c).to_pylist() for c in COLUMNS))}
    for dt, inline in (("d1", False), ("d0", True)):
        ids = pq.read_table(path / unquote(adds[dt]["path"])).column("id").to_pylist()
        _delete_rows(path, adds[dt], [0], inline)
        rows -= {r for r in rows if r[0] == ids[0]}
    return rows


def test_adopt_a_delta_table_then_upsert_into_it(tmp_path: Path) -> None:
    path = tmp_path / "t"
    expected = a_delta_rs_table(path)
    before = DeltaTable(str(path))
    version, table_id = before.version(), before.metadata().id
    # 1. Adopted through the CLI: the rows the vectors deleted are not indexed, every reader agrees.
    result = CliRunner().invoke(main, ["build-index", str(path), "--key", "id", "--num-shards", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["keys"] == len(expected) == 6
    table = Table.open(str(path))
    assert set(assert_readers_agree(table, COLUMNS)) == expected
    adopted = DeltaTable(str(path))
    assert adopted.version() == version + 1 and adopted.metadata().id == table_id
    assert "deletionVectors" in adopted.protocol().reader_features
    # 2. An upsert: updates in both vector-holding files and elsewhere, a delete, a new key, a deleted key back.
    gone = sorted({f"k{i}" for i in range(8)} - {r[0] for r in expected})
    batch = pa.table(
        {
            "id": ["k1", "k4", "k6", "k5", "k9", gone[0]],
            "dt": ["d1", "d0", "d2", "d2", "d3", "d1"],
            "v": pa.array([11, 14, 16, 0, 19, 20], pa.int64()),
            "_dbidx_delete": [False, False, False, True, False, False],
        }
    )
    upsert_arrow(batch, table, key="id", partition="dt", cache_config=CacheConfig(base_path=str(tmp_path / "c")))
    expected = {r for r in expected if r[0] not in {"k1", "k4", "k6", "k5"}}
    expected |= {("k1", "d1", 11), ("k4", "d0", 14), ("k6", "d2", 16), ("k9", "d3", 19), (gone[0], "d1", 20)}
    assert set(assert_readers_agree(table, COLUMNS)) == expected
    assert DeltaTable(str(path)).version() == version + 2
    assert verify_table(table).ok
    # 3. Another engine appends: dbidx absorbs it, and its next upsert updates the appended row (no duplicate).
    write_deltalake(
        str(path),
        pa.table({"id": ["x"], "dt": ["d9"], "v": pa.array([1], pa.int64())}),
        partition_by=["dt"],
        mode="append",
    )
    assert set(assert_readers_agree(Table.open(str(path)), COLUMNS)) == expected | {("x", "d9", 1)}
    upsert_arrow(
        pa.table({"id": ["x", "k1"], "dt": ["d9", "d1"], "v": pa.array([2, 12], pa.int64())}),
        Table.open(str(path)),
        key="id",
        partition="dt",
        cache_config=CacheConfig(base_path=str(tmp_path / "c")),
    )
    expected = {r for r in expected if r[0] != "k1"} | {("x", "d9", 2), ("k1", "d1", 12)}
    assert set(assert_readers_agree(Table.open(str(path)), COLUMNS)) == expected
    assert verify_table(Table.open(str(path))).ok


def test_a_delta_table_must_be_adopted_before_any_write(tmp_path: Path) -> None:
    path = tmp_path / "t"
    write_deltalake(
        str(path), pa.table({"id": ["a"], "dt": ["d"], "v": pa.array([1], pa.int64())}), partition_by=["dt"]
    )
    versions = sorted(p.name for p in (path / "_delta_log").iterdir())
    table = Table.create(str(path), num_shards=1)  # leaves the Delta log as it is
    with pytest.raises(ForeignCommitError, match="build-index"):
        upsert_arrow(
            pa.table({"id": ["b"], "dt": ["d"], "v": pa.array([2], pa.int64())}),
            table,
            key="id",
            partition="dt",
            cache_config=CacheConfig(base_path=str(tmp_path / "c")),
        )
    assert sorted(p.name for p in (path / "_delta_log").iterdir()) == versions


def test_features_dbidx_cannot_keep_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "t"
    write_deltalake(
        str(path), pa.table({"id": ["a"], "v": pa.array([1], pa.int64())}), configuration={"delta.appendOnly": "true"}
    )
    with pytest.raises(DeltaFeatureError, match="append-only"):
        build_index(Table.create(str(path), num_shards=1), "id")
    other = tmp_path / "u"
    write_deltalake(str(other), pa.table({"id": ["a"], "v": pa.array([1], pa.int64())}))
    _write_version(
        other,
        [
            {
                "protocol": {
                    "minReaderVersion": 3,
                    "minWriterVersion": 7,
                    "readerFeatures": ["deletionVectors"],
                    "writerFeatures": ["deletionVectors", "checkpointProtection"],
                }
            }
        ],
    )
    # Named: the feature, the version that turned it on, the way to turn it off (data/delta_features.py).
    with pytest.raises(
        DeltaFeatureError,
        match=r"`checkpointProtection`, turned on by Delta version 1 .*DROP FEATURE checkpointProtection",
    ):
        build_index(Table.create(str(other), num_shards=1), "id")
    assert not list((other / ".dbidx" / "timeline" / "completed").glob("*.json"))


def test_the_adoption_version_heals_and_survives_a_checkpoint(tmp_path: Path) -> None:
    """A crash right after the adopting build-index published (its Delta version missing): verify names it, repair
    writes it byte-identical; a checkpoint of the table keeps the version numbering."""
    path = tmp_path / "t"
    a_delta_rs_table(path)
    version = DeltaTable(str(path)).version()
    table = Table.create(str(path), num_shards=1)
    build_index(table, "id")
    adoption = path / "_delta_log" / f"{version + 1:020d}.json"
    written = adoption.read_bytes()
    adoption.unlink()
    reopened = Table.open(str(path))
    assert not verify_table(reopened).ok
    result = CliRunner().invoke(main, ["repair", str(path)])
    assert result.exit_code == 0, result.output
    assert adoption.read_bytes() == written
    reopened.checkpoint()
    again = Table.open(str(path))
    assert again.data_view().delta_offset == version + 1 - 1 and verify_table(again).ok
    upsert_arrow(
        pa.table({"id": ["k1"], "dt": ["d1"], "v": pa.array([5], pa.int64())}),
        again,
        key="id",
        partition="dt",
        cache_config=CacheConfig(base_path=str(tmp_path / "c")),
    )
    assert DeltaTable(str(path)).version() == version + 2
    assert ("k1", "d1", 5) in assert_readers_agree(again, COLUMNS)


def test_a_commit_another_engine_makes_during_the_adoption_refuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other engine appends while build-index reads the snapshot: nothing is published (the adoption would miss
    that commit's rows), and build-index again adopts the newer version."""
    from dbidx.table import build_index as adoption

    path = tmp_path / "t"
    write_deltalake(
        str(path), pa.table({"id": ["a"], "dt": ["d"], "v": pa.array([1], pa.int64())}), partition_by=["dt"]
    )
    real, calls = adoption._read_source, []

    def read_then_append(*args, **kwargs):
        if not calls:
            calls.append(1)
            write_deltalake(
                str(path),
                pa.table({"id": ["b"], "dt": ["d"], "v": pa.array([2], pa.int64())}),
                partition_by=["dt"],
                mode="append",
            )
        return real(*args, **kwargs)

    monkeypatch.setattr(adoption, "_read_source", read_then_append)
    table = Table.create(str(path), num_shards=1)
    with pytest.raises(ForeignCommitError, match="nothing was published") as caught:
        build_index(table, "id")
    assert caught.value.published is None
    after = Table.open(str(path))
    after.refresh()
    assert [r.action for r in after.timeline.completed()] == ["rollback"] and not after.timeline.pending()
    monkeypatch.undo()
    build_index(Table.open(str(path)), "id")
    assert_readers_agree(Table.open(str(path)), ("id", "dt", "v"), {("a", "d", 1), ("b", "d", 2)})


def test_a_log_naming_files_outside_the_table_is_refused_by_name(tmp_path: Path) -> None:
    """A shallow clone's log names its source's files by absolute URI, which Spark spells `file:/dir/x.parquet` (one
    slash, no `://`): adopting it, or absorbing a version that adds such a file, is a DeltaFeatureError naming the
    file and the way out, never a relative path `file:/...` looked up inside the table ("file is missing")."""
    source = tmp_path / "source"
    write_deltalake(
        str(source), pa.table({"id": ["a"], "dt": ["d1"], "v": pa.array([1], pa.int64())}), partition_by=["dt"]
    )
    (add,) = [a["add"] for a in _log(source) if "add" in a]
    outside = {**add, "path": f"file:{source}/{add['path']}"}
    clone = tmp_path / "clone"
    (clone / "_delta_log").mkdir(parents=True)
    lines = [json.dumps({"add": outside} if "add" in a else a) for a in _log(source)]
    (clone / "_delta_log" / f"{0:020d}.json").write_text("\n".join(lines) + "\n")
    with pytest.raises(DeltaFeatureError, match=r"outside its directory \(a shallow clone.*CREATE TABLE .*build-index"):
        build_index(Table.create(str(clone), num_shards=1), "id")
    assert not list((clone / ".dbidx" / "timeline" / "completed").glob("*.json"))
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    upsert_arrow(
        pa.table({"id": ["b"], "dt": ["d1"], "v": pa.array([2], pa.int64())}),
        table,
        key="id",
        partition="dt",
        cache_config=CacheConfig(str(tmp_path / "c")),
    )
    _write_version(tmp_path / "t", [{"commitInfo": {"operation": "WRITE"}}, {"add": outside}])
    with pytest.raises(DeltaFeatureError, match=r"outside the table .*a shallow clone.*--readopt"):
        Table.open(str(tmp_path / "t")).sync_delta_log()
