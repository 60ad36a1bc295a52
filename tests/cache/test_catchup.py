"""Catch-up from the index: completed and rolled-back instants, other writers, compaction, cleaning, global mode."""

from __future__ import annotations

import pytest

from dbidx.cache import catchup
from dbidx.cache.catchup import sync
from dbidx.cache.codec import global_location
from dbidx.cache.loading import load_from_snapshot
from dbidx.cache.record_cache import GLOBAL_PARTITION
from dbidx.cache.verify import verify
from dbidx.errors import HistoryCompactedError
from dbidx.index.compaction import clean, compact
from dbidx.table.facade import Table

from tests.cache_helpers import DAY1, DAY2, DAY3, make_table, open_cache, truth


def shard_keys(table: Table, keys: list[str], shard: int) -> list[str]:
    return [k for k, s in zip(keys, table.shard_of(keys)) if s == shard]


@pytest.fixture()
def table(tmp_path) -> Table:
    return make_table(tmp_path)


def loaded(table: Table, shard: int, base, partitions=(DAY1, DAY2, DAY3), **config):
    cache = open_cache(table, shard, base, **config)
    for p in partitions:
        load_from_snapshot(cache, table, p, table.timeline.latest_seq)
    cache.set_watermark(table.timeline.latest_seq)
    return cache


def test_a_completed_instants_entries_reach_the_cache_at_the_next_sync_and_a_rolled_back_ones_never(table, tmp_path):
    with loaded(table, 0, tmp_path / "c") as cache:
        new = shard_keys(table, [f"c-{i}" for i in range(50)], 0)
        gone = shard_keys(table, [f"k1-{i:05d}" for i in range(20)], 0)
        writer = table.new_commit()
        writer.insert(DAY1, new, "fg-c")
        writer.delete(DAY1, gone)
        assert sync(cache, table).applied_entries == 0  # in flight: nothing of it is in the cache
        assert cache.lookup(DAY1, new) == [None] * len(new)
        writer.commit()
        assert sync(cache, table).applied_entries == len(new) + len(gone)
        assert cache.lookup(DAY1, new + gone) == ["fg-c"] * len(new) + [None] * len(gone)
        assert cache.watermark == table.timeline.latest_seq
        assert verify(cache, table).ok
        failed = table.new_commit()
        failed.insert(DAY2, shard_keys(table, [f"zz-{i}" for i in range(20)], 0), "fg-z")
        table.rollback(failed.instant)
        sync(cache, table)
        assert cache.lookup(DAY2, shard_keys(table, [f"zz-{i}" for i in range(20)], 0)) == [None] * len(
            shard_keys(table, [f"zz-{i}" for i in range(20)], 0)
        )
        assert verify(cache, table).ok


def test_catch_up_after_commits_by_another_cache_instance(table, tmp_path):
    cache = loaded(table, 1, tmp_path / "mine")
    cache.close()
    # Another executor (its own cache dir) takes over shard 1 and commits inserts, updates, deletes.
    other = loaded(table, 1, tmp_path / "other")
    moved = shard_keys(table, [f"k2-{i:05d}" for i in range(30)], 1)
    with table.new_commit() as w:
        w.insert(DAY3, shard_keys(table, [f"o-{i}" for i in range(80)], 1), "fg-o")
        w.delete(DAY2, moved)
    with table.new_commit() as w:
        w.insert(DAY2, moved[:10], "fg-back")  # re-insert after delete
    sync(other, table)
    other.close()
    # Our cache reopens (clean close: no recovery) and only catches up.
    with open_cache(table, 1, tmp_path / "mine") as cache:
        assert not cache.recovered
        result = sync(cache, table)
        assert result.reloaded_partitions == [] and result.applied_entries > 0
        for p in (DAY1, DAY2, DAY3):
            assert dict(cache.items(p)) == truth(table, p, 1)
        assert verify(cache, table).ok
        assert sync(cache, table).applied_entries == 0  # idempotent


def test_catch_up_across_compaction_and_cleaning(table, tmp_path):
    with loaded(table, 0, tmp_path / "c") as cache:
        with table.new_commit() as w:
            w.insert(DAY1, shard_keys(table, [f"x-{i}" for i in range(40)], 0), "fg-x")
        compact(table)
        # Compaction alone keeps the deltas: catch-up still applies them.
        result = sync(cache, table)
        assert result.reloaded_partitions == [] and result.applied_partitions
        assert verify(cache, table).ok
        # New commits, then a compaction and a clean remove the delta history: the partition is reloaded.
        with table.new_commit() as w:
            w.insert(DAY1, shard_keys(table, [f"y-{i}" for i in range(40)], 0), "fg-y")
        compact(table)
        clean(table, retain_completions=0)
        # verify cannot rebuild the state the cache claims (its files are cleaned): it says to sync first.
        with pytest.raises(HistoryCompactedError, match=r"behind a clean.*sync it first"):
            verify(cache, table)
        result = sync(cache, table)
        assert DAY1 in result.reloaded_partitions
        assert dict(cache.items(DAY1)) == truth(table, DAY1, 0)
        assert verify(cache, table).ok


def test_a_clean_between_listing_and_reading_reloads_every_partition_of_the_range(table, tmp_path, monkeypatch):
    """The reader thread meets a delta file a clean removed after catch-up listed it: the error reaches sync, the
    reads not started are not made, and every partition of the range is reloaded (those applied before included),
    ending exactly at the table's state."""
    with loaded(table, 0, tmp_path / "c") as cache:
        with table.new_commit() as w:
            for day in (DAY1, DAY2, DAY3):
                w.insert(day, shard_keys(table, [f"z-{day}-{i}" for i in range(40)], 0), "fg-z")
        compact(table)
        read = table.read_incremental
        reads = []

        def clean_first(files, partitions=None):
            if not reads:
                clean(table, retain_completions=0)  # the listed delta files are gone now
            reads.append(len(files))
            return read(files, partitions)

        monkeypatch.setattr(table, "read_incremental", clean_first)
        result = sync(cache, table)
        assert sorted(result.reloaded_partitions) == [DAY1, DAY2, DAY3] and result.applied_partitions == []
        assert len(reads) <= catchup.READ_AHEAD + 1  # no read was made past the failure's read-ahead
        for day in (DAY1, DAY2, DAY3):
            assert dict(cache.items(day)) == truth(table, day, 0)
        assert verify(cache, table).ok


def test_a_gap_larger_than_the_bound_reloads(table, tmp_path):
    with loaded(table, 0, tmp_path / "c", max_catchup_entries=10) as cache:
        with table.new_commit() as w:
            w.insert(DAY2, [f"big-{i}" for i in range(200)], "fg-big")
            w.insert(DAY3, [f"small-{i}" for i in range(3)], "fg-small")
        result = sync(cache, table)
        assert result.reloaded_partitions == [DAY2]
        assert DAY3 in result.applied_partitions
        assert verify(cache, table).ok


def test_global_mode_catch_up_with_a_partition_move(tmp_path):
    table = make_table(tmp_path, global_index=True)
    shard = 0
    with open_cache(table, shard, tmp_path / "c") as cache:
        load_from_snapshot(cache, table, GLOBAL_PARTITION, table.timeline.latest_seq)
        mine = shard_keys(table, [f"k1-{i:05d}" for i in range(300)], shard)[:5]
        with table.new_commit() as w:
            w.move(mine, DAY1, "fg-1-0", DAY3, "fg-moved")
        sync(cache, table)
        assert cache.lookup(GLOBAL_PARTITION, mine) == [global_location(DAY3, "fg-moved")] * 5
        assert verify(cache, table).ok


def test_verify_reports_a_diff(table, tmp_path):
    with loaded(table, 0, tmp_path / "c", partitions=(DAY1,)) as cache:
        key = next(iter(truth(table, DAY1, 0)))
        cache.apply(DAY1, [key, "phantom"], ["fg-wrong", "fg-1-0"], [False, False], synced_seq=cache.watermark)
        result = verify(cache, table)
        assert not result.ok
        diff = result.partitions[0]
        assert (diff.wrong_location, diff.extra, diff.missing) == (1, 1, 0)
        assert any("phantom" in e for e in diff.examples)


def test_a_change_large_next_to_what_the_cache_holds_reloads(tmp_path):
    """Catch-up reloads a partition when its pending change exceeds RELOAD_FRACTION (3x) of the entries the cache
    holds (and RELOAD_MIN_ENTRIES): a partition that was empty when loaded takes a bulk load by the SST path, not entry
    by entry; a small change next to a big partition is still applied."""
    table = make_table(tmp_path, num_shards=1, keys_per_day=3_000)
    with loaded(table, 0, tmp_path / "c", partitions=(DAY1, DAY2, "dt=2025-01-09")) as cache:
        assert cache.partitions()["dt=2025-01-09"].entries == 0
        with table.new_commit() as w:
            w.insert("dt=2025-01-09", [f"bulk-{i}" for i in range(catchup.RELOAD_MIN_ENTRIES + 1)], "fg-bulk")
            w.insert(DAY1, [f"more-{i}" for i in range(catchup.RELOAD_MIN_ENTRIES + 1)], "fg-more")  # 67% of DAY1
            w.insert(DAY2, [f"big-{i}" for i in range(10_000)], "fg-big")  # 333% of DAY2
        result = sync(cache, table)
        assert sorted(result.reloaded_partitions) == sorted([DAY2, "dt=2025-01-09"])
        assert result.applied_partitions == [DAY1]
        for p in (DAY1, DAY2, "dt=2025-01-09"):
            assert dict(cache.items(p)) == truth(table, p, 0)
        assert verify(cache, table).ok
    assert catchup.prefers_reload(10, 0, bound=5)  # over the absolute bound, whatever the cache holds
    assert not catchup.prefers_reload(catchup.RELOAD_MIN_ENTRIES, 0, bound=10**9)
