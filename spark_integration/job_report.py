"""What Spark did to run an upsert: task attempts, retries, speculation, kills and executors lost (issue 43).

Only the winning attempt of each task reports back to dbidx, so the task results alone cannot say that a shard's
first attempt died with its executor or that a speculative copy was launched and killed. Spark's own status store
(the live `AppStatusStore` behind the web UI and the REST API; it is kept with `spark.ui.enabled=false` too) can.
The upsert's jobs are found by a job tag of their own, added beside whatever job group and tags the caller set
(`foreachBatch` sets its own), and read through the REST API's JSON form (`api.v1` objects written by Spark's own
`JacksonMessageWriter`): a documented schema, and one Py4J call per object instead of one per field.

Each task also reports its own attempt number, stage and host (`TaskAttempt`), parsed as strictly as every other
figure a task sends. The figures from the status store are a report, not an input to the commit: if they cannot be
read (the store evicted the job, Spark Connect has no SparkContext here) they are unknown (None), never 0, and
reading them never fails an upsert. pyspark is never imported here; the Py4J objects come from the caller's context.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Iterator, Sequence
from weakref import WeakKeyDictionary

log = logging.getLogger(__name__)
TASK_KEY = "spark_attempt"  # the key of a task's own attempt figures in its result payload
SETTLE_SECONDS = 2.0  # how long to wait for Spark's listener to record the end of the job it already finished
FIGURES = (
    "jobs",
    "stages",
    "stage_retries",
    "task_attempts",
    "retried",
    "speculative",
    "killed",
    "running",
    "executors_lost",
)
SHARD_FIELDS = ("attempt_number", "host", "executor", "stage_attempt", "speculative", "attempts")
_MAX_INT = 2**31 - 1
_REASON_CHARS = 200
_HANDLES: WeakKeyDictionary[Any, tuple[Any, Any, Callable[[Any], Any], Any, Any, bool]] = WeakKeyDictionary()


@dataclass(frozen=True)
class TaskAttempt:
    """What a task attempt reports about itself: its attempt number, its stage and the host it ran on."""

    attempt_number: int
    stage_id: int
    host: str

    @classmethod
    def of_task(cls, context: Any) -> "TaskAttempt":
        """The figures a running task sends (from pyspark's TaskContext; its Python side has no stage attempt or
        executor id, which the driver reads from the status store by the task's id)."""
        return cls(attempt_number=context.attemptNumber(), stage_id=context.stageId(), host=socket.gethostname())

    @classmethod
    def from_dict(cls, sent: Any) -> "TaskAttempt":
        """Parse what a task sent: whole numbers in Spark's int range, a printable host name (ValueError, KeyError
        or TypeError otherwise, which the driver turns into a CommitError); keys it does not know are ignored."""
        if not isinstance(sent, dict):
            raise ValueError(f"task attempt figures {sent!r:.100} are not a mapping")
        values = {name: sent[name] for name in ("attempt_number", "stage_id")}
        for name, value in values.items():
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _MAX_INT:
                raise ValueError(f"task attempt figure {name} must be a whole number >= 0, got {value!r:.100}")
        host = sent["host"]
        if not isinstance(host, str) or not 0 < len(host) <= 255 or not host.isprintable():
            raise ValueError(f"task attempt host must be a printable name of 1 to 255 characters, got {host!r:.100}")
        return cls(host=host, **values)


class JobResults(list):
    """What an upsert's Spark job returned to `driver.run_upsert`: its task results, (shard, task attempt id,
    payload) each, and `spark`, the report that reads what Spark did to run them. The driver checks the results and
    reads the report in `commit_results`, where a task's own attempt figures are parsed with the rest of its
    result; a plain list is a job run without Spark (`upsert_arrow`, tests)."""

    def __init__(self, rows: list[tuple[int, int, bytes]], spark: "SparkJobReport") -> None:
        super().__init__(rows)
        self.spark = spark


class SparkJobReport:
    """What Spark did to run the jobs of one upsert, read from Spark's status store after they ended."""

    def __init__(self, context: Any, tag: str, why_unknown: str | None = None) -> None:
        """context: the driver's pyspark SparkContext (None: no figures, `why_unknown` says why)."""
        self.context = context
        self.tag = tag
        self.why_unknown = why_unknown

    @classmethod
    @contextmanager
    def watching(cls, session: Any, instant: str) -> Iterator["SparkJobReport"]:
        """Tag the jobs the block starts (in this thread) so the report can find them afterwards, then take the tag
        off again. A job tag is added beside the caller's own job group and tags, which stay as they were."""
        tag = f"dbidx-upsert-{instant}"
        context, why_unknown = None, None
        try:
            context = session.sparkContext
            context.addJobTag(tag)
        except Exception as exc:  # noqa: BLE001 - e.g. Spark Connect: the upsert runs, its figures are unknown
            context, why_unknown = None, f"the job could not be tagged ({type(exc).__name__}: {str(exc)[:200]})"
        try:
            yield cls(context, tag, why_unknown)
        finally:
            if context is not None:
                try:
                    context.removeJobTag(tag)
                except Exception as exc:  # noqa: BLE001 - a leftover tag marks the caller's later jobs, no more
                    log.warning("dbidx: could not remove Spark job tag %s: %s", tag, exc)

    def summarize(
        self, winners: Sequence[tuple[int, int, TaskAttempt]]
    ) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
        """The summary's `spark` section and each shard's figures (SHARD_FIELDS, by shard), from the winning
        attempts (shard, task attempt id, what it reported) and the status store. Never raises: a figure the store
        cannot give is None, and the section's `unknown` says why."""
        section: dict[str, Any] = dict.fromkeys(FIGURES)
        section.update(lost_executors=[], unknown=self.why_unknown)
        shards = {
            shard: {
                "attempt_number": sent.attempt_number,
                "host": sent.host,
                "executor": None,
                "stage_attempt": None,
                "speculative": None,
                "attempts": None,
            }
            for shard, _, sent in winners
        }
        if self.context is not None:
            try:
                self._read_store(section, shards, winners)
            except Exception as exc:  # noqa: BLE001 - a report: the upsert has committed or is about to
                section.update(dict.fromkeys(FIGURES), lost_executors=[], unknown=_why(exc))
                for figures in shards.values():
                    figures.update(executor=None, stage_attempt=None, speculative=None, attempts=None)
        if section["unknown"] is not None:
            log.warning("dbidx: what Spark did for %s is unknown: %s", self.tag, section["unknown"])
        section["later_attempts"] = [
            {
                "shard": shard,
                "attempt_number": f["attempt_number"],
                "executor": f["executor"],
                "speculative": f["speculative"],
            }
            for shard, f in sorted(shards.items())
            if f["attempt_number"] > 0
        ]
        return section, shards

    def _read_store(
        self,
        section: dict[str, Any],
        shards: dict[int, dict[str, Any]],
        winners: Sequence[tuple[int, int, TaskAttempt]],
    ) -> None:
        """Fill the figures from the status store (Py4J errors propagate to `summarize`)."""
        tracker, store, read, no_statuses, no_quantiles, speculation_on = _handles(self.context)
        jobs = self._settled_jobs(tracker, store, read, {sent.stage_id for _, _, sent in winners})
        counts: Counter[str] = Counter()
        result_tasks: list[tuple[int, dict[str, Any]]] = []  # (stage attempt, task) of the stages winners ran in
        winner_stages = {sent.stage_id for _, _, sent in winners}
        for stage_id in sorted({s for job in jobs for s in job["stageIds"]}):
            for attempt in read(store.stageData(stage_id, False, no_statuses, False, no_quantiles)):
                if attempt["status"] == "SKIPPED":  # its output came from an earlier job of the upsert
                    continue
                counts["stages"] += 1
                counts["stage_retries"] += int(attempt["attemptId"] > 0)
                counts["retried"] += attempt["numFailedTasks"]
                counts["killed"] += attempt["numKilledTasks"]
                counts["running"] += attempt["numActiveTasks"]
                counts["task_attempts"] += sum(
                    attempt[k] for k in ("numCompleteTasks", "numFailedTasks", "numKilledTasks", "numActiveTasks")
                )
                if speculation_on:  # (else there is none to count: a round trip saved per stage)
                    speculation = read(store.speculationSummary(stage_id, attempt["attemptId"]))
                    counts["speculative"] += speculation["numTasks"] if speculation else 0
                if stage_id in winner_stages:
                    result_tasks += [
                        (attempt["attemptId"], task)
                        for task in read(store.taskList(stage_id, attempt["attemptId"], _MAX_INT))
                    ]
        section.update(
            {name: counts[name] for name in FIGURES if name not in ("jobs", "executors_lost")}, jobs=len(jobs)
        )
        now_ms = round(time.time() * 1000)
        lost = _removed_between(
            read(store.executorList(False)),
            min(_ms(j["submissionTime"]) if j.get("submissionTime") else now_ms for j in jobs),
            max(_ms(j["completionTime"]) if j.get("completionTime") else now_ms for j in jobs),
        )
        section.update(executors_lost=len(lost), lost_executors=lost)
        # Each shard: how many attempts its task took, and where and how its winner ran.
        tries = Counter(task["partitionId"] for _, task in result_tasks)
        by_id = {task["taskId"]: (stage_attempt, task) for stage_attempt, task in result_tasks}
        for shard, task_id, _sent in winners:
            found = by_id.get(task_id)
            if found is not None:
                stage_attempt, task = found
                shards[shard].update(
                    executor=task["executorId"],
                    stage_attempt=stage_attempt,
                    speculative=task["speculative"],
                    attempts=tries[shard],
                )

    def _settled_jobs(
        self, tracker: Any, store: Any, read: Callable[[Any], Any], stages: set[int]
    ) -> list[dict[str, Any]]:
        """The upsert's jobs (REST form) once Spark's listener has recorded the end of the one its winning tasks
        ran in. The job has ended when `collect` returns, but the listener records events asynchronously; it
        records them in order, so every earlier event of the upsert's jobs is in the store by then."""
        deadline, pause = time.monotonic() + SETTLE_SECONDS, 0.002
        while True:
            jobs = [read(store.job(job_id)) for job_id in read(tracker.getJobIdsForTag(self.tag))]
            ended = {s for job in jobs if job["status"] != "RUNNING" for s in job["stageIds"]}
            if jobs and stages <= ended:
                return jobs
            if time.monotonic() > deadline:
                raise LookupError(
                    f"Spark's status store has not recorded the end of the job tagged {self.tag} "
                    f"(stages {sorted(stages)}) within {SETTLE_SECONDS} s (evicted, or its listener "
                    "is behind)"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


def _handles(context: Any) -> tuple[Any, Any, Callable[[Any], Any], Any, Any, bool]:
    """What a report reads through, once per SparkContext (each Py4J step is a round trip): the status tracker,
    the status store, a reader of `api.v1` objects as JSON, an empty status list and quantile array (arguments
    the store's methods take), and whether speculation is on (a setting fixed when the context started)."""
    known = _HANDLES.get(context)
    if known is None:
        jvm_context, jvm = context._jsc.sc(), context._jvm
        mapper = jvm.org.apache.spark.status.api.v1.JacksonMessageWriter().mapper()

        def read(java_object: Any) -> Any:
            return json.loads(mapper.writeValueAsString(java_object))

        speculation_on = context.getConf().get("spark.speculation", "false").strip().lower() == "true"
        known = _HANDLES[context] = (
            jvm_context.statusTracker(),
            jvm_context.statusStore(),
            read,
            jvm.java.util.ArrayList(),
            context._gateway.new_array(jvm.double, 0),
            speculation_on,
        )
    return known


def describe(section: dict[str, Any]) -> str:
    """One line for `dbidx commits`: what Spark did for an upsert."""
    if section.get("task_attempts") is None:
        return f"spark: figures unknown ({section.get('unknown') or 'not recorded'})"
    later = ", ".join(
        f"shard {a['shard']} won by attempt {a['attempt_number']}"
        + (" (speculative)" if a.get("speculative") else "")
        + (f" on executor {a['executor']}" if a.get("executor") is not None else "")
        for a in section.get("later_attempts") or []
    )
    return (
        f"spark: {section['task_attempts']} task attempts in {section['jobs']} jobs, {section['retried']} "
        f"retried, {section['speculative']} speculative, {section['killed']} killed, {section['running']} "
        f"still running, {section['stage_retries']} stage retries, {section['executors_lost']} executors lost"
        + (f"; {later}" if later else "")
    )


def _why(exc: Exception) -> str:
    """An error in a line: its type and the first two lines of its text (a Py4J error's second line names the Java
    exception), at most 300 characters."""
    lines = [line.strip(" :") for line in str(exc).splitlines() if line.strip(" :")]
    return f"{type(exc).__name__}: {' '.join(lines[:2])}"[:300]


def _removed_between(executors: list[dict[str, Any]], start_ms: int, end_ms: int) -> list[dict[str, Any]]:
    """Executors Spark removed between two instants (lost, or released: the reason says which)."""
    return [
        {
            "executor": e["id"],
            "host": e["hostPort"].rpartition(":")[0] or e["hostPort"],
            "reason": (e.get("removeReason") or "")[:_REASON_CHARS],
        }
        for e in executors
        if e.get("removeTime") and start_ms <= _ms(e["removeTime"]) <= end_ms
    ]


def _ms(stamp: str) -> int:
    """Epoch milliseconds of a REST API time ("2025-01-15T10:20:30.123GMT")."""
    return round(
        datetime.strptime(stamp.removesuffix("GMT"), "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()
        * 1000
    )
