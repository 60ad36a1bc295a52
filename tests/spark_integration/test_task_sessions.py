"""The tag path's shard sessions end on the failure path when tagging fails: the success epilogue (reaper run,
metrics) never runs for a task that raised, and the cache is closed either way."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest

from dbidx.cache.record_cache import RecordIndexCache
from dbidx.cache.store import lock_path
from dbidx.config import CacheConfig
from dbidx.data.reads import read_arrow
from dbidx.errors import InvalidKeyError
from dbidx.table.facade import Table
from dbidx.spark_integration import shard_sessions, task
from dbidx.spark_integration.local import upsert_arrow
from dbidx.spark_integration.tagger import TagOptions


def batch(keys: list) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({"id": pa.array(keys, pa.string()), "dt": ["2025-03-01"] * len(keys)})


@pytest.fixture()
def setup(tmp_path: Path):
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "cache"), reaper_interval_s=0.0)
    upsert_arrow(
        pa.table({"id": ["a", "b"], "dt": ["2025-03-01"] * 2}), table, key="id", partition="dt", cache_config=config
    )
    with RecordIndexCache.for_table(table, 0, config) as cache:
        cache.set_info(shard_sessions.REAPER_INFO, {"last_ms": 0, "dropped": []})
    return table, config


def test_a_failing_batch_skips_the_session_epilogue_and_releases_the_cache(setup) -> None:
    table, config = setup
    options = TagOptions(key="id", partition="dt", cache=config)
    tagged = task.tag_batches([batch(["a", "x"]), batch(["b", None])], table, options)
    assert next(tagged).num_rows == 2
    with pytest.raises(InvalidKeyError, match="null"):
        list(tagged)
    with RecordIndexCache.for_table(table, 0, config) as cache:  # reopens: the lock was released
        assert cache.info(shard_sessions.REAPER_INFO)["last_ms"] == 0  # the reaper epilogue did not run


def test_a_clean_task_runs_the_epilogue(setup) -> None:
    table, config = setup
    rows = list(task.tag_batches([batch(["a", "x"])], table, TagOptions(key="id", partition="dt", cache=config)))
    assert rows[0].column("_dbidx_is_update").to_pylist() == [True, False]
    with RecordIndexCache.for_table(table, 0, config) as cache:
        assert cache.info(shard_sessions.REAPER_INFO)["last_ms"] > 0


def test_the_task_reaper_removes_caches_a_dead_executor_left(setup, tmp_path: Path) -> None:
    """A shard cache of another table, last opened two hours ago and held by nobody, goes at the end of a task;
    the task's own cache stays."""
    table, config = setup
    config = replace(config, partition_ttl_hours=1.0)
    other = Table.create(str(tmp_path / "other"), num_shards=1)
    with RecordIndexCache.for_table(other, 0, config) as dead:
        dead_path = dead.path
    old = time.time() - 7200
    for path in (dead_path, Path(str(dead_path) + ".lock")):
        os.utime(path, (old, old))
    upsert_arrow(pa.table({"id": ["c"], "dt": ["2025-03-01"]}), table, key="id", partition="dt", cache_config=config)
    assert not dead_path.exists() and not dead_path.parent.exists()
    with RecordIndexCache.for_table(table, 0, config) as cache:
        assert cache.info(shard_sessions.REAPER_INFO)["abandoned"] == [str(dead_path)]
        assert None not in cache.lookup("dt=2025-03-01", ["a", "b"])  # its own partition is still loaded


def _flip_bytes_of_largest_sst(cache_dir: Path) -> Path:
    sst = max(cache_dir.glob("*.sst"), key=lambda p: p.stat().st_size)
    data = bytearray(sst.read_bytes())
    for pos in range(64, int(len(data) * 0.8), 997):  # many data blocks, not the footer
        data[pos] ^= 0x5A
    sst.write_bytes(bytes(data))
    return sst


def test_a_damaged_cache_is_rebuilt_within_the_task(tmp_path: Path) -> None:
    """Flipped bytes in a cache's SST (disk or copy error) fail RocksDB's block checksums: nothing is tagged from
    them; the session discards the cache and a second session in the same task rebuilds it from the index and tags
    exactly as before (tag and upsert alike, counted in cache_rebuilds). A CURRENT naming a missing MANIFEST (a
    file deleted by hand) is damage too, not an error on every upsert for ever."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "cache"), reaper_interval_s=3600.0)
    keys = [f"key-{i:06d}" for i in range(20_000)]
    upsert_arrow(
        pa.table({"id": keys, "dt": ["2025-03-01"] * len(keys)}), table, key="id", partition="dt", cache_config=config
    )
    options = TagOptions(key="id", partition="dt", cache=config)
    probe = [batch(keys[::7] + ["new-1", "new-2"])]
    expected = [True] * len(keys[::7]) + [False, False]
    assert next(task.tag_batches(probe, table, options)).column("_dbidx_is_update").to_pylist() == expected
    cache_dir = RecordIndexCache.for_table(table, 0, config).path
    before = lock_path(cache_dir).read_bytes()
    _flip_bytes_of_largest_sst(cache_dir)
    # 1. tag: another block-cache size, so blocks cached by the first session (checked when read) are not reused.
    damaged = TagOptions(key="id", partition="dt", cache=replace(config, block_cache_mb=63))
    assert next(task.tag_batches(probe, table, damaged)).column("_dbidx_is_update").to_pylist() == expected
    assert cache_dir.exists() and lock_path(cache_dir).read_bytes() != before  # a new incarnation
    # 2. upsert, after the manifest was deleted by hand: rebuilt, counted, and the batch lands.
    current = (cache_dir / "CURRENT").read_text().strip()
    (cache_dir / current).unlink()
    summary = upsert_arrow(
        pa.table({"id": keys[:5] + ["new-3"], "dt": ["2025-03-01"] * 6}),
        table,
        key="id",
        partition="dt",
        cache_config=replace(config, block_cache_mb=62),
    )
    assert summary.cache_rebuilds == 1 and (summary.updates, summary.inserts) == (5, 1)
    assert sorted(read_arrow(Table.open(table.uri)).column("id").to_pylist()) == sorted(keys + ["new-3"])
    with RecordIndexCache.for_table(table, 0, config) as cache:
        assert None not in cache.lookup("dt=2025-03-01", keys[:100])  # the rebuilt cache serves


def test_an_upsert_task_reads_the_table_state_once(setup, monkeypatch) -> None:
    """One view per task: catch-up, planning, superseded rows and the index writer share the task's one refresh
    (on an object store each refresh is two LIST requests); only the settled check reads the timeline anew."""
    table, config = setup
    upsert_arrow(pa.table({"id": ["c"], "dt": ["2025-03-01"]}), table, key="id", partition="dt", cache_config=config)
    refreshes: list[str] = []
    real_refresh, real_rows = Table._refresh_views, task._upsert_rows
    inside = []

    def counted(self: Table) -> None:
        refreshes.append("task" if inside else "driver")
        real_refresh(self)

    def marked(*args, **kwargs):
        inside.append(True)
        try:
            return real_rows(*args, **kwargs)
        finally:
            inside.pop()

    monkeypatch.setattr(Table, "_refresh_views", counted)
    monkeypatch.setattr(task, "_upsert_rows", marked)
    summary = upsert_arrow(
        pa.table({"id": ["a", "d"], "dt": ["2025-03-01"] * 2}), table, key="id", partition="dt", cache_config=config
    )
    assert (summary.updates, summary.inserts) == (1, 1)
    assert refreshes.count("task") == 0  # warm_table's refresh, just before the task body, is the one it uses
    assert refreshes.count("driver") >= 1


def test_a_pinned_table_keeps_its_state_in_its_thread_only(setup) -> None:
    table, config = setup
    other = Table.open(table.uri)
    with table.pinned():
        seen = table.refresh().applied_seq
        with other.new_commit() as writer:  # another handle's commit (another process, as far as `table` knows)
            writer.insert("dt=2025-03-01", ["e"], "fg-e")
        assert table.refresh().applied_seq == seen  # pinned: no new listing in this thread
        assert table.refresh(force=True).applied_seq == seen + 1  # unless forced
        seen += 1
        with table.pinned():  # nested: shares the outer block's state
            assert table.data_view().applied_seq == seen
        import threading

        with other.new_commit() as writer:
            writer.insert("dt=2025-03-01", ["f"], "fg-f")
        found = []
        thread = threading.Thread(target=lambda: found.append(table.refresh().applied_seq))
        thread.start()
        thread.join()
        assert found == [seen + 1]  # another thread is not pinned
    assert table.refresh().applied_seq == seen + 1


def test_a_task_given_a_fresh_copy_of_the_table_tags_against_the_latest_commit(setup, monkeypatch) -> None:
    """Spark hands each task an unpickled Table that has read nothing yet; the first task of a worker must still
    start its one view from the table's latest state (the pinned block trusts warm_table to have refreshed)."""
    import pickle

    table, config = setup
    monkeypatch.setattr(shard_sessions, "_TABLES", {})
    fresh = pickle.loads(pickle.dumps(table))
    assert shard_sessions.warm_table(fresh).timeline.latest_seq == table.refresh().applied_seq > 0
    monkeypatch.setattr(shard_sessions, "_TABLES", {})
    summary = upsert_arrow(
        pa.table({"id": ["a"], "dt": ["2025-03-01"]}),
        pickle.loads(pickle.dumps(table)),
        key="id",
        partition="dt",
        cache_config=config,
    )
    assert summary.updates == 1
