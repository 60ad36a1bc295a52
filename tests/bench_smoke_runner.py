"""Runs benchmark scripts at smoke size one after the other in this one process, so their Spark JVM starts once
(tests/test_bench_smoke.py; each script stops its SparkSession at its end, and the next script's SparkSession is a
new SparkContext in the same JVM: ~0.5 s instead of ~15 s of JVM start and first job on 2 cores).

Usage: `python tests/bench_smoke_runner.py PLAN.json`, PLAN a list of {"name", "script", "args", "cwd", "out"}: each
script runs as `python SCRIPT ARGS` would (runpy, as `__main__`, its own sys.argv, in its own `cwd`), with what it
prints (sys.stdout, sys.stderr) written to `out`.stdout and `out`.stderr, and its exit status (SystemExit as the
interpreter would turn it into one; 1 after any other exception, its traceback in its stderr) to `out`.rc. What the
JVM and Python workers write goes to the runner's own stdout and stderr.

What sharing changes, and what the runner does about it: Spark keeps its first local root dirs for the life of the
JVM (a later SparkContext's spark.local.dir is not read, and the first's path is recreated when used), so
SPARK_LOCAL_DIRS points every script's Spark scratch at one dir of the runner's, removed at the end; a script that
fails without stopping its SparkContext has it stopped before the next script runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import shutil
import sys
import tempfile
import traceback
from pathlib import Path


def exit_status(code: object) -> int:
    """The interpreter's status for `raise SystemExit(code)` (a message is printed to stderr, status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run(script: str, args: list[str], cwd: str) -> int:
    saved_argv, saved_path, saved_cwd = sys.argv, list(sys.path), os.getcwd()
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))  # as `python SCRIPT` puts the script's dir first
    os.chdir(cwd)
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as exc:
        return exit_status(exc.code)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, then the next script runs
        traceback.print_exc()
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.chdir(saved_cwd)
        stop_spark()


def stop_spark() -> None:
    """Stop a SparkContext a script left running (a failed one), so the next script gets its own settings."""
    pyspark = sys.modules.get("pyspark")
    if pyspark is None:
        return
    context = pyspark.SparkContext._active_spark_context
    if context is not None:
        context.stop()


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    scratch = tempfile.mkdtemp(prefix="dbidx-bench-smoke-spark-")
    os.environ["SPARK_LOCAL_DIRS"] = scratch  # read by the JVM the first script starts; see the module docstring
    try:
        for step in plan:
            out = Path(step["out"])
            with (
                open(f"{out}.stdout", "w") as stdout,
                open(f"{out}.stderr", "w") as stderr,
                contextlib.redirect_stdout(stdout),
                contextlib.redirect_stderr(stderr),
            ):
                status = run(step["script"], step["args"], step["cwd"])
            Path(f"{out}.rc").write_text(str(status))
            print(f"{step['name']}: exit {status}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
