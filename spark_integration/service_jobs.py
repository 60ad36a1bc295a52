"""The table services as Spark jobs: a `WorkRunner` (dbidx/runner.py) whose pieces of work (a data compaction's
file-group rewrites, an index compaction's group merges) run as the tasks of one Spark job, and `maintain`, the
services run from a Spark driver.

Why: a Spark writer's driver is often a small machine, while a compaction round reads and rewrites hundreds of files;
as a job, the pieces run on the executors, in parallel, under Spark's retries. What stays in the driver is what must:
the choice of work (from the folded views), the checks of every result and the publish.

How a piece travels: the work function and the items are pickled with the job (driver to executors); the pieces are
packed into slices of about equal bytes, one Spark partition each, and a task runs its slice's pieces one after
another, returning (item, attempt, payload) per piece as an Arrow row, so the driver reads bytes it parses strictly,
never a pickle from an executor. A retried or speculative task's
try writes its files under its own attempt number, announced by a marker (runner.py): the loser's files are deleted
after the publish. A dbidx error in a task comes back as its own type (task_errors.retyped).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Iterator, Sequence

import pyarrow as pa

from dbidx.errors import CommitError
from dbidx.table.services import ServicesReport
from dbidx.table.facade import Table
from dbidx.progress import Progress
from dbidx.runner import Work
from dbidx.spark_integration.task_errors import typed_errors

RESULT_DDL = "item long, attempt int, payload binary"


class SparkWorkRunner:
    """Runs a service's pieces of work as one Spark job on `spark`'s cluster, packed into as many tasks as it has
    cores."""

    where = "spark"

    def __init__(self, spark: Any) -> None:
        self.spark = spark

    def run(self, work: Work, items: Sequence[Any], what: str, weights: Sequence[int] | None = None) -> Iterator[bytes]:
        """Each item's payload, in order, once the whole job is done (CommitError if a piece's result is missing or
        repeated: nothing is published then). The pieces are packed into as many tasks as the cluster has cores
        (`defaultParallelism`), balanced by `weights` (bytes to read): a task costs Spark's scheduling and a Python
        worker's round trip, tens to hundreds of milliseconds, more than a small piece's own work."""
        items = list(items)
        if not items:
            return iter(())
        context = self.spark.sparkContext
        slices = balanced(
            weights if weights is not None else [1] * len(items), max(1, min(len(items), context.defaultParallelism))
        )
        described = context.getLocalProperty("spark.job.description")
        context.setJobDescription(f"dbidx {what}"[:1000])
        try:
            with typed_errors():
                rows = (
                    self.spark.range(len(slices), numPartitions=len(slices))
                    .mapInArrow(partial(_run_pieces, work=work, items=items, slices=slices), RESULT_DDL)
                    .collect()
                )
        finally:
            context.setJobDescription(described)
        got: dict[int, bytes] = {}
        for row in rows:
            if row.item in got or not 0 <= row.item < len(items):
                raise CommitError(
                    f"dbidx {what}: the Spark job returned item {row.item} twice or out of range "
                    f"(of {len(items)}); nothing was published"
                )
            got[row.item] = bytes(row.payload)
        if len(got) != len(items):
            missing = sorted(set(range(len(items))) - set(got))
            raise CommitError(
                f"dbidx {what}: the Spark job returned no result for {len(missing)} of {len(items)} "
                f"pieces (e.g. item {missing[0]}); nothing was published"
            )
        return iter([got[i] for i in range(len(items))])


def balanced(weights: Sequence[int], slices: int) -> list[list[int]]:
    """Item indexes in `slices` groups of about equal weight: heaviest first, each to the lightest group so far (the
    greedy rule; within 4/3 of the best for this problem). Groups keep their items in order."""
    groups: list[list[int]] = [[] for _ in range(slices)]
    loads = [0] * slices
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        lightest = min(range(slices), key=lambda g: (loads[g], g))
        groups[lightest].append(i)
        loads[lightest] += max(weights[i], 1)
    return [sorted(g) for g in groups if g]


def _run_pieces(
    batches: Iterator[pa.RecordBatch], work: Work, items: list[Any], slices: list[list[int]]
) -> Iterator[pa.RecordBatch]:
    """In a task: run the pieces of every slice this Spark partition holds, as this task attempt."""
    from pyspark import TaskContext

    context = TaskContext.get()
    attempt = context.attemptNumber() if context is not None else 0
    for batch in batches:
        for slice_id in batch.column(0).to_pylist():
            for item in slices[slice_id]:
                payload = work(items[item], attempt)
                yield pa.RecordBatch.from_pydict(
                    {
                        "item": pa.array([item], pa.int64()),
                        "attempt": pa.array([attempt], pa.int32()),
                        "payload": pa.array([payload], pa.binary()),
                    }
                )


def maintain(
    spark: Any,
    table: Table,
    budget_seconds: float | None = None,
    budget_files: int | None = None,
    progress: Progress | None = None,
) -> ServicesReport:
    """Run the table services the table needs now (as `Table.maintain` / `dbidx maintain`), with the compactions'
    pieces as Spark jobs on `spark`: for a maintenance job scheduled on a cluster."""
    return table.maintain(budget_seconds, budget_files, progress, runner=SparkWorkRunner(spark))
