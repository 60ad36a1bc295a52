"""Commit-path benchmark: a large initial load and change batches through `upsert`, with the driver's peak memory.

What it shows: the driver's memory does not grow with the number of rows or new keys in a batch (tasks write the
index files; the driver receives a few hundred bytes per written file and publishes), and the table is complete at
the end (row count and payload sum checked against arithmetic, not against the index).

Data, generated inside Spark (nothing passes through the driver's Python): keys `md5(id)` (32 hex, UUID-like),
30 daily partitions by `id % 30`, payload `v = id`. Steps: an initial load of `--keys` new keys, then batches of
`--new-keys` new keys each (plus 10 % as many updates of old keys, `v = v + 1`), then `read_table` count and sum.
Peak RSS per step, of the driver JVM (in local mode it also runs the executors' tasks and the shuffle) and of the
driver's Python process, from Linux's VmHWM, reset before each step (`/proc/<pid>/clear_refs`); and, sampled every
0.2 s (psutil, else /proc), the largest RSS of any one process of the application (driver, JVM, Python workers) and the
sum over all of them.
Run: `python benchmarks/commit_bench.py [--keys 10000000] [--new-keys 100000,100000,1000000] [--driver-memory 4g]
[--smoke] [--write-results]`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report

from dbidx.config import CacheConfig
from dbidx.table.facade import Table
from dbidx.spark_integration.api import upsert
from dbidx.spark_integration.reads import read_table

PARTITIONS = 30


def peak_mb(pid: int) -> float:
    """Peak RSS (VmHWM) of a process since its last reset, in MB."""
    return _report.status_bytes("VmHWM", pid) / 2**20


def rows(spark, start: int, count: int, updates: int = 0, total: int = 0):
    """New keys start..start+count, plus `updates` existing keys of 0..total (spread evenly) with v = id + 1."""
    from pyspark.sql import functions as F

    def shaped(df, bump: int):
        return df.select(
            F.md5(F.col("id").cast("string")).alias("key"),
            F.format_string("2025-01-%02d", (F.col("id") % PARTITIONS + 1).cast("int")).alias("dt"),
            (F.col("id") + bump).alias("v"),
        )

    frame = shaped(spark.range(start, start + count), 0)
    if updates:
        step = max(total // updates, 1)
        frame = frame.unionByName(shaped(spark.range(0, step * updates, step), 1))
    return frame


def empty_job(df, shards: int) -> int:
    """The Spark floor of an upsert batch: the same rows through the same shape of job (row ids, shuffle by key
    into one partition per shard, mapInArrow into Python workers, one result row per task), doing nothing else."""
    import pyarrow as pa
    from pyspark.sql import functions as F

    def consume(batches):
        yield pa.RecordBatch.from_pydict({"n": [sum(b.num_rows for b in batches)]})

    shuffled = df.withColumn("_rid", F.monotonically_increasing_id()).repartition(shards, F.col("key").cast("string"))
    return sum(row.n for row in shuffled.mapInArrow(consume, "n long").collect())


def measure(spark, label: str, fn, pids: dict[str, int]) -> dict:
    for pid in pids.values():
        _report.reset_peak_rss(pid)
    with _report.TreeRss() as rss:
        started = time.perf_counter()
        result = fn()
        out = {"step": label, "seconds": time.perf_counter() - started, "result": result}
    out["largest_process_mb"], out["all_processes_mb"] = rss.largest / 2**20, rss.total / 2**20
    out.update({f"{name}_peak_mb": peak_mb(pid) for name, pid in pids.items()})
    print(
        f"{label}: {out['seconds']:.1f} s, " + ", ".join(f"{n} {out[f'{n}_peak_mb']:.0f} MB" for n in pids),
        file=sys.stderr,
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=10_000_000, help="keys of the initial load")
    parser.add_argument(
        "--new-keys",
        default="100000,100000,1000000",
        help="new keys per change batch (two equal first sizes: the first-batch-after-load ratio)",
    )
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--driver-memory", default="4g")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds; used by tests)")
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.keys, args.new_keys, args.driver_memory = 20_000, "1000,2000", "1g"
    batches = [int(n) for n in args.new_keys.split(",")]
    work = Path(tempfile.mkdtemp(prefix="dbidx-commit-bench-"))
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("dbidx-commit-bench")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.memory", args.driver_memory)
        .config("spark.sql.shuffle.partitions", "8")
        .config("spark.local.dir", str(work / "spark"))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    pids = {"driver JVM": spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid(), "driver Python": os.getpid()}
    try:
        table = Table.create(str(work / "table"), num_shards=args.shards)
        config = CacheConfig(base_path=str(work / "cache"))
        steps = [
            measure(
                spark,
                f"initial load, {args.keys:,} new keys",
                lambda: upsert(rows(spark, 0, args.keys), table, key="key", partition="dt", cache_config=config),
                pids,
            )
        ]
        total, bumped = args.keys, set()
        for n in batches:
            updates = n // 10
            steps.append(
                measure(
                    spark,
                    f"batch: {n:,} new keys + {updates:,} updates",
                    lambda n=n, u=updates, t=total: upsert(
                        rows(spark, t, n, u, t), table, key="key", partition="dt", cache_config=config
                    ),
                    pids,
                )
            )
            step = max(total // updates, 1) if updates else 1
            bumped |= set(range(0, step * updates, step))  # v = id + 1 for these ids (set, not added, on repeats)
            total += n
        # The floor: an empty job of the warm batch's shape (same rows, no table), median of 3.
        if len(batches) > 1 and batches[0] == batches[1]:
            n = batches[1]
            floor = sorted(
                (
                    measure(
                        spark,
                        f"empty Spark job, {n:,} + {n // 10:,} rows",
                        lambda: empty_job(rows(spark, args.keys + n, n, n // 10, args.keys + n), args.shards),
                        pids,
                    )
                    for _ in range(3)
                ),
                key=lambda m: m["seconds"],
            )[1]
        else:
            floor = None
        check = measure(
            spark,
            "read_table count + sum",
            lambda: read_table(spark, table).agg(F.count("*").alias("n"), F.sum("v").alias("s")).collect()[0],
            pids,
        )
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    expected_sum = total * (total - 1) // 2 + len(bumped)
    got = check["result"]
    ok = got["n"] == total and got["s"] == expected_sum
    summaries = [s["result"] for s in steps]
    table_rows = [
        [
            s["step"],
            s["seconds"],
            f"{r.inserts / s['seconds']:,.0f}",
            r.inserts,
            r.updates,
            r.data_files,
            r.index_entries,
            round(s["driver JVM_peak_mb"]),
            round(s["driver Python_peak_mb"]),
            round(s["largest_process_mb"]),
            round(s["all_processes_mb"]),
        ]
        for s, r in zip(steps, summaries)
    ]
    table_rows.append(
        [
            check["step"],
            check["seconds"],
            "",
            got["n"],
            "",
            "",
            "",
            round(check["driver JVM_peak_mb"]),
            round(check["driver Python_peak_mb"]),
            round(check["largest_process_mb"]),
            round(check["all_processes_mb"]),
        ]
    )
    python_peaks = [s["driver Python_peak_mb"] for s in steps[1:]]
    verdict = (
        f"Final table: {got['n']:,} rows (expected {total:,}), payload sum {got['s']:,} (expected "
        f"{expected_sum:,}): {'complete' if ok else 'WRONG'}. Driver Python peak over the change batches: "
        f"{min(python_peaks):.0f}-{max(python_peaks):.0f} MB for {batches[0]:,} to {batches[-1]:,} new keys."
    )
    load_rate = summaries[0].inserts / steps[0]["seconds"]
    verdict += (
        f" Initial load: {load_rate:,.0f} new keys/s end to end (target >= 1,000,000); largest single "
        f"process during it {steps[0]['largest_process_mb']:,.0f} MB (target <= 2,048)."
    )
    if len(batches) > 1 and batches[0] == batches[1]:
        cold, warm = steps[1]["seconds"], steps[2]["seconds"]
        verdict += (
            f" First batch after the load: {cold:.2f} s, the next one of the same size {warm:.2f} s: "
            f"{cold / warm:.1f}x (target <= 2x; the first batch loads every partition it touches into the "
            "shard caches)."
        )
    if floor is not None:
        warm = steps[2]["seconds"]
        verdict += (
            f" Warm batch vs an empty Spark job of the same shape (same rows, row ids, shuffle by key, "
            f"mapInArrow into Python, one result per task; median of 3): {warm:.2f} s vs "
            f"{floor['seconds']:.2f} s = {warm / floor['seconds']:.2f}x (target <= 1.2x)."
        )
    body = "\n\n".join(
        [
            "## Commit path: initial load and change batches, driver memory",
            f"Machine: {_report.machine()}; Spark local[2], spark.driver.memory={args.driver_memory}, {args.shards} key "
            f"shards. Command: `{_report.command()}`. Keys md5(id) over {PARTITIONS} daily partitions, generated in "
            "Spark. Peak RSS per step (VmHWM reset before each): the driver JVM (in local mode it also runs the tasks "
            "and the shuffle, so it follows the batch size and -Xmx) and the driver's Python process (which holds only "
            "the task results: the file records).",
            _report.table(
                [
                    "step",
                    "seconds",
                    "new keys/s",
                    "inserts",
                    "updates",
                    "data files",
                    "index entries",
                    "driver JVM peak MB",
                    "driver Python peak MB",
                    "largest process MB",
                    "all processes MB",
                ],
                table_rows,
            ),
            verdict,
        ]
    )
    if args.write_results and not args.smoke:
        _report.write_figures(
            "commit",
            {
                "keys": args.keys,
                "batches": batches,
                "driver_memory": args.driver_memory,
                "steps": [
                    {k: v for k, v in s.items() if k != "result"}
                    | {
                        "inserts": r.inserts,
                        "updates": r.updates,
                        "data_files": r.data_files,
                        "index_entries": r.index_entries,
                    }
                    for s, r in zip(steps, summaries)
                ],
                "final_rows": got["n"],
                "final_sum": got["s"],
                "complete": ok,
                "empty_job_s": floor["seconds"] if floor else None,
            },
        )
        _report.write_section("commit", body)
    print(body)
    if not ok:
        raise SystemExit("the table is not complete: " + verdict)


if __name__ == "__main__":
    main()
