"""Read a table with Delta Lake on Spark in a process of its own, and print what it read: the demo's fifth reader
(`dbidx demo`'s final check, beside dbidx, polars and DuckDB).

Why a process of its own: Delta Spark's jars are loaded by `spark.jars.packages` when a JVM starts, and the demo's
session is a second application in its JVM (the warm restart), which does not load packages again; a fresh
`python -m dbidx.spark_integration.delta_spark_check PATH COLUMN...` starts one JVM with Delta, reads the table's
Delta log (deletion vectors honoured), prints the rows as JSON lines on stdout and exits. Exit 3: this Spark is
not the one Delta's jars are built for (README), which the caller reports as skipped, never as rows.
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    path, columns = argv[0], argv[1:]
    import pyspark
    from pyspark.sql import SparkSession

    from dbidx.errors import ConfigError
    from dbidx.spark_integration.delta_spark import check_spark_version, default_ivy_dir, with_delta_spark

    try:
        check_spark_version(pyspark.__version__)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 3
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (
        with_delta_spark(SparkSession.builder, default_ivy_dir())
        .master("local[2]")
        .appName("dbidx-delta-spark-check")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.databricks.delta.snapshotPartitions", "2")
        .getOrCreate()
    )
    try:
        for row in spark.read.format("delta").load(path).select(*columns).toLocalIterator():
            print(json.dumps(list(row)))
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
