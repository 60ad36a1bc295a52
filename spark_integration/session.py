"""A quiet local SparkSession (`quiet_local_session`): what the demo and a notebook start. pyspark is imported
lazily."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any


_QUIET_LOG4J = """# Written by dbidx (quiet_local_session): Spark's own log at ERROR from the JVM's first line
# (setLogLevel comes too late for the start-up warnings).
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n%ex
"""


def quiet_local_session(
    local_dir: Path, app_name: str = "dbidx", master: str = "local[2]", driver_memory: str = "2g"
) -> Any:
    """A local Spark session whose log is at ERROR from its first line (setLogLevel comes too late for the start-up
    warnings), Arrow on, its scratch under `local_dir`: for the demo, or a notebook, whose own lines are the
    output. Python workers run this interpreter."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    local_dir.mkdir(parents=True, exist_ok=True)
    log4j = local_dir / "log4j2-quiet.properties"
    log4j.write_text(_QUIET_LOG4J)
    spark = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{log4j}")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.local.dir", str(local_dir))
        .config("spark.driver.memory", driver_memory)
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark
