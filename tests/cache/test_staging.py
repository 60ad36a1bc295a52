"""Staged loads (cache/staging.py): a bulk load's tasks stage their entries beside the shard caches, and the next
catch-up installs exactly the partitions the completion confirms; everything else is discarded unread."""

from __future__ import annotations

import json
import time
import logging
from pathlib import Path

import pytest

from dbidx.cache import staging
from dbidx.cache.catchup import sync
from dbidx.cache.loading import snapshot_entries
from dbidx.cache.record_cache import GLOBAL_PARTITION, RecordIndexCache
from dbidx.config import CacheConfig
from dbidx.table.facade import Table
from dbidx.spark_integration.local import upsert_arrow

from tests.data.test_compaction import as_arrow, current


def rows(n: int, day: str, value: int, start: int = 0) -> list[tuple]:
    return [(f"k{i:05d}", day, value, False) for i in range(start, start + n)]


def load(tmp_path: Path, global_index: bool = False, **config: object) -> tuple[Table, CacheConfig, list[tuple]]:
    table = Table.create(str(tmp_path / "t"), num_shards=2, global_index=global_index)
    cache_config = CacheConfig(base_path=str(tmp_path / "cache"), **config)
    first = rows(400, "d1", 1) + rows(300, "d2", 1, start=1000) + [("gone", "d1", 0, True)]
    upsert_arrow(as_arrow(first), table, key="id", partition="dt", cache_config=cache_config)
    return table, cache_config, first


def stage(cache_path: Path, instant: str, attempt: str, groups: list[tuple], config: CacheConfig) -> Path:
    """Stage partitions as a task would (one StagedLoad, one SST per delta record); returns the staged directory."""
    with staging.StagedLoad(cache_path, instant, attempt, config) as load:
        for record, partition, keys, locations in groups:
            load.add(record, partition, keys, locations)
    assert load.failed is None, load.failed
    return load.root / f"{instant}~{attempt}"


def staged_dirs(table: Table, config: CacheConfig) -> list[Path]:
    found = []
    for shard in range(table.num_shards):
        root = staging.staged_root(RecordIndexCache.for_table(table, shard, config).path)
        found += sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.is_dir() else []
    return found


def assert_cache_is_the_index(table: Table, config: CacheConfig) -> None:
    table.refresh()
    for shard in range(table.num_shards):
        with RecordIndexCache.for_table(table, shard, config) as cache:
            sync(cache, table)  # the batch's own commit reaches the cache at the next catch-up
            for partition in cache.partitions():
                keys, locations = snapshot_entries(
                    table, shard, partition, table.timeline.latest_seq, cache.global_mode
                )
                assert dict(cache.items(partition)) == dict(zip(keys.to_pylist(), locations.to_pylist()))


@pytest.mark.parametrize("global_index", [False, True], ids=["partitioned", "global"])
def test_the_first_batch_after_a_bulk_load_installs_the_staged_partitions_and_loads_nothing(
    tmp_path: Path, global_index: bool
) -> None:
    table, config, first = load(tmp_path, global_index)
    assert len(staged_dirs(table, config)) == 2  # one per shard task
    second = rows(100, "d1", 2) + rows(50, "d3", 2, start=5000) + [("k01000", "d2", 0, True)]
    summary = upsert_arrow(as_arrow(second), table, key="id", partition="dt", cache_config=config)
    # 1. Every loaded partition the batch needed came from the staged SSTs: only the new one (d3, both shards) was
    #    loaded on demand, and it had no entries yet.
    assert summary.on_demand_loads == (0 if global_index else 2)
    assert summary.staged_loads == (2 if global_index else 4)
    assert (summary.inserts, summary.updates, summary.deletes) == (50, 100, 1)
    assert staged_dirs(table, config) == []  # installed or not, a settled instant's staging is gone
    # 2. What the cache holds is exactly the index, and the table is what the batches say.
    expected = {(k, d, v) for k, d, v, _ in first[:700]}
    expected = {r for r in expected if not (r[0] < "k00100" and r[1] == "d1")} - {("k01000", "d2", 1)}
    expected |= {(k, d, v) for k, d, v, _ in second[:150]}
    assert current(table) == expected
    assert_cache_is_the_index(table, config)
    if global_index:
        with RecordIndexCache.for_table(table, 0, config) as cache:
            assert list(cache.partitions()) == [GLOBAL_PARTITION]


def test_stage_loads_false_stages_nothing(tmp_path: Path) -> None:
    table, config, _ = load(tmp_path, stage_loads=False)
    assert staged_dirs(table, config) == []
    summary = upsert_arrow(as_arrow(rows(10, "d1", 2)), table, key="id", partition="dt", cache_config=config)
    assert summary.staged_loads == 0 and summary.on_demand_loads == 2  # d1 in both shards, from the index


def test_a_rolled_back_loads_staging_is_discarded_and_never_installed(tmp_path: Path, monkeypatch) -> None:
    from dbidx.table.writer import CommitWriter

    def fail(*_args, **_kwargs):
        raise RuntimeError("publish failed")

    monkeypatch.setattr(CommitWriter, "_commit", fail)
    with pytest.raises(RuntimeError):
        load(tmp_path)
    monkeypatch.undo()
    table, config = Table.open(str(tmp_path / "t")), CacheConfig(base_path=str(tmp_path / "cache"))
    assert len(staged_dirs(table, config)) == 2  # the tasks staged before the publish failed
    for shard in range(2):
        with RecordIndexCache.for_table(table, shard, config) as cache:
            result = sync(cache, table)
            assert result.staged_partitions == [] and cache.partitions() == {}
    assert staged_dirs(table, config) == []


def test_staging_a_completion_does_not_confirm_is_discarded_unread(tmp_path: Path, caplog) -> None:
    table, config, _ = load(tmp_path, stage_loads=False)
    table.refresh()
    record = table.timeline.completed()[-1]
    d1 = next(f for f in record.files if f.partition == "dt=d1" and f.shard == 0)
    cache_path = RecordIndexCache.for_table(table, 0, config).path
    keys, locations = snapshot_entries(table, 0, "dt=d1", record.seq, False)
    # 1. Another attempt's file name (a losing attempt), 2. a checksum the record does not hold, 3. a damaged
    #    manifest: none is installed, all are deleted.
    other = type(d1)(**{**vars(d1), "path": d1.path.replace(".parquet", "-x.parquet")})
    stage(cache_path, record.instant, "other", [(other, "dt=d1", keys, locations)], config)
    wrong = type(d1)(**{**vars(d1), "checksum": "0" * len(d1.checksum)})
    stage(cache_path, record.instant, "wrong", [(wrong, "dt=d1", keys, locations)], config)
    damaged = stage(cache_path, record.instant, "damaged", [(d1, "dt=d1", keys, locations)], config)
    manifest = json.loads((damaged / staging.MANIFEST).read_text())
    manifest["partitions"][0]["entries"] += 1
    (damaged / staging.MANIFEST).write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING), RecordIndexCache.for_table(table, 0, config) as cache:
        result = sync(cache, table)
        assert result.staged_partitions == [] and cache.partitions() == {}
    assert "unreadable" in caplog.text
    assert staged_dirs(table, config) == []


def test_a_partition_with_other_files_at_that_seq_is_not_installed(tmp_path: Path) -> None:
    """Staged entries are a partition's whole state only when the staged delta is its only live file."""
    table, config, _ = load(tmp_path, stage_loads=False)
    upsert_arrow(as_arrow(rows(30, "d1", 1, start=3000)), table, key="id", partition="dt", cache_config=config)
    table.refresh()
    record = table.timeline.completed()[-1]
    delta = next(f for f in record.files if f.partition == "dt=d1")
    with RecordIndexCache.for_table(table, delta.shard, config) as cache:
        cache.drop_partition("dt=d1")
    cache_path = RecordIndexCache.for_table(table, delta.shard, config).path
    entries = table.incremental(record.seq - 1, record.seq, ["dt=d1"], delta.shard)
    keys, locations = entries.column("key").combine_chunks(), entries.column("file_group").combine_chunks()
    stage(cache_path, record.instant, "0", [(delta, "dt=d1", keys, locations)], config)
    with RecordIndexCache.for_table(table, delta.shard, config) as cache:
        result = sync(cache, table)
        assert result.staged_partitions == []
        assert "dt=d1" not in cache.partitions()  # left for an on-demand load of the whole snapshot


def test_a_pending_instants_staging_is_kept_until_it_settles(tmp_path: Path) -> None:
    table, config, _ = load(tmp_path, stage_loads=False)
    table.refresh()
    record = table.timeline.completed()[-1]
    d1 = next(f for f in record.files if f.partition == "dt=d1" and f.shard == 0)
    keys, locations = snapshot_entries(table, 0, "dt=d1", record.seq, False)
    cache_path = RecordIndexCache.for_table(table, 0, config).path
    staged = stage(cache_path, "29990101000000000", "0", [(d1, "dt=d1", keys, locations)], config)
    with RecordIndexCache.for_table(table, 0, config) as cache:
        view = table.refresh()
        assert staging.promote(cache, table, view, view.applied_seq).installed == [] and staged.is_dir()
        # An instant that never settles is abandoned after a day.
        result = staging.promote(
            cache, table, view, view.applied_seq, now_s=staged.stat().st_mtime + staging.ABANDONED_S + 1
        )
        assert result.discarded == [staged.name] and not staged.exists()


def test_a_staging_whose_history_was_compacted_and_cleaned_is_discarded_and_sync_goes_on(
    tmp_path: Path, caplog
) -> None:
    """The load's delta compacted into a base and cleaned before the shard's cache was next opened on this node:
    the staged entries can no longer be checked against the index, so they go (with a warning), and catch-up
    carries on; the partitions load from the index."""
    table, config, _ = load(tmp_path)
    table.compact(min_files=1)
    table.clean(retain_completions=0)
    reopened = Table.open(table.uri)
    with caplog.at_level(logging.WARNING):
        for shard in range(2):
            with RecordIndexCache.for_table(reopened, shard, config) as cache:
                result = sync(cache, reopened)
                assert result.staged_partitions == [] and cache.partitions() == {}
    assert staged_dirs(reopened, config) == []
    summary = upsert_arrow(as_arrow(rows(10, "d1", 2)), reopened, key="id", partition="dt", cache_config=config)
    assert summary.updates == 10 and summary.on_demand_loads == 2


def test_a_failing_staging_never_fails_the_load(tmp_path: Path, monkeypatch, caplog) -> None:
    def no_space(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(staging, "build_sst", no_space)
    with caplog.at_level(logging.WARNING):
        table, config, first = load(tmp_path)
    assert "staging the load's entries" in caplog.text
    assert current(table) == {(k, d, v) for k, d, v, _ in first[:700]}
    assert staged_dirs(table, config) == []
    root = staging.staged_root(RecordIndexCache.for_table(table, 0, config).path)
    assert not root.exists() or not [p for p in root.iterdir()]  # the temp directory went too


def test_a_task_pinned_at_an_older_view_does_not_take_a_cache_ahead_of_it_for_a_restore(tmp_path: Path) -> None:
    """Another process caught the shard's cache up past the view this task pinned (it waited for the lock):
    catch-up looks again instead of dropping the cache as if the table had been restored from a backup."""
    table, config, _ = load(tmp_path)
    other = Table.open(table.uri)
    with table.pinned():
        seen = table.refresh().applied_seq
        keys = [
            k
            for k, s in zip(
                ["late-1", "late-2", "late-3", "late-4"], other.shard_of(["late-1", "late-2", "late-3", "late-4"])
            )
            if s == 0
        ]
        with other.new_commit() as writer:  # another process's commit, and its catch-up of this shard's cache
            writer.insert("dt=d1", keys, "fg-late")
        with RecordIndexCache.for_table(other, 0, config) as cache:
            sync(cache, other)
            assert cache.watermark == seen + 1
        with RecordIndexCache.for_table(table, 0, config) as cache:
            result = sync(cache, table)
            assert result.dropped_partitions == [] and result.to_seq == seen + 1 and cache.partitions()


def test_the_reaper_removes_staging_nobody_opened_for_a_day(tmp_path: Path) -> None:
    import os

    from dbidx.cache.reaper import sweep_abandoned

    table, config, _ = load(tmp_path)
    found = staged_dirs(table, config)
    assert len(found) == 2
    old = found[0].stat().st_mtime - staging.ABANDONED_S - 60
    os.utime(found[0], (old, old))
    sweep_abandoned(tmp_path / "cache", config.partition_ttl_hours)
    assert staged_dirs(table, config) == found[1:]  # the fresh one stays: a task of its shard may come


def test_the_reaper_goes_on_when_another_process_removes_what_it_was_about_to_list(tmp_path: Path, monkeypatch) -> None:
    """A task installing its staged load deletes its `.staged` directory, and another reaper an emptied table
    directory, while this sweep holds their names: the sweep skips what is gone (it ran in a task's close and
    failed the batch over it) and still removes what is due."""
    import os
    import shutil

    from dbidx.cache import reaper

    table, config, _ = load(tmp_path)
    found = staged_dirs(table, config)  # one staged load per shard, each in its shard's `.staged` directory
    roots = [entry.parent for entry in found]
    assert len(found) == 2 and roots[0] != roots[1]
    for entry in found:  # both a day old
        old = entry.stat().st_mtime - staging.ABANDONED_S - 60
        os.utime(entry, (old, old))
    real_abandoned = reaper.abandoned

    def meanwhile_the_other_shard_installs(entry: Path, now_s: float) -> bool:
        shutil.rmtree(roots[1], ignore_errors=True)  # the other shard's task took its staged load and its directory
        return real_abandoned(entry, now_s)

    monkeypatch.setattr(reaper, "abandoned", meanwhile_the_other_shard_installs)
    assert reaper.sweep_staged(roots[0].parent, time.time()) == [str(found[0])]
    assert staged_dirs(table, config) == [] and not roots[0].exists()
    # A table directory another reaper removed after the base was listed: nothing to list, no error.
    real_sweep_staged = reaper.sweep_staged
    monkeypatch.setattr(
        reaper,
        "sweep_staged",
        lambda table_dir, now_s: (shutil.rmtree(table_dir), real_sweep_staged(table_dir, now_s))[1],
    )
    assert reaper.sweep_abandoned(tmp_path / "cache", config.partition_ttl_hours) == []
