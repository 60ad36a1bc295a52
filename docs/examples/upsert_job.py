"""A small dbidx upsert application to try a cluster deployment with (docs/DEPLOY.md): it runs a few batches of
synthetic changes (inserts and updates over a few `dt` partitions, some deletes) into a table and prints one JSON
line per batch with where its time went and how many partitions each shard's task loaded on demand (cold caches).

    spark-submit --master spark://HOST:7077 --archives dbidx-env.tar.gz#env \\
        --conf spark.pyspark.python=./env/bin/python --conf spark.pyspark.driver.python="$(which python)" \\
        docs/examples/upsert_job.py --table /shared/tables/demo --shards 4 --batches 2

The table location must be one every node sees (DEPLOY.md section 5). The table is created on the first run
(with --shards key shards) and opened on later ones; each run starts its batch numbering after the table's last
completed upsert, so runs of the same command keep updating the same keys. --pause-in-tasks makes every shard's
task sleep after it wrote its files and before it reports: a window to try what DEPLOY.md says about a driver that
dies mid-upsert.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", required=True, help="table URI (a path every node sees, or s3://...)")
    parser.add_argument("--shards", type=int, default=4, help="key shards if the table is created [4]")
    parser.add_argument("--batches", type=int, default=2, help="batches to run [2]")
    parser.add_argument("--rows", type=int, default=20_000, help="rows per batch [20000]")
    parser.add_argument("--days", type=int, default=6, help="dt partitions the keys spread over [6]")
    parser.add_argument(
        "--pause-in-tasks",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="sleep in every task after it wrote its files, before it reports [0]",
    )
    args = parser.parse_args(argv)

    from pyspark.sql import SparkSession

    from dbidx.table.facade import Table
    from dbidx.spark_integration.api import upsert

    spark = SparkSession.builder.appName("dbidx-upsert-example").getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    table = Table.open_or_create(args.table, num_shards=args.shards)
    table.timeline.refresh()
    done_before = table.timeline.latest_seq  # completions so far: each run's batches draw other keys
    pause = args.pause_in_tasks

    def hook(shard: int, attempt: int) -> None:  # runs in each task, after its files are written
        if pause:
            time.sleep(pause)

    for n in range(args.batches):
        seq = done_before + n
        rng = random.Random(seq)
        keyspace = args.rows * 5  # later batches update keys earlier ones inserted
        rows = [
            (f"k{rng.randrange(keyspace):08d}", f"2025-01-{1 + rng.randrange(args.days):02d}", seq, rng.random() < 0.02)
            for _ in range(args.rows)
        ]
        df = spark.createDataFrame(rows, "id string, dt string, v long, _dbidx_delete boolean")
        started = time.perf_counter()
        summary = upsert(df, table, key="id", partition="dt", on_task_written=hook if pause else None)
        print(
            json.dumps(
                {
                    "app": spark.sparkContext.applicationId,
                    "batch": n,
                    "instant": summary.instant,
                    "seconds": round(time.perf_counter() - started, 2),
                    "inserts": summary.inserts,
                    "updates": summary.updates,
                    "deletes": summary.deletes,
                    "on_demand_loads": [s.get("on_demand_loads") for s in summary.per_shard],
                    "executors_lost": (summary.spark or {}).get("executors_lost"),  # what Spark did (job_report.py)
                    "abandoned": summary.abandoned,
                }
            ),
            flush=True,
        )  # other writers' unfinished attempts found, rolled back
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
