"""A Delta Spark writer in a process of its own (tests/spark_integration/test_delta_spark_ops.py): its own JVM and
SparkSession (`local[1]`, a small heap), built as a user builds one (`with_delta_spark`), running the SQL statements
it reads from stdin, one JSON line each ({"sql": ...}), and answering each with one JSON line on stdout prefixed
`REPLY ` ({"ok": true, "attempts": N} or {"ok": false, "error": ...}). A statement that loses a race to another
writer's commit (Delta's Concurrent*Exception: its optimistic check) is run again, up to 5 times, as a user's job
would retry it. Usage: python delta_spark_process.py IVY_DIR LOCAL_DIR."""

from __future__ import annotations

import json
import sys


def main(ivy_dir: str, local_dir: str) -> None:
    from pyspark.sql import SparkSession

    from dbidx.spark_integration.delta_spark import with_delta_spark

    spark = (
        with_delta_spark(SparkSession.builder, ivy_dir)
        .master("local[1]")
        .appName("dbidx-delta-spark-writer")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", "512m")
        .config("spark.sql.shuffle.partitions", "1")
        .config("spark.databricks.delta.snapshotPartitions", "1")
        .config("spark.local.dir", local_dir)
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    reply({"ready": True})
    for line in sys.stdin:
        sql = json.loads(line)["sql"]
        for attempt in range(1, 6):
            try:
                spark.sql(sql).collect()
                reply({"ok": True, "attempts": attempt})
                break
            except Exception as exc:  # noqa: BLE001 -- any failure is reported to the test, which decides
                if "Concurrent" not in type(exc).__name__ + str(exc)[:500] or attempt == 5:
                    reply({"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:2000]}"})
                    break
    spark.stop()


def reply(message: dict) -> None:
    print("REPLY " + json.dumps(message), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
