"""Checkpoints and archive bundles: a table opened from a checkpoint is the table replayed from its first record,
under the random change stream of the oracle tests (upserts, index and data compactions, cleans), and every damaged
or crafted checkpoint is a loud error."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import pytest

from dbidx.buckets.assigner import BucketSpec
from dbidx.config import CacheConfig
from dbidx.data import reads
from dbidx.errors import CorruptFileError, HistoryCompactedError
from dbidx.table import facade as table_module
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table
from dbidx.spark_integration.driver import commit_history
from dbidx.spark_integration.local import upsert_arrow
from dbidx.storage import checkpoint, layout
from dbidx.storage.data_view import DataView
from dbidx.storage.index_view import IndexView

from tests.spark_helpers import Oracle, random_batch
from tests.data.test_compaction import as_arrow, current
from tests.retention import clean_without_waiting

INTERVAL = 4


def replayed(table: Table) -> tuple[dict, dict]:
    """Index and data views folded from record 1 (archived records included), in checkpoint form."""
    records = table.timeline.completed()
    assert [r.seq for r in records] == list(range(1, table.timeline.latest_seq + 1))
    index, data = IndexView(), DataView()
    index.apply(records)
    data.apply(records)
    return index.to_dict(), data.to_dict()


def build(tmp_path: Path, global_index: bool, batches: int = 22) -> tuple[Table, Oracle, CacheConfig]:
    """A table written by a random stream with index and data compactions and cleans between the upserts."""
    rng = random.Random(1123 + global_index)
    table = Table.create(str(tmp_path / "t"), num_shards=2, global_index=global_index, checkpoint_interval=INTERVAL)
    clean_without_waiting(table)  # the cleans take replaced data and DV files too (the views fold their deletion)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    oracle, serial = Oracle(global_index), [0]
    for i in range(batches):
        batch = random_batch(rng, oracle, serial, size=30)
        upsert_arrow(
            as_arrow(batch), table, key="id", partition="dt", buckets=BucketSpec(capacity=5), cache_config=config
        )
        oracle.apply(batch)
        if i % 6 == 5:
            table.compact()
            table.compact_data()
            table.clean(retain_completions=1)
    return table, oracle, config


@pytest.mark.slow
@pytest.mark.parametrize("global_index", [False, True], ids=["partitioned", "global"])
def test_a_table_opened_from_a_checkpoint_is_the_replayed_table(tmp_path: Path, global_index: bool) -> None:
    table, oracle, config = build(tmp_path, global_index)
    latest = table.timeline.latest_seq
    # 1. Checkpoints were written every INTERVAL completions; the two newest stay, older records are bundled.
    seqs = checkpoint.checkpoint_seqs(table.io)
    assert len(seqs) == 2 and seqs[-1] >= latest - INTERVAL
    archived = checkpoint.archive_ranges(table.io)
    assert archived and archived[0][0] == 1 and archived[-1][1] == seqs[0]
    assert len(table.io.list_names(layout.COMPLETED_DIR)) <= latest - seqs[0]
    # 2. A new reader starts from the newest checkpoint and reads only the records after it...
    fresh = Table.open(table.uri)
    fresh.refresh()
    assert fresh.timeline.base_seq == seqs[-1] and fresh.timeline.latest_seq == latest
    assert len(fresh.timeline._records) == latest - seqs[-1]
    # 3. ...and holds exactly what a replay of every record gives (history read back from the bundles).
    opened = fresh._view.to_dict(), fresh._data.to_dict()
    assert opened == replayed(fresh)
    assert current(fresh) == oracle.expected_rows()
    assert verify_table(fresh).ok
    # 4. History stays available on demand: every commit, the seq of the first instant.
    history = commit_history(fresh, last=1000)
    assert [h["seq"] for h in history] == list(range(latest, 0, -1))
    first = history[-1]["instant"]
    assert fresh.timeline.seq_of(first) == 1
    # 5. Writes continue on top of a checkpoint-opened table, caches catch up, and the stream stays exact.
    rng = random.Random(7)
    for _ in range(INTERVAL + 1):
        batch = random_batch(rng, oracle, [10_000], size=20)
        upsert_arrow(
            as_arrow(batch), fresh, key="id", partition="dt", buckets=BucketSpec(capacity=5), cache_config=config
        )
        oracle.apply(batch)
    assert current(Table.open(table.uri)) == oracle.expected_rows()
    # 6. The process that wrote the first records (and read them as files) keeps refreshing after the archiving.
    table.refresh()
    assert table.timeline.latest_seq == fresh.timeline.latest_seq


@pytest.mark.slow
def test_reads_from_before_a_pruned_history_are_refused(tmp_path: Path) -> None:
    """A checkpoint leaves out files that were replaced and cleaned: a read reaching back past them is
    HistoryCompactedError (caches reload), never a silently shorter answer."""
    table, _, _ = build(tmp_path, False, batches=14)
    fresh = Table.open(table.uri)
    fresh.refresh()
    floor = fresh._view.history_floor
    assert floor > 0  # the stream cleaned replaced files before the newest checkpoint
    with pytest.raises(HistoryCompactedError, match="checkpoint"):
        fresh.incremental(0)
    with pytest.raises(HistoryCompactedError, match="checkpoint"):
        fresh.snapshot(fresh.partitions()[0].partition, as_of=floor - 1)
    plan = fresh.incremental_plan(0, fresh.timeline.latest_seq)
    assert plan and all(cleaned for _, cleaned in plan.values())
    assert fresh.incremental(fresh.timeline.latest_seq - 1).num_rows >= 0  # recent history reads fine


def test_a_failing_checkpoint_write_never_fails_the_commit(tmp_path: Path, monkeypatch) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1, checkpoint_interval=1)

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(table_module, "write_checkpoint", broken)  # what Table.checkpoint calls
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with table.new_commit() as writer:
            writer.insert("p", ["a", "b"], "fg")
    assert table.timeline.latest_seq == 1 and checkpoint.checkpoint_seqs(table.io) == []
    assert any("disk full" in str(w.message) for w in caught)
    assert Table.open(table.uri).lookup(["a"], "p").num_rows == 1


def small_table(tmp_path: Path, commits: int = 6) -> Table:
    table = Table.create(str(tmp_path / "t"), num_shards=1, checkpoint_interval=2)
    for i in range(commits):
        with table.new_commit() as writer:
            writer.insert("p", [f"k{i}"], "fg")
    return table


def test_a_damaged_checkpoint_is_loud_and_removing_it_opens_from_the_log(tmp_path: Path) -> None:
    table = small_table(tmp_path)
    newest = checkpoint.checkpoint_seqs(table.io)[-1]
    path = Path(table.io.path(layout.checkpoint_file(newest)))
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptFileError, match=f"checkpoint .*{path.name}"):
        Table.open(table.uri).refresh()
    path.unlink()
    fresh = Table.open(table.uri)
    assert fresh.lookup([f"k{i}" for i in range(6)], "p").num_rows == 6
    assert fresh.timeline.base_seq < newest


def reseal(table: Table, seq: int, change) -> None:
    """Rewrite a checkpoint with a valid checksum around a crafted change (what an attacker could do)."""
    cp = checkpoint.read_checkpoint(table.io, seq, table.props.table_id)
    payload = {
        "format": checkpoint.CHECKPOINT_FORMAT,
        "table_id": table.props.table_id,
        "seq": cp.seq,
        "max_instant": cp.max_instant,
        "index": cp.index,
        "data": cp.data,
    }
    change(payload)
    Path(table.io.path(layout.checkpoint_file(seq))).write_bytes(checkpoint.seal(payload))


@pytest.mark.parametrize(
    "craft, match",
    [
        (lambda p: p["index"]["files"][0]["file"].update(path="../outside.parquet"), "outside|segment"),
        (lambda p: p["index"]["files"][0]["file"].update(shard=7), "shard 7"),
        (lambda p: p.update(table_id="0" * 32), "belongs to table"),
        (
            lambda p: p["data"]["replaced"].append({"path": ".dbidx/table.json", "seq": 1, "source": False}),
            "metadata folder",
        ),
        (lambda p: p["index"].update(applied_seq=1), "not at its own seq"),
    ],
    ids=["path-escape", "shard-range", "other-table", "metadata-as-data", "seq-mismatch"],
)
def test_a_crafted_checkpoint_is_refused(tmp_path: Path, craft, match) -> None:
    table = small_table(tmp_path)
    reseal(table, checkpoint.checkpoint_seqs(table.io)[-1], craft)
    with pytest.raises(CorruptFileError, match=match):
        Table.open(table.uri).refresh()


def test_a_checkpoint_beyond_the_log_and_stray_files_are_refused(tmp_path: Path) -> None:
    table = small_table(tmp_path)
    newest = checkpoint.checkpoint_seqs(table.io)[-1]
    src = Path(table.io.path(layout.checkpoint_file(newest)))
    beyond = Path(table.io.path(layout.checkpoint_file(99)))
    beyond.write_bytes(src.read_bytes())
    with pytest.raises(CorruptFileError, match="says seq|beyond the end"):
        Table.open(table.uri).refresh()
    beyond.unlink()
    (src.parent / "notes.txt").write_text("x")
    with pytest.raises(CorruptFileError, match="unexpected file"):
        Table.open(table.uri).refresh()


def test_an_explicit_checkpoint_and_an_empty_table(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1, checkpoint_interval=0)
    assert table.checkpoint() is None  # nothing to fold yet
    with table.new_commit() as writer:
        writer.insert("p", ["a"], "fg")
    assert checkpoint.checkpoint_seqs(table.io) == []  # interval 0: never on its own
    assert table.checkpoint() == 1 and table.checkpoint() is None
    fresh = Table.open(table.uri)
    assert fresh.lookup(["a"], "p").num_rows == 1 and fresh.timeline.base_seq == 1
    assert reads.read_arrow(fresh).num_rows == 0


def test_a_cache_behind_a_pruned_history_reloads_every_partition(tmp_path: Path) -> None:
    """Opened from a checkpoint that left out cleaned files, the table cannot tell which partitions changed
    after the cache's watermark: catch-up reloads them all, and the cache matches the table."""
    from dbidx.cache.catchup import sync
    from dbidx.cache.loading import load_from_snapshot
    from dbidx.cache.verify import verify

    from tests.cache_helpers import DAY1, DAY2, DAY3, make_table, open_cache, truth

    table = make_table(tmp_path)
    with open_cache(table, 0, tmp_path / "c") as cache:
        for p in (DAY1, DAY2, DAY3):
            load_from_snapshot(cache, table, p, table.timeline.latest_seq)
        cache.set_watermark(table.timeline.latest_seq)
        keys = [f"x-{i}" for i in range(40)]
        with table.new_commit() as w:
            w.insert(DAY1, [k for k, s in zip(keys, table.shard_of(keys)) if s == 0], "fg-x")
        table.compact()
        table.clean(retain_completions=0)
        with table.new_commit() as w:
            w.insert(DAY2, ["late"], "fg-late")
        table.checkpoint()
        fresh = Table.open(table.uri)
        result = sync(cache, fresh)
        assert sorted(result.reloaded_partitions) == sorted([DAY1, DAY2, DAY3]) and not result.applied_partitions
        for p in (DAY1, DAY2, DAY3):
            assert dict(cache.items(p)) == truth(fresh, p, 0)
        assert verify(cache, fresh).ok


def test_verify_compares_the_checkpoint_with_a_replay(tmp_path: Path) -> None:
    table = small_table(tmp_path)
    check = verify_table(Table.open(table.uri))
    assert check.ok and check.checkpoint_seq == checkpoint.checkpoint_seqs(table.io)[-1]
    # A well-formed checkpoint (valid checksum) that leaves out a live file: opening trusts it, verify does not.
    reseal(table, check.checkpoint_seq, lambda p: p["index"]["files"].pop(0))
    check = verify_table(Table.open(table.uri))
    assert not check.ok and "differs from a replay" in check.damaged[0]["problem"]


def test_a_record_archived_between_listing_and_reading_comes_from_its_bundle(tmp_path: Path) -> None:
    """A reader listed record files, then an archiver bundled and removed them: the reader takes them from the
    bundle; a listed record that is there but damaged stays a CorruptFileError."""
    table = small_table(tmp_path)
    archived = checkpoint.archive_ranges(table.io)
    assert archived and archived[0][0] == 1
    first, last = archived[0]
    stale_listing = set(range(1, table.timeline.latest_seq + 1))  # what a reader saw before the archiving
    records = checkpoint.read_records(table.io, table.props.table_id, range(first, last + 1), stale_listing)
    assert [r.seq for r in records] == list(range(first, last + 1))
    newest = table.timeline.latest_seq
    Path(table.io.path(layout.completed_file(newest))).write_bytes(b"{not json")
    with pytest.raises(CorruptFileError, match="not valid"):
        checkpoint.read_records(table.io, table.props.table_id, range(newest, newest + 1), stale_listing)


def test_a_damaged_archived_record_names_its_bundle(tmp_path: Path) -> None:
    """A record inside a (validly sealed) bundle that fails its own checksum: the error names the bundle it was read
    from, not a completed/<seq>.json that does not exist."""
    table = small_table(tmp_path)
    first, last = checkpoint.archive_ranges(table.io)[0]
    records = checkpoint.read_archive(table.io, first, last, table.props.table_id)
    records[first] = records[first].replace(b'"seq"', b'"seq" ', 1).replace(b"1", b"2", 1)
    bundle = table.io.path(layout.archive_file(first, last))
    Path(bundle).unlink()
    assert checkpoint.write_archive(table.io, table.props.table_id, first, [records[s] for s in range(first, last + 1)])
    with pytest.raises(CorruptFileError, match=f"completion record {first} in archive bundle {bundle}"):
        checkpoint.read_records(table.io, table.props.table_id, range(first, first + 1), set())
