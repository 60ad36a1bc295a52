"""The process model and failure handling (docs/DESIGN.md sections 2 and 3) under Spark: retried and speculative
attempts, failed jobs, other processes and writers, streaming."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from dbidx.buckets.assigner import BucketSpec
from dbidx.cli import main
from dbidx.config import CacheConfig
from dbidx.data.schema import encode_schema
from dbidx.errors import CommitError, HookError, InvalidInputError, InvalidKeyError
from dbidx.table.facade import Table
from dbidx.spark_integration import api, task
from dbidx.spark_integration.api import tag, upsert
from dbidx.spark_integration.driver import _check_layout_and_schema, commit_results
from dbidx.spark_integration.reads import committed_data_files, read_table
from dbidx.spark_integration.tagger import TagOptions
from dbidx.spark_integration.task_result import ShardMetrics, TaskResult, pack_payload, unpack_result
from dbidx.storage import leftovers, markers
from dbidx.storage.data_view import SCHEMA_EXTRA
from dbidx.storage.records import ACTION_ROLLBACK

from tests.delta_readers import assert_readers_agree
from tests.spark_helpers import SCHEMA, Oracle, index_state

pytestmark = pytest.mark.spark


def rows_of(n: int, day: str = "2025-03-01", start: int = 0, value: int = 0) -> list[tuple]:
    return [(f"k{i:05d}", day, value + i, False) for i in range(start, start + n)]


def parquet_on_disk(table: Table) -> set[str]:
    return {
        rel for rel, _ in table.io.list_files_recursive("") if rel.endswith(".parquet") and not rel.startswith(".dbidx")
    }


def read_rows(spark, table: Table) -> set[tuple]:
    return {(r.id, r.dt, r.v) for r in read_table(spark, table).select("id", "dt", "v").collect()}


@pytest.fixture()
def setup(tmp_path: Path):
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    return table, CacheConfig(base_path=str(tmp_path / "cache"))


def test_attempt_failing_after_writing_is_retried_without_duplicates(spark, setup) -> None:
    table, config = setup
    clean = upsert(spark.createDataFrame(rows_of(100), SCHEMA), table, key="id", partition="dt", cache_config=config)
    # What Spark did (job_report.py): nothing retried, each shard's first attempt won, on the local executor.
    assert clean.spark is not None and clean.spark["unknown"] is None, clean.spark
    assert (clean.spark["retried"], clean.spark["killed"], clean.spark["later_attempts"]) == (0, 0, [])
    assert [(m["shard"], m["attempt_number"], m["attempts"], m["executor"]) for m in clean.per_shard] == [
        (0, 0, 1, "driver"),
        (1, 0, 1, "driver"),
    ]

    def fail_first_attempt(partition_id: int, attempt_number: int) -> None:
        if attempt_number == 0:
            raise RuntimeError(f"injected failure of task {partition_id} after its data files were written")

    batch = rows_of(60, value=1000) + rows_of(40, start=100, value=1000)  # 60 updates, 40 inserts
    summary = upsert(
        spark.createDataFrame(batch, SCHEMA),
        table,
        key="id",
        partition="dt",
        cache_config=config,
        on_task_written=fail_first_attempt,
    )
    assert (summary.updates, summary.inserts) == (60, 40)
    # Spark retried each shard's task once (local[2,3]): the summary says so, and which attempt won where.
    did = summary.spark
    assert {
        k: did[k] for k in ("retried", "speculative", "killed", "running", "stage_retries", "executors_lost", "unknown")
    } == {
        "retried": 2,
        "speculative": 0,
        "killed": 0,
        "running": 0,
        "stage_retries": 0,
        "executors_lost": 0,
        "unknown": None,
    }, did
    assert did["task_attempts"] == clean.spark["task_attempts"] + 2
    assert [
        (m["shard"], m["attempt_number"], m["attempts"], m["executor"], m["speculative"]) for m in summary.per_shard
    ] == [(0, 1, 2, "driver", False), (1, 1, 2, "driver", False)]
    assert [a["shard"] for a in did["later_attempts"]] == [0, 1]
    # ... and `dbidx commits` shows the same figures (stored in the completion record).
    shown = CliRunner().invoke(main, ["commits", table.uri, "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["commits"][0]["metrics"]["spark"] == did
    text = CliRunner().invoke(main, ["commits", table.uri]).output
    assert f"spark: {did['task_attempts']} task attempts" in text and "2 retried" in text, text
    assert "shard 1 won by attempt 1 on executor driver" in text, text
    # The failed attempts' files (data, index, touched keys) were announced, never listed, and deleted after the commit.
    assert summary.orphans_deleted > summary.data_files > 0
    assert parquet_on_disk(table) == {p for p, _, _ in committed_data_files(table)}
    index_on_disk = {rel for rel, _ in table.io.list_files_recursive(".dbidx/rli")}
    assert index_on_disk == {f.path for rec in table.timeline.completed() for f in rec.files}
    assert not table.io.list_names(markers.marker_dir(summary.instant))
    expected = {(k, d, v) for k, d, v, _ in rows_of(100)} - {(k, d, v) for k, d, v, _ in rows_of(60)}
    expected |= {(k, d, v) for k, d, v, _ in batch}
    assert read_rows(spark, table) == expected
    assert len(index_state(table)) == 140
    assert_readers_agree(
        table, ("id", "dt", "v"), expected, spark=spark
    )  # the failed attempts' files are in no Delta version


def test_failed_job_is_rolled_back_and_the_batch_can_be_replayed(spark, setup) -> None:
    table, config = setup
    upsert(spark.createDataFrame(rows_of(50), SCHEMA), table, key="id", partition="dt", cache_config=config)
    before_index, before_files = index_state(table), parquet_on_disk(table)

    def always_fail(partition_id: int, attempt_number: int) -> None:
        raise RuntimeError("injected failure on every attempt")

    batch = spark.createDataFrame(rows_of(30, value=7) + rows_of(30, start=50), SCHEMA)
    with pytest.raises(Exception, match="injected failure on every attempt"):
        upsert(batch, table, key="id", partition="dt", cache_config=config, on_task_written=always_fail)
    last = table.timeline.completed()[-1]
    assert last.action == ACTION_ROLLBACK
    assert index_state(table) == before_index
    # Attempts still running when the job failed withdraw their own files once they see the rollback.
    deadline = time.monotonic() + 60
    while parquet_on_disk(table) != before_files and time.monotonic() < deadline:
        time.sleep(0.2)
    assert parquet_on_disk(table) == before_files
    assert not table.timeline.pending()
    first = {(k, d, v) for k, d, v, _ in rows_of(50)}
    assert_readers_agree(
        table, ("id", "dt", "v"), first, spark=spark
    )  # the rollback is a Delta version that changes no row
    replay = upsert(batch, table, key="id", partition="dt", cache_config=config)
    assert (replay.updates, replay.inserts, replay.orphans_deleted) == (30, 30, 0)
    replayed = {(k, d, v) for k, d, v, _ in rows_of(30, value=7) + rows_of(30, start=50)}
    assert_readers_agree(table, ("id", "dt", "v"), replayed | {r for r in first if r[0] >= "k00030"}, spark=spark)


class LedgerClosedError(Exception):
    """A hook's own exception type, defined in an importable module (this one)."""


def closed_ledger(partition_id: int, attempt_number: int) -> None:
    raise LedgerClosedError(f"ledger of shard {partition_id} is closed")


def missing_entry(partition_id: int, attempt_number: int) -> None:
    raise KeyError(f"entry-{partition_id}")


def local_failure(partition_id: int, attempt_number: int) -> None:
    class NotImportable(Exception):
        """Defined in a function: the driver cannot reach it by module path."""

    raise NotImportable(f"local failure in shard {partition_id}")


@pytest.mark.parametrize(
    ("hook", "kind", "message"),
    [
        (closed_ledger, LedgerClosedError, r"ledger of shard [01] is closed"),
        (missing_entry, KeyError, r"'entry-[01]'"),
        (
            local_failure,
            HookError,
            (
                r"on_task_written raised tests\.spark_integration\.test_retries\.local_failure\."
                r"<locals>\.NotImportable: local failure in shard [01] \(that type cannot be "
                r"imported .*"
            ),
        ),
    ],
    ids=["custom", "builtin", "not-importable"],
)
def test_an_exception_of_the_hook_comes_back_with_its_own_type(spark, setup, hook, kind, message) -> None:
    """What on_task_written raises in a task reaches the caller as its own type and message, not as a Spark error."""
    table, config = setup
    batch = spark.createDataFrame(rows_of(20), SCHEMA)
    with pytest.raises(kind) as raised:
        upsert(batch, table, key="id", partition="dt", cache_config=config, on_task_written=hook)
    assert type(raised.value) is kind and re.fullmatch(message, str(raised.value)), repr(raised.value)
    # Spark gave up after its third attempt (local[2,3]): the note names the shard and the attempt.
    assert any(
        re.fullmatch(
            r"raised by on_task_written in the task of shard [01], attempt 2, and re-raised on the "
            r"driver; the Spark error that carried it is its __cause__",
            note,
        )
        for note in raised.value.__notes__
    ), raised.value.__notes__
    assert "dbidx-hook-error[" in str(raised.value.__cause__)
    assert [r.action for r in table.timeline.completed()] == [ACTION_ROLLBACK]


def test_speculative_duplicate_attempts_leave_one_version(setup) -> None:
    """Two attempts of the same task run at once (speculation): both write, one wins, the other leaves nothing."""
    table, config = setup
    options = TagOptions(key="id", partition="dt", buckets=BucketSpec(capacity=25), cache=config)
    batch = pa.RecordBatch.from_pylist([{"id": k, "dt": d, "v": v} for k, d, v, _ in rows_of(80)])
    shard0 = pa.Table.from_batches([batch]).filter(pa.array(table.shard_of([r["id"] for r in batch.to_pylist()]) == 0))
    writer = table.new_commit()
    results: dict[int, TaskResult] = {}

    def attempt(attempt_id: int) -> None:  # the two attempts contend for the shard's cache lock: one waits
        results[attempt_id] = task.upsert_batches(shard0.to_batches(), table, options, writer.instant, attempt_id)

    threads = [threading.Thread(target=attempt, args=(a,)) for a in (11, 12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [f.file_group for f in results[11].files] == [f.file_group for f in results[12].files]
    empty = task.upsert_batches([], table, options, writer.instant, 13)  # shard 1 has no rows in this batch
    winner = results[12].pack()
    schema, _seq = _check_layout_and_schema(table, options, shard0.schema, "the batch")  # as run_upsert records it
    writer.extra[SCHEMA_EXTRA] = encode_schema(schema)
    record, summary = commit_results(writer, [(0, 12, winner), (1, 13, empty.pack())], options, expected_tasks=2)
    keep = [f.path for f in record.data_files] + [f.path for f in record.files]
    deleted = markers.discard_unlisted(table.io, writer.instant, keep=keep)
    loser = [f.path for f in results[11].files + results[11].index_files]
    assert sorted(deleted) == sorted(
        loser
        + [t.path for t in results[11].touched if t.path not in loser]
        + [t.path for t in results[12].touched if t.path not in keep]
    )
    assert parquet_on_disk(table) == {f.path for f in record.data_files}
    assert summary.inserts == shard0.num_rows and len(index_state(table)) == shard0.num_rows
    # The winner's rows, once: the loser's files are in no Delta version.
    assert_readers_agree(table, ("id", "dt", "v"), {(r["id"], r["dt"], r["v"]) for r in shard0.to_pylist()})


@pytest.mark.parametrize(
    "bad",
    [
        {"hits": "many"},
        {"hits": -7},
        {"hits": 1.5},
        {"shard": "0"},
        {"sync_seconds": float("nan")},
        {"tagged_seq": None},
    ],
    ids=str,
)
def test_a_task_result_with_malformed_metrics_publishes_nothing(setup, bad) -> None:
    """Task results are input: metrics that are missing, not numbers, negative, fractional where whole or not
    finite are a CommitError, and nothing is published."""
    table, config = setup
    options = TagOptions(key="id", partition="dt", cache=config)
    writer = table.new_commit()
    results = [task.upsert_batches([], table, options, writer.instant, attempt=a).to_wire() for a in (1, 2)]
    results[0]["metrics"] = [ShardMetrics(shard=0).to_dict() | bad]
    with pytest.raises(CommitError, match="a task result is malformed"):
        commit_results(writer, [(s, s + 1, pack_payload(r)) for s, r in enumerate(results)], options, expected_tasks=2)
    writer.rollback()
    assert [r.action for r in table.timeline.completed()] == [ACTION_ROLLBACK]


def test_malformed_attempt_figures_from_a_spark_task_publish_nothing(spark, setup, monkeypatch) -> None:
    """A task's own attempt figures are input like its metrics: one that says it is attempt -1 fails the commit
    (CommitError), the instant is rolled back; more malformed forms: test_job_report.py."""
    table, config = setup
    collect = api._collect_results

    def with_bad_attempt(results):
        rows = collect(results)
        shard, attempt, payload = rows[-1]
        sent = unpack_result(payload)
        sent["spark_attempt"]["attempt_number"] = -1
        return rows[:-1] + [(shard, attempt, pack_payload(sent))]

    monkeypatch.setattr(api, "_collect_results", with_bad_attempt)
    with pytest.raises(CommitError, match="a task result is malformed .*attempt_number must be a whole number"):
        upsert(spark.createDataFrame(rows_of(20), SCHEMA), table, key="id", partition="dt", cache_config=config)
    assert [r.action for r in table.timeline.completed()] == [ACTION_ROLLBACK]
    assert parquet_on_disk(table) == set()


def test_late_attempts_withdraw_and_leftovers_are_swept(setup) -> None:
    """An attempt that finishes writing after its instant settled removes its files; a killed one is swept."""
    table, config = setup
    options = TagOptions(key="id", partition="dt", cache=config)
    batch = pa.RecordBatch.from_pylist([{"id": k, "dt": d, "v": v} for k, d, v, _ in rows_of(20)])
    writer = table.new_commit()
    instant = writer.instant
    writer.rollback()  # the job failed and the driver cleaned up already
    late = task.upsert_batches([batch], table, options, instant, attempt=77)
    assert late.files and parquet_on_disk(table) == set()
    # A killed attempt: its file and marker were written, nothing withdrew them; the next upsert sweeps them.
    killed = f"dt=2025-03-01/00000000-{'0' * 24}_{instant}_78.parquet"
    table.io.write_atomic(markers.marker_of(instant, killed), b"")
    table.io.write_atomic(killed, b"partial")
    assert leftovers.sweep_settled(table.io, table.timeline).settled_files == [killed]
    assert parquet_on_disk(table) == set() and table.io.list_dirs(markers.MARKERS_DIR) == []


def test_shard_served_by_other_processes_and_writers_stays_correct(spark, setup) -> None:
    table, config = setup
    # Arrow workers.
    upsert(spark.createDataFrame(rows_of(100), SCHEMA), table, key="id", partition="dt", cache_config=config)
    # Another writer (another job, another executor) commits behind the caches' back, into a loaded partition.
    with table.new_commit() as writer:
        writer.insert("dt=2025-03-01", [f"ext{i}" for i in range(30)], "external-fg")
    probe = rows_of(10) + [(f"ext{i}", "2025-03-01", 0, False) for i in range(10)] + rows_of(10, start=500)
    # An RDD worker (a different Python process from the Arrow workers) tags against the same shard caches.
    tagged = tag(
        spark.createDataFrame(probe, SCHEMA), table, key="id", partition="dt", cache_config=config, use_rdd=True
    ).collect()
    flags = {r.id: (r._dbidx_is_update, r._dbidx_file_group) for r in tagged}
    assert all(flags[f"k{i:05d}"][0] for i in range(10)) and not any(flags[f"k{i:05d}"][0] for i in range(500, 510))
    assert all(flags[f"ext{i}"] == (True, "external-fg") for i in range(10))
    with table.new_commit() as writer:
        writer.insert("dt=2025-03-01", [f"ext{i}" for i in range(30, 60)], "external-fg")
    probe += [(f"ext{i}", "2025-03-01", 0, False) for i in range(30, 40)]
    # And the Arrow path again: it catches up on the second external commit and counts it.
    summary = upsert(spark.createDataFrame(probe, SCHEMA), table, key="id", partition="dt", cache_config=config)
    assert (summary.updates, summary.inserts) == (30, 10)
    assert summary.catchup_entries == 30


def test_streaming_foreach_batch(spark, tmp_path: Path, setup) -> None:
    table, config = setup
    source = tmp_path / "incoming"
    source.mkdir()
    oracle = Oracle(global_mode=False)
    batches = [rows_of(40), rows_of(20, value=100) + rows_of(10, start=40), [("k00001", "2025-03-01", 0, True)]]
    for i, batch in enumerate(batches):
        path = source / f"part-{i}.json"
        path.write_text("\n".join(json.dumps({"id": k, "dt": d, "v": v, "_dbidx_delete": x}) for k, d, v, x in batch))
        os.utime(path, (1_700_000_000 + i * 60, 1_700_000_000 + i * 60))  # the file source goes by mtime
        oracle.apply(batch)
    summaries = []
    query = (
        spark.readStream.schema(SCHEMA)
        .option("maxFilesPerTrigger", 1)
        .json(str(source))
        .writeStream.foreachBatch(
            lambda df, _id: summaries.append(upsert(df, table, key="id", partition="dt", cache_config=config))
        )
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(180)
    assert [(s.inserts, s.updates, s.deletes) for s in summaries] == [(40, 0, 0), (10, 20, 0), (0, 0, 1)]
    assert read_rows(spark, table) == oracle.expected_rows()


def test_bad_input_gets_typed_errors_and_leaves_nothing(spark, setup) -> None:
    table, config = setup
    with pytest.raises(InvalidInputError, match="no key column 'user_id'"):
        upsert(spark.createDataFrame(rows_of(3), SCHEMA), table, key="user_id", partition="dt", cache_config=config)
    assert table.timeline.pending() == [] and table.timeline.completed() == []
    with pytest.raises(InvalidInputError, match="no delete column 'deleted'"):
        upsert(
            spark.createDataFrame(rows_of(3), SCHEMA),
            table,
            key="id",
            partition="dt",
            delete_column="deleted",
            cache_config=config,
        )
    with pytest.raises(InvalidInputError, match="must be boolean"):
        upsert(
            spark.createDataFrame(rows_of(3), SCHEMA),
            table,
            key="id",
            partition="dt",
            delete_column="v",
            cache_config=config,
        )
    floats = spark.createDataFrame([(1.0, "2025-03-01")], "id double, dt string")
    with pytest.raises(InvalidKeyError, match="key column 'id' of the upsert DataFrame is double"):
        upsert(floats, table, key="id", partition="dt", cache_config=config)
    for kind, match in (
        ("boolean", "is boolean: a boolean key"),
        ("array<int>", "is array<int>: a list, struct"),
        ("struct<a:int>", "is struct<a:int>: a list, struct"),
    ):
        unfit = spark.createDataFrame([], f"id {kind}, dt string")  # refused from the schema, before any job
        with pytest.raises(InvalidKeyError, match=f"key column 'id' of the upsert DataFrame {match}"):
            upsert(unfit, table, key="id", partition="dt", cache_config=config)
    twice = spark.createDataFrame(rows_of(3), SCHEMA).select("id", "dt", "v", "id")
    with pytest.raises(InvalidInputError, match="more than one column named 'id'"):
        upsert(twice, table, key="id", partition="dt", cache_config=config)
    assert table.timeline.pending() == [] and table.timeline.completed() == []
    nulls = spark.createDataFrame([("a", "2025-03-01", 1, False), (None, "2025-03-01", 2, False)], SCHEMA)
    with pytest.raises(InvalidKeyError, match="null"):
        upsert(nulls, table, key="id", partition="dt", cache_config=config)
    assert [r.action for r in table.timeline.completed()] == [ACTION_ROLLBACK]
    assert parquet_on_disk(table) == set()


def test_tasks_reap_expired_partitions_when_due(spark, tmp_path: Path) -> None:
    """No long-lived process holds a cache, so tasks run the TTL reaper (at most every reaper.interval.s)."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "cache"), partition_ttl_hours=1.0, reaper_interval_s=0.0)
    old_days = [(f"k{i}", f"2025-03-0{1 + i % 3}", i, False) for i in range(30)]
    # The table's first write takes the bulk path (no cache); the second one loads the three days into the cache.
    upsert(
        spark.createDataFrame([("seed", "2025-03-01", 0, False)], SCHEMA),
        table,
        key="id",
        partition="dt",
        cache_config=config,
    )
    upsert(spark.createDataFrame(old_days, SCHEMA), table, key="id", partition="dt", cache_config=config)
    from dbidx.cache.record_cache import RecordIndexCache

    with RecordIndexCache.for_table(table, 0, config) as cache:  # age the three days by two hours
        for partition in cache.partitions():
            cache.touch(partition, at_ms=cache.partitions()[partition].last_access_ms - 2 * 3600 * 1000)
    summary = upsert(
        spark.createDataFrame([("new", "2025-03-09", 1, False)], SCHEMA),
        table,
        key="id",
        partition="dt",
        cache_config=config,
    )
    assert summary.evictions == 3
    with RecordIndexCache.for_table(table, 0, config) as cache:
        assert sorted(cache.partitions()) == ["dt=2025-03-09"]
    # An evicted day is loaded on demand again when a batch touches it, and answers correctly.
    again = upsert(spark.createDataFrame(old_days[:3], SCHEMA), table, key="id", partition="dt", cache_config=config)
    assert (again.updates, again.on_demand_loads) == (3, 3)


def test_a_damaged_executor_cache_is_discarded_and_the_retry_commits_the_batch(spark, setup) -> None:
    """Flipped bytes in every shard cache's SST (a disk or copy error on the executor): each first attempt meets
    the checksum failure, discards its cache and fails; the retry rebuilds the cache from the index, and the batch
    commits exactly its updates and inserts - no key read as new, no duplicate."""
    from dataclasses import replace

    table, config = setup
    upsert(spark.createDataFrame(rows_of(3000), SCHEMA), table, key="id", partition="dt", cache_config=config)
    upsert(spark.createDataFrame(rows_of(500, value=1), SCHEMA), table, key="id", partition="dt", cache_config=config)
    shard_dirs = sorted(p for p in Path(config.base_path).glob("*/shard-*") if p.is_dir() and "." not in p.name)
    assert len(shard_dirs) == 2
    for shard_dir in shard_dirs:
        sst = max(shard_dir.glob("*.sst"), key=lambda p: p.stat().st_size)
        data = bytearray(sst.read_bytes())
        for pos in range(64, int(len(data) * 0.8), 397):
            data[pos] ^= 0x5A
        sst.write_bytes(bytes(data))
    # Another block-cache size: blocks the workers cached in the last batch (checked when read) are not reused.
    damaged = replace(config, block_cache_mb=63)
    batch = rows_of(3000, start=1000, value=2)  # 2,000 updates and 1,000 inserts
    summary = upsert(spark.createDataFrame(batch, SCHEMA), table, key="id", partition="dt", cache_config=damaged)
    assert (summary.updates, summary.inserts) == (2000, 1000)
    assert len(index_state(table)) == 4000
    latest = {k: (k, d, v) for k, d, v, _ in rows_of(3000) + rows_of(500, value=1) + batch}
    assert read_rows(spark, table) == set(latest.values())
    assert all(d.exists() for d in shard_dirs)  # rebuilt by the retries


def test_a_spark_upsert_claims_its_instant_with_its_application_and_a_live_heartbeat(
    spark, setup, tmp_path: Path
) -> None:
    """While the job runs, the instant's claim names the Spark application (issue 43 item 2): what `dbidx commits`
    shows of an attempt whose driver died."""
    table, config = setup
    seen = str(tmp_path / "pending.json")
    uri = table.uri

    def record_pending(partition_id: int, attempt_number: int) -> None:  # runs in the task, mid-job
        Path(seen).write_text(json.dumps([a.to_dict() for a in Table.open(uri).pending_attempts()]))

    upsert(
        spark.createDataFrame(rows_of(20), SCHEMA),
        table,
        key="id",
        partition="dt",
        cache_config=config,
        on_task_written=record_pending,
    )
    [attempt] = json.loads(Path(seen).read_text())
    assert attempt["tags"] == {
        "spark_app_id": spark.sparkContext.applicationId,
        "spark_app_name": spark.sparkContext.appName,
    }
    assert attempt["alive"] is True and attempt["heartbeat_age_seconds"] is not None and attempt["files"]
    assert table.pending_attempts() == []
