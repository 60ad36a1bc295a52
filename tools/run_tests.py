"""Run pytest with its temporary files on a memory-backed filesystem when the machine has one (`make test`,
`make test-fast`): `python -m tools.run_tests [pytest arguments]` (as `python -m pytest`, the
repository root is on sys.path: tests import `tests.` and `tools.` modules, and so do the processes they start).

Why: the suite creates tens of thousands of small files (RocksDB directories, Delta logs, data and index files) and
deletes them again. On tmpfs (/dev/shm) that costs less system time than on a disk: on 2 cores, the tests of
tests/data that need no Spark took 127 s instead of 157 s (system time 24 s instead of 41 s). In the full suite the
pure-Python tests gain as much, but the machine is CPU-bound by the Spark JVMs then, and the whole run measured the
same within its noise (706-761 s either way, 2026-11-27). The files are real files all the same: RocksDB, Parquet
and the Delta log see a POSIX filesystem, and the tests' fsyncs still run. A full `make test` peaked at 0.5 GB there.

The directory is one of this run's own (two runs at once do not share it), used as pytest's --basetemp, and removed
when pytest ends, whatever the outcome (it holds RAM). Without a usable tmpfs (none, not writable, or less than
MIN_FREE_MB free), or with DBIDX_TEST_TMP=disk, pytest keeps its default place; DBIDX_TEST_TMP=DIR puts the run's
directory in DIR. A --basetemp given on the command line is kept as it is.

With --spark-cds (first, before pytest's arguments: `make test`), the Spark JVMs the tests start use a class-data
archive of Spark's classes (tools/spark_cds.py: built once per virtualenv, about 60 s on 2 cores), passed to the
tests as DBIDX_TEST_JVM_OPTIONS; DBIDX_TEST_CDS=off runs them without it.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest

from tools import spark_cds

MEMORY_FS = "/dev/shm"
MIN_FREE_MB = 4096  # a full `make test` peaked at 0.5 GB


def temp_root(env: dict[str, str]) -> str | None:
    """Where this run's directory goes: DBIDX_TEST_TMP if set (None for "disk"), else /dev/shm when usable."""
    chosen = env.get("DBIDX_TEST_TMP", "")
    if chosen == "disk":
        return None
    if chosen:
        return chosen
    if not (os.path.isdir(MEMORY_FS) and os.access(MEMORY_FS, os.W_OK | os.X_OK)):
        return None
    if shutil.disk_usage(MEMORY_FS).free < MIN_FREE_MB << 20:
        return None
    return MEMORY_FS


def main(args: list[str]) -> int:
    """Run pytest with `args`, in this run's own temporary directory if any; pytest's exit status."""
    if args[:1] == ["--spark-cds"]:
        args = args[1:]
        archive = None if os.environ.get("DBIDX_TEST_CDS") == "off" else spark_cds.ensure_archive()
        os.environ.setdefault(spark_cds.OPTIONS_ENV, spark_cds.jvm_options(archive))
        print(f"Spark JVMs: {spark_cds.jvm_options_for_tests()}")
    root = None if any(a.startswith("--basetemp") for a in args) else temp_root(dict(os.environ))
    if root is None:
        return int(pytest.main(args))
    run_dir = tempfile.mkdtemp(prefix="dbidx-tests-", dir=root)
    try:
        print(f"test files in {run_dir} (removed at the end; DBIDX_TEST_TMP=disk keeps pytest's default)")
        return int(pytest.main([f"--basetemp={os.path.join(run_dir, 'base')}", *args]))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
