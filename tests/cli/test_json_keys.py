"""docs/CLI.md lists each command's top-level `--json` keys: every command prints exactly those (state made through
the library first, so each command has something to report)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dbidx.cli import main
from dbidx.config import CacheConfig
from dbidx.table.facade import Table
from dbidx.spark_integration.local import upsert_arrow

DOC = Path(__file__).resolve().parents[2] / "docs" / "CLI.md"


def documented_keys() -> dict[str, set[str]]:
    """Command (its first words before an argument) -> the top-level keys its row of the table names."""
    rows = {}
    for line in DOC.read_text().splitlines():
        match = re.match(r"^\| `([a-z -]+?)(?: [A-Z].*?)?` \| (.*) \|$", line)
        if not match:
            continue
        keys = match.group(2)
        while re.search(r"\[[^\[\]]*\]|\([^()]*\)", keys):  # drop nested lists and remarks, innermost first
            keys = re.sub(r"\[[^\[\]]*\]|\([^()]*\)", "", keys)
        rows[match.group(1)] = set(re.findall(r"`([a-z_]+)`", keys))
    return rows


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("json")
    table = Table.create(str(root / "t"), num_shards=2)
    config = CacheConfig(base_path=str(root / "c"))
    for v in range(2):
        keys = [f"k{i}" for i in range(30)] + [f"n{v}"]
        upsert_arrow(
            pa.table({"id": keys, "dt": ["2025-01-09"] * len(keys), "v": [v] * len(keys)}),
            table,
            key="id",
            partition="dt",
            cache_config=config,
        )
    (root / "d" / "dt=2025-01-01").mkdir(parents=True)
    pq.write_table(pa.table({"id": ["a", "b"]}), root / "d" / "dt=2025-01-01" / "p.parquet")
    return {"t": table.uri, "d": str(root / "d"), "i": str(root / "i"), "c": str(root / "c")}


COMMANDS = {
    "init": ["init", "{i}"],
    "build-index": ["build-index", "{d}", "--key", "id"],
    "lookup": ["lookup", "{t}", "k1", "--partition", "dt=2025-01-09"],
    "commits": ["commits", "{t}"],
    "stats": ["stats", "{t}"],
    "verify": ["verify", "{t}"],
    "cache bootstrap": ["cache", "bootstrap", "{t}", "--days", "3", "--now", "2025-01-10"],
    "bootstrap": ["bootstrap", "{t}", "--days", "3", "--now", "2025-01-10"],
    "cache info": ["cache", "info"],
    "cache stats": ["cache", "stats"],
    "cache sync": ["cache", "sync", "{t}"],
    "cache verify": ["cache", "verify", "{t}"],
    "cache reap": ["cache", "reap"],
    "cache services": ["cache", "services"],
    "compact": ["compact", "{t}", "--data"],
    "rollback": ["rollback", "{t}", "--all-pending"],
    "repair": ["repair", "{t}"],
    "sync": ["sync", "{t}"],
    "upgrade": ["upgrade", "{t}"],
    "config": ["config", "{t}", "clean_interval=5"],
    "maintain": ["maintain", "{t}"],
    "vacuum": ["vacuum", "{t}", "--dry-run"],
    "clean": ["clean", "{t}", "--retain", "0"],
}


def test_the_doc_lists_every_command() -> None:
    assert set(documented_keys()) == set(COMMANDS) | {"demo"}


@pytest.mark.parametrize("command", list(COMMANDS))  # in order: bootstrap makes the caches the others report
def test_json_keys_are_the_documented_ones(tables: dict[str, str], command: str) -> None:
    args = [a.format(**tables) for a in COMMANDS[command]] + ["--json"]
    result = CliRunner().invoke(main, args, env={"DBIDX_CACHE_BASE_PATH": tables["c"]})
    assert result.exit_code == 0, result.output
    assert set(json.loads(result.stdout)) == documented_keys()[command]


def test_an_error_prints_error_and_message(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["stats", str(tmp_path / "nope"), "--json"])
    assert result.exit_code == 3
    assert set(json.loads(result.stdout)) == documented_keys().get("any command, on an error", {"error", "message"})
