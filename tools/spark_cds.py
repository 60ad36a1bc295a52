"""A class-data-sharing archive of the Spark JVM's classes, so the many short-lived JVMs of the test suite start
faster: `python -m tools.spark_cds` builds it (tools/run_tests.py does when it is missing) and prints its path.

Why: `make test` starts many Spark JVMs (the session's Spark, the benchmark smokes, the demo, the
standalone cluster's daemons, drivers and executors), and each start loads and verifies thousands of Spark classes.
A dynamic AppCDS archive (JDK 13+: -XX:ArchiveClassesAtExit, then -XX:SharedArchiveFile) maps them in parsed instead.
On 2 cores, a local SparkSession's start and first mapInArrow job took 25 s of CPU and 20 s of wall time without it,
17 s and 13 s with it. The JVM is the same JVM running the same classes: only how they reach memory changes.

The archive belongs to one JDK build and one pyspark (its name holds both), lives in the virtualenv (`make clean`
removes it) and is built by running a small Spark job of the kinds the tests run (DataFrames, a shuffle, Arrow to
Python and back, Parquet) with the archiving option. A JVM that cannot use it (another classpath, another JDK) runs
without it, silently: the options turn the CDS log off, whose warnings would otherwise go to the JVM's stdout.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BASE_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"  # C1 only, serial GC: quick short-lived JVMs
QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"  # a JVM that cannot map the archive says so on stdout otherwise
BUILD_TIMEOUT_S = 600
OPTIONS_ENV = "DBIDX_TEST_JVM_OPTIONS"  # how tools/run_tests.py hands the options to the tests and their children

_JOB = """
import os, sys, tempfile
os.environ["PYSPARK_PYTHON"] = sys.executable
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
         .config("spark.sql.shuffle.partitions", "4").getOrCreate())
df = spark.createDataFrame([(i, str(i % 7), i * 0.5) for i in range(2000)], "id long, dt string, v double")
def same(batches):
    yield from batches
with tempfile.TemporaryDirectory() as scratch:
    out = os.path.join(scratch, "t")
    df.repartition(2, "dt").mapInArrow(same, df.schema).write.partitionBy("dt").parquet(out)
    spark.read.parquet(out).groupBy("dt").count().collect()
df.rdd.mapPartitions(lambda rows: [sum(1 for _ in rows)]).collect()
spark.stop()
"""


def archive_path(prefix: str = sys.prefix) -> Path:
    """Where the archive for this virtualenv's pyspark and the `java` on PATH goes."""
    import pyspark

    java = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=60)
    build = hashlib.sha256((java.stderr + java.stdout).encode()).hexdigest()[:12]
    return Path(prefix) / "spark-cds" / f"pyspark-{pyspark.__version__}-jdk-{build}.jsa"


def build(path: Path) -> Path | None:
    """Build the archive at `path` (atomically: a half-written archive is never seen); None if this JDK cannot."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".partial")
    os.close(fd)
    os.unlink(partial)  # the JVM writes the archive itself, at exit
    env = dict(os.environ, SPARK_SUBMIT_OPTS=f"{BASE_OPTIONS} {QUIET} -XX:ArchiveClassesAtExit={partial}")
    try:
        try:
            done = subprocess.run(
                [sys.executable, "-c", _JOB], env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
            )
        except (OSError, subprocess.TimeoutExpired) as exc:  # the tests run without it: slower, not wrong
            print(f"no Spark class-data archive: {exc}", file=sys.stderr)
            return None
        if done.returncode != 0 or not os.path.exists(partial):
            print(f"no Spark class-data archive (exit {done.returncode}): {done.stderr[-800:]}", file=sys.stderr)
            return None
        os.replace(partial, path)
        return path
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def jvm_options(archive: Path | None) -> str:
    """The tests' options for a Spark JVM (tools/run_tests.py hands them to the tests as OPTIONS_ENV):
    the quick-start ones, and the archive when there is one."""
    return f"{BASE_OPTIONS} {QUIET} -XX:SharedArchiveFile={archive}" if archive is not None else BASE_OPTIONS


def jvm_options_for_tests() -> str:
    """The options the tests give every Spark JVM they start: what tools/run_tests.py chose, else the quick-start
    ones (a bare `pytest` run)."""
    return os.environ.get(OPTIONS_ENV, BASE_OPTIONS)


def ensure_archive() -> Path | None:
    """This virtualenv's archive, built first if missing (about 60 s on 2 cores); None if it cannot be built."""
    path = archive_path()
    return path if path.exists() else build(path)


if __name__ == "__main__":
    found = ensure_archive()  # a JDK that cannot build one is not an error: the tests' JVMs start without it
    print(f"Spark class-data archive: {found if found is not None else 'none (the JVMs start without one)'}")
