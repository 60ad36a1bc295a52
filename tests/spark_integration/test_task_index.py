"""A task's index files (spark_integration/task_index.py) on a real table directory: one delta file per (partition,
shard) that gets entries, written partition by partition, all announced before any is written."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from dbidx.config import CacheConfig
from dbidx.errors import InvalidPartitionError
from dbidx.index import rli_files
from dbidx.table.facade import Table
from dbidx.table.writer import CommitWriter
from dbidx.spark_integration.tagger import TAG_FIELDS, TagOptions
from dbidx.spark_integration.task_index import write_task_index
from dbidx.storage import markers


def tagged_rows(rows: list[tuple[str, str, str | None, bool, bool]]) -> pa.Table:
    """(key, partition, file group, is_update, is_delete) rows as a tagger leaves them (old location: the same)."""
    keys, parts, fgs, updates, deletes = (list(c) for c in zip(*rows))
    columns = [
        parts,
        fgs,
        updates,
        [p if u else None for p, u in zip(parts, updates)],
        [f if u else None for f, u in zip(fgs, updates)],
        deletes,
    ]
    table = pa.table({"id": keys})
    for spec, values in zip(TAG_FIELDS, columns):
        table = table.append_column(spec, pa.array(values, spec.type))
    return table


def test_each_partition_gets_its_files_announced_first_and_only_entries_count(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    options = TagOptions(key="id", partition="dt", cache=CacheConfig(base_path=str(tmp_path / "c")))
    # dt=b comes first in the rows (dictionary code 0) but sorts after dt=a: files follow the names.
    rows = [(f"new-{i}", "dt=a" if i % 2 else "dt=b", "fg-1", False, False) for i in range(40)]
    rows += [(f"gone-{i}", "dt=a", "fg-1", True, True) for i in range(6)]  # tombstones
    rows += [(f"kept-{i}", "dt=c", "fg-2", True, False) for i in range(5)]  # updates in place: no entry, no file
    rows += [("missing", "dt=d", None, False, True)]  # a delete of a key that is not there: no entry
    writer = CommitWriter(table)
    staged: list[tuple[str, list[str]]] = []
    files, touched, changes = write_task_index(
        table,
        tagged_rows(rows),
        options,
        writer.instant,
        0,
        {0: 0, 1: 0},
        on_written=lambda record, entries: staged.append((record.path, entries.column(rli_files.KEY).to_pylist())),
    )
    # 1. One file per (partition, shard) with entries, in (partition, shard) order, exactly these announced, each
    #    handed to on_written once with its sorted entries.
    groups = [(f.partition, f.shard) for f in files]
    assert groups == sorted(groups) and {p for p, _ in groups} == {"dt=a", "dt=b"} and groups[0][0] == "dt=a"
    assert set(markers.announced_files(table.io, writer.instant)) == {f.path for f in files} | {
        t.path for t in touched if t.path and t.path not in {f.path for f in files}
    }
    read = {f.path: rli_files.read_rli_file(table.io, f) for f in files}
    assert staged == [(f.path, read[f.path].column(rli_files.KEY).to_pylist()) for f in files]
    # 2. Every entry once, sorted in its file; inserts and tombstones where they belong.
    keys = [k for t in read.values() for k in t.column(rli_files.KEY).to_pylist()]
    assert sorted(keys) == sorted([r[0] for r in rows[:46]])
    assert all(
        t.column(rli_files.KEY).to_pylist() == sorted(t.column(rli_files.KEY).to_pylist()) for t in read.values()
    )
    assert sum(f.tombstones for f in files) == 6 and sum(f.inserts for f in files) == 40
    assert all(f.tombstones == 0 for f in files if f.partition == "dt=b")
    # 3. The stats change: +1 per insert, -1 per tombstone, per file group too.
    assert changes["dt=a"].live == 20 - 6 and changes["dt=b"].live == 20 and set(changes) == {"dt=a", "dt=b"}
    assert changes["dt=a"].fills == {"fg-1": 14} and changes["dt=b"].fills == {"fg-1": 20}
    # 4. Touched keys: every tagged group; a group whose delta holds exactly its keys points at the delta file.
    by_group = {(t.partition, t.shard): t for t in touched}
    assert {p for p, _ in by_group} == {"dt=a", "dt=b", "dt=c", "dt=d"}
    assert all(by_group[(f.partition, f.shard)].path == f.path for f in files if f.partition == "dt=b")
    writer.rollback()


def test_a_bad_partition_name_is_refused_before_any_marker_or_file(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    options = TagOptions(key="id", partition="dt", cache=CacheConfig(base_path=str(tmp_path / "c")))
    writer = CommitWriter(table)
    rows = [("k1", "dt=a", "fg-1", False, False), ("k2", "dt=m/..", "fg-1", False, False)]
    with pytest.raises(InvalidPartitionError):
        write_task_index(table, tagged_rows(rows), options, writer.instant, 0, {0: 0}, shard=0)
    assert markers.announced_files(table.io, writer.instant) == []
    writer.rollback()
