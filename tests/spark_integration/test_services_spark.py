"""The table services after a Spark upsert (`api.upsert`): they run in the driver after the publish and report in
the summary; the rows stay exactly the model's, read by Spark and by the other engines."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from dbidx.config import CacheConfig
from dbidx.table.service_settings import write_settings
from dbidx.table.facade import Table
from dbidx.data import reads
from dbidx.errors import CorruptFileError
from dbidx.spark_integration.api import maintain, upsert
from dbidx.spark_integration.reads import read_table

from tests.delta_readers import assert_readers_agree
from tests.spark_helpers import SCHEMA, Oracle, random_batch

pytestmark = pytest.mark.spark


def test_services_run_after_a_spark_upsert(spark, tmp_path: Path, services_on: None) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    write_settings(table.io, {"data_min_small_files": 2, "index_min_files": 2, "spark_jobs_min_mb": 0})
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    oracle, serial, rng = Oracle(False), [0], random.Random(4402)
    ran: list[str] = []
    tracker = spark.sparkContext.statusTracker()
    for _ in range(3):
        batch = random_batch(rng, oracle, serial, size=20)
        jobs_before = len(tracker.getJobIdsForGroup())
        summary = upsert(spark.createDataFrame(batch, SCHEMA), table, key="id", partition="dt", cache_config=config)
        oracle.apply(batch)
        runs = summary.services["ran"]
        ran += [r["service"] for r in runs]
        assert summary.to_dict()["services"] == summary.services
        # The compactions' pieces ran as Spark jobs of their own (one each), after the upsert's.
        compactions = [r for r in runs if r["service"] in ("data_compaction", "index_compaction")]
        assert all(r["details"]["ran_on"] == "spark" for r in compactions)
        assert len(tracker.getJobIdsForGroup()) - jobs_before >= 1 + len(compactions)
    assert {"data_compaction", "index_compaction"} <= set(ran)
    expected = {(ident[-1], day, value) for ident, (day, value) in oracle.rows.items()}
    got = {(r.id, r.dt.split("=", 1)[-1], r.v) for r in read_table(spark, table).select("id", "dt", "v").collect()}
    assert got == expected
    assert_readers_agree(table, ["id", "dt", "v"], expected, spark=spark)


def _loaded(spark, tmp_path: Path, seed: int) -> tuple[Table, Oracle]:
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    oracle, serial, rng = Oracle(False), [0], random.Random(seed)
    for _ in range(4):
        batch = random_batch(rng, oracle, serial, size=30)
        upsert(spark.createDataFrame(batch, SCHEMA), table, key="id", partition="dt", cache_config=config)
        oracle.apply(batch)
    write_settings(
        table.io,
        {"data_min_small_files": 2, "index_compaction": False, "clean": False, "log_cleanup": False, "vacuum": False},
    )
    return table, oracle


def test_a_compaction_task_that_fails_once_is_retried_and_its_first_try_deleted(
    spark, tmp_path: Path, monkeypatch
) -> None:
    """`maintain` on Spark: each file group's rewrite is a task; a first try that wrote its base and then died is
    retried by Spark, the second try's base is published and the first's is deleted."""
    from dbidx.data import compaction

    table, oracle = _loaded(spark, tmp_path, 4407)
    real = compaction.rewrite_file_group

    def dies_after_writing(io, instant, key, schema, unit, attempt):  # pickled by value into the tasks
        payload = real(io, instant, key, schema, unit, attempt)
        if attempt == 0:
            raise RuntimeError("executor lost after writing its base")
        return payload

    monkeypatch.setattr(compaction, "rewrite_file_group", dies_after_writing)
    report = maintain(spark, table)
    monkeypatch.undo()
    [run] = [r for r in report.ran if r.service == "data_compaction"]
    assert run.details["ran_on"] == "spark" and run.details["file_groups"] >= 2
    timeline = Table.open(table.uri).timeline
    timeline.refresh()
    record = timeline.record_of(run.instant)
    bases = {f.path for f in record.data_files}
    assert bases and all(p.endswith(f"_{run.instant}_1.parquet") for p in bases)
    on_disk = {rel for rel, _ in table.io.list_files_recursive("") if run.instant in rel and rel.endswith(".parquet")}
    assert on_disk == bases  # the first tries' files are gone
    expected = {(ident[-1], day, value) for ident, (day, value) in oracle.rows.items()}
    assert_readers_agree(table, ["id", "dt", "v"], expected, spark=spark)


def test_a_damaged_file_in_a_compaction_task_is_a_typed_error_and_nothing_is_published(spark, tmp_path: Path) -> None:
    """A CorruptFileError raised in an executor comes back as itself; the compaction is rolled back with every base
    its tasks wrote, and the table is as it was."""
    table, _ = _loaded(spark, tmp_path, 4408)
    unit = next(u for u in reads.plan_read(table).units if len(u.files) >= 2)
    path = table.io.path(unit.files[0].path)
    with open(path, "r+b") as handle:  # same size, other bytes: only the checksum can tell
        handle.seek(unit.files[0].size // 2)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0xFF]))
    latest = table.timeline.latest_seq
    with pytest.raises(CorruptFileError, match="raised in a Spark task"):
        maintain(spark, table)
    timeline = Table.open(table.uri).timeline
    timeline.refresh()
    rollback = [r for r in timeline.completed(after_seq=latest) if r.action == "rollback"]
    assert len(rollback) == 1 and timeline.record_of(rollback[0].rolled_back).action == "rollback"
    written = [rel for rel, _ in table.io.list_files_recursive("") if rollback[0].rolled_back in rel]
    assert written == []
