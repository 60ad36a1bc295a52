"""Compaction, cleaning, incremental reads across them, and seek vs scan lookups, on real Parquet files."""

from __future__ import annotations

import random

import pytest

from dbidx.errors import HistoryCompactedError
from dbidx.index.compaction import compact
from dbidx.table.facade import Table

from tests.table.commit_during import commit_after_planning


def as_map(table) -> dict[str, str]:
    return dict(zip(table.column("key").to_pylist(), table.column("file_group").to_pylist()))


@pytest.fixture()
def table(tmp_path) -> Table:
    t = Table.create(str(tmp_path / "t"), num_shards=2, row_group_size=64)
    rng = random.Random(7)
    keys = [f"user-{i:05d}" for i in range(2000)]
    rng.shuffle(keys)
    for batch in range(4):
        with t.new_commit() as w:
            w.insert("dt=2025-01-01", keys[batch * 400 : (batch + 1) * 400], f"fg-{batch}")
    with t.new_commit() as w:
        w.delete("dt=2025-01-01", keys[:100])
    return t


def test_compaction_keeps_the_snapshot_and_drops_tombstones(table):
    before = as_map(table.snapshot("dt=2025-01-01"))
    assert len(before) == 1500
    result = compact(table)
    assert result.groups == 2 and result.files_replaced == 10
    after = as_map(table.snapshot("dt=2025-01-01"))
    assert after == before
    for s in range(2):
        files = table.refresh().files("dt=2025-01-01", s)
        assert [f.kind for f in files] == ["base"]
        assert files[0].tombstones == 0
    # Older instants still read as they were (the replaced files are kept until cleaned).
    assert len(as_map(table.snapshot("dt=2025-01-01", as_of=4))) == 1600


def test_snapshot_during_compaction_sees_the_old_files(table):
    """A compaction that has written its bases but not published them is invisible."""
    from dbidx.index import rli_files
    from dbidx.storage import layout
    from dbidx.storage.records import ACTION_COMPACTION

    before = as_map(table.snapshot("dt=2025-01-01"))
    started = table.timeline.start(ACTION_COMPACTION)
    merged = table.snapshot("dt=2025-01-01", shard=0)
    path = layout.base_file("dt=2025-01-01", 0, started.instant)
    table.timeline.mark_inflight(started, [path])
    rli_files.write_rli_file(table.io, path, merged.slice(0, 10), 64)  # a partial base on disk
    assert as_map(Table.open(table.uri).snapshot("dt=2025-01-01")) == before
    table.rollback(started.instant)
    assert as_map(table.snapshot("dt=2025-01-01")) == before


def test_commit_landing_during_compaction_stays_newer(table):
    """A delete published while a compaction ran must not be undone by the compaction's base."""
    view = table.refresh()
    victim = table.snapshot("dt=2025-01-01").column("key")[0].as_py()
    # Compaction reads the files as of now ...
    from dbidx.index import compaction

    with commit_after_planning(table, lambda w: w.delete("dt=2025-01-01", [victim])):
        compaction.compact(table)
    assert victim not in as_map(table.snapshot("dt=2025-01-01"))
    assert view is table.refresh()


def test_incremental_across_compaction_and_clean(table):
    full = table.incremental(0, None)
    assert full.num_rows == 1700
    assert table.compact().files_replaced > 0  # Table.compact/clean: the public spelling of the module functions
    # The compaction does not add incremental entries; the deltas are still readable.
    assert table.incremental(0, None).num_rows == 1700
    assert table.incremental(5, None).num_rows == 0
    with table.new_commit() as w:
        w.insert("dt=2025-01-01", ["late-key"], "fg-9")
    assert table.clean(retain_completions=0) is not None
    # Reads after the clean horizon work; reads reaching behind it say so clearly.
    assert table.incremental(6, None).column("key").to_pylist() == ["late-key"]  # seq 6 = compaction, 7 = late-key
    with pytest.raises(HistoryCompactedError, match="reload"):
        table.incremental(0, None)
    with pytest.raises(HistoryCompactedError):
        table.snapshot("dt=2025-01-01", as_of=3)
    assert len(as_map(table.snapshot("dt=2025-01-01"))) == 1501


@pytest.mark.parametrize("n_keys", [1, 20, 700])
def test_seek_scan_and_auto_agree(table, n_keys):
    rng = random.Random(n_keys)
    live = table.snapshot("dt=2025-01-01").column("key").to_pylist()
    probe = rng.sample(live, min(n_keys, len(live))) + [f"absent-{i}" for i in range(n_keys)]
    results = {}
    for mode in ("seek", "scan", "auto"):
        plan: dict[str, int] = {}
        results[mode] = as_map(table.lookup(probe, "dt=2025-01-01", mode=mode, plan=plan))
        assert plan, mode
    assert results["seek"] == results["scan"] == results["auto"]
    assert set(results["seek"]) == set(probe) & set(live)


def test_lookup_after_compaction_and_of_deleted_keys(table):
    live = set(table.snapshot("dt=2025-01-01").column("key").to_pylist())  # once, not once per candidate
    deleted = [k for k in [f"user-{i:05d}" for i in range(2000)] if k not in live][:5]
    assert table.lookup(deleted, "dt=2025-01-01").num_rows == 0
    compact(table)
    assert table.lookup(deleted, "dt=2025-01-01").num_rows == 0
    some = table.snapshot("dt=2025-01-01").column("key").to_pylist()[:3]
    assert sorted(table.lookup(some, "dt=2025-01-01").column("key").to_pylist()) == sorted(some)
