"""Running dbidx beside Delta Lake on Spark (Delta Spark) in one SparkSession: the jars and the two settings.

Why a helper: a team on Delta Spark reads, MERGEs, OPTIMIZEs and VACUUMs its dbidx tables with Delta Spark from
the same session its upserts run in. Delta Spark is a set of JVM jars built against one Spark minor version: Delta
4.4.0 (`io.delta:delta-spark_2.13:4.4.0`, and `delta-spark==4.4.0` on PyPI for the Python `DeltaTable` API) runs on
Spark 4.2.0 and fails on 4.3.0 with NoSuchMethodError (measured here). dbidx itself needs none of it; this module only
names the pairing once, for users (docs/DEPLOY.md) and for the tests.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Mapping

DELTA_VERSION = "4.4.0"
DELTA_SPARK_PACKAGE = f"io.delta:delta-spark_2.13:{DELTA_VERSION}"
SPARK_VERSION = "4.2.0"  # the Spark minor version Delta 4.4.0 is built against (its POM's spark-sql_2.13)

DELTA_SQL_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}


def delta_spark_conf(ivy_dir: str | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The SparkSession settings that load Delta Spark: its Maven package (Spark resolves it with its dependencies
    from Maven Central at start-up, into `ivy_dir` when given: a cache that later sessions reuse offline), the SQL
    extension and the catalog. Start the session with them; `spark.read.format("delta")` then reads dbidx tables."""
    conf = {"spark.jars.packages": DELTA_SPARK_PACKAGE, **DELTA_SQL_CONF}
    if ivy_dir is not None:
        conf["spark.jars.ivy"] = ivy_dir
    conf.update(extra or {})
    return conf


def default_ivy_dir() -> str:
    """Where the Delta jars are cached: `DBIDX_DELTA_IVY_DIR`, else `delta-ivy` in this Python environment (the tests,
    the demo and the benchmarks share it, so a machine downloads the jars once)."""
    return os.environ.get("DBIDX_DELTA_IVY_DIR") or os.path.join(sys.prefix, "delta-ivy")


def with_delta_spark(builder: Any, ivy_dir: str | None = None) -> Any:
    """`builder` (a SparkSession.Builder) with `delta_spark_conf` applied."""
    for key, value in delta_spark_conf(ivy_dir).items():
        builder = builder.config(key, value)
    return builder


def check_spark_version(version: str) -> None:
    """Refuse by name a Spark whose minor version Delta Spark's jars were not built for: its failure would come
    later, from inside a Delta command, as a NoSuchMethodError."""
    from dbidx.errors import ConfigError

    if version.split(".")[:2] != SPARK_VERSION.split(".")[:2]:
        raise ConfigError(
            f"Delta Spark {DELTA_VERSION} runs on Spark {SPARK_VERSION[:3]}.x; this session is Spark {version} "
            f"(pip install 'pyspark=={SPARK_VERSION}' 'delta-spark=={DELTA_VERSION}')"
        )
