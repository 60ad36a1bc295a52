"""The benchmark scripts run at smoke size inside the test suite, so they never rot."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize("script", ["bootstrap_bench.py", "cache_bench.py"])
def test_benchmark_runs_at_smoke_size(script, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, str(BENCHMARKS / script), "--smoke"], capture_output=True, text=True,
                            cwd=tmp_path, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| keys |" in result.stdout or "| parallelism |" in result.stdout
    assert "B/entry" in result.stdout
    assert list(tmp_path.iterdir()) == []  # the script cleans up its work dir


@pytest.mark.spark
@pytest.mark.slow
def test_spark_benchmark_runs_at_smoke_size(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, str(BENCHMARKS / "spark_bench.py"), "--smoke"], capture_output=True,
                            text=True, cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| index keys | dbidx s/batch | Spark join s/batch |" in result.stdout
    assert "| 20,000 |" in result.stdout
    assert list(tmp_path.iterdir()) == []
