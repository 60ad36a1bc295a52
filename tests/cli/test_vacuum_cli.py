"""`dbidx vacuum URI [--retention-hours N] [--dry-run] [--json]` (CliRunner): the library's vacuum, its report as text
or one JSON object, bad retentions as exit 2; the state checked through the library."""

from __future__ import annotations

import json
import re
from pathlib import Path

from click.testing import CliRunner

from dbidx.cli import main
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table

from tests.table.test_vacuum import DAY_S, PLAIN, SPACED, Scene


KEYS = {"uri", "retention_hours", "dry_run", "deleted", "bytes", "protected", "seconds"}
DOC = Path(__file__).resolve().parents[2] / "docs" / "CLI.md"


def test_the_doc_lists_the_json_keys() -> None:
    section = DOC.read_text().split("## `dbidx vacuum", 1)[1]
    keys = section.split("`--json` keys:", 1)[1].split("\n\n", 1)[0]
    keys = re.sub(r"\[[^\]]*\]|\([^()]*\)", "", keys)  # nested lists and remarks
    assert set(re.findall(r"`([a-z_]+)`", keys)) == KEYS


def test_dry_run_then_vacuum_then_bad_retentions(tmp_path: Path) -> None:
    s = Scene(tmp_path)
    rows = s.rows()
    old = s.orphan(f"dt={SPACED}/part-crashed.parquet", 10 * DAY_S)
    young = s.orphan(f"dt={PLAIN}/part-running.parquet", 3600)
    uri, runner = s.table.uri, CliRunner()
    result = runner.invoke(main, ["vacuum", uri, "--retention-hours", "24", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report) == KEYS
    assert report["deleted"] == [old] and report["dry_run"] is True and report["retention_hours"] == 24
    assert report["uri"] == uri and report["bytes"] == (s.root / old).stat().st_size
    assert {old, young} <= s.files()
    result = runner.invoke(main, ["vacuum", uri, "--retention-hours", "24"])
    assert result.exit_code == 0, result.output
    assert f"deleted {old}" in result.output and "deleted 1 files" in result.output
    assert old not in s.files() and young in s.files()
    assert s.rows() == rows and verify_table(Table.open(uri)).ok
    result = runner.invoke(main, ["--json", "vacuum", uri])  # the default retention (7 days): the young one stays
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["deleted"] == [] and young in s.files()
    for bad in ("0", "-3", "1.5"):
        result = runner.invoke(main, ["vacuum", uri, "--retention-hours", bad, "--json"])
        assert result.exit_code == 2, (bad, result.output)
        assert "retention" in json.loads(result.stdout)["message"]
    assert young in s.files()


def test_a_missing_table_exits_3(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["vacuum", str(tmp_path / "nope"), "--json"])
    assert result.exit_code == 3, result.output
    assert json.loads(result.stdout)["error"] == "TableNotFoundError"
