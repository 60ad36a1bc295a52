"""`dbidx config`, `dbidx maintain` and the services line of `dbidx stats` (CliRunner), and the Table methods over
the table services (`service_settings`, `configure_services`, `maintain`)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from dbidx.cli import main
from dbidx.table import service_settings
from dbidx.table.service_settings import SERVICES_FILE, ServiceSettings
from dbidx.table.facade import Table

from tests.table.test_services import SMALL, Writer, live_data_files


def test_table_methods(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    assert table.service_settings() == ServiceSettings()
    assert table.configure_services(budget_files=5).budget_files == 5
    assert Table.open(table.uri).service_settings().budget_files == 5
    assert table.maintain().ran == []


def test_cli_config_maintain_and_stats(tmp_path: Path) -> None:
    w = Writer(tmp_path, "t", seed=5, after_commit=False, **SMALL)
    for _ in range(6):
        w.upsert()
    uri, runner = w.table.uri, CliRunner()
    result = runner.invoke(main, ["config", uri, "data_min_small_files=3", "clean=off", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["settings"]["clean"] is False
    assert Table.open(uri).service_settings().data_min_small_files == 3
    result = runner.invoke(main, ["config", uri])
    assert result.exit_code == 0, result.output
    assert "clean = False  (set)" in result.output
    for bad in ("clean=perhaps", "nope=1", "budget_files=0", "noequals"):
        result = runner.invoke(main, ["config", uri, bad])
        assert result.exit_code == 2, (bad, result.output)
    result = runner.invoke(main, ["stats", uri, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["services"]["data_min_small_files"] == 3
    result = runner.invoke(main, ["stats", uri])
    assert "data_min_small_files=3" in result.output and "services:" in result.output
    before = live_data_files(w.table)
    result = runner.invoke(main, ["maintain", uri, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["runs"] == 1 and report["ran"][0]["service"] == "data_compaction"
    assert live_data_files(Table.open(uri)) < before
    result = runner.invoke(main, ["maintain", uri, "--loop", "--interval", "0", "--max-runs", "2"])
    assert result.exit_code == 0, result.output
    assert "2 runs" in result.output and "nothing to do" in result.output
    w.table.io.write_atomic(SERVICES_FILE, b'{"format": 1, "settings": {"budget_seconds": -1}}')
    result = runner.invoke(main, ["config", uri])
    assert result.exit_code == 4 and "budget_seconds" in result.output
    assert service_settings.KEYS == tuple(ServiceSettings().to_dict())


def test_cli_config_sets_delta_table_properties(tmp_path: Path) -> None:
    w = Writer(tmp_path, "t", seed=6, after_commit=False)
    w.upsert()
    uri, runner = w.table.uri, CliRunner()
    result = runner.invoke(
        main,
        [
            "config",
            uri,
            "delta.logRetentionDuration=interval 2 days",
            "team.owner=ingest",
            "clean_interval=4",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["changed"] == ["clean_interval", "delta.logRetentionDuration", "team.owner"]
    assert payload["delta_properties"]["delta.logRetentionDuration"] == "interval 2 days"
    table = Table.open(uri)
    assert table.delta_properties()["team.owner"] == "ingest" and table.service_settings().clean_interval == 4
    result = runner.invoke(main, ["config", uri, "team.owner=default"])
    assert result.exit_code == 0, result.output
    assert "team.owner" not in Table.open(uri).delta_properties()
    assert "delta.logRetentionDuration = interval 2 days  (Delta table property)" in result.output
    for bad in ("delta.appendOnly=true", "delta.logRetentionDuration=soon", "delta.checkpointInterval=0"):
        result = runner.invoke(main, ["config", uri, bad])
        assert result.exit_code == 2, (bad, result.output)


def test_cli_clean_deletes_what_compactions_replaced(tmp_path: Path) -> None:
    w = Writer(tmp_path, "t", seed=8, after_commit=False)
    for _ in range(4):
        w.upsert()
    w.table.compact_data(min_files=2)
    replaced = [p for p, _ in w.table.data_view().replaced(w.table.timeline.latest_seq)]
    assert replaced
    runner = CliRunner()
    # At Delta's default retention they stay a week (Delta readers of the versions before the compaction read them),
    # and the clean says so.
    result = runner.invoke(main, ["clean", w.table.uri, "--retain", "0", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["instant"] is None and payload["deleted"] == [], payload
    assert payload["waiting"] >= len(replaced) and payload["retention"] == "interval 1 weeks"
    assert all(Path(w.table.io.path(p)).exists() for p in replaced)
    # With the table's retention short, --retain 0 takes them.
    result = runner.invoke(main, ["config", w.table.uri, "delta.deletedFileRetentionDuration=interval 1 milliseconds"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["clean", w.table.uri, "--retain", "0", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["instant"] and set(replaced) <= set(payload["deleted"]) and payload["waiting"] == 0
    assert not any(Path(w.table.io.path(p)).exists() for p in replaced)
    assert Table.open(w.table.uri).data_view().replaced(10**9) == []
    result = runner.invoke(main, ["clean", w.table.uri])
    assert result.exit_code == 0 and "nothing to delete" in result.output, result.output
