"""Time-bounded, global and on-demand loading against a real index and real RocksDB caches."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dbidx.bootstrap.on_demand import OnDemandLoader
from dbidx.bootstrap.time_bounded import INFO_NAME, bootstrap
from dbidx.cache.codec import global_location
from dbidx.cache.record_cache import GLOBAL_PARTITION, RecordIndexCache
from dbidx.cache.registry import table_cache_dir_name
from dbidx.cache.verify import verify
from dbidx.config import CacheConfig
from dbidx.errors import CacheMismatchError, InvalidInputError
from dbidx.table.facade import Table

from tests.cache_helpers import open_cache, random_uuids

NOW = "2025-01-10"
DAYS = [f"dt=2025-01-{d:02d}" for d in range(1, 11)]


def make_daily_table(root: Path, keys_per_day: int = 400, num_shards: int = 3, global_index: bool = False) -> Table:
    """Ten daily partitions (2025-01-01 .. 10) plus a non-date partition, random UUID keys."""
    table = Table.create(str(root / "table"), num_shards=num_shards, row_group_size=128, global_index=global_index)
    for partition in DAYS + ["region=eu"]:
        with table.new_commit() as w:
            w.insert(
                partition, random_uuids(keys_per_day), [f"{i % 4:08d}-{partition[-2:]}" for i in range(keys_per_day)]
            )
    return table


def shard_truth(table: Table, partition: str | None, shard: int) -> dict[str, str]:
    """Key -> location of one shard, computed from the whole partition and the hash (not the shard read path)."""
    snap = table.snapshot(partition)
    keys = snap.column("key").to_pylist()
    mine = table.shard_of(keys) == shard
    if table.global_index:
        locs = [
            global_location(p, fg)
            for p, fg in zip(snap.column("partition").to_pylist(), snap.column("file_group").to_pylist())
        ]
    else:
        locs = snap.column("file_group").to_pylist()
    return {k: loc for k, loc, m in zip(keys, locs, mine) if m}


@pytest.fixture()
def table(tmp_path):
    return make_daily_table(tmp_path)


def test_bootstrap_loads_the_window_and_each_shard_exactly_its_keys(table, tmp_path):
    base = tmp_path / "caches"
    result = bootstrap(table, days=3, now=NOW, base_path=base, config=CacheConfig())
    # region=eu has no date in its path and was committed by the wall clock, after 2025-01-10: it counts as recent
    window = DAYS[-3:] + ["region=eu"]
    assert sorted(s["partition"] for s in result.selection["selected"]) == window
    assert result.partitions_loaded == 4 * table.num_shards
    assert result.entries == 4 * 400 and result.disk_bytes > 0
    for shard in range(table.num_shards):
        with open_cache(table, shard, base) as cache:
            assert sorted(cache.partitions()) == window
            for partition in window:
                assert dict(cache.items(partition)) == shard_truth(table, partition, shard)
            info = cache.info(INFO_NAME)
            assert info["oldest_partition"] == "dt=2025-01-08" and info["first_day"] == "2025-01-08"
            assert info["loaded_seq"] == table.timeline.latest_seq and info["days"] == 3
            assert cache.watermark == table.timeline.latest_seq


def test_a_single_shard_bootstrap_touches_no_other_shard(table, tmp_path):
    base = tmp_path / "caches"
    bootstrap(table, days=2, shards=[1], now=NOW, base_path=base)
    assert [
        p.name
        for p in (base / table_cache_dir_name(table)).iterdir()
        if p.name.startswith("shard-") and p.is_dir() and not p.name.endswith(".tmp")
    ] == ["shard-00001-of-00003"]


def test_warm_restart_loads_nothing_and_only_catches_up(table, tmp_path):
    base = tmp_path / "caches"
    bootstrap(table, days=3, now=NOW, base_path=base)
    new_keys = random_uuids(50)
    with table.new_commit() as w:
        w.insert(DAYS[-1], new_keys, "00000009-new")
        w.delete(DAYS[-2], table.snapshot(DAYS[-2]).column("key").to_pylist()[:7])
    again = bootstrap(table, days=3, now=NOW, base_path=base)
    assert again.partitions_loaded == 0 and again.entries == 0
    assert sum(s.caught_up_entries for s in again.shards) == 57
    for shard in range(table.num_shards):
        with open_cache(table, shard, base) as cache:
            assert verify(cache, table).ok
            assert dict(cache.items(DAYS[-1])) == shard_truth(table, DAYS[-1], shard)


def test_a_wider_window_later_loads_only_the_missing_days(table, tmp_path):
    base = tmp_path / "caches"
    bootstrap(table, days=2, now=NOW, base_path=base)
    wider = bootstrap(table, days=4, now=NOW, base_path=base)
    assert sorted({p for s in wider.shards for p in s.loaded}) == DAYS[-4:-2]
    assert all(sorted(s.already_ready) == DAYS[-2:] + ["region=eu"] for s in wider.shards)


@pytest.mark.parametrize("parallelism", ["serial", "threads", "processes"])
def test_every_parallelism_gives_the_same_content(table, tmp_path, parallelism):
    base = tmp_path / parallelism
    result = bootstrap(table, days=4, now=NOW, base_path=base, parallelism=parallelism, workers=2)
    assert result.parallelism == parallelism
    for shard in range(table.num_shards):
        with open_cache(table, shard, base) as cache:
            assert verify(cache, table).ok
            assert sum(s.entries for s in cache.partitions().values()) == len(
                [k for p in DAYS[-4:] + ["region=eu"] for k in shard_truth(table, p, shard)]
            )


def test_progress_reports_every_slice_and_ends_at_the_total(table, tmp_path):
    events: list[tuple[int, int, str]] = []
    result = bootstrap(
        table,
        days=2,
        now=NOW,
        base_path=tmp_path / "c",
        parallelism="threads",
        progress=lambda done, total, step, rows: events.append((done, total, step)),
    )
    assert len(events) == result.partitions_loaded
    assert events[-1][0] == result.entries and all(e[0] <= e[1] for e in events)
    assert [e[0] for e in events] == sorted(e[0] for e in events)


def test_global_bootstrap_loads_the_shards_slice_of_the_whole_index(tmp_path):
    table = make_daily_table(tmp_path, keys_per_day=200, global_index=True)
    base = tmp_path / "caches"
    result = bootstrap(table, days=1, now=NOW, base_path=base)
    assert result.entries == 11 * 200  # the time window does not apply: keys are unique table-wide
    for shard in range(table.num_shards):
        with open_cache(table, shard, base) as cache:
            assert list(cache.partitions()) == [GLOBAL_PARTITION]
            assert dict(cache.items(GLOBAL_PARTITION)) == shard_truth(table, None, shard)


def test_bad_shards_and_foreign_cache_dirs_are_refused(table, tmp_path):
    base = tmp_path / "caches"
    with pytest.raises(InvalidInputError, match="out of range 0..2"):
        bootstrap(table, days=1, shards=[3], base_path=base)
    bootstrap(table, days=1, shards=[0], now=NOW, base_path=base)
    open_cache(table, 0, base).close()
    shard_dir = RecordIndexCache.for_table(table, 0).identity.shard_dir(base)
    with pytest.raises(CacheMismatchError, match="cache directory of one shard"):
        bootstrap(table, days=1, base_path=shard_dir)
    other = make_daily_table(tmp_path / "other", keys_per_day=10)
    with pytest.raises(CacheMismatchError, match=f"table {table.props.table_id}"):
        bootstrap(other, days=1, base_path=base / table_cache_dir_name(table))


# ---- on-demand ---------------------------------------------------------------------------------------------


def test_cold_partitions_of_a_batch_load_concurrently(table, tmp_path):
    cold = DAYS[:5]
    barrier = threading.Barrier(len(cold), timeout=20)  # breaks unless all five builds are running at once
    with open_cache(table, 0, tmp_path / "c") as cache:
        loader = OnDemandLoader(cache, table, workers=8, on_build_start=lambda _p: barrier.wait())
        report = loader.ensure_loaded(cold + [DAYS[0]])
        loader.close()
        assert sorted(report.loaded) == cold and report.joined == []
        for partition in cold:
            assert dict(cache.items(partition)) == shard_truth(table, partition, 0)
        assert cache.metrics.on_demand_loads == 5 and cache.metrics.stall_seconds > 0
        assert all(cache.metrics.per_partition[p].on_demand_loads == 1 for p in cold)
        assert report.stall_seconds < sum(report.load_seconds.values()) + 5  # waited once, not five times


def test_two_callers_asking_for_one_cold_partition_trigger_one_load(table, tmp_path):
    started = threading.Event()
    joined = threading.Event()
    release = threading.Event()
    builds: list[str] = []

    def slow_start(partition: str) -> None:
        builds.append(partition)
        started.set()
        release.wait(20)

    with open_cache(table, 1, tmp_path / "c") as cache:
        loader = OnDemandLoader(cache, table, on_build_start=slow_start, on_join=lambda p: joined.set())
        reports = []
        first = threading.Thread(target=lambda: reports.append(loader.ensure_loaded([DAYS[2]])))
        first.start()
        assert started.wait(20)
        second = threading.Thread(target=lambda: reports.append(loader.ensure_loaded([DAYS[2]])))
        second.start()
        assert joined.wait(20)  # the second caller found the first load in flight and waits on it
        release.set()
        first.join(20)
        second.join(20)
        loader.close()
        assert builds == [DAYS[2]]
        assert sorted((r.loaded, r.joined) for r in reports) == [([], [DAYS[2]]), ([DAYS[2]], [])]
        assert dict(cache.items(DAYS[2])) == shard_truth(table, DAYS[2], 1)


def test_ensure_loaded_is_a_no_op_for_ready_partitions(table, tmp_path):
    with open_cache(table, 2, tmp_path / "c") as cache, OnDemandLoader(cache, table) as loader:
        first = loader.ensure_loaded([DAYS[4], DAYS[4]])
        assert first.loaded == [DAYS[4]]
        second = loader.ensure_loaded([DAYS[4]])
        assert second.loaded == [] and second.stall_seconds == 0
        assert cache.metrics.on_demand_loads == 1


def test_an_on_demand_load_of_a_missing_partition_is_ready_and_empty(table, tmp_path):
    with open_cache(table, 0, tmp_path / "c") as cache, OnDemandLoader(cache, table) as loader:
        loader.ensure_loaded(["dt=2030-01-01"])
        assert cache.lookup("dt=2030-01-01", ["nope"]) == [None]


# ---- crash safety ----------------------------------------------------------------------------------------

_KILL_SCRIPT = """
import sys, time
from dbidx.bootstrap.time_bounded import bootstrap
from dbidx.table.facade import Table

def progress(done, total, step, rows):
    print("LOADED", step, flush=True)

if __name__ == "__main__":
    bootstrap(Table.open(sys.argv[1]), days=10, now="2025-01-10", base_path=sys.argv[2], parallelism="serial",
              progress=progress, flush_interval_s=0)
    print("DONE", flush=True)
"""


@pytest.mark.slow
def test_a_bootstrap_killed_midway_leaves_no_partial_partition_and_the_next_one_finishes(tmp_path):
    table = make_daily_table(tmp_path, keys_per_day=30_000, num_shards=1)
    base = tmp_path / "caches"
    script = tmp_path / "boot.py"
    script.write_text(_KILL_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen(
        [sys.executable, str(script), table.uri, str(base)], stdout=subprocess.PIPE, text=True, env=env
    )
    seen = 0
    for line in proc.stdout:  # type: ignore[union-attr]
        if line.startswith("LOADED"):
            seen += 1
            if seen == 3:  # kill while the next partition is being built or ingested
                proc.send_signal(signal.SIGKILL)
                break
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    with open_cache(table, 0, base) as cache:
        assert cache.recovered
        ready = sorted(cache.partitions())
        assert 3 <= len(ready) < 11
        for partition in ready:  # whatever survived is complete
            assert dict(cache.items(partition)) == shard_truth(table, partition, 0)
    result = bootstrap(table, days=10, now=NOW, base_path=base)
    assert result.partitions_loaded == 11 - len(ready)
    with open_cache(table, 0, base) as cache:
        assert sorted(cache.partitions()) == DAYS + ["region=eu"]
        assert verify(cache, table).ok
