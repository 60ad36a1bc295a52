"""Commits, rollbacks, visibility, tombstones and point-in-time reads of the persisted index, on real files."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from dbidx.errors import InstantStateError, TableExistsError, TableNotFoundError
from dbidx.table.facade import Table
from dbidx.storage import layout
from dbidx.storage.records import ACTION_ROLLBACK


def entries(table: pa.Table) -> dict[str, str]:
    """key -> file group of a snapshot or lookup result."""
    return dict(zip(table.column("key").to_pylist(), table.column("file_group").to_pylist()))


@pytest.fixture()
def table(tmp_path) -> Table:
    return Table.create(str(tmp_path / "t"), num_shards=3, row_group_size=64)


def test_create_open_and_properties(tmp_path):
    created = Table.create(str(tmp_path / "t"), num_shards=5)
    opened = Table.open(str(tmp_path / "t"))
    assert opened.props == created.props
    assert opened.num_shards == 5 and not opened.global_index
    with pytest.raises(TableExistsError, match="already exists"):
        Table.create(str(tmp_path / "t"))
    with pytest.raises(TableNotFoundError, match="no dbidx table"):
        Table.open(str(tmp_path / "missing"))


def test_commit_is_visible_only_after_publish(table):
    writer = table.new_commit()
    writer.insert("dt=2025-01-01", ["a", "b", "c"], "fg-1")
    # Nothing is visible before the commit, not even the written-but-unpublished state.
    assert table.snapshot("dt=2025-01-01").num_rows == 0
    assert writer.instant in table.timeline.pending()
    record = writer.commit()
    assert record.seq == 1 and record.action == "commit"
    assert entries(table.snapshot("dt=2025-01-01")) == {"a": "fg-1", "b": "fg-1", "c": "fg-1"}
    assert table.timeline.pending() == []
    # Another process (a fresh Table object) sees the same.
    assert entries(Table.open(table.uri).snapshot("dt=2025-01-01")) == {"a": "fg-1", "b": "fg-1", "c": "fg-1"}


def test_delta_files_are_sorted_and_one_per_partition_and_shard(table):
    keys = [f"k{i:04d}" for i in range(500)]
    with table.new_commit() as w:
        w.insert("p", keys, "fg")
        w.insert("q", keys[:10], "fg")
    record = table.latest()
    groups = {(f.partition, f.shard) for f in record.files}
    assert len(groups) == len(record.files)
    assert {f.partition for f in record.files} == {"p", "q"}
    for f in record.files:
        file_keys = pa.parquet.read_table(table.io.path(f.path)).column("key").to_pylist()
        assert file_keys == sorted(file_keys)
        assert set(table.shard_of(file_keys).tolist()) == {f.shard}


def test_entries_out_of_key_order_are_never_written(table, monkeypatch):
    """The writer checks its sort (arrays.string_sort_indices is a fast path): entries out of order fail the commit
    with a CommitError naming the pair, and nothing is published."""
    from dbidx.errors import CommitError
    from dbidx.index import rli_files

    monkeypatch.setattr(rli_files, "sort_entries", lambda entries: entries.take(pa.array([1, 0, 2])))
    writer = table.new_commit()
    writer.insert("p", ["a", "b", "c"], "fg")
    with pytest.raises(CommitError, match="not in key order.*'b' before 'a'"):
        writer.commit()
    assert table.snapshot("p").num_rows == 0


def test_rollback_removes_files_and_blocks_commit(table):
    writer = table.new_commit()
    writer.insert("p", ["x", "y"], "fg")
    planned = [layout.delta_file("p", s, writer.instant) for s in range(3)]
    writer.rollback()
    assert all(not os.path.exists(table.io.path(p)) for p in planned)
    assert table.snapshot("p").num_rows == 0
    assert table.timeline.record_of(writer.instant).action == ACTION_ROLLBACK
    with pytest.raises(InstantStateError):
        writer.commit()


def test_crashed_writer_is_rolled_back_by_another_process(table):
    writer = table.new_commit()
    writer.insert("p", [f"k{i}" for i in range(50)], "fg")
    # Simulate a crash after the files were written but before the publish.
    groups = writer.buffer.sorted_groups()
    paths = [layout.delta_file(g[0], g[1], writer.instant) for g in groups]
    table.timeline.mark_inflight(writer.started, paths)
    writer.buffer.write(table.io, groups)
    other = Table.open(table.uri)
    assert other.timeline.pending() == [writer.instant]
    assert other.snapshot("p").num_rows == 0
    other.rollback(writer.instant)
    assert not any(os.path.exists(table.io.path(p)) for p in paths)
    assert other.timeline.pending() == []
    # The crashed writer can no longer publish.
    with pytest.raises(InstantStateError, match="rolled back"):
        writer.commit()


def test_exception_inside_context_rolls_back(table):
    with pytest.raises(RuntimeError):
        with table.new_commit() as w:
            w.insert("p", ["a"], "fg")
            raise RuntimeError("task failed")
    assert table.snapshot("p").num_rows == 0
    assert table.timeline.latest_seq == 1  # just the rollback record


def test_tombstone_and_reinsert_after_delete(table):
    with table.new_commit() as w:
        w.insert("p", ["a", "b", "c"], "fg-1")
    first = table.latest().instant
    with table.new_commit() as w:
        assert w.delete("p", ["b", "zzz-not-there"]) == 1
    assert entries(table.snapshot("p")) == {"a": "fg-1", "c": "fg-1"}
    with table.new_commit() as w:
        w.insert("p", ["b"], "fg-2")
    assert entries(table.snapshot("p")) == {"a": "fg-1", "b": "fg-2", "c": "fg-1"}
    # The old instant still reads as it was.
    assert entries(table.snapshot("p", as_of=first)) == {"a": "fg-1", "b": "fg-1", "c": "fg-1"}
    assert entries(table.snapshot("p", as_of=2)) == {"a": "fg-1", "c": "fg-1"}
    stats = {s.partition: s for s in table.partitions()}
    assert stats["p"].live_keys == 3
    assert stats["p"].bucket_fills == {"fg-1": 2, "fg-2": 1}


def test_snapshot_of_one_shard_is_the_hash_slice(table):
    keys = [f"key-{i}" for i in range(300)]
    with table.new_commit() as w:
        w.insert("p", keys, "fg")
    shards = table.shard_of(keys)
    for s in range(3):
        want = sorted(k for k, sh in zip(keys, shards) if sh == s)
        assert sorted(table.snapshot("p", shard=s).column("key").to_pylist()) == want


def test_instant_ids_are_unique_and_increasing(table):
    ids = [table.timeline.start("commit").instant for _ in range(20)]
    assert ids == sorted(ids) and len(set(ids)) == 20
    assert all(len(i) == 17 and i.isdigit() for i in ids)


def test_incremental_returns_inserts_and_tombstones_in_order(table):
    with table.new_commit() as w:
        w.insert("p", ["a", "b"], "fg")
    with table.new_commit() as w:
        w.insert("q", ["c"], "fg")
        w.delete("p", ["a"], "fg")
    inc = table.incremental(1, None)
    rows = sorted(
        zip(
            inc.column("partition").to_pylist(),
            inc.column("key").to_pylist(),
            inc.column("deleted").to_pylist(),
            inc.column("seq").to_pylist(),
        )
    )
    assert rows == [("p", "a", True, 2), ("q", "c", False, 2)]
    only_q = table.incremental(None, None, partitions=["q"])
    assert only_q.column("key").to_pylist() == ["c"]
    assert table.incremental(2, 2).num_rows == 0


def test_partition_stats_track_last_commit(table):
    with table.new_commit() as w:
        w.insert("dt=2025-01-01", ["a"], "00000000-aaaa")
    with table.new_commit() as w:
        w.insert("dt=2025-01-02", ["b", "c"], "00000001-bbbb")
    stats = {s.partition: s for s in table.partitions()}
    assert set(stats) == {"dt=2025-01-01", "dt=2025-01-02"}
    assert stats["dt=2025-01-02"].last_instant == table.latest().instant
    assert stats["dt=2025-01-01"].last_commit_ms <= stats["dt=2025-01-02"].last_commit_ms
    assert stats["dt=2025-01-02"].live_keys == 2


def test_table_is_picklable_and_reads_the_same(table):
    import pickle

    with table.new_commit() as w:
        w.insert("p", ["a", "b"], "fg")
    clone = pickle.loads(pickle.dumps(table))
    assert entries(clone.snapshot("p")) == entries(table.snapshot("p"))


def test_any_pyarrow_filesystem_works_through_the_same_code(tmp_path):
    import pyarrow.fs as pafs

    fs = pafs._MockFileSystem()
    table = Table.create("mem/table", num_shards=2, fs=fs)
    with table.new_commit() as w:
        w.insert("dt=2025-01-01", [f"k{i}" for i in range(100)], "fg")
    with table.new_commit() as w:
        w.delete("dt=2025-01-01", ["k1"])
    reopened = Table.open("mem/table", fs=fs)
    snap = reopened.snapshot("dt=2025-01-01")
    assert snap.num_rows == 99 and "k1" not in snap.column("key").to_pylist()
    found = reopened.lookup(["k5", "k1"], "dt=2025-01-01")
    assert found.column("key").to_pylist() == ["k5"]
    assert not pc.any(snap.column("deleted")).as_py()


def test_a_group_written_twice_in_one_instant_is_refused_before_anything_is_written(table):
    from dbidx.errors import CommitError
    from dbidx.index import rli_files as rf

    writer = table.new_commit()
    writer.insert("p", ["a"], "fg")
    shard = int(table.shard_of(["a"])[0])
    entries = rf.sort_entries(
        pa.table(
            {"key": ["a"], "file_group": ["fg"], "instant": [writer.instant], "deleted": [False]}, schema=table.schema
        )
    )
    task_file = rf.write_rli_file(table.io, layout.delta_file("p", shard, writer.instant, 7), entries, 64, "p", shard)
    writer.add_written([task_file], [], {}, [])
    with pytest.raises(CommitError, match="two index files for partition 'p'"):
        writer.commit()
    assert not os.path.exists(table.io.path(layout.delta_file("p", shard, writer.instant)))
    assert table.latest().action == ACTION_ROLLBACK
