"""Touched-keys files: a task's one file of several partitions reads back per partition, verified."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest

from dbidx.errors import ConflictError, CorruptFileError
from dbidx.index.conflicts import TouchedKeys, check_conflicts, write_touched_groups
from dbidx.table.facade import Table
from dbidx.storage import layout


def test_a_task_touched_file_reads_back_each_partitions_keys_and_finds_a_conflict(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    since = table.timeline.latest_seq
    instant = table.timeline.start("commit").instant
    groups = [("p1", pa.array(["a", "c"])), ("p2", pa.array(["a", "b", "z"]))]
    records = write_touched_groups(table.io, layout.touched_file(0, instant, 3), groups, 0, since)
    assert [r.load(table.io).to_pylist() for r in records] == [["a", "c"], ["a", "b", "z"]]
    assert [(r.partition, r.min_key, r.max_key) for r in records] == [("p1", "a", "c"), ("p2", "a", "z")]
    # A commit that landed meanwhile with an entry for "b" in p2 (not in p1) conflicts on p2 only.
    with table.new_commit() as writer:
        writer.insert("p2", ["b"], "fg")
        writer.insert("p1", ["b"], "fg")
    news = table.timeline.completed(after_seq=since)
    with pytest.raises(ConflictError, match="'b'") as caught:
        check_conflicts(table.io, instant, news, {("p1", 0): records[0], ("p2", 0): records[1]})
    assert "p2" in str(caught.value)
    check_conflicts(table.io, instant, news, {("p1", 0): records[0]})  # p1 touched only a and c: no conflict
    damaged = replace(records[0], checksum="0" * 16)
    with pytest.raises(CorruptFileError, match="touched-keys file"):
        damaged.load(table.io)
    # A record naming a partition the file does not hold (or another key range) is damage, never "no keys".
    for forged in (replace(records[0], partition="p9"), replace(records[1], max_key="y")):
        with pytest.raises(CorruptFileError, match="does not hold the keys its record states"):
            forged.load(table.io)


def test_a_global_delta_file_serving_as_touched_keys_reads_back_whole(tmp_path: Path) -> None:
    """A global-mode delta file (which has a `partition` column) stands for its group's touched keys when it holds all
    of them: every key comes back (a filter on that column would drop them all and hide conflicts)."""
    table = Table.create(str(tmp_path / "t"), num_shards=1, global_index=True)
    with table.new_commit() as writer:
        writer.insert("p1", ["a", "b"], "fg")
        writer.insert("p2", ["c"], "fg")
    delta = table.latest().files[0]
    touched = TouchedKeys(None, 0, delta.min_key, delta.max_key, 0, delta.path, delta.size, delta.checksum)
    assert touched.load(table.io).to_pylist() == ["a", "b", "c"]
