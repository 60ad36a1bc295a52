"""Bad input and damaged files give typed errors that name the culprit; nothing half-written stays behind."""

from __future__ import annotations

import os

import pytest

from dbidx.errors import CorruptFileError, DbidxError, InvalidKeyError, InvalidPartitionError
from dbidx.table.facade import Table
from dbidx.storage import layout


@pytest.fixture()
def table(tmp_path) -> Table:
    return Table.create(str(tmp_path / "t"), num_shards=2)


@pytest.mark.parametrize(
    "bad", ["../escape", "a/../../b", "/etc/passwd", "a\x00b", "a//b", "./a", "a/", ".dbidx/rli", "C:/x", "a\\b"]
)
def test_bad_partition_paths_are_rejected_by_name(table, bad):
    writer = table.new_commit()
    with pytest.raises(InvalidPartitionError) as info:
        writer.insert(bad, ["k"], "fg")
    assert repr(bad) in str(info.value)
    writer.rollback()
    with pytest.raises(InvalidPartitionError):
        table.snapshot(bad)


@pytest.mark.parametrize("keys", [[""], ["ok", None], [None]])
def test_empty_or_null_keys_are_rejected(table, keys):
    with pytest.raises(InvalidKeyError, match="position"):
        with table.new_commit() as w:
            w.insert("p", keys, "fg")
    assert table.snapshot("p").num_rows == 0
    with pytest.raises(InvalidKeyError):
        table.lookup([""], "p")


def test_unusual_but_valid_partition_paths_round_trip(table):
    paths = ["dt=2025-01-15/hour=03", "région=Île de France", "a b/c=d", "/".join(["x" * 250] * 2), ""]
    with table.new_commit() as w:
        for i, p in enumerate(paths):
            w.insert(p, [f"key-{i}"], "fg")
    for i, p in enumerate(paths):
        assert table.snapshot(p).column("key").to_pylist() == [f"key-{i}"]
    names = {layout.partition_dir_name(p) for p in paths}
    assert len(names) == len(paths) and all(len(n) <= 200 and "/" not in n for n in names)


def _first_rli_file(table: Table) -> str:
    record = table.latest()
    return table.io.path(record.files[0].path)


def test_truncated_rli_file_is_named(table):
    with table.new_commit() as w:
        w.insert("p", [f"k{i}" for i in range(1000)], "fg")
    path = _first_rli_file(table)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(CorruptFileError, match=path.replace("\\", "\\\\")):
        Table.open(table.uri).snapshot("p")


def test_rli_file_replaced_by_a_shorter_valid_file_is_detected(table):
    import pyarrow.parquet as pq

    with table.new_commit() as w:
        w.insert("p", [f"k{i}" for i in range(1000)], "fg")
    path = _first_rli_file(table)
    pq.write_table(pq.read_table(path).slice(0, 10), path)
    with pytest.raises(CorruptFileError, match="bytes but its commit recorded"):
        Table.open(table.uri).snapshot("p")


def test_garbage_completion_record_is_named(table):
    with table.new_commit() as w:
        w.insert("p", ["a"], "fg")
    path = table.io.path(layout.completed_file(1))
    with open(path, "wb") as f:
        f.write(b"{not json")
    with pytest.raises(CorruptFileError, match="000000000001.json"):
        Table.open(table.uri).snapshot("p")


def test_missing_rli_file_is_named(table):
    with table.new_commit() as w:
        w.insert("p", ["a", "b"], "fg")
    path = _first_rli_file(table)
    os.remove(path)
    with pytest.raises(CorruptFileError, match="missing"):
        Table.open(table.uri).snapshot("p")


def test_out_of_range_arguments(table):
    with pytest.raises(DbidxError, match="shard"):
        table.snapshot("p", shard=2)
    with pytest.raises(DbidxError, match="num_shards"):
        Table.create(table.uri + "-x", num_shards=0)
    with pytest.raises(DbidxError, match="not a completed instant"):
        table.snapshot("p", as_of="20990101000000000")


def test_stray_file_in_the_completion_log_and_bad_instants_are_named(table):
    from dbidx.errors import InvalidInputError

    with table.new_commit() as w:
        w.insert("p=1", ["a"], "fg")
    stray = os.path.join(table.uri, ".dbidx", "timeline", "completed", "notes.json")
    with open(stray, "w") as fh:
        fh.write("{}")
    with pytest.raises(CorruptFileError, match="notes.json"):
        Table.open(table.uri).snapshot("p=1")
    os.remove(stray)
    for bad in ("2025", "2025010100000000x", 20250101000000000):
        with pytest.raises(InvalidInputError, match="17-digit"):
            table.snapshot("p=1", as_of=bad if isinstance(bad, str) else str(bad) + "0")
