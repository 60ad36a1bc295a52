"""What Spark did to run an upsert (spark_integration/job_report.py), without Spark: the task's own attempt figures
parsed strictly by the driver, the status store's figures summed from a stand-in store of REST-form objects (as
Spark's JacksonMessageWriter writes them), unknown figures as None, and the `dbidx commits` line. The same figures
from a real local Spark session: tests/spark_integration/test_retries.py; a lost executor: test_cluster.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import pyarrow as pa
import pytest

from dbidx.config import CacheConfig
from dbidx.errors import CommitError
from dbidx.table.facade import Table
from dbidx.spark_integration import job_report, task
from dbidx.spark_integration.driver import commit_results
from dbidx.spark_integration.job_report import (
    FIGURES,
    TASK_KEY,
    JobResults,
    SparkJobReport,
    TaskAttempt,
    describe,
)
from dbidx.spark_integration.local import upsert_arrow
from dbidx.spark_integration.tagger import TagOptions
from dbidx.spark_integration.task_result import pack_payload
from dbidx.storage.records import ACTION_ROLLBACK

GOOD = {"attempt_number": 1, "stage_id": 7, "host": "worker-3.example"}
T0 = "2025-01-15T10:00:00.000GMT"


def stage(
    stage_id: int,
    attempt: int = 0,
    status: str = "COMPLETE",
    complete: int = 2,
    failed: int = 0,
    killed: int = 0,
    active: int = 0,
) -> dict[str, Any]:
    return {
        "stageId": stage_id,
        "attemptId": attempt,
        "status": status,
        "numTasks": 2,
        "numCompleteTasks": complete,
        "numFailedTasks": failed,
        "numKilledTasks": killed,
        "numActiveTasks": active,
    }


def task_data(
    task_id: int, partition: int, attempt: int, executor: str, status: str = "SUCCESS", speculative: bool = False
) -> dict[str, Any]:
    return {
        "taskId": task_id,
        "index": partition,
        "partitionId": partition,
        "attempt": attempt,
        "executorId": executor,
        "host": "10.0.0.1",
        "status": status,
        "speculative": speculative,
    }


class FakeStore:
    """Spark's AppStatusStore and SparkStatusTracker as a report sees them: objects it reads as JSON."""

    def __init__(self) -> None:
        self.jobs = {
            3: {
                "jobId": 3,
                "status": "SUCCEEDED",
                "stageIds": [4],
                "submissionTime": T0,
                "completionTime": "2025-01-15T10:00:05.000GMT",
            },
            4: {
                "jobId": 4,
                "status": "SUCCEEDED",
                "stageIds": [5, 6],
                "submissionTime": "2025-01-15T10:00:05.100GMT",
                "completionTime": "2025-01-15T10:00:20.000GMT",
            },
        }
        # Stage 4 (the shuffle's map side) ran in job 3 (as adaptive execution runs it), so job 4 shows its copy
        # (stage 5) as skipped; stage 6 (the shard tasks) ran twice: its second attempt after a fetch failure, and
        # in it shard 1 lost its executor and ran again while a speculative copy of shard 0 was killed.
        self.stages = {
            4: [stage(4, complete=3, failed=1)],
            5: [stage(5, status="SKIPPED", complete=0)],
            6: [stage(6, complete=0, failed=1), stage(6, attempt=1, complete=2, failed=1, killed=1)],
        }
        self.speculation = {
            (6, 1): {
                "numTasks": 1,
                "numActiveTasks": 0,
                "numCompletedTasks": 0,
                "numFailedTasks": 0,
                "numKilledTasks": 1,
            }
        }
        self.tasks = {
            (6, 0): [task_data(20, 0, 0, "1", status="FAILED")],
            (6, 1): [
                task_data(30, 0, 0, "1"),
                task_data(31, 1, 0, "2", status="FAILED"),
                task_data(32, 1, 1, "1"),
                task_data(33, 0, 1, "3", status="KILLED", speculative=True),
            ],
        }
        self.executors = [
            {"id": "driver", "hostPort": "10.0.0.9:4040", "removeTime": None},
            {
                "id": "2",
                "hostPort": "10.0.0.2:39000",
                "removeTime": "2025-01-15T10:00:10.000GMT",
                "removeReason": "Command exited with code 137",
            },
            {
                "id": "0",
                "hostPort": "10.0.0.3:39000",
                "removeTime": "2025-01-15T09:00:00.000GMT",
                "removeReason": "idle",
            },
        ]  # removed an hour before: not lost during this job

    def getJobIdsForTag(self, tag: str) -> list[int]:
        return [4, 3] if tag == "dbidx-upsert-I1" else []

    def job(self, job_id: int) -> dict[str, Any]:
        return self.jobs[job_id]

    def stageData(self, stage_id: int, *_: Any) -> list[dict[str, Any]]:
        return self.stages[stage_id]

    def speculationSummary(self, stage_id: int, attempt: int) -> dict[str, Any] | None:
        return self.speculation.get((stage_id, attempt))

    def taskList(self, stage_id: int, attempt: int, _max: int) -> list[dict[str, Any]]:
        return self.tasks[(stage_id, attempt)]

    def executorList(self, _active_only: bool) -> list[dict[str, Any]]:
        return self.executors


class FakeContext:
    """The pyspark SparkContext's Py4J side, with the fake store behind it."""

    def __init__(self, store: FakeStore, speculation: bool = True) -> None:
        self._jsc = MagicMock()
        self._jsc.sc.return_value.statusStore.return_value = store
        self._jsc.sc.return_value.statusTracker.return_value = store
        self._jvm = MagicMock()
        writer = self._jvm.org.apache.spark.status.api.v1.JacksonMessageWriter.return_value
        writer.mapper.return_value.writeValueAsString.side_effect = json.dumps
        self._gateway = MagicMock()
        self.conf = {"spark.speculation": "true" if speculation else "false"}

    def getConf(self) -> Any:
        return self.conf


WINNERS = [(0, 30, TaskAttempt(0, 6, "node-a")), (1, 32, TaskAttempt(1, 6, "node-b"))]


def test_the_store_s_figures_are_summed_over_the_upsert_s_jobs_and_stages() -> None:
    section, shards = SparkJobReport(FakeContext(FakeStore()), "dbidx-upsert-I1").summarize(WINNERS)
    assert {k: section[k] for k in FIGURES} == {
        "jobs": 2,
        "stages": 3,
        "stage_retries": 1,
        "task_attempts": 4 + 1 + 4,
        "retried": 3,
        "speculative": 1,
        "killed": 1,
        "running": 0,
        "executors_lost": 1,
    }
    assert section["lost_executors"] == [
        {"executor": "2", "host": "10.0.0.2", "reason": "Command exited with code 137"}
    ]
    assert section["unknown"] is None
    assert section["later_attempts"] == [{"shard": 1, "attempt_number": 1, "executor": "1", "speculative": False}]
    assert shards == {
        0: {
            "attempt_number": 0,
            "host": "node-a",
            "executor": "1",
            "stage_attempt": 1,
            "speculative": False,
            "attempts": 3,
        },
        1: {
            "attempt_number": 1,
            "host": "node-b",
            "executor": "1",
            "stage_attempt": 1,
            "speculative": False,
            "attempts": 2,
        },
    }
    assert describe(section) == (
        "spark: 9 task attempts in 2 jobs, 3 retried, 1 speculative, 1 killed, 0 still running, 1 stage retries, "
        "1 executors lost; shard 1 won by attempt 1 on executor 1"
    )


def test_without_speculation_no_speculation_summary_is_read() -> None:
    store = FakeStore()
    store.speculationSummary = MagicMock(side_effect=AssertionError("read although speculation is off"))
    section, _ = SparkJobReport(FakeContext(store, speculation=False), "dbidx-upsert-I1").summarize(WINNERS)
    assert section["speculative"] == 0 and section["unknown"] is None


@pytest.mark.parametrize("damage", ["evicted", "never_ends", "no_context"])
def test_figures_the_store_cannot_give_are_unknown_and_fail_nothing(
    damage: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An evicted job, a listener that never records the end, no SparkContext (Spark Connect): every figure is
    None (not 0), the reason is kept, the shards keep what their tasks said, and nothing raises."""
    store = FakeStore()
    context: Any = FakeContext(store)
    why = None
    if damage == "evicted":
        store.job = MagicMock(
            side_effect=RuntimeError(
                "An error occurred while calling o81.job.\n: java.util.NoSuchElementException: Job 4 not found"
            )
        )
    elif damage == "never_ends":
        store.jobs[4]["status"] = "RUNNING"
        monkeypatch.setattr(job_report, "SETTLE_SECONDS", 0.05)
    else:
        context, why = None, "the job could not be tagged (PySparkNotImplementedError: no sparkContext)"
    with caplog.at_level(logging.WARNING, logger=job_report.__name__):
        section, shards = SparkJobReport(context, "dbidx-upsert-I1", why).summarize(WINNERS)
    assert all(section[k] is None for k in FIGURES) and section["lost_executors"] == []
    expected = {
        "evicted": "RuntimeError: An error occurred while calling o81.job. java.util.NoSuchElementException",
        "never_ends": "LookupError: Spark's status store has not recorded the end of the job tagged "
        "dbidx-upsert-I1 (stages [6])",
        "no_context": why,
    }[damage]
    assert section["unknown"].startswith(expected), section["unknown"]
    assert shards[1] == {
        "attempt_number": 1,
        "host": "node-b",
        "executor": None,
        "stage_attempt": None,
        "speculative": None,
        "attempts": None,
    }
    assert section["later_attempts"] == [{"shard": 1, "attempt_number": 1, "executor": None, "speculative": None}]
    assert describe(section).startswith("spark: figures unknown (")
    assert "is unknown" in caplog.text


def test_the_job_tag_is_added_beside_the_caller_s_and_taken_off() -> None:
    session = MagicMock()
    with SparkJobReport.watching(session, "I9") as report:
        session.sparkContext.addJobTag.assert_called_once_with("dbidx-upsert-I9")
        session.sparkContext.removeJobTag.assert_not_called()
    session.sparkContext.removeJobTag.assert_called_once_with("dbidx-upsert-I9")
    assert report.context is session.sparkContext and report.why_unknown is None
    session.sparkContext.addJobTag.side_effect = RuntimeError("no tags here")
    with pytest.raises(KeyError):  # the job's own error passes through; the figures are unknown
        with SparkJobReport.watching(session, "I10") as report:
            raise KeyError("the job failed")
    assert report.context is None and "no tags here" in report.why_unknown


@pytest.mark.parametrize(
    "bad",
    [
        "1",
        {"attempt_number": 1, "stage_id": 7},
        GOOD | {"attempt_number": -1},
        GOOD | {"attempt_number": "1"},
        GOOD | {"attempt_number": True},
        GOOD | {"attempt_number": 1.0},
        GOOD | {"stage_id": 2**31},
        GOOD | {"stage_id": None},
        GOOD | {"host": ""},
        GOOD | {"host": "a\nb"},
        GOOD | {"host": 5},
        GOOD | {"host": "h" * 256},
    ],
    ids=str,
)
def test_malformed_attempt_figures_are_refused(bad: Any) -> None:
    """What a task says about its attempt is input: missing, of another type, negative, out of Spark's int range,
    not a printable host name: refused (the driver makes that a CommitError, below)."""
    with pytest.raises((ValueError, KeyError, TypeError)):
        TaskAttempt.from_dict(bad)
    assert TaskAttempt.from_dict(GOOD | {"new_figure": 1}) == TaskAttempt(1, 7, "worker-3.example")


# ---- in the driver's publish (driver.commit_results) -----------------------------------------------------------


@pytest.mark.parametrize("bad", ["missing", GOOD | {"attempt_number": -1}], ids=str)
def test_a_task_s_malformed_attempt_figures_publish_nothing(tmp_path: Path, bad: Any) -> None:
    """A Spark job's task result without its attempt figures, or with a malformed one, is a CommitError, and
    nothing is published."""
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    options = TagOptions(key="id", partition="dt", cache=CacheConfig(base_path=str(tmp_path / "cache")))
    writer = table.new_commit()
    results = [task.upsert_batches([], table, options, writer.instant, attempt=a).to_wire() for a in (1, 2)]
    results[0][TASK_KEY], results[1][TASK_KEY] = GOOD, bad
    if bad == "missing":
        del results[1][TASK_KEY]
    rows = [(s, s + 1, pack_payload(r)) for s, r in enumerate(results)]
    with pytest.raises(CommitError, match="a task result is malformed"):
        commit_results(writer, JobResults(rows, SparkJobReport(None, "t", "no Spark here")), options, expected_tasks=2)
    writer.rollback()
    assert [r.action for r in table.timeline.completed()] == [ACTION_ROLLBACK]


def test_an_upsert_run_in_process_has_no_spark_section(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    data = pa.table({"id": [f"k{i}" for i in range(20)], "dt": ["2025-01-15"] * 20, "v": list(range(20))})
    summary = upsert_arrow(
        data, table, key="id", partition="dt", cache_config=CacheConfig(base_path=str(tmp_path / "cache"))
    )
    assert summary.spark is None and summary.to_dict()["spark"] is None
    assert table.timeline.completed()[-1].extra["metrics"]["spark"] is None
    assert [{k: m[k] for k in job_report.SHARD_FIELDS} for m in summary.per_shard] == [
        dict.fromkeys(job_report.SHARD_FIELDS)
    ] * 2
