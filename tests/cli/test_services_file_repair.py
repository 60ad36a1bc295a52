"""A bad value in `.dbidx/services.json` (issue 63 item 6): the documented `dbidx config URI KEY=default` repairs it,
the errors name the file and the fix, and `stats` still shows the table (saying why no service runs)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from dbidx.cli import main
from dbidx.table.facade import Table
from dbidx.table.service_settings import SERVICES_FILE


def _table(tmp_path: Path) -> Table:
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    runner = CliRunner()
    assert runner.invoke(main, ["config", table.uri, "data_min_small_files=3"]).exit_code == 0
    path = Path(table.io.path(SERVICES_FILE))
    data = json.loads(path.read_text())
    data["settings"]["budget_seconds"] = -5  # out of range: what a hand edit or a bad tool leaves
    path.write_text(json.dumps(data))
    return table


def test_config_key_default_repairs_a_bad_value_and_keeps_the_other_keys(tmp_path: Path) -> None:
    table = _table(tmp_path)
    runner = CliRunner()
    stats = runner.invoke(main, ["stats", table.uri, "--json"])
    assert stats.exit_code == 0, stats.output
    report = json.loads(stats.output)
    assert report["services"] is None and "budget_seconds=default" in report["services_error"]
    assert SERVICES_FILE in report["services_error"] or "services.json" in report["services_error"]
    text = runner.invoke(main, ["stats", table.uri])
    assert text.exit_code == 0 and "the table services do not run" in text.output
    maintain = runner.invoke(main, ["maintain", table.uri])
    assert maintain.exit_code == 4 and "budget_seconds=default" in maintain.output, maintain.output
    fixed = runner.invoke(main, ["config", table.uri, "budget_seconds=default", "--json"])
    assert fixed.exit_code == 0, fixed.output
    settings = json.loads(fixed.output)["settings"]
    assert settings["data_min_small_files"] == 3  # the other key the user set is kept
    assert Table.open(table.uri).service_settings().data_min_small_files == 3
    assert runner.invoke(main, ["maintain", table.uri]).exit_code == 0


def test_another_bad_key_still_refuses_a_change_naming_that_key(tmp_path: Path) -> None:
    table = _table(tmp_path)
    result = CliRunner().invoke(main, ["config", table.uri, "data_min_small_files=4"])
    assert result.exit_code == 4 and "budget_seconds" in result.output, result.output


def test_a_file_that_is_not_json_names_the_way_back(tmp_path: Path) -> None:
    table = _table(tmp_path)
    Path(table.io.path(SERVICES_FILE)).write_text("{not json")
    result = CliRunner().invoke(main, ["config", table.uri, "budget_seconds=default"])
    assert result.exit_code == 4 and "delete the file" in result.output, result.output
