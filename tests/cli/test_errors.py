"""Every CLI command, given bad arguments, answers with one line (or one JSON object with --json) and the
documented exit code, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dbidx.cli import main
from dbidx.table.facade import Table

TABLE_COMMANDS = [
    ["init", "{t}"],
    ["build-index", "{t}", "--key", "id"],
    ["lookup", "{t}", "k1", "--partition", "dt=1"],
    ["commits", "{t}"],
    ["stats", "{t}"],
    ["cache", "bootstrap", "{t}", "--cache-dir", "{c}"],
    ["cache", "sync", "{t}", "--cache-dir", "{c}"],
    ["verify", "{t}"],
    ["cache", "verify", "{t}", "--cache-dir", "{c}"],
    ["compact", "{t}"],
    ["rollback", "{t}", "--all-pending"],
]
CACHE_COMMANDS = [
    ["cache", "stats", "--cache-dir", "{c}"],
    ["cache", "reap", "--cache-dir", "{c}"],
    ["cache", "sync", "{t}", "--cache-dir", "{c}"],
    ["cache", "verify", "{t}", "--cache-dir", "{c}"],
]


def run(args: list[str]) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.stdout, result.output


def check(args: list[str], codes: set[int]) -> None:
    code, _stdout, output = run(args)
    assert code in codes, (args, code, output)
    assert "Traceback" not in output, (args, output)
    assert output.strip().startswith(("Error:", "Usage:")) or "Error:" in output, (args, output)
    code, stdout, output = run(args + ["--json"])
    assert code in codes, (args, code, output)
    payload = json.loads(stdout)  # exactly one JSON object on stdout
    assert set(payload) == {"error", "message"} and payload["message"], (args, payload)


@pytest.mark.parametrize("case", ["a file", "a missing table", "a bad URI scheme"])
@pytest.mark.parametrize("command", TABLE_COMMANDS, ids=lambda c: " ".join(c[:3]))
def test_table_commands_with_a_bad_table(tmp_path: Path, command: list[str], case: str) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a table")
    table = {"a file": str(a_file), "a missing table": str(tmp_path / "nope"), "a bad URI scheme": "nope://x/y"}[case]
    if case == "a missing table" and command[0] in ("init", "build-index"):
        pytest.skip("init and build-index create the table")
    args = [part.format(t=table, c=str(tmp_path / "cache")) for part in command]
    check(args, {2} if case != "a missing table" else {3})


@pytest.mark.parametrize("case", ["a file", "a missing dir"])
@pytest.mark.parametrize("command", CACHE_COMMANDS, ids=lambda c: " ".join(c[:3]))
def test_cache_commands_with_a_bad_cache_dir(tmp_path: Path, command: list[str], case: str) -> None:
    table = Table.create(str(tmp_path / "t"))
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a cache")
    cache = str(a_file) if case == "a file" else str(tmp_path / "nope")
    check([part.format(t=table.uri, c=cache) for part in command], {2, 6})


def test_usage_errors_and_unknown_commands(tmp_path: Path) -> None:
    check(["stats"], {2})
    check(["lookup", "k1"], {2})
    check(["init", str(tmp_path / "t"), "--num-shards", "zero"], {2})
    code, _out, output = run(["no-such-command"])
    assert code == 2 and "No such command" in output


def test_a_bug_says_please_report_and_shows_its_traceback_only_with_verbose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = Table.create(str(tmp_path / "t"))

    def broken(*_args, **_kwargs):
        raise KeyError("surprise")

    monkeypatch.setattr(Table, "partitions", broken)
    code, _out, output = run(["stats", table.uri])
    assert code == 1 and "please report" in output and "Traceback" not in output
    code, _out, output = run(["--verbose", "stats", table.uri])
    assert code == 1 and "Traceback" in output and "surprise" in output
    code, stdout, _output = run(["stats", table.uri, "--json"])
    assert code == 1 and json.loads(stdout)["error"] == "KeyError"
