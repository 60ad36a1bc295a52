"""The benchmark scripts run at smoke size, so they never rot: the runs are marked `bench_smoke` (`make bench-smoke`,
which CI runs right after `make test`); the checks of the committed figures and charts are in `make test`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


SMOKE = {  # script -> a line of its results table that shows it ran to the end
    "index_bench.py": "Seek/scan crossover",
    "bootstrap_bench.py": "| parallelism |",
    "cache_bench.py": "B/entry",
    "footprint_bench.py": "| key shape | entries | partitions | index Parquet B/entry |",
    "skew_bench.py": "| day | new keys | keys | simple max |",
    "restart_bench.py": "| K commits | entries to catch up |",
    "table_bench.py": "| after commits | dbidx commit s | files written | dbidx live files | dbidx read s |",
    "absorb_bench.py": "| dbidx second steady batch after the absorb (",  # the check ran before (a mismatch fails)
    "dv_reader_bench.py": "| file | ",  # every reader's count was checked against dbidx's before
}


def test_every_benchmark_script_is_smoke_tested():
    scripts = {p.name for p in BENCHMARKS.glob("*_bench.py")}
    assert scripts == set(SMOKE) | set(SPARK_SMOKE) | {"soak_bench.py"}


@pytest.mark.slow  # a benchmark run end to end, in a subprocess: `make bench-smoke` (CI runs it after `make test`)
@pytest.mark.bench_smoke
@pytest.mark.parametrize("script", sorted(SMOKE))
def test_benchmark_runs_at_smoke_size(script, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--smoke"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert SMOKE[script] in result.stdout
    assert list(tmp_path.iterdir()) == []  # the script cleans up its work dir


SPARK_SMOKE = {  # Spark benchmarks -> lines their output must hold
    "spark_bench.py": ["| index keys | dbidx s/batch | Spark join s/batch |", "| 20,000 |"],
    "commit_bench.py": [
        "| step | seconds | new keys/s | inserts |",
        ": complete.",
    ],  # the final table is checked by the script
    # Peers not installed show as skipped; a wrong read-back anywhere makes the script fail.
    "peer_bench.py": ["| system | status | load s | median s/batch (excl. batch 1) |", "| dbidx | ok |"],
    # Two tiny sizes: the per-size table, the disk/RAM table and the verdict comparing them.
    "scale_bench.py": [
        "| index keys | index B/entry | build s | cache B/entry |",
        "| 60,000 |",
        "Warm s/batch (2,000 rows) at 60,000 keys is",
    ],
    # Every figure beside its anchor, then the read-back check (a mismatch also fails the script).
    "speed_bench.py": [
        "| figure | dbidx | anchor | ratio | goal | met |",
        "| steady batch (median of batch 2) |",
        ": check ok.",
    ],
    # The same compactions in the driver and as Spark jobs; both copies must read back the same rows.
    "service_jobs_bench.py": [
        "| service | pieces | input MiB | driver s | Spark job s |",
        "| data compaction |",
        ": check ok.",
    ],
}


SOAK_SERVICES = ["on"]  # "off" is one setting apart (each run costs a Spark start: ~30 s)
# The Spark benchmarks whose own process starts Spark run one after the other in one process (tests/
# bench_smoke_runner.py), so the JVM starts once for all of them instead of once each (~15 s each on 2 cores).
# peer_bench.py starts Spark in its children (its smoke shares one child between its Spark systems): a process of
# its own. The JVM keeps the driver memory of the script that started it: commit_bench.py (whose smoke asks for 1g,
# the others' 4g) runs last.
SHARED_SPARK = sorted(set(SPARK_SMOKE) - {"peer_bench.py"}, key=lambda script: (script == "commit_bench.py", script))


@pytest.fixture(scope="module")
def shared_spark_smokes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Each of SHARED_SPARK at smoke size (and soak_bench.py per SOAK_SERVICES), in one process: name -> its exit
    status, stdout, stderr, and the dir it ran in (empty again if it cleaned up)."""
    base = tmp_path_factory.mktemp("bench-smoke")
    steps = [(script, script, ["--smoke"]) for script in SHARED_SPARK]
    steps += [(f"soak_bench.py[{s}]", "soak_bench.py", ["--smoke", "--services", s]) for s in SOAK_SERVICES]
    plan = []
    for number, (name, script, args) in enumerate(steps):
        (base / f"cwd-{number}").mkdir()
        plan.append(
            {
                "name": name,
                "script": str(BENCHMARKS / script),
                "args": args,
                "cwd": str(base / f"cwd-{number}"),
                "out": str(base / f"out-{number}"),
            }
        )
    (base / "plan.json").write_text(json.dumps(plan))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    runner = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "bench_smoke_runner.py"), str(base / "plan.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300 * len(plan),
    )
    results = {}
    for step in plan:
        out = Path(step["out"])
        rc = out.with_name(out.name + ".rc")
        results[step["name"]] = {
            "rc": int(rc.read_text()) if rc.exists() else None,
            "stdout": out.with_name(out.name + ".stdout").read_text() if rc.exists() else "",
            "stderr": (out.with_name(out.name + ".stderr").read_text() if rc.exists() else "")
            + f"\n--- the runner (exit {runner.returncode}):\n{runner.stdout[-1500:]}\n{runner.stderr[-3000:]}",
            "cwd": Path(step["cwd"]),
        }
    return results


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.bench_smoke
@pytest.mark.parametrize("script", SHARED_SPARK)
def test_spark_benchmark_runs_at_smoke_size(shared_spark_smokes, script):
    result = shared_spark_smokes[script]
    assert result["rc"] == 0, result["stderr"][-4500:]
    for line in SPARK_SMOKE[script]:
        assert line in result["stdout"]
    assert list(result["cwd"].iterdir()) == []


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.bench_smoke
def test_peer_benchmark_runs_at_smoke_size(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "peer_bench.py"), "--smoke"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for line in SPARK_SMOKE["peer_bench.py"]:
        assert line in result.stdout
    assert list(tmp_path.iterdir()) == []


HUDI_SYSTEMS = {  # peer_bench.py's Hudi systems at smoke size -> their labels in its table
    "hudi-cow": "Hudi upsert, copy-on-write, global record index",
    "hudi-mor": "Hudi upsert, merge-on-read, global record index",
}


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.peer_env
def test_hudi_peers_run_at_smoke_size(tmp_path):
    """peer_bench.py's Hudi systems (not in its default smoke: they run on a Spark of their own, in a virtualenv the
    benchmark builds from PyPI and Maven Central on first use) at smoke size: each ran to the end and read back the
    right table, the merge-on-read one compacted, and the table notes name the type and the index."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))  # the benchmark must keep it from the Hudi child
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "peer_bench.py"), "--smoke", "--systems", ",".join(HUDI_SYSTEMS)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=900,  # the first run builds the environment (about a minute) before the two systems' 2-3 minutes
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split(" | ")[0][2:]: line for line in result.stdout.splitlines() if line.startswith("| Hudi ")}
    for label in HUDI_SYSTEMS.values():
        assert rows[label].startswith(f"| {label} | ok |") and rows[label].endswith("| ok |"), rows[label]
    assert rows[HUDI_SYSTEMS["hudi-mor"]].split(" | ")[12] != "-"  # compact s
    assert "MERGE_ON_READ, index GLOBAL_RECORD_LEVEL_INDEX" in result.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.bench_smoke
@pytest.mark.parametrize("services", SOAK_SERVICES)
def test_soak_benchmark_runs_at_smoke_size(shared_spark_smokes, services):
    """12 batches of 200 rows on 2,000 keys, reads every 4: the goals table (every goal measured, none claimed
    without its figures), the read-back check, exit status 0, with the table services on."""
    result = shared_spark_smokes[f"soak_bench.py[{services}]"]
    assert result["rc"] == 0, result["stderr"][-4500:]
    out = result["stdout"]
    for line in (
        "| figure | value | goal | met |",
        "| live data files: most in batches 9-12 vs most in batches 5-8 |",
        "| upsert + service s: batches 9-12 vs batches 5-8 |",
        ": check ok.",
        "| batch | rows | dbidx s | polars s | delta-rs s | anchor s |",
        f"services {services}",
        "| service | batches | sum s | runs | mean s | max s | share |",
        "| all services | 9-12 |",
    ):
        assert line in out, line
    time_goal = next(row for row in out.splitlines() if row.startswith("| upsert + service s: batches 9-12"))
    assert "(services " in time_goal  # the services' share of the time goal's two windows
    goals = [row for row in out.splitlines() if row.startswith("| ") and row.rstrip().endswith(("| yes |", "| NO |"))]
    assert len(goals) == 6  # files, seconds, three readers, bytes: all measured at this size
    assert list(result["cwd"].iterdir()) == []


@pytest.mark.slow
@pytest.mark.bench_smoke
def test_service_growth_runs_at_smoke_size(tmp_path):
    """24 batches of 200 rows on 2,000 keys, windows of 8, profiled: the per-window totals, the per-service table
    (every service's trigger measured: the wrapped functions still exist in dbidx.table.services) and the profile's
    growth tables."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "service_growth.py"), "--smoke", "--profile"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for line in (
        "| batches | upsert wall s | upsert CPU s | services wall s | services CPU s |",
        "| service:part | batches | wall s | CPU s | calls |",
        "| data_compaction:trigger | 17-24 |",
        "| vacuum:trigger | 17-24 |",
        "| function (tottime: CPU s (calls) per window) |",
    ):
        assert line in out, line
    assert "Not measured" not in out
    assert list(tmp_path.iterdir()) == []


def test_projection_is_computed_from_the_committed_results():
    """PROJECTION.md and the README's figures come from benchmarks/results/*.json, never from typing."""
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "projection.py"), "--print-only"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| quantity | value | from |" in result.stdout
    readme = (BENCHMARKS.parent / "README.md").read_text()
    for line in result.stdout.splitlines():
        if line.startswith("- "):
            assert line in readme, f"README's Performance section is stale; rerun benchmarks/projection.py: {line}"
    assert (BENCHMARKS / "PROJECTION.md").read_text().split("\n")[0] == "# The billion-key projection"


@pytest.mark.slow
def test_every_chart_is_drawn_from_the_committed_figures(tmp_path, monkeypatch):
    """Each chart redraws from benchmarks/results/<name>.json, names its machine and command, and RESULTS.md
    shows it."""
    pytest.importorskip("matplotlib")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import charts

    results = (BENCHMARKS / "RESULTS.md").read_text()
    for name in charts.CHARTS:
        written = charts.draw(name, out_dir=tmp_path)
        if not written and name in charts.DRAWN_ONCE_RUN:
            continue
        assert written, f"benchmarks/results/{name}.json is missing: run the {name} benchmark with --write-results"
        for link in written:
            assert (tmp_path / Path(link).name).stat().st_size > 10_000
            assert f"({link})" in results, f"RESULTS.md does not show {link}"
