"""A driver application for tests/spark_integration/test_cluster.py: upserts a change stream into a table on a
standalone cluster.

Run as its own process (plain python or spark-submit), because the test session's JVM already hosts a
SparkContext. Input: a JSON file of batches (rows of `id, dt, v, _dbidx_delete`). Output: a JSON file with each
batch's CommitSummary (per-shard metrics included), where each shard's task attempts ran, and the table's rows.

The cache base path is deliberately not set: caches must land where dbidx puts them by default on an executor.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

from dbidx.tools.spark_cds import jvm_options_for_tests  # a script of its own: the repository is importable as dbidx

SCHEMA = "id string, dt string, v long, _dbidx_delete boolean"
EXECUTOR_MAIN = "CoarseGrainedExecutorBackend"
# As cluster_harness.JVM_OPTIONS: quick short-lived JVMs (and the class-data archive `make test` passes on).
JVM_OPTIONS = jvm_options_for_tests()
SLOW_S = 90.0  # how long the first attempt of the --speculate task stalls: a speculative copy wins long before
# Speculation for --speculate: a task is copied once it runs 1.5 times the median of its stage's finished tasks (and
# at least 2 s, so the ordinary sub-second tasks of these batches are left alone), by elapsed time only.
SPECULATION = {
    "spark.speculation": "true",
    "spark.speculation.interval": "100ms",
    "spark.speculation.quantile": "0.5",
    "spark.speculation.multiplier": "1.5",
    "spark.speculation.minTaskRuntime": "2s",
    "spark.speculation.efficiency.enabled": "false",
}


def executor_pid(start: int) -> int | None:
    """The executor JVM above a Python worker: walk up parent pids until a command line names the executor."""
    pid = start
    while pid > 1:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        if EXECUTOR_MAIN.encode() in cmdline:
            return pid
        pid = int(stat.rpartition(")")[2].split()[1])  # field 4 (ppid), after the parenthesised command name
    return None


def make_hook(
    batch: int, probe_dir: str, kill_at: tuple[int, int] | None, slow_at: tuple[int, int] | None = None
) -> Callable[[int, int], None]:
    """on_task_written hook: record where each task attempt ran; SIGKILL the executor once at (batch, shard)
    `kill_at`; stall the first attempt at `slow_at` (a straggler: Spark speculates a copy of it on the other
    worker, the copy waits until the straggler reached its hook, then wins, and Spark kills the straggler).

    The kill happens after the attempt wrote its data and index files and before it reports back, on the first
    attempt only; an exclusive create of a marker file makes it happen at most once whatever Spark retries.
    """

    def hook(shard: int, attempt: int) -> None:
        # 1. Where this attempt ran: the worker is the one whose local dir holds this process's SPARK_LOCAL_DIRS.
        import dbidx

        record = {
            "batch": batch,
            "shard": shard,
            "attempt": attempt,
            "pid": os.getpid(),
            "local_dirs": os.environ.get("SPARK_LOCAL_DIRS", ""),
            "cwd": os.getcwd(),
            "python": sys.executable,
            "dbidx": dbidx.__file__,
        }
        name = f"b{batch}-s{shard}-a{attempt}-p{os.getpid()}.json"
        Path(probe_dir, name).write_text(json.dumps(record))
        if slow_at == (batch, shard) and attempt == 0:
            time.sleep(SLOW_S)
        elif slow_at == (batch, shard):
            # The copy reports back only once the straggler reached its hook too: under load the copy was launched
            # (by elapsed time) and won before the straggler had written its files, so no probe said where it ran.
            deadline = time.monotonic() + SLOW_S / 2
            while not list(Path(probe_dir).glob(f"b{batch}-s{shard}-a0-*.json")) and time.monotonic() < deadline:
                time.sleep(0.1)
        if kill_at != (batch, shard) or attempt != 0:
            return
        # 2. At most one kill in the whole run.
        try:
            fd = os.open(Path(probe_dir, "killed"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return
        target = executor_pid(os.getpid())
        os.write(fd, json.dumps({"executor_pid": target, "record": record}).encode())
        os.close(fd)
        if target is not None:
            os.kill(target, signal.SIGKILL)
            time.sleep(30)  # never report this attempt: the JVM is gone, and this worker goes with it

    return hook


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the batches, write the result JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--master", required=True)
    parser.add_argument("--table", required=True)
    parser.add_argument("--batches", required=True, help="JSON file: a list of batches, each a list of rows")
    parser.add_argument("--out", required=True)
    parser.add_argument("--probe-dir", required=True)
    parser.add_argument("--local-dir", required=True, help="the driver's spark.local.dir")
    parser.add_argument("--create", type=int, default=0, help="create the table with this many shards")
    parser.add_argument("--kill", default="", help="BATCH:SHARD: SIGKILL the executor running that task once")
    parser.add_argument("--archive", default="", help="spark.archives value (a packed env), if any")
    parser.add_argument(
        "--speculate",
        default="",
        help="BATCH:SHARD: turn speculation on and stall the first "
        "attempt of that task until a speculative copy of it has won",
    )
    args = parser.parse_args(argv)

    from pyspark.sql import SparkSession

    from dbidx.table.facade import Table
    from dbidx.spark_integration.api import upsert
    from dbidx.spark_integration.reads import read_table

    builder = (
        SparkSession.builder.master(args.master)
        .appName(Path(args.out).stem)
        .config("spark.executor.cores", "1")
        .config("spark.cores.max", "2")
        .config("spark.executor.memory", "512m")
        .config("spark.driver.memory", "512m")
        .config("spark.task.maxFailures", "4")
        .config("spark.ui.enabled", "false")
        # Both executors before the first job (else one may run every task of it), and no locality wait:
        # tasks go to whichever executor is free.
        .config("spark.scheduler.minRegisteredResourcesRatio", "1.0")
        .config("spark.scheduler.maxRegisteredResourcesWaitingTime", "30s")
        .config("spark.locality.wait", "0s")
        .config("spark.driver.extraJavaOptions", JVM_OPTIONS)
        .config("spark.executor.extraJavaOptions", JVM_OPTIONS)
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.local.dir", args.local_dir)
    )
    if args.archive:
        builder = builder.config("spark.archives", args.archive)
    if args.speculate:
        for name, value in SPECULATION.items():
            builder = builder.config(name, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    kill_at = tuple(int(x) for x in args.kill.split(":")) if args.kill else None
    slow_at = tuple(int(x) for x in args.speculate.split(":")) if args.speculate else None
    table = Table.create(args.table, num_shards=args.create) if args.create else Table.open(args.table)
    batches = json.loads(Path(args.batches).read_text())
    summaries: list[dict[str, Any]] = []
    started = time.perf_counter()
    for n, rows in enumerate(batches):
        df = spark.createDataFrame([tuple(r) for r in rows], SCHEMA)
        summary = upsert(
            df, table, key="id", partition="dt", on_task_written=make_hook(n, args.probe_dir, kill_at, slow_at)
        )  # type: ignore[arg-type]
        summaries.append(summary.to_dict())
    final = [[r.id, r.dt, r.v] for r in read_table(spark, table).select("id", "dt", "v").collect()]
    result = {
        "summaries": summaries,
        "rows": final,
        "seconds": round(time.perf_counter() - started, 2),
        "app_id": spark.sparkContext.applicationId,
    }
    Path(args.out).write_text(json.dumps(result))
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
