"""Concurrent writers (optimistic concurrency on keys) and the global index mode with partition moves."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from dbidx.errors import ConflictError, DuplicateKeyError
from dbidx.table.facade import Table


def as_map(table) -> dict[str, str]:
    return dict(zip(table.column("key").to_pylist(), table.column("file_group").to_pylist()))


def test_overlapping_new_keys_conflict_and_publish_nothing(tmp_path):
    table = Table.create(str(tmp_path / "t"), num_shards=4)
    first, second = table.new_commit(), Table.open(table.uri).new_commit()
    first.insert("p", ["a", "b", "c"], "fg-1")
    second.insert("p", ["c", "d"], "fg-2")
    first.commit()
    with pytest.raises(ConflictError, match=r"'c'"):
        second.commit()
    assert as_map(table.snapshot("p")) == {"a": "fg-1", "b": "fg-1", "c": "fg-1"}
    assert table.timeline.pending() == []
    # The loser's files are gone.
    second_files = [p for p, _ in table.io.list_files_recursive(".dbidx/rli") if second.instant in p]
    assert second_files == []


def test_disjoint_keys_and_other_partitions_do_not_conflict(tmp_path):
    table = Table.create(str(tmp_path / "t"), num_shards=4)
    a, b, c = table.new_commit(), table.new_commit(), table.new_commit()
    a.insert("p", ["a", "b"], "fg-1")
    b.insert("p", ["x", "y"], "fg-2")
    c.insert("q", ["a", "b"], "fg-3")  # same keys, other partition: fine in partitioned mode
    a.commit(), b.commit(), c.commit()
    assert as_map(table.snapshot("p")) == {"a": "fg-1", "b": "fg-1", "x": "fg-2", "y": "fg-2"}
    assert as_map(table.snapshot("q")) == {"a": "fg-3", "b": "fg-3"}


def test_global_mode_conflicts_across_partitions(tmp_path):
    table = Table.create(str(tmp_path / "t"), num_shards=4, global_index=True)
    a, b = table.new_commit(), table.new_commit()
    a.insert("p", ["k1"], "fg-1")
    b.insert("q", ["k1"], "fg-2")
    a.commit()
    with pytest.raises(ConflictError, match="global index"):
        b.commit()


def _race(uri: str, keys: list[str], fg: str, barrier, results) -> None:
    table = Table.open(uri)
    writer = table.new_commit()
    writer.insert("p", keys, fg)
    barrier.wait()
    try:
        writer.commit()
        results.put((fg, "ok"))
    except ConflictError:
        results.put((fg, "conflict"))


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False])
def test_two_processes_racing(tmp_path, overlap):
    """Real processes publishing at the same moment: overlapping keys -> exactly one wins; disjoint -> both win."""
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    keys_a = [f"k{i}" for i in range(0, 3000)]
    keys_b = [f"k{i}" for i in range(2500 if overlap else 3000, 6000)]
    procs = [
        ctx.Process(target=_race, args=(table.uri, keys, fg, barrier, results))
        for keys, fg in ((keys_a, "fg-a"), (keys_b, "fg-b"))
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    outcome = dict(results.get(timeout=5) for _ in procs)
    snap = as_map(table.snapshot("p"))
    if overlap:
        assert sorted(outcome.values()) == ["conflict", "ok"]
        winner = "fg-a" if outcome["fg-a"] == "ok" else "fg-b"
        assert set(snap.values()) == {winner}
    else:
        assert outcome == {"fg-a": "ok", "fg-b": "ok"}
        assert len(snap) == 6000
    # Every key has exactly one location, and the log has no gaps.
    assert table.timeline.latest_seq == len(table.timeline.refresh())


def test_global_mode_partition_move(tmp_path):
    table = Table.create(str(tmp_path / "g"), num_shards=3, global_index=True)
    with table.new_commit() as w:
        w.insert("dt=2025-01-01", ["a", "b", "c"], "fg-1")
    with table.new_commit() as w:
        w.move(["b"], "dt=2025-01-01", "fg-1", "dt=2025-01-05", "fg-7")
    found = table.lookup(["a", "b", "c", "zz"])
    rows = {
        k: (p, fg)
        for k, p, fg in zip(
            found.column("key").to_pylist(),
            found.column("partition").to_pylist(),
            found.column("file_group").to_pylist(),
        )
    }
    assert rows == {"a": ("dt=2025-01-01", "fg-1"), "b": ("dt=2025-01-05", "fg-7"), "c": ("dt=2025-01-01", "fg-1")}
    assert sorted(table.snapshot("dt=2025-01-01").column("key").to_pylist()) == ["a", "c"]
    assert table.snapshot("dt=2025-01-05").column("key").to_pylist() == ["b"]
    assert table.snapshot(None).num_rows == 3
    stats = {s.partition: s for s in table.partitions()}
    assert stats["dt=2025-01-01"].live_keys == 2 and stats["dt=2025-01-01"].bucket_fills == {"fg-1": 2}
    assert stats["dt=2025-01-05"].live_keys == 1 and stats["dt=2025-01-05"].bucket_fills == {"fg-7": 1}


def test_partitioned_mode_move_is_tombstone_plus_insert(tmp_path):
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    with table.new_commit() as w:
        w.insert("old", ["a", "b"], "fg-1")
    with table.new_commit() as w:
        w.move(["a"], "old", "fg-1", "new", "fg-2")
    assert as_map(table.snapshot("old")) == {"b": "fg-1"}
    assert as_map(table.snapshot("new")) == {"a": "fg-2"}


def test_same_key_twice_in_one_commit_is_rejected(tmp_path):
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    writer = table.new_commit()
    writer.insert("p", ["a", "b"], "fg-1")
    writer.insert("p", ["a"], "fg-2")
    with pytest.raises(DuplicateKeyError, match="'a'"):
        writer.commit()
    assert table.snapshot("p").num_rows == 0
    timeline = table.io.path(".dbidx/timeline")
    assert sorted(set(os.listdir(timeline)) - {"staged", "heartbeats"}) == ["completed", "latest"]
    for kept_empty in ("staged", "heartbeats"):
        assert not os.path.exists(f"{timeline}/{kept_empty}") or not os.listdir(f"{timeline}/{kept_empty}")
