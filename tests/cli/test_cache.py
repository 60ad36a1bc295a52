"""The `dbidx cache` commands (stats, sync, verify, reap), checked back through the library."""

from __future__ import annotations

import json
import os
import time

import pyarrow as pa
import pytest
from click.testing import CliRunner

from dbidx.cache.loading import load_from_snapshot

from dbidx.cache.dir_lock import lock_path
from dbidx.cache.inspect import find_cache_dirs, open_cache_dir
from dbidx.cache.reaper import sweep_abandoned
from dbidx.cli import main
from dbidx.data.key_columns import FileKeys
from dbidx.data.key_files import KEY_FILES_DIR, KeyFiles
from dbidx.storage.records import DataFileRecord

from tests.cache_helpers import DAY1, DAY2, make_table, open_cache


@pytest.fixture()
def setup(tmp_path):
    table = make_table(tmp_path)
    base = tmp_path / "caches"
    for shard in range(table.num_shards):
        with open_cache(table, shard, base) as cache:
            for p in (DAY1, DAY2):
                load_from_snapshot(cache, table, p, table.timeline.latest_seq)
            cache.set_watermark(table.timeline.latest_seq)
    return table, base


def run(args: list[str], code: int = 0) -> dict:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == code, result.output
    return json.loads(result.stdout) if "--json" in args else {}


def test_stats_of_every_cache_under_a_base_path(setup):
    table, base = setup
    report = run(["cache", "stats", "--cache-dir", str(base), "--json"])
    assert [c["shard"] for c in report["caches"]] == [0, 1]
    per_shard = [{p["partition"]: p["entries"] for p in c["partitions"]} for c in report["caches"]]
    assert sum(s[DAY1] for s in per_shard) == 300 and sum(s[DAY2] for s in per_shard) == 300
    assert all(p["state"] == "ready" and p["disk_bytes"] > 0 for c in report["caches"] for p in c["partitions"])
    text = CliRunner().invoke(main, ["cache", "stats", "--cache-dir", str(find_cache_dirs(base)[0])])
    assert text.exit_code == 0 and DAY1 in text.output and "watermark 3" in text.output


def test_sync_then_verify(setup):
    table, base = setup
    with table.new_commit() as w:
        w.insert(DAY1, [f"new-{i}" for i in range(50)], "fg-new")
    synced = run(["cache", "sync", table.uri, "--cache-dir", str(base), "--json"])
    assert sum(c["applied_entries"] for c in synced["caches"]) == 50
    verified = run(["cache", "verify", table.uri, "--cache-dir", str(base), "--json"])
    assert verified["ok"] is True
    parts = [p for c in verified["caches"] for p in c["partitions"]]
    assert parts and all(p["index_entries"] == p["cache_entries"] == p["mdt_entries"] for p in parts)  # 0.1's name
    # Damage one cache through the library: verify exits 1 and names the difference.
    path = find_cache_dirs(base)[0]
    with open_cache_dir(path) as cache:
        cache.apply(DAY2, ["ghost"], ["fg-ghost"], [False], synced_seq=cache.watermark)
    result = CliRunner().invoke(main, ["cache", "verify", table.uri, "--cache-dir", str(base)])
    assert result.exit_code == 1 and "ghost" in result.output and "MISMATCH" in result.output


def _touch_locks(base, seconds_from_now: float) -> None:
    """Set every shard cache's last-use time (the mtimes of its lock file and its directory)."""
    stamp = time.time() + seconds_from_now
    for path in find_cache_dirs(base):
        os.utime(lock_path(path), (stamp, stamp))
        os.utime(path, (stamp, stamp))


def test_reap_dry_run_then_for_real(setup):
    table, base = setup
    _touch_locks(base, 3600)  # opened "recently": not abandoned, so only their partitions' own TTL applies
    dry = run(["cache", "reap", "--cache-dir", str(base), "--ttl-hours", "0.0000001", "--dry-run", "--json"])
    assert dry["abandoned"] == [] and all(sorted(c["dropped"]) == [DAY1, DAY2] for c in dry["caches"])
    for path in find_cache_dirs(base):
        with open_cache_dir(path) as cache:
            assert len(cache.partitions()) == 2
    _touch_locks(base, 3600)
    run(["cache", "reap", "--cache-dir", str(base), "--ttl-hours", "0.0000001", "--json"])
    for path in find_cache_dirs(base):
        with open_cache_dir(path) as cache:
            assert cache.partitions() == {}


def test_reap_removes_abandoned_caches_but_never_a_held_one(setup):
    table, base = setup
    held, idle = find_cache_dirs(base)
    _touch_locks(base, -7200)  # nobody opened either for two hours
    with open_cache(table, 0, base):  # ... but shard 0 is open right now (its flock is held)
        _touch_locks(base, -7200)
        dry = sweep_abandoned(base, ttl_hours=1, dry_run=True)
        assert [a.path for a in dry] == [str(idle)] and idle.exists()
        assert dry[0].idle_hours >= 2 and dry[0].disk_bytes > 0
        assert [a.path for a in sweep_abandoned(base, ttl_hours=1)] == [str(idle)]
    assert find_cache_dirs(base) == [held] and not idle.exists() and not lock_path(idle).exists()
    with open_cache_dir(held) as cache:  # the held cache kept its partitions
        assert len(cache.partitions()) == 2
    # The CLI: a cache opened a minute ago stays; one idle past the TTL goes, and the table dir with it.
    assert run(["cache", "reap", "--cache-dir", str(base), "--ttl-hours", "1", "--json"])["abandoned"] == []
    _touch_locks(base, -7200)
    text = CliRunner().invoke(main, ["cache", "reap", "--cache-dir", str(base), "--ttl-hours", "1"])
    assert text.exit_code == 0, text.output
    assert f"{held}: removed abandoned cache" in text.output
    assert list(base.iterdir()) == []


def test_sweep_leaves_what_it_does_not_recognise(tmp_path):
    stranger = tmp_path / "base" / "some-table" / "shard-00000-of-00001"
    stranger.mkdir(parents=True)
    (stranger / "notes.txt").write_text("not a cache")
    os.utime(stranger, (0, 0))
    assert sweep_abandoned(tmp_path / "base", ttl_hours=1) == [] and (stranger / "notes.txt").exists()
    assert sweep_abandoned(tmp_path / "nowhere", ttl_hours=1) == []


def test_cache_command_errors(setup, tmp_path):
    table, base = setup
    result = CliRunner().invoke(main, ["cache", "stats", "--cache-dir", str(tmp_path / "nowhere")])
    assert result.exit_code == 6 and "does not exist" in result.output
    other = make_table(tmp_path / "other")
    result = CliRunner().invoke(main, ["cache", "verify", other.uri, "--cache-dir", str(find_cache_dirs(base)[0])])
    assert result.exit_code == 6 and "replicates table" in result.output
    result = CliRunner().invoke(main, ["stats"])
    assert result.exit_code == 2 and "Missing argument 'URI'" in result.output


def test_reap_removes_key_files_unused_for_the_ttl(setup):
    _table, base = setup
    table_dir = find_cache_dirs(base)[0].parent
    store = KeyFiles(table_dir / KEY_FILES_DIR, 1 << 30)
    records = [
        DataFileRecord(path=f"d/{n}.parquet", partition="d", file_group="0", rows=3, size=1, checksum=f"xxh64:{n:016x}")
        for n in range(2)
    ]
    for rec in records:
        store.save(rec, FileKeys.of(pa.array(["a", "b", "c"])))
    os.utime(store.path_of(records[0]), (time.time() - 7200,) * 2)
    assert sweep_abandoned(base, ttl_hours=1) == []  # the caches were opened just now: they stay
    assert [p.name for p in store.root.iterdir()] == [store.path_of(records[1]).name]
    _touch_locks(base, -7200)
    os.utime(store.path_of(records[1]), (time.time() - 7200,) * 2)
    assert len(sweep_abandoned(base, ttl_hours=1)) == 2
    assert list(base.iterdir()) == []  # key files, caches and the table directory: all gone
