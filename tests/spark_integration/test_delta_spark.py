"""Delta Lake on Spark (Delta Spark 4.4.0, the protocol's reference implementation) beside dbidx, in the tests' one
SparkSession (tests/conftest.py loads its jars): it reads every dbidx table exactly as dbidx, deltalake, polars and
DuckDB do, at every version, and its writes and maintenance (MERGE, UPDATE, DELETE with deletion vectors, INSERT,
OPTIMIZE, Z-order, REORG PURGE, checkpoints, ADD COLUMNS, RESTORE) are absorbed or refused by name, with dbidx's
upserts over the touched keys after each and every reader checked against a model; its VACUUM keeps what the
retention needs and takes what dbidx's compactions replaced (issue 60, sections 1 and 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest

from dbidx.data import reads
from dbidx.data.deletion_vectors import VECTOR_STORAGE
from dbidx.data.delta_log import listed_versions
from dbidx.errors import DeltaFeatureError
from dbidx.table.facade import Table
from dbidx.table.readopt import readopt
from dbidx.table.vector_storage import misplaced_vectors

from tests.data.test_foreign_writers import COLUMNS, Writer, rows_of
from tests.delta_readers import via_delta_spark, via_deltalake
from tests.retention import clean_without_waiting

pytestmark = pytest.mark.spark


def spark_rows(spark, path: str, version: int | None = None) -> set[tuple]:
    return set(via_delta_spark(spark, path, COLUMNS, version))


def full_check(spark, w: Writer) -> None:
    """Delta Spark as the fifth reader: the same rows as dbidx, deltalake, polars and DuckDB, and the model's."""
    w.check()  # dbidx, deltalake, polars, DuckDB, no key twice, verify
    assert spark_rows(spark, w.path) == rows_of(w.model)


def test_delta_spark_reads_every_version_of_a_dbidx_table(spark, tmp_path: Path) -> None:
    """After upserts with deletes, both compactions, a clean, checkpoints: Delta Spark's time travel to each version
    reads what deltalake reads there; the latest is the model; DESCRIBE HISTORY and DETAIL describe the log."""
    w = Writer(tmp_path)
    table = Table.open(w.path)
    table.compact_data(min_files=1, target_file_bytes=1 << 30)
    w.touched_update(100)
    table = Table.open(w.path)
    table.compact(min_files=2)
    table.checkpoint()
    w.upsert([("k3", "d1", 3), ("k4", "d2", 4)], deletes=[True, False])
    table = Table.open(w.path)
    table.clean(retain_completions=0)  # replaced index files; data files stay delta.deletedFileRetentionDuration
    full_check(spark, w)
    versions = listed_versions(table.io)
    for version in versions[1:]:  # version 0 (the table's creation) has no columns yet
        assert spark_rows(spark, w.path, version) == set(via_deltalake(w.path, COLUMNS, version)), version
    history = spark.sql(f"DESCRIBE HISTORY delta.`{w.path}`").collect()
    assert sorted(r["version"] for r in history) == versions
    assert {r["operation"] for r in history} >= {"MERGE", "OPTIMIZE"}
    (detail,) = spark.sql(f"DESCRIBE DETAIL delta.`{w.path}`").collect()
    assert detail["numFiles"] == len(Table.open(w.path).data_view().live())
    assert list(detail["partitionColumns"]) == ["dt"]


def _merge(spark, w: Writer) -> None:
    spark.sql(
        f"""MERGE INTO delta.`{w.path}` t
        USING (SELECT 'k5' id, 'd3' dt, 555L v UNION ALL SELECT 'k8' id, 'd3' dt, -1L v
               UNION ALL SELECT 'n1' id, 'd1' dt, 7L v) s
        ON t.dt = s.dt AND t.id = s.id
        WHEN MATCHED AND s.v < 0 THEN DELETE WHEN MATCHED THEN UPDATE SET *
        WHEN NOT MATCHED AND s.v >= 0 THEN INSERT *"""
    )
    w.model.pop(("d3", "k8"), None)
    if ("d3", "k5") in w.model:
        w.model[("d3", "k5")] = 555
    w.model[("d1", "n1")] = 7


def _update(spark, w: Writer) -> None:
    spark.sql(f"UPDATE delta.`{w.path}` SET v = v + 1000 WHERE dt = 'd2'")
    w.model = {k: v + 1000 if k[0] == "d2" else v for k, v in w.model.items()}


def _delete(spark, w: Writer) -> None:
    spark.sql(f"DELETE FROM delta.`{w.path}` WHERE v % 2 = 0")  # about half the rows: vectors on most files
    w.model = {k: v for k, v in w.model.items() if v % 2}


def _insert(spark, w: Writer) -> None:
    spark.sql(f"INSERT INTO delta.`{w.path}` VALUES ('a1', 'd2', 1), ('a2', 'd3', 2)")
    w.model.update({("d2", "a1"): 1, ("d3", "a2"): 2})


def _optimize(spark, w: Writer) -> None:
    spark.sql(f"OPTIMIZE delta.`{w.path}`")


def _z_order(spark, w: Writer) -> None:
    spark.sql(f"OPTIMIZE delta.`{w.path}` ZORDER BY (id)")


def _reorg(spark, w: Writer) -> None:
    spark.sql(f"REORG TABLE delta.`{w.path}` APPLY (PURGE)")


def _checkpoint(spark, w: Writer) -> None:
    jvm = spark.sparkContext._jvm
    jvm.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, w.path).checkpoint()


WRITES: dict[str, Callable] = {
    "merge": _merge,
    "update": _update,
    "delete": _delete,
    "insert": _insert,
    "optimize": _optimize,
    "z-order": _z_order,
    "reorg-purge": _reorg,
    "checkpoint": _checkpoint,
}


def quick_check(spark, w: Writer) -> None:
    """dbidx's read and Delta Spark's against the model (full_check adds the other readers and verify)."""
    w.quick_check()
    assert spark_rows(spark, w.path) == rows_of(w.model)


def test_delta_spark_writes_are_absorbed_and_dbidx_writes_on(spark, tmp_path: Path) -> None:
    """Each Delta Spark write (its DV-writing MERGE, UPDATE and DELETE over files dbidx wrote among them), then a
    dbidx upsert of every live key (so of every file it touched): dbidx's read against the model after the write
    (the absorb), dbidx's and Delta Spark's after the upsert; then several Delta Spark versions absorbed as one run.
    One table for all (each Spark read costs seconds)."""
    w = Writer(tmp_path)
    for step, (name, write) in enumerate(WRITES.items()):
        write(spark, w)
        w.quick_check()
        w.touched_update(5000 + 100 * step)
        quick_check(spark, w)
    full_check(spark, w)
    for name in ("merge", "optimize", "delete", "checkpoint", "update"):  # one run of five versions
        WRITES[name](spark, w)
    full_check(spark, w)
    w.touched_update(7000)
    full_check(spark, w)


def test_delta_spark_add_columns_then_dbidx_upserts_with_the_column(spark, tmp_path: Path) -> None:
    """ADD COLUMNS is absorbed as a new data column; a dbidx upsert then carries it (an upsert replaces whole
    rows: one without it is refused by name, SchemaError)."""
    import pyarrow as pa

    from dbidx.config import CacheConfig
    from dbidx.errors import SchemaError
    from dbidx.spark_integration.local import upsert_arrow

    w = Writer(tmp_path)
    spark.sql(f"ALTER TABLE delta.`{w.path}` ADD COLUMNS (note STRING)")
    with pytest.raises(SchemaError, match="note"):
        w.touched_update(10)
    rows = pa.table({"id": ["k1", "z9"], "dt": ["d2", "d1"], "v": pa.array([11, 99], pa.int64()), "note": ["a", None]})
    upsert_arrow(rows, Table.open(w.path), key="id", partition="dt", cache_config=CacheConfig(str(tmp_path / "c")))
    w.model.update({("d2", "k1"): 11, ("d1", "z9"): 99})
    full_check(spark, w)
    got = {tuple(r) for r in spark.read.format("delta").load(w.path).select("id", "note").collect()}
    assert ("k1", "a") in got and ("z9", None) in got
    ours = reads.read_arrow(Table.open(w.path), columns=["id", "note"]).to_pylist()
    assert {(r["id"], r["note"]) for r in ours} == got


def test_delta_spark_restore_is_refused_by_name_and_readopt_takes_the_table(spark, tmp_path: Path) -> None:
    w = Writer(tmp_path)
    spark.sql(f"RESTORE TABLE delta.`{w.path}` TO VERSION AS OF 2")
    restored = spark_rows(spark, w.path)
    with pytest.raises(DeltaFeatureError, match=r"--readopt"):
        Table.open(w.path).sync_delta_log()
    readopt(w.path, "id")
    w.model = {(d, i): v for i, d, v in restored}
    full_check(spark, w)
    w.touched_update(8000)
    full_check(spark, w)


@pytest.mark.parametrize("overlap", [False, True], ids=["other-keys", "same-keys"])
def test_a_delta_spark_commit_landing_while_a_dbidx_upsert_runs(
    spark, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    """Delta Spark commits while dbidx's tasks run (the rules as for delta-rs): an INSERT of other keys leaves the
    upsert to commit at the next version; an UPDATE of the keys it writes makes it conflict, nothing published,
    and a retry lands."""
    from dbidx.errors import ConflictError
    from dbidx.spark_integration import task

    w = Writer(tmp_path)
    real = task.upsert_batches
    fired: list[bool] = []

    def tasks_then_delta_spark(*args, **kwargs):
        result = real(*args, **kwargs)
        if not fired:
            fired.append(True)
            (_update if overlap else _insert)(spark, w)
        return result

    monkeypatch.setattr(task, "upsert_batches", tasks_then_delta_spark)
    if overlap:
        with pytest.raises(ConflictError):  # the model keeps Delta Spark's update, not the failed upsert's row
            w.upsert([("k4", "d2", 44)], table=Table.open(w.path))
        quick_check(spark, w)
    else:
        w.upsert([("k4", "d2", 43)], table=Table.open(w.path))
        quick_check(spark, w)
    monkeypatch.undo()
    w.upsert([("k4", "d2", 44)], table=Table.open(w.path))
    full_check(spark, w)


def _vacuum(spark, path: str, how: str = "", dry_run: bool = True) -> set[str]:
    """The files Delta Spark's VACUUM lists (DRY RUN) or deletes, table-relative; RETAIN 0 HOURS needs Delta's
    retention check off, which a user turns off the same way."""
    spark.conf.set("spark.databricks.delta.retentionDurationCheck.enabled", "false")
    try:
        rows = spark.sql(f"VACUUM delta.`{path}` {how} {'DRY RUN' if dry_run else ''}").collect()
    finally:
        spark.conf.unset("spark.databricks.delta.retentionDurationCheck.enabled")
    root = Path(path).resolve().as_uri().removeprefix("file://")
    return {str(r[0]).removeprefix("file:").removeprefix(root + "/") for r in rows} if dry_run else set()


def test_delta_spark_vacuum_keeps_what_the_retention_needs_and_takes_what_dbidx_replaced(spark, tmp_path: Path) -> None:
    """Within the table's retention (Delta's default week) VACUUM and VACUUM LITE list nothing after dbidx's
    upserts, both compactions and a clean, and every version reads as before; RETAIN 0 HOURS lists exactly the data
    files dbidx's data compaction replaced (never `.dbidx/`, whose DV files the log's vectors point into), and dbidx
    reads, writes and cleans on after it deleted them."""
    w = Writer(tmp_path)
    Table.open(w.path).set_delta_properties({VECTOR_STORAGE: "file"})
    Table.open(w.path).match_vector_storage()
    Table.open(w.path).compact_data(min_files=1, target_file_bytes=1 << 30)
    w.touched_update(100)
    table = Table.open(w.path)
    table.compact(min_files=2)
    table.clean(retain_completions=0)
    versions = listed_versions(table.io)
    assert _vacuum(spark, w.path) == set()
    assert _vacuum(spark, w.path, "LITE") == set()
    _vacuum(spark, w.path, dry_run=False)
    for version in sorted(set(versions[1::3] + versions[-2:])):  # a sample: every version is read in the test above
        assert spark_rows(spark, w.path, version) == set(via_deltalake(w.path, COLUMNS, version)), version
    full_check(spark, w)
    replaced = {path for path, _ in Table.open(w.path).data_view().replaced(1 << 62)}
    assert replaced and _vacuum(spark, w.path, "RETAIN 0 HOURS") == replaced
    _vacuum(spark, w.path, "RETAIN 0 HOURS", dry_run=False)
    assert not any(Path(w.path, p).exists() for p in replaced)
    full_check(spark, w)
    w.touched_update(200)
    clean_without_waiting(Table.open(w.path))
    Table.open(w.path).clean(retain_completions=0)  # the files VACUUM took are gone already: nothing fails
    full_check(spark, w)


def test_inline_vectors_fail_delta_spark_vacuum_until_the_table_logs_them_in_files(spark, tmp_path: Path) -> None:
    """Delta Spark 4.4.0's VACUUM fails on an inline vector (scala.MatchError), dbidx's default form; `dbidx config
    URI dbidx.deletionVectors.storage=file` moves them into files at once, after which VACUUM runs. Delta Spark's own
    file-backed vectors on a table left inline are logged inline by `dbidx sync` (delta-rs deadlocks on many)."""
    from click.testing import CliRunner

    from dbidx.cli import main

    w = Writer(tmp_path)
    w.touched_update(100)
    with pytest.raises(Exception, match="MatchError"):
        _vacuum(spark, w.path)
    _delete(spark, w)  # Delta Spark's vectors, in its own DV files
    result = CliRunner().invoke(main, ["sync", w.path, "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["vectors_moved"] > 0, result.output
    assert misplaced_vectors(Table.open(w.path)) == []
    full_check(spark, w)
    result = CliRunner().invoke(main, ["config", w.path, f"{VECTOR_STORAGE}=file", "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["vectors_moved"] > 0, result.output
    assert _vacuum(spark, w.path) == set()
    full_check(spark, w)
    w.touched_update(200)
    full_check(spark, w)


def test_delta_spark_reads_an_adopted_table_and_one_whose_log_was_cleaned(spark, tmp_path: Path) -> None:
    """Adoption (a delta-rs table with a file-backed and an inline vector, then dbidx upserts) and log cleanup
    (expired JSON below a checkpoint): Delta Spark reads each version left as deltalake does, the latest as dbidx."""
    import pyarrow as pa
    from click.testing import CliRunner

    from dbidx.cli import main
    from dbidx.config import CacheConfig
    from dbidx.data.log_retention import expire_log
    from dbidx.spark_integration.local import upsert_arrow

    from tests.data.test_delta_adopt import a_delta_rs_table
    from tests.data.test_log_retention import DAY_MS, age_log, expected, table_with_checkpoints, write
    from tests.delta_readers import assert_readers_agree

    path = tmp_path / "adopted"
    rows = a_delta_rs_table(path)
    result = CliRunner().invoke(main, ["build-index", str(path), "--key", "id", "--num-shards", "2"])
    assert result.exit_code == 0, result.output
    adopted_at = listed_versions(Table.open(str(path)).io)[-1]
    batch = pa.table({"id": ["k1", "k7", "z1"], "dt": ["d1", "d3", "d2"], "v": pa.array([11, 17, 21], pa.int64())})
    upsert_arrow(batch, Table.open(str(path)), key="id", partition="dt", cache_config=CacheConfig(str(tmp_path / "c")))
    rows = {r for r in rows if r[0] not in {"k1", "k7"}} | {("k1", "d1", 11), ("k7", "d3", 17), ("z1", "d2", 21)}
    assert set(assert_readers_agree(Table.open(str(path)), COLUMNS, rows, spark=spark)) == rows
    for version in listed_versions(Table.open(str(path)).io):
        if version >= adopted_at - 2:  # the delta-rs versions before the adoption too
            assert spark_rows(spark, str(path), version) == set(via_deltalake(str(path), COLUMNS, version)), version

    cleaned = table_with_checkpoints(tmp_path / "cleaned", writes=12, every=5)  # checkpoints at versions 5 and 10
    age_log(cleaned, days=40)
    write(cleaned, tmp_path / "cleaned", 12)
    assert expire_log(cleaned.io, 30 * DAY_MS).kept_from == 10
    assert set(assert_readers_agree(Table.open(cleaned.uri), COLUMNS, expected(13), spark=spark)) == expected(13)
    assert set(via_deltalake(cleaned.uri, COLUMNS, 11)) == expected(11)
    # The log was aged 40 days: Delta Spark refuses time travel past delta.deletedFileRetentionDuration, loudly.
    with pytest.raises(Exception, match="TIME_TRAVEL_BEYOND_DELETED_FILE_RETENTION"):
        spark_rows(spark, cleaned.uri, 11)


def test_dbidx_adopts_a_table_delta_spark_created_and_both_write_on(spark, tmp_path: Path) -> None:
    """Issue 60 section 4, the plain case: a partitioned table Delta Spark created with deletion vectors, written
    and DELETEd from (its vectors in its own DV files), adopted by `dbidx build-index`; then dbidx upserts and Delta
    Spark MERGEs take turns, every reader against the model after each."""
    from click.testing import CliRunner

    from dbidx.cli import main

    path = str(tmp_path / "t")
    spark.conf.set("spark.databricks.delta.properties.defaults.enableDeletionVectors", "true")
    try:
        spark.createDataFrame(
            [(f"k{i}", ("d1", "d2", "d3")[i % 3], i) for i in range(30)], "id string, dt string, v long"
        ).write.format("delta").partitionBy("dt").save(path)
    finally:
        spark.conf.unset("spark.databricks.delta.properties.defaults.enableDeletionVectors")
    spark.sql(f"DELETE FROM delta.`{path}` WHERE v % 7 = 0")
    result = CliRunner().invoke(main, ["build-index", path, "--key", "id", "--num-shards", "2"])
    assert result.exit_code == 0, result.output
    w = Writer.over(path, tmp_path / "cache", {(d, i): v for i, d, v in spark_rows(spark, path)})
    assert len(w.model) == 30 - 5
    full_check(spark, w)
    w.touched_update(100)
    full_check(spark, w)
    _merge(spark, w)
    _delete(spark, w)
    quick_check(spark, w)
    w.touched_update(200)
    full_check(spark, w)


def test_not_null_columns_of_a_delta_spark_table_are_enforced_and_kept(spark, tmp_path: Path) -> None:
    """Before: dbidx upserted a null into a NOT NULL column of an adopted Delta Spark table, and every Delta Spark
    read of the table then failed (DELTA_NOT_NULL_CONSTRAINT_VIOLATED); a dbidx version with a metaData dropped the
    constraint and the columns' comments. Now the upsert is refused by name with no row written, delete rows need
    no value, the constraint and the comment stay through dbidx's property changes, and dropping the constraint
    with Delta Spark is absorbed."""
    import pyarrow as pa

    from dbidx.errors import InvalidInputError
    from dbidx.spark_integration.local import upsert_arrow
    from dbidx.table.build_index import build_index

    path = str(tmp_path / "t")
    spark.sql(
        f"CREATE TABLE delta.`{path}` (id STRING NOT NULL, dt STRING, v BIGINT NOT NULL COMMENT 'the value') "
        "USING delta PARTITIONED BY (dt) TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')"
    )
    spark.sql(f"INSERT INTO delta.`{path}` VALUES ('a', 'd1', 1), ('b', 'd2', 2), ('c', 'd1', 3)")
    build_index(Table.create(path, num_shards=1), "id")
    w = Writer.over(path, tmp_path / "c", {("d1", "a"): 1, ("d2", "b"): 2, ("d1", "c"): 3})
    with pytest.raises(InvalidInputError, match=r"'v' is NOT NULL .*1 value\(s\) .*no row was written"):
        w.upsert([("a", "d1", None), ("n", "d2", 4)], table=Table.open(path))  # type: ignore[list-item]
    assert set(via_delta_spark(spark, path, COLUMNS)) == rows_of(w.model)  # (the model kept the refused rows out)
    w.upsert([("c", "d1", None)], deletes=[True], table=Table.open(path))  # type: ignore[list-item]
    Table.open(path).set_delta_properties({"owner": "team-a"})  # a metaData version of dbidx's
    with pytest.raises(Exception, match="NOT_NULL_CONSTRAINT_VIOLATED"):
        spark.sql(f"INSERT INTO delta.`{path}` VALUES ('z', 'd1', NULL)")
    assert set(via_delta_spark(spark, path, COLUMNS)) == rows_of(w.model)
    spark.sql(f"ALTER TABLE delta.`{path}` ALTER COLUMN v DROP NOT NULL")
    Table.open(path).sync_delta_log()
    w.upsert([("a", "d1", None)], table=Table.open(path))  # type: ignore[list-item]
    assert set(via_delta_spark(spark, path, COLUMNS)) == rows_of(w.model) and ("a", "d1", None) in rows_of(w.model)
    batch = pa.table({"id": ["b"], "dt": ["d2"], "v": pa.array([20], pa.int64()), "w": ["x"]})
    upsert_arrow(batch, Table.open(path), key="id", partition="dt", cache_config=w.config)  # a new column
    with pytest.raises(Exception, match="NOT_NULL_CONSTRAINT_VIOLATED"):
        spark.sql(f"INSERT INTO delta.`{path}` VALUES (NULL, 'd1', 5, 'y')")
    comments = {r["col_name"]: r["comment"] for r in spark.sql(f"DESCRIBE TABLE delta.`{path}`").collect()}
    assert comments["v"] == "the value" and "w" in comments  # the columns' metadata kept through dbidx's metaData
