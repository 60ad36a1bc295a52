"""Shared fixtures: one local SparkSession for the whole test session (it costs ~6 s to start)."""
from __future__ import annotations

import os
import shutil
import sys
from typing import Iterator

import pytest


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator["pyspark.sql.SparkSession"]:  # noqa: F821
    """A `local[2,3]` SparkSession (2 cores; a failed task is retried up to 3 times) running this interpreter."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.fail("Java 17 is required for the Spark tests: install openjdk-17-jre-headless or set JAVA_HOME")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    local_dir = tmp_path_factory.mktemp("spark-local")
    session = (
        SparkSession.builder.master("local[2,3]")
        .appName("dbidx-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
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
        patch.setattr(driver, "services_after_commit", lambda table: None)
        yield


@pytest.fixture
def services_on() -> None:
    """Keep the table services after each upsert as users get them (see _services_after_commit_off)."""
