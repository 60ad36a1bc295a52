"""The Delta table feature v2Checkpoint with Delta Spark 4.4.0 (issue 60 section 3, docs/FORMAT.md section 12d):
Delta Spark writes UUID-named checkpoints (JSON by default, Parquet by a session setting) whose adds sit in sidecar
files; dbidx absorbs from them, adopts from them, checkpoints from them (a classic checkpoint, written by delta-rs
from a copy of the log's tail), cleans them up (sidecars too) and refuses a damaged one by name, while Delta Spark,
deltalake and DuckDB read every version dbidx leaves (polars 2.2 refuses the feature by name)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from dbidx.data.delta_actions import from_checkpoint
from dbidx.data.delta_checkpoint import write_delta_checkpoint
from dbidx.data.delta_checkpoint_files import UUID_NAMED, parse_name
from dbidx.data.delta_log import DELTA_LOG_DIR, listed_versions, read_checkpoint_pointer
from dbidx.data.log_retention import DAY_MS, expire_log
from dbidx.errors import CorruptFileError
from dbidx.storage.fileio import FileIO
from dbidx.table.build_index import build_index
from dbidx.table.facade import Table
from dbidx.table.readopt import readopt
from dbidx.table.verify_table import verify_table

from tests.data.test_foreign_writers import COLUMNS, Writer, rows_of
from tests.delta_readers import assert_readers_agree, via_delta_spark

pytestmark = [pytest.mark.spark, pytest.mark.delta_tier]  # `make test-delta-spark`

V2 = "'delta.checkpointPolicy' = 'v2', 'delta.checkpointInterval' = '2'"
RETENTION_MS = 30 * DAY_MS
LATER_MS = 40 * DAY_MS  # "now" for the log cleanup: every file is older than the retention (and a day)


def _now_later() -> int:
    return int(time.time() * 1000) + LATER_MS


def _uuid_checkpoints(path: str) -> list[str]:
    names = (p.name for p in (Path(path) / DELTA_LOG_DIR).iterdir())
    return sorted(n for n in names if (parsed := parse_name(n)) is not None and parsed[1] == UUID_NAMED)


def _sidecars(path: str) -> list[str]:
    return sorted(p.name for p in (Path(path) / DELTA_LOG_DIR / "_sidecars").glob("*.parquet"))


def _agree(path: str, model: dict, spark) -> None:
    table = Table.open(path)
    assert_readers_agree(table, COLUMNS, rows_of(model), spark=spark, polars_refuses="v2Checkpoint")
    assert verify_table(table).ok


def _merge(spark, path: str, rows: list[tuple[str, str, int]]) -> None:
    source = " UNION ALL ".join(f"SELECT '{i}' AS id, '{d}' AS dt, CAST({v} AS BIGINT) AS v" for i, d, v in rows)
    spark.sql(
        f"MERGE INTO delta.`{path}` t USING ({source}) s ON t.id = s.id AND t.dt = s.dt "
        "WHEN MATCHED THEN UPDATE SET * WHEN NOT MATCHED THEN INSERT *"
    )


def test_delta_spark_turns_v2_checkpoints_on_a_dbidx_table_and_both_write_on(spark, tmp_path: Path) -> None:
    """Before: dbidx refused the table (v2Checkpoint). Now: absorbed, even from a V2 checkpoint whose versions a
    log cleanup expired; dbidx's checkpoint and log cleanup leave every reader right, and Delta Spark writes on."""
    w = Writer(tmp_path)  # dbidx's versions 0-4: upserts with a delete
    spark.sql(f"ALTER TABLE delta.`{w.path}` SET TBLPROPERTIES ({V2})")  # version 5
    spark.sql(f"INSERT INTO delta.`{w.path}` VALUES ('s1', 'd1', 901)")  # 6: a V2 checkpoint (JSON, sidecars)
    spark.sql(f"INSERT INTO delta.`{w.path}` VALUES ('s2', 'd2', 902)")  # 7
    w.model.update({("d1", "s1"): 901, ("d2", "s2"): 902})
    (spark_checkpoint,) = _uuid_checkpoints(w.path)
    assert spark_checkpoint.startswith(f"{6:020d}.checkpoint.") and spark_checkpoint.endswith(".json")
    assert _sidecars(w.path) and not (Path(w.path) / DELTA_LOG_DIR / f"{6:020d}.checkpoint.parquet").exists()
    # A log cleanup expires the versions below it, Delta Spark's 5 and 6 included, before dbidx absorbed them: the
    # absorption reads them from the V2 checkpoint and its sidecar; the sidecar it names stays.
    io = Table.open(w.path).io
    assert expire_log(io, RETENTION_MS, _now_later()).kept_from == 6
    assert min(listed_versions(io)) == 6 and _sidecars(w.path)
    w.upsert([("k1", "d2", 11), ("s1", "d1", 12), ("n1", "d3", 13), ("k2", "d3", 0)], [False, False, False, True])
    # dbidx's checkpoint: delta-rs writes it from the V2 checkpoint, its sidecar and the JSON after it.
    written = write_delta_checkpoint(io)
    assert written is not None and (written.version, written.published) == (8, True)
    classic = pq.read_table(Path(w.path) / DELTA_LOG_DIR / f"{8:020d}.checkpoint.parquet")
    assert classic.column("checkpointMetadata").drop_null().to_pylist() == [{"version": 8}]
    assert read_checkpoint_pointer(io)["version"] == 8 and "v2Checkpoint" not in read_checkpoint_pointer(io)
    live = {a.path for a in from_checkpoint(io, 8, {}).adds}  # dbidx reads its own checkpoint back
    assert live == {f.removeprefix(w.path + "/") for f in DeltaTable(w.path).file_uris()}
    # dbidx's log cleanup from it: Delta Spark's V2 checkpoint and its sidecar, no longer named, go.
    expiry = expire_log(io, RETENTION_MS, _now_later())
    assert expiry.kept_from == 8 and not _uuid_checkpoints(w.path) and not _sidecars(w.path)
    assert min(listed_versions(io)) == 8
    _agree(w.path, w.model, spark)
    # Delta Spark writes on (an INSERT, a MERGE that updates by deletion vector: its next V2 checkpoint at 10).
    spark.sql(f"INSERT INTO delta.`{w.path}` VALUES ('s3', 'd3', 903)")
    _merge(spark, w.path, [("k5", "d3", 55), ("m1", "d1", 1)])
    w.model.update({("d3", "s3"): 903, ("d3", "k5"): 55, ("d1", "m1"): 1})
    assert _uuid_checkpoints(w.path) and set(via_delta_spark(spark, w.path, COLUMNS)) == rows_of(w.model)
    w.upsert([("k5", "d3", 56), ("m1", "d1", 2), ("s3", "d3", 0)], [False, False, True], Table.open(w.path))
    _agree(w.path, w.model, spark)


def test_dbidx_adopts_a_table_delta_spark_created_with_v2_checkpoints(spark, tmp_path: Path) -> None:
    """A partitioned table Delta Spark created with v2 checkpoints in Parquet (sidecars, a vector of a DELETE):
    adopted from its V2 checkpoint alone (no JSON after it), then written by dbidx and re-adopted."""
    path = str(tmp_path / "t")
    spark.conf.set("spark.databricks.delta.checkpointV2.topLevelFileFormat", "parquet")
    try:
        spark.sql(
            f"CREATE TABLE delta.`{path}` (id STRING, dt STRING, v BIGINT) USING delta PARTITIONED BY (dt) "
            f"TBLPROPERTIES ({V2}, 'delta.enableDeletionVectors' = 'true')"
        )
        spark.sql(f"INSERT INTO delta.`{path}` VALUES " + ", ".join(f"('a{i}', 'd{i % 2}', {i})" for i in range(8)))
        spark.sql(f"INSERT INTO delta.`{path}` VALUES ('b1', 'd1', 11), ('b2', 'd0', 12)")
        spark.sql(f"DELETE FROM delta.`{path}` WHERE id = 'a3'")
        spark.sql(f"INSERT INTO delta.`{path}` VALUES ('b3', 'd0', 13)")  # version 4: a V2 checkpoint
    finally:
        spark.conf.unset("spark.databricks.delta.checkpointV2.topLevelFileFormat")
    assert _uuid_checkpoints(path)[-1].startswith(f"{4:020d}.checkpoint.") and _uuid_checkpoints(path)[-1].endswith(
        ".parquet"
    )
    assert _sidecars(path) and max(listed_versions(FileIO.from_uri(path))) == 4
    model = {(f"d{i % 2}", f"a{i}"): i for i in range(8) if i != 3} | {("d1", "b1"): 11, ("d0", "b2"): 12}
    model[("d0", "b3")] = 13
    build_index(Table.create(path, num_shards=1), "id")
    w = Writer.over(path, tmp_path / "cache", model)
    _agree(path, w.model, spark)
    w.upsert([("a1", "d1", 101), ("c1", "d0", 102), ("a4", "d0", 0)], [False, False, True])
    _agree(path, w.model, spark)
    readopt(path, "id")
    w.quick_check()


# ---- damage ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def damaged_base(spark, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A table Delta Spark wrote with a V2 checkpoint (JSON, one sidecar) at version 2 and a version after it."""
    path = str(tmp_path_factory.mktemp("v2-damage") / "t")
    spark.sql(f"CREATE TABLE delta.`{path}` (id STRING, dt STRING, v BIGINT) USING delta TBLPROPERTIES ({V2})")
    for i in range(3):
        spark.sql(f"INSERT INTO delta.`{path}` VALUES ('k{i}', 'd1', {i})")
    assert len(_uuid_checkpoints(path)) == 1 and len(_sidecars(path)) == 1
    return path


def _missing(log: Path, top: Path, sidecar: Path) -> str:
    sidecar.unlink()
    return sidecar.name


def _truncated(log: Path, top: Path, sidecar: Path) -> str:
    sidecar.write_bytes(sidecar.read_bytes()[: sidecar.stat().st_size // 2])
    return sidecar.name


def _no_metadata(log: Path, top: Path, sidecar: Path) -> str:
    lines = [line for line in top.read_text().splitlines() if not line.startswith('{"checkpointMetadata"')]
    top.write_text("\n".join(lines) + "\n")
    return top.name


def _wrong_metadata(log: Path, top: Path, sidecar: Path) -> str:
    lines = [json.loads(line) for line in top.read_text().splitlines()]
    for line in lines:
        if "checkpointMetadata" in line:
            line["checkpointMetadata"]["version"] = "two"
    top.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return top.name


@pytest.mark.parametrize("damage", [_missing, _truncated, _no_metadata, _wrong_metadata], ids=lambda f: f.__name__)
def test_a_damaged_v2_checkpoint_is_refused_by_name(damaged_base: str, tmp_path: Path, damage) -> None:
    """Adoption, dbidx's checkpoint writer and the absorption of expired versions each name the damaged file
    (CorruptFileError: CLI exit 4); nothing is written."""
    shutil.copytree(damaged_base, tmp_path / "t")
    path = str(tmp_path / "t")
    log = Path(path) / DELTA_LOG_DIR
    (top,) = [log / n for n in _uuid_checkpoints(path)]
    named = damage(log, top, log / "_sidecars" / _sidecars(path)[0])
    before = sorted(p.name for p in log.iterdir())
    io = FileIO.from_uri(path)
    with pytest.raises(CorruptFileError, match=named.replace(".", r"\.")):
        write_delta_checkpoint(io)
    with pytest.raises(CorruptFileError, match=named.replace(".", r"\.")):
        from_checkpoint(io, 2, {})
    with pytest.raises(CorruptFileError, match=named.replace(".", r"\.")):
        build_index(Table.create(path, num_shards=1), "id")
    assert sorted(p.name for p in log.iterdir()) == before
    assert not list((Path(path) / ".dbidx" / "timeline" / "completed").glob("*.json"))


def test_the_log_cleanup_keeps_what_a_v2_checkpoint_names(spark, damaged_base: str, tmp_path: Path) -> None:
    """PROTOCOL.md "Metadata Cleanup" 4-5: a sidecar a checkpoint left names stays; one no checkpoint names goes
    once older than a day (as of midnight UTC), not before; a V2 checkpoint whose sidecar is missing is no
    cut-off (nothing deleted below it)."""
    shutil.copytree(damaged_base, tmp_path / "t")
    path = str(tmp_path / "t")
    sidecars = Path(path) / DELTA_LOG_DIR / "_sidecars"
    (named,) = _sidecars(path)
    orphan = sidecars / "an-unfinished-checkpoint.parquet"  # a checkpoint being written, or one a crash left
    shutil.copy(sidecars / named, orphan)
    io = FileIO.from_uri(path)
    now = int(time.time() * 1000)
    assert expire_log(io, 0, now).kept_from == 2 and min(listed_versions(io)) == 2
    assert _sidecars(path) == sorted([named, orphan.name])  # the orphan is younger than a day
    assert expire_log(io, 0, now + 2 * DAY_MS).kept_from == 2 and _sidecars(path) == [named]
    assert set(via_delta_spark(spark, path, ["id", "v"])) == {("k0", 0), ("k1", 1), ("k2", 2)}
    # Without its sidecar the checkpoint is no starting point: the cleanup keeps every version.
    broken = str(tmp_path / "broken")
    shutil.copytree(damaged_base, broken)
    (Path(broken) / DELTA_LOG_DIR / "_sidecars" / named).unlink()
    assert expire_log(FileIO.from_uri(broken), 0, now + 2 * DAY_MS).kept_from is None
    assert listed_versions(FileIO.from_uri(broken)) == [0, 1, 2, 3]
