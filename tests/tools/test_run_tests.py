"""tools/run_tests.py and tools/spark_cds.py: where a test run's files go, and the options the tests' JVMs get."""

from __future__ import annotations

import os
from pathlib import Path

from tools import run_tests, spark_cds


def test_the_run_directory_follows_dbidx_test_tmp(tmp_path: Path) -> None:
    assert run_tests.temp_root({"DBIDX_TEST_TMP": "disk"}) is None  # pytest's own default place
    assert run_tests.temp_root({"DBIDX_TEST_TMP": str(tmp_path)}) == str(tmp_path)
    usable = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK)
    default = run_tests.temp_root({})
    assert default in ((run_tests.MEMORY_FS, None) if usable else (None,))


def test_the_jvm_options_name_the_archive_only_when_there_is_one(tmp_path: Path) -> None:
    assert spark_cds.jvm_options(None) == spark_cds.BASE_OPTIONS
    archive = tmp_path / "spark.jsa"
    with_archive = spark_cds.jvm_options(archive).split()
    assert with_archive[: len(spark_cds.BASE_OPTIONS.split())] == spark_cds.BASE_OPTIONS.split()
    assert f"-XX:SharedArchiveFile={archive}" in with_archive
    assert "-Xlog:cds=off" in with_archive  # a JVM that cannot map it stays quiet on stdout (the demo's JSON)
    path = spark_cds.archive_path(str(tmp_path))
    assert path.parent == tmp_path / "spark-cds" and path.name.startswith("pyspark-") and path.suffix == ".jsa"


def test_the_tests_jvms_take_what_run_tests_chose_else_the_quick_start_options(monkeypatch) -> None:
    monkeypatch.delenv(spark_cds.OPTIONS_ENV, raising=False)
    assert spark_cds.jvm_options_for_tests() == spark_cds.BASE_OPTIONS
    monkeypatch.setenv(spark_cds.OPTIONS_ENV, "-XX:+UseSerialGC -Xshare:off")
    assert spark_cds.jvm_options_for_tests() == "-XX:+UseSerialGC -Xshare:off"
