"""Shared fixtures: one local SparkSession for the whole test session (it costs ~6 s to start)."""

from __future__ import annotations

import os
import shutil
import sys
from typing import Iterator

import pytest

from dbidx.spark_integration.delta_spark import default_ivy_dir
from tools.spark_cds import jvm_options_for_tests

# Every JVM the tests start through spark-submit (the session's Spark below, the benchmark smokes', the demo's, the
# cluster drivers') is short-lived and runs tiny jobs: C1 only and the serial collector, as tests/cluster_harness.py
# gives its daemons, spend far less CPU on start-up and JIT (spark_bench --smoke: 41 s of CPU -> 28 s; the tests of
# spark_integration/test_upsert.py: 118 s -> 95 s). spark-submit adds SPARK_SUBMIT_OPTS to the driver's java
# options; a value already set is kept.
# tools/run_tests.py (`make test`) adds its class-data archive of Spark's classes (tools/spark_cds.py says why).
os.environ.setdefault("SPARK_SUBMIT_OPTS", jvm_options_for_tests())


# Delta Spark's jars, resolved by Spark from Maven Central on a machine's first test session and kept with the
# virtualenv (about 90 MB): later sessions resolve them offline.
DELTA_IVY_DIR = default_ivy_dir()  # shared with the demo and the benchmarks: the jars are fetched once


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator["pyspark.sql.SparkSession"]:  # noqa: F821
    """A `local[2,3]` SparkSession (2 cores; a failed task is retried up to 3 times) running this interpreter."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.fail("Java 17 is required for the Spark tests: install openjdk-17-jre-headless or set JAVA_HOME")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    import pyspark
    from pyspark.sql import SparkSession

    from dbidx.spark_integration.delta_spark import check_spark_version, with_delta_spark

    check_spark_version(pyspark.__version__)  # Delta Spark's jars run on one Spark minor version (README)
    local_dir = tmp_path_factory.mktemp("spark-local")
    session = (
        with_delta_spark(SparkSession.builder, DELTA_IVY_DIR)
        .master("local[2,3]")
        .appName("dbidx-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.databricks.delta.snapshotPartitions", "2")  # Delta Spark's log replay: 50 tasks by default
        .config("spark.sql.sources.parallelPartitionDiscovery.parallelism", "4")  # VACUUM's listing: 10,000 tasks
        .config("spark.driver.memory", "1g")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.local.dir", str(local_dir))
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(autouse=True)
def _services_after_commit_off(request: pytest.FixtureRequest) -> Iterator[None]:
    """The table services that run after each upsert (on by default for users) are off in tests, which count files,
    versions and completions of exactly the commits they make; tests of the services ask for `services_on`. A
    MonkeyPatch of its own: a test's `monkeypatch.undo()` must not turn them back on."""
    if "services_on" in request.fixturenames:
        yield
        return
    from dbidx.spark_integration import driver

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(driver, "services_after_commit", lambda table, runner=None: None)
        yield


@pytest.fixture
def services_on() -> None:
    """Keep the table services after each upsert as users get them (see _services_after_commit_off)."""


# ---- running the suite on several processes (pytest-xdist: `make test` runs `-n 3 --dist loadgroup`) ----------

HEAVY_MARKS = ("slow", "cluster")  # tests of tens of seconds each: started first, so none is left to run alone last


def _xdist_group(item: pytest.Item) -> str | None:
    """Which tests must share one worker process: every test of the session's SparkSession (one local Spark per test
    run, as without xdist), and the tests of a module that share a module- or class-scoped fixture (a set-up made
    once, such as a local S3 server, a Spark cluster or the children a kill-point module forks at once)."""
    fixturedefs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    if "spark" in fixturedefs:
        return "spark-session"
    if any(defs and defs[-1].scope in ("module", "class", "package") for defs in fixturedefs.values()):
        return item.nodeid.split("::")[0]
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist only: mark each test's group (see _xdist_group) and put the Spark session's tests, then the heavy
    ones, at the head of the queue (with --no-loadscope-reorder the queue keeps this order), so the long units start
    first and the many short tests fill in around them."""
    if not getattr(config.option, "loadgroup", False):  # set in each xdist worker of a `--dist loadgroup` run
        return
    rank: dict[str, int] = {}
    for item in items:
        group = _xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        heavy = any(item.get_closest_marker(mark) for mark in HEAVY_MARKS)
        rank[item.nodeid] = 0 if group == "spark-session" else 1 if heavy else 2
    items.sort(key=lambda item: rank[item.nodeid])  # stable: collection order within each rank


@pytest.hookimpl(trylast=True)  # after xdist's own hook, which appends "@<group>" to the node id of a grouped test
def pytest_collection_finish(session: pytest.Session) -> None:
    """Under `--dist loadgroup`, fail at once if the groups did not reach the scheduler: pytest-xdist 3.8 on pytest
    9.2 leaves node ids unchanged (pytest-xdist#1386), which would start a SparkSession in every worker and split
    module set-ups. pyproject.toml keeps pytest below 9.2 for that."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [item.nodeid for item in session.items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if lost:
        message = (
            f"pytest-xdist did not group {len(lost)} tests (e.g. {lost[0]}): with pytest "
            f"{pytest.__version__}, --dist loadgroup does not work (pytest-xdist#1386); "
            "pip install -e '.[dev]' installs a pytest that works"
        )
        print(message, file=sys.__stderr__)  # a worker's exception reaches the terminal only as INTERNALERROR
        raise pytest.UsageError(message)
