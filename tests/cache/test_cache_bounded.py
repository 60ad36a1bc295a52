"""A table's executor-local cache directory stays bounded over many batches: its RocksDB shard caches near one copy
of their entries however often catch-up re-points the same keys, and its key files (data/key_files.py) to those of
the table's live data files however often a data compaction replaces them (cache/key_file_sweep.py). Real rocksdict,
real key files, real data compactions; sizes are compared, never times."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pyarrow as pa
import pytest

from dbidx.cache import key_file_sweep
from dbidx.cache.catchup import sync
from dbidx.cache.loading import load_from_snapshot
from dbidx.cache.reaper import sweep_abandoned
from dbidx.cache.store import directory_bytes
from dbidx.config import CacheConfig
from dbidx.data import reads
from dbidx.data.key_files import KEY_FILES_DIR, KeyFiles, finished_files, wait_for_saves
from dbidx.table.facade import Table
from dbidx.spark_integration.local import upsert_arrow

from tests.cache_helpers import open_cache, random_uuids

DAY = "dt=2025-01-01"


def sst_bytes(path: Path) -> int:
    return sum(e.stat().st_size for e in os.scandir(path) if e.name.endswith(".sst"))


@pytest.mark.slow
@pytest.mark.parametrize("moved", [2_000, 17_000], ids=["write-batch", "ingested-sst"])
def test_many_catchups_of_the_same_keys_leave_about_one_copy_on_disk(tmp_path: Path, moved: int) -> None:
    """Each round deletes `moved` keys and inserts them again at a new file group (two commits), then a task-like
    session (open, catch up, close) applies them: through a write batch, or as one ingested SST past
    SST_APPLY_MIN_ENTRIES. After 30 rounds (1.5 to 13 times the partition's entries re-pointed) the shard's SST
    bytes stay within 1.6x those of a fresh load of the same final state (measured: 1.11x and 1.00x at round 30, at
    most 1.42x between two compactions of the ingested path; without the compaction at close, 1.4x to 3.2x as the
    background compactions closing the store aborted came and went), and the directory's other files (manifest,
    options, info log) do not grow with the rounds."""
    n = 40_000
    table = Table.create(str(tmp_path / "table"), num_shards=1, row_group_size=4096)
    keys = random_uuids(n)
    with table.new_commit() as w:
        w.insert(DAY, keys, "fg-0")
    with open_cache(table, 0, tmp_path / "cache") as cache:
        load_from_snapshot(cache, table, DAY, table.timeline.latest_seq)
        shard = cache.path
    others_start = directory_bytes(shard) - sst_bytes(shard)
    for r in range(1, 31):
        start = (r * moved) % n
        again = (keys + keys)[start : start + moved]
        with table.new_commit() as w:
            w.delete(DAY, again)
        with table.new_commit() as w:
            w.insert(DAY, again, f"fg-{r}")
        with open_cache(table, 0, tmp_path / "cache") as cache:
            result = sync(cache, table)
            assert result.applied_partitions == [DAY] and not result.reloaded_partitions
    with open_cache(table, 0, tmp_path / "cache") as cache:
        assert cache.partitions()[DAY].entries == n
    with open_cache(table, 0, tmp_path / "fresh") as fresh:
        load_from_snapshot(fresh, table, DAY, table.timeline.latest_seq)
        one_copy = sst_bytes(fresh.path)
    assert sst_bytes(shard) <= 1.6 * one_copy, (sst_bytes(shard), one_copy)
    assert directory_bytes(shard) - sst_bytes(shard) <= others_start + (256 << 10)


# ---------------------------------------------------------------------------------------------------------------
# Key files of data files the table no longer has.


def batch(ids: range, version: int) -> pa.Table:
    return pa.table(
        {
            "id": pa.array([f"k{i:06d}" for i in ids]),
            "dt": pa.array([f"d{i % 3}" for i in ids]),
            "v": pa.array([version] * len(ids), pa.int64()),
        }
    )


def key_dir(base: Path) -> Path:
    found = list(base.glob(f"*/{KEY_FILES_DIR}"))
    assert len(found) == 1, found
    return found[0]


def live_names(table: Table) -> set[str]:
    return {f"{f.record.checksum.rsplit(':', 1)[-1]}-{f.record.rows}.keys" for f in table.data_view().live()}


def on_disk(root: Path) -> tuple[set[str], int]:
    files = finished_files(root)
    return {os.path.basename(p) for _m, _s, p in files}, sum(size for _m, size, _p in files)


@pytest.mark.slow
def test_data_compactions_leave_key_files_of_the_live_files_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """40 batches of updates, a data compaction after every 4th: the key-file directory holds exactly the key files
    of the table's live data files after each batch (each one's task sweeps what the compaction before it replaced),
    so its bytes at batch 40 stay near those at batch 8, where they grew with every replaced file before. Tasks
    count the recent key files as old (the sweep's mtime guard is tested on its own below)."""
    monkeypatch.setattr(key_file_sweep, "MTIME_SLACK_S", -3600.0)
    key_file_sweep.forget_swept()
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    upsert_arrow(batch(range(6000), 0), table, key="id", partition="dt", cache_config=config)
    sizes, written = {}, set(range(6000))
    for number in range(1, 41):
        start = (number * 700) % 6000
        written |= set(range(start, start + 1500))
        summary = upsert_arrow(
            batch(range(start, start + 1500), number), table, key="id", partition="dt", cache_config=config
        )
        wait_for_saves()
        names, size = on_disk(key_dir(tmp_path / "cache"))
        # The files of this batch's own instant are live by now, and nothing else is kept.
        assert names == live_names(table), number
        sizes[number] = size
        if number % 4 == 0:
            table.compact_data(min_files=2, deleted_share=0.2)
    assert sizes[40] <= 1.5 * sizes[8], sizes
    # Markers of settled instants went with the next batch's sweeps: only the last batch's tasks' are left.
    markers = list(key_file_sweep.pending_dir(key_dir(tmp_path / "cache")).glob("*.json"))
    assert len(markers) <= 2 and {m.name.split("~")[0] for m in markers} == {summary.instant}
    data = reads.read_arrow(table)
    assert sorted(data.column("id").to_pylist()) == [f"k{i:06d}" for i in sorted(written)]


@pytest.fixture()
def swept_table(tmp_path: Path) -> tuple[Table, KeyFiles]:
    """A table with live data files (key files on), its key-file directory, and this process's memo of sweeps
    cleared (as in a new worker process)."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    upsert_arrow(batch(range(300), 0), table, key="id", partition="dt", cache_config=config)
    upsert_arrow(batch(range(100), 1), table, key="id", partition="dt", cache_config=config)
    wait_for_saves()
    key_file_sweep.forget_swept()
    return table, KeyFiles(key_dir(tmp_path / "cache"), 1 << 30)


def fake_key_file(disk: KeyFiles, seed: int, age_s: float = 3600.0) -> str:
    """A key file's name for no live data file, last modified `age_s` ago (the sweep judges names and times only)."""
    name = f"{seed:016x}-{seed}.keys"
    path = disk.root / name
    path.write_bytes(b"x" * 1000)
    old = time.time() - age_s
    os.utime(path, (old, old))
    return name


def test_a_pending_instant_keeps_its_announced_key_files_until_it_settles(swept_table) -> None:
    table, disk = swept_table
    live = live_names(table)
    writer = table.new_commit()  # a sibling task's upsert, still running: its files may become live
    pending = fake_key_file(disk, 1)
    dead = fake_key_file(disk, 2)
    key_file_sweep.announce(disk.root, writer.instant, 7, [("d0/x.parquet", pending)])
    with table.pinned(refreshed=True):
        result = key_file_sweep.sweep(disk, table, time.time())
    assert result.full and result.deleted == [dead] and result.kept_pending == 1
    assert on_disk(disk.root)[0] == live | {pending}
    # Rolled back: nothing can make its file live any more; its marker goes with it.
    writer.rollback()
    table.refresh()
    with table.pinned(refreshed=True):
        result = key_file_sweep.sweep(disk, table, time.time())
    assert result.deleted == [pending] and result.markers_removed == 1
    assert on_disk(disk.root)[0] == live
    assert not list(key_file_sweep.pending_dir(disk.root).iterdir())


def test_a_sweep_keeps_key_files_changed_after_its_view_and_lists_only_when_something_died(swept_table) -> None:
    table, disk = swept_table
    live = live_names(table)
    with table.pinned(refreshed=True):
        assert key_file_sweep.sweep(disk, table, time.time()).full  # the first in this process lists
    recent = fake_key_file(disk, 3, age_s=0.0)  # saved by a task whose view is newer: maybe a live file there
    with table.pinned(refreshed=True):
        result = key_file_sweep.sweep(disk, table, time.time() - 60)
    assert not result.full and not result.deleted  # nothing was removed since the last sweep: no listing
    key_file_sweep.forget_swept()
    with table.pinned(refreshed=True):
        result = key_file_sweep.sweep(disk, table, time.time() - 60)
    assert result.full and result.kept_recent == 1 and not result.deleted
    os.utime(disk.root / recent, (time.time() - 3600, time.time() - 3600))
    with table.pinned(refreshed=True):  # kept for being recent: the next sweep lists again and decides
        result = key_file_sweep.sweep(disk, table, time.time())
    assert result.full and result.deleted == [recent]
    assert on_disk(disk.root)[0] == live


def test_unreadable_and_stale_markers_go(swept_table, caplog: pytest.LogCaptureFixture) -> None:
    table, disk = swept_table
    pending = key_file_sweep.pending_dir(disk.root)
    pending.mkdir(exist_ok=True)
    (pending / f"{'1' * 17}~3.json").write_text("{not json")
    with table.pinned(refreshed=True):
        key_file_sweep.sweep(disk, table, time.time())
    assert not (pending / f"{'1' * 17}~3.json").exists() and "unreadable key-file marker" in caplog.text
    # A writer whose instant never settles (its driver gone, the table never written again): the reaper's
    # abandoned sweep removes the marker once it is as old as the TTL, and the directory with it.
    writer = table.new_commit()
    marker = key_file_sweep.announce(disk.root, writer.instant, 1, [("d0/y.parquet", fake_key_file(disk, 4))])
    os.utime(marker, (time.time() - 7200, time.time() - 7200))
    sweep_abandoned(disk.root.parent.parent, ttl_hours=1.0)
    assert not pending.exists()
    writer.rollback()
