"""The CLI through click's CliRunner: exit codes, text and --json output, state checked through the library."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dbidx import __version__
from dbidx.cli import main
from dbidx.table.facade import Table


@pytest.fixture()
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture()
def dataset(tmp_path) -> Path:
    root = tmp_path / "data"
    for day in ("2025-01-01", "2025-01-02"):
        (root / f"dt={day}").mkdir(parents=True)
        keys = [f"{day}-{i}" for i in range(200)]
        pq.write_table(pa.table({"id": keys}), root / f"dt={day}" / "part-0.parquet")
    return root


def test_help_and_version(runner):
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == 0, result.output
    for command in (
        "build-index",
        "lookup",
        "stats",
        "commits",
        "compact",
        "demo",
        "init",
        "rollback",
        "cache",
        "verify",
        "upgrade",
    ):
        assert command in result.output
    result = runner.invoke(main, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output


def test_build_index_lookup_stats_compact(runner, dataset):
    result = runner.invoke(
        main, ["build-index", str(dataset), "--key", "id", "--partition-col", "dt", "--num-shards", "3", "--json"]
    )
    assert result.exit_code == 0, result.output
    built = json.loads(result.output)
    assert built["keys"] == 400 and built["partitions"] == 2
    table = Table.open(str(dataset))
    assert table.num_shards == 3 and table.snapshot("dt=2025-01-01").num_rows == 200

    result = runner.invoke(
        main, ["lookup", str(dataset), "2025-01-01-7", "brand-new", "--partition", "dt=2025-01-01", "--json"]
    )
    assert result.exit_code == 0, result.output
    found = json.loads(result.output)
    assert [r["key"] for r in found["found"]] == ["2025-01-01-7"] and found["missing"] == ["brand-new"]
    assert found["found"][0]["file_group"] == "part-0"

    result = runner.invoke(main, ["lookup", str(dataset), "brand-new", "--partition", "dt=2025-01-01"])
    assert result.exit_code == 1 and "new key" in result.output

    result = runner.invoke(main, ["stats", str(dataset), "--json"])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.output)
    assert stats["live_keys"] == 400 and {p["partition"] for p in stats["partitions"]} == {
        "dt=2025-01-01",
        "dt=2025-01-02",
    }
    result = runner.invoke(main, ["stats", str(dataset)])
    assert result.exit_code == 0 and "400 live keys" in result.output

    with table.new_commit() as w:
        w.delete("dt=2025-01-01", ["2025-01-01-1"])
    result = runner.invoke(main, ["compact", str(dataset), "--retain", "0", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["groups"] >= 1
    assert Table.open(str(dataset)).snapshot("dt=2025-01-01").num_rows == 199


def test_errors_exit_non_zero_with_a_clear_message(runner, tmp_path, dataset):
    result = runner.invoke(main, ["stats", str(tmp_path / "nowhere")])
    assert result.exit_code == 3
    assert "no dbidx table" in result.output and "Traceback" not in result.output
    result = runner.invoke(main, ["stats", str(tmp_path / "nowhere"), "--json"])
    assert result.exit_code == 3
    assert json.loads(result.output.splitlines()[0])["error"] == "TableNotFoundError"
    result = runner.invoke(main, ["build-index", str(dataset), "--key", "missing_col"])
    assert result.exit_code == 2 and "missing_col" in result.output
    result = runner.invoke(main, ["lookup", str(dataset), "k", "--partition", "../up"])
    assert result.exit_code == 2 and "'../up'" in result.output
    result = runner.invoke(main, ["init", str(dataset)])
    assert result.exit_code == 3 and "already exists" in result.output


def test_init_and_rollback_of_a_crashed_writer(runner, tmp_path):
    uri = str(tmp_path / "t")
    result = runner.invoke(main, ["init", uri, "--num-shards", "2", "--global-index"])
    assert result.exit_code == 0, result.output
    table = Table.open(uri)
    assert table.global_index
    crashed = table.new_commit()  # started and never finished (by this very process: provably alive)
    result = runner.invoke(main, ["commits", uri, "--json"])
    pending = json.loads(result.output)["pending"]
    assert [(p["instant"], p["action"], p["alive"]) for p in pending] == [(crashed.instant, "commit", True)]
    result = runner.invoke(main, ["rollback", uri, "--all-pending", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == {"rolled_back": [], "published": [], "skipped_alive": [crashed.instant]}
    result = runner.invoke(main, ["rollback", uri, "--all-pending", "--force", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["rolled_back"] == [crashed.instant]
    assert Table.open(uri).timeline.pending() == []


@pytest.mark.spark
@pytest.mark.slow
def test_demo_runs(tmp_path):
    """The README's main command, in its own process (it starts and restarts its own Spark application)."""
    workdir = tmp_path / "demo"
    # The smallest sizes the demo allows (small tables get fewer deletes and late updates than asked).
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dbidx.cli",
            "demo",
            "--dir",
            str(workdir),
            "--keys",
            "100",
            "--days",
            "2",
            "--batches",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    # The narrative (on stderr with --json) starts before Spark does and explains itself; Spark's log stays at
    # ERROR from the JVM's first line.
    narrative = result.stderr.splitlines()
    assert narrative[0].startswith("dbidx demo: table") and "starting Spark" in result.stderr
    assert "'catch-up' =" in result.stderr and "'on-demand' =" in result.stderr and "footprint" in result.stderr
    assert not [line for line in narrative if " WARN " in line], result.stderr[-3000:]  # (the JVM's own
    # "WARNING: Using incubator modules" line is printed by java itself, before any logger exists)
    assert report["rows_checked"] == report["live_keys"] > 100
    assert report["index_bytes_per_entry"] == report["mdt_bytes_per_entry"] > 0  # 0.1's name, kept for 0.2
    assert [b["via"] for b in report["batches"]] == ["batch", "streaming", "batch"]
    assert report["batches"][0]["inserts"] == 100 and all(b["updates"] > 0 for b in report["batches"][1:])
    # The same table through the Delta log: polars, duckdb and Delta Spark (dev dependencies; Delta Spark in a
    # process of its own) see exactly the checked rows.
    checked = report["rows_checked"]
    assert report["other_readers"] == {"polars": checked, "duckdb": checked, "Delta Spark": checked}
    assert "open table: polars reads the same" in result.stderr and "open table: duckdb" in result.stderr
    assert "open table: Delta Spark reads the same" in result.stderr
    # It ends with a picture: batch time and cache hit rate per batch (matplotlib is a dev dependency).
    assert Path(report["chart"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "chart: " in result.stderr
    runner = CliRunner()
    history = runner.invoke(main, ["commits", str(workdir / "table"), "--json"])
    assert history.exit_code == 0, history.output
    upserts = [c for c in json.loads(history.output)["commits"] if c["action"] == "commit"]
    assert [c["metrics"]["rows"] for c in reversed(upserts)] == [b["rows"] for b in report["batches"]]
    assert all(c["metrics"]["seconds"] > 0 for c in upserts)  # measured before it is stored, not 0.0
    text = runner.invoke(main, ["commits", str(workdir / "table")]).output
    assert "hit rate" in text and "of keys not in the index: nothing to delete" in text
    # The demo's caches are left on disk, behind the final compaction + clean: verify says so, sync reloads what
    # was cleaned, and then the caches verify against the index.
    table = Table.open(str(workdir / "table"))
    behind = runner.invoke(main, ["cache", "verify", table.uri, "--cache-dir", str(workdir / "_cache")])
    assert behind.exit_code != 0 and "dbidx cache sync" in behind.output
    synced = runner.invoke(main, ["cache", "sync", table.uri, "--cache-dir", str(workdir / "_cache"), "--json"])
    assert synced.exit_code == 0, synced.output
    assert all(c["reloaded_partitions"] for c in json.loads(synced.output)["caches"])
    verified = runner.invoke(main, ["--json", "cache", "verify", table.uri, "--cache-dir", str(workdir / "_cache")])
    assert verified.exit_code == 0, verified.output
    assert len(json.loads(verified.output)["caches"]) == table.num_shards


def test_demo_refuses_a_directory_it_did_not_create(tmp_path):
    notes = tmp_path / "mine" / "notes.txt"
    notes.parent.mkdir()
    notes.write_text("keep me")
    result = CliRunner().invoke(
        main, ["demo", "--dir", str(notes.parent), "--keys", "100", "--days", "2", "--batches", "2", "--json"]
    )
    assert result.exit_code == 2, result.output
    assert "not created by `dbidx demo`" in json.loads(result.stdout)["message"]
    assert notes.read_text() == "keep me"
    too_small = CliRunner().invoke(main, ["demo", "--dir", str(tmp_path / "new"), "--keys", "99"])
    assert too_small.exit_code == 2 and "--keys >= 100" in too_small.output


def test_repair_writes_a_missing_delta_version(runner, dataset):
    result = runner.invoke(main, ["build-index", str(dataset), "--key", "id", "--partition-col", "dt"])
    assert result.exit_code == 0, result.output
    version = dataset / "_delta_log" / f"{1:020d}.json"
    written = version.read_bytes()
    version.unlink()  # a crash between the build-index completion and its Delta version
    result = runner.invoke(main, ["repair", str(dataset), "--json"])
    assert result.exit_code == 0, result.output
    nothing = {"settled_files": 0, "timeline_files": 0, "temp_files": 0, "cleaned_files": 0, "rolled_back": 0}
    assert json.loads(result.output) == {
        "versions_written": 1,
        "versions_absorbed": 0,
        "version": 1,
        "leftovers_deleted": 0,
        "swept": nothing,
        "rolled_back": [],
        "out_of_range_removed": [],
    }
    assert version.read_bytes() == written
    result = runner.invoke(main, ["repair", str(dataset)])
    assert result.exit_code == 0 and "wrote 0 missing Delta version(s)" in result.output
    from deltalake import DeltaTable, QueryBuilder

    rows = QueryBuilder().register("t", DeltaTable(str(dataset))).execute("select count(*) as n from t").read_all()
    assert pa.table(rows).column("n").to_pylist() == [400]
    assert Table.open(str(dataset)).latest().seq == 1
