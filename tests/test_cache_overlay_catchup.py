"""Overlay semantics, commit/rollback, and catch-up from the MDT (other writers, compaction, cleaning, global mode)."""
from __future__ import annotations

import pytest

from dbidx.cache import catchup
from dbidx.cache.catchup import sync
from dbidx.cache.codec import global_location
from dbidx.cache.loading import load_from_snapshot
from dbidx.cache.record_cache import GLOBAL_PARTITION
from dbidx.cache.verify import verify
from dbidx.errors import CacheError, HistoryCompactedError, InstantStateError
from dbidx.mdt.compaction import clean, compact
from dbidx.mdt.table import Table

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


def test_a_reopened_cache_counts_its_pending_entries_once(table, tmp_path):
    """Closing and reopening one cache object rebuilds the overlay counts instead of adding to them, so a finished
    instant leaves nothing pending and the partition can be dropped again."""
    cache = loaded(table, 0, tmp_path / "c")
    new = shard_keys(table, [f"re-{i}" for i in range(20)], 0)
    with cache:
        cache.put_pending("i1", DAY1, new, ["fg-x"] * len(new), attempt="7")
    with cache.open():
        assert cache.pending_instants(DAY1) == {"i1": len(new)}
        assert cache.finish_instant("i1", attempt="7") == len(new)
        assert cache.pending_instants() == {}
        assert cache.drop_partition(DAY1)


def test_overlay_input_is_checked_before_anything_is_written(table, tmp_path):
    """What the overlay stores is what it reads back strictly (three strings): an int attempt (Spark's) is stored
    as its string and finishes by either spelling; a missing location or instant is an InvalidInputError, also on
    a closed cache, and leaves nothing staged that a later open would call damaged."""
    from dbidx.cache.record_cache import RecordIndexCache
    from dbidx.errors import InvalidInputError, InvalidPartitionError

    cache = loaded(table, 0, tmp_path / "c")
    key = shard_keys(table, [f"in-{i}" for i in range(20)], 0)[:2]
    with cache:
        assert cache.put_pending("i1", DAY1, key, ["fg-a", "fg-b"], attempt=7) == 2
        with pytest.raises(InvalidInputError, match=r"locations must be non-empty strings, got None"):
            cache.put_pending("i2", DAY1, key, ["fg-a", None])
        with pytest.raises(InvalidInputError, match=r"instant must be a non-empty string"):
            cache.put_pending("", DAY1, key, ["fg-a", "fg-b"])
    with cache.open():
        assert cache.pending_instants() == {"i1": 2} and cache.lookup(DAY1, key) == ["fg-a", "fg-b"]
        assert cache.finish_instant("i1", attempt="7") == 2
    closed = RecordIndexCache(tmp_path / "c", None)
    with pytest.raises(InvalidPartitionError):
        closed.put_pending("i3", "/abs", key, ["fg-a", "fg-b"])


def test_overlay_sees_keys_of_the_same_and_earlier_uncommitted_batches(table, tmp_path):
    with loaded(table, 0, tmp_path / "c") as cache:
        new = shard_keys(table, [f"new-{i}" for i in range(40)], 0)
        # Batch 1 of instant A assigns the first half; the same key twice in a batch keeps one entry.
        assert cache.put_pending("A", DAY1, new[:5] + new[:1], ["fg-new"] * 6, attempt="t1") == 5
        assert cache.lookup(DAY1, new[:6]) == ["fg-new"] * 5 + [None]
        # A later batch of another, still uncommitted instant B sees A's keys and adds its own.
        cache.put_pending("B", DAY1, new[5:8], ["fg-b"] * 3, attempt="t1")
        assert cache.lookup(DAY1, new[:8]) == ["fg-new"] * 5 + ["fg-b"] * 3
        assert cache.pending_instants(DAY1) == {"A": 5, "B": 3}
        assert cache.metrics.to_dict()["pending_hits"] == 13
        # Overlay entries of other partitions are not visible here.
        assert cache.lookup(DAY2, new[:2]) == [None, None]
        # Rolling back A removes exactly A's entries.
        assert catchup.rollback(cache, "A") == 5
        assert cache.lookup(DAY1, new[:8]) == [None] * 5 + ["fg-b"] * 3


def test_retried_and_speculative_attempts_leave_one_set(table, tmp_path):
    with loaded(table, 0, tmp_path / "c") as cache:
        keys = shard_keys(table, [f"r-{i}" for i in range(60)], 0)
        cache.put_pending("I", DAY1, keys, ["fg-1"] * len(keys), attempt="task3.attempt0")
        cache.put_pending("I", DAY1, keys, ["fg-2"] * len(keys), attempt="task3.attempt1")  # retry overwrites
        assert cache.pending_instants() == {"I": len(keys)}
        assert set(cache.lookup(DAY1, keys)) == {"fg-2"}
        # The failed first attempt is cleaned up by attempt id: the retry's entries stay.
        assert catchup.rollback(cache, "I", attempt="task3.attempt0") == 0
        assert set(cache.lookup(DAY1, keys)) == {"fg-2"}


def test_commit_applies_completed_instants_and_drops_their_overlay(table, tmp_path):
    with loaded(table, 0, tmp_path / "c") as cache:
        new = shard_keys(table, [f"c-{i}" for i in range(50)], 0)
        gone = shard_keys(table, [f"k1-{i:05d}" for i in range(20)], 0)
        writer = table.new_commit()
        cache.put_pending(writer.instant, DAY1, new, ["fg-c"] * len(new))
        with pytest.raises(InstantStateError, match="has not completed"):
            catchup.commit(cache, table, writer.instant)
        writer.insert(DAY1, new, "fg-c")
        writer.delete(DAY1, gone)
        writer.commit()
        result = catchup.commit(cache, table, writer.instant)
        assert result.finished_instants == [writer.instant] and cache.pending_instants() == {}
        assert cache.lookup(DAY1, new + gone) == ["fg-c"] * len(new) + [None] * len(gone)
        assert cache.watermark == table.timeline.latest_seq
        assert verify(cache, table).ok
        # A rolled-back instant's overlay entries disappear at the next sync.
        failed = table.new_commit()
        cache.put_pending(failed.instant, DAY2, ["zz-1"], ["fg-z"])
        table.rollback(failed.instant)
        assert sync(cache, table).finished_instants == [failed.instant]
        assert cache.lookup(DAY2, ["zz-1"]) == [None]
        with pytest.raises(InstantStateError, match="rolled back"):
            catchup.commit(cache, table, failed.instant)


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


def test_pending_partitions_cannot_be_dropped(table, tmp_path):
    with loaded(table, 0, tmp_path / "c", partitions=(DAY1,)) as cache:
        cache.put_pending("P", DAY1, ["a"], ["fg"])
        with pytest.raises(CacheError, match="uncommitted"):
            cache.drop_partition(DAY1)
        catchup.rollback(cache, "P")
        assert cache.drop_partition(DAY1) and not cache.is_ready(DAY1)


def test_a_change_large_next_to_what_the_cache_holds_reloads(tmp_path):
    """Catch-up reloads a partition when its pending change exceeds RELOAD_FRACTION (3x) of the entries the cache
    holds (and RELOAD_MIN_ENTRIES): a partition that was empty when loaded takes a bulk load by the SST path, not entry by
    entry; a small change next to a big partition is still applied."""
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
    assert not catchup.prefers_reload(catchup.RELOAD_MIN_ENTRIES, 0, bound=10 ** 9)
