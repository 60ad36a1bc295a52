"""`dbidx bootstrap` (the spelling the mission names) and `dbidx cache bootstrap`, the same command, through click's
CliRunner, checked back through the library; and its error exits."""

from __future__ import annotations

import json

from click.testing import CliRunner

from dbidx.cache.registry import table_cache_dir_name
from dbidx.cache.verify import verify
from dbidx.cli import main

from tests.cache_helpers import open_cache
from tests.bootstrap.test_loading import DAYS, make_daily_table


def invoke(args: list[str]):
    return CliRunner().invoke(main, args)


def test_bootstrap_json_reports_what_it_loaded(tmp_path):
    table = make_daily_table(tmp_path, keys_per_day=100, num_shards=2)
    base = tmp_path / "caches"
    result = invoke(
        [
            "cache",
            "bootstrap",
            table.uri,
            "--days",
            "2",
            "--now",
            "2025-01-10",
            "--all-shards",
            "--cache-dir",
            str(base),
            "--json",
        ]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["partitions_loaded"] == 3 * 2 and report["entries"] == 300
    assert report["seconds"] > 0 and report["disk_bytes"] > 0 and report["entries_per_second"] > 0
    assert sorted(s["partition"] for s in report["selection"]["selected"]) == DAYS[-2:] + ["region=eu"]
    for shard in range(2):
        with open_cache(table, shard, base) as cache:
            assert sorted(cache.partitions()) == DAYS[-2:] + ["region=eu"]
            assert verify(cache, table).ok


def test_bootstrap_text_output_and_one_shard(tmp_path):
    table = make_daily_table(tmp_path, keys_per_day=100, num_shards=2)
    base = tmp_path / "caches"
    result = invoke(
        [
            "cache",
            "bootstrap",
            table.uri,
            "--days",
            "1",
            "--now",
            "2025-01-10",
            "--shard",
            "1",
            "--num-shards",
            "2",
            "--cache-dir",
            str(base),
            "--partition-pattern",
            "dt=%Y-%m-%d",
        ]
    )
    assert result.exit_code == 0, result.output
    assert "bootstrapped 1 shard(s)" in result.output and "entries/s" in result.output
    with open_cache(table, 1, base) as cache:
        assert "dt=2025-01-10" in cache.partitions()


def test_bootstrap_error_exits(tmp_path):
    table = make_daily_table(tmp_path, keys_per_day=20, num_shards=2)
    base = tmp_path / "caches"
    missing = invoke(["cache", "bootstrap", str(tmp_path / "nope"), "--days", "1", "--json"])
    assert missing.exit_code == 3 and "no dbidx table" in missing.output
    out_of_range = invoke(["cache", "bootstrap", table.uri, "--shard", "2", "--cache-dir", str(base)])
    assert out_of_range.exit_code == 2 and "out of range 0..1" in out_of_range.output
    wrong_count = invoke(
        ["cache", "bootstrap", table.uri, "--shard", "0", "--num-shards", "4", "--cache-dir", str(base)]
    )
    assert wrong_count.exit_code == 2 and "has 2 shards" in wrong_count.output
    both = invoke(["cache", "bootstrap", table.uri, "--shard", "0", "--all-shards", "--cache-dir", str(base)])
    assert both.exit_code == 2
    bad_now = invoke(["cache", "bootstrap", table.uri, "--now", "someday", "--cache-dir", str(base)])
    assert bad_now.exit_code == 2 and "--now" in bad_now.output
    bad_pattern = invoke(["cache", "bootstrap", table.uri, "--partition-pattern", "dt=%Y", "--cache-dir", str(base)])
    assert bad_pattern.exit_code == 2 and "partition pattern" in bad_pattern.output
    # a cache dir that belongs to another table
    assert invoke(["cache", "bootstrap", table.uri, "--days", "1", "--cache-dir", str(base)]).exit_code == 0
    other = make_daily_table(tmp_path / "other", keys_per_day=20, num_shards=2)
    foreign = invoke(
        ["cache", "bootstrap", other.uri, "--cache-dir", str(base / table_cache_dir_name(table)), "--json"]
    )
    assert foreign.exit_code == 6, foreign.output
    assert json.loads(foreign.stdout)["error"] == "CacheMismatchError"


def test_top_level_bootstrap_as_the_mission_spells_it(tmp_path):
    """`dbidx bootstrap URI --days 7`: the last 7 days (and the non-date partition) land in every shard's cache."""
    table = make_daily_table(tmp_path, keys_per_day=100, num_shards=2)
    base = tmp_path / "caches"
    result = invoke(["bootstrap", table.uri, "--days", "7", "--now", "2025-01-10", "--cache-dir", str(base)])
    assert result.exit_code == 0, result.output
    assert "bootstrapped 2 shard(s)" in result.output and "(7 days)" in result.output
    window = DAYS[-7:] + ["region=eu"]
    for shard in range(2):
        with open_cache(table, shard, base) as cache:
            assert sorted(cache.partitions()) == window
            assert verify(cache, table).ok
    # `dbidx cache bootstrap` still works, over the same caches: everything is already ready
    again = invoke(
        ["cache", "bootstrap", table.uri, "--days", "7", "--now", "2025-01-10", "--cache-dir", str(base), "--json"]
    )
    assert again.exit_code == 0, again.output
    report = json.loads(again.stdout)
    assert report["partitions_loaded"] == 0 and report["days"] == 7
    assert all(sorted(s["already_ready"]) == window for s in report["shards"])


def test_both_spellings_print_the_same_json_keys(tmp_path):
    table = make_daily_table(tmp_path, keys_per_day=20, num_shards=2)
    options = ["--days", "3", "--now", "2025-01-10", "--json"]
    top = invoke(["bootstrap", table.uri, *options, "--cache-dir", str(tmp_path / "a")])
    nested = invoke(["cache", "bootstrap", table.uri, *options, "--cache-dir", str(tmp_path / "b")])
    assert top.exit_code == 0, top.output
    assert nested.exit_code == 0, nested.output
    top_report, nested_report = json.loads(top.stdout), json.loads(nested.stdout)
    assert set(top_report) == set(nested_report)
    assert top_report["partitions_loaded"] == nested_report["partitions_loaded"] == 4 * 2


def test_bootstrap_is_a_listed_top_level_command_and_the_cache_one():
    listing = invoke(["--help"])
    assert listing.exit_code == 0, listing.output
    assert any(line.split()[:1] == ["bootstrap"] for line in listing.output.splitlines())
    assert main.commands["bootstrap"] is main.commands["cache"].commands["bootstrap"]  # every flag identical
    assert not main.commands["bootstrap"].hidden
    usage = invoke(["bootstrap", "--help"])
    assert usage.exit_code == 0 and "--days" in usage.output and "--all-shards" in usage.output
