"""Data compaction per file group under the random change stream of the oracle tests, with a concurrent upsert."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pyarrow as pa
import pytest

from dbidx.buckets.assigner import BucketSpec
from dbidx.config import CacheConfig
from dbidx.data import compaction as data_compaction, reads
from dbidx.errors import CorruptFileError
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table
from dbidx.spark_integration.local import upsert_arrow
from dbidx.storage.data_view import DataView

from tests.retention import clean_without_waiting
from tests.spark_helpers import Oracle, random_batch


def as_arrow(batch: list[tuple]) -> pa.Table:
    ids, days, values, deletes = zip(*batch)
    return pa.table(
        {"id": list(ids), "dt": list(days), "v": pa.array(values, pa.int64()), "_dbidx_delete": list(deletes)}
    )


def current(table: Table) -> set[tuple]:
    data = reads.read_arrow(table)
    days = [d.split("=", 1)[1] if "=" in d else d for d in data.column("dt").to_pylist()]
    return set(zip(data.column("id").to_pylist(), days, data.column("v").to_pylist()))


def data_files_on_disk(table: Table) -> set[str]:
    return {
        rel
        for rel, _ in table.io.list_files_recursive("")
        if rel.endswith(".parquet") and not rel.startswith(".dbidx/")
    }


@pytest.mark.slow
@pytest.mark.parametrize("global_index", [False, True], ids=["partitioned", "global"])
def test_compaction_keeps_every_row_and_a_concurrent_upsert_lands(
    tmp_path: Path, monkeypatch, global_index: bool
) -> None:
    rng = random.Random(20261123 + global_index)
    table = Table.create(str(tmp_path / "t"), num_shards=3, global_index=global_index)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    oracle, serial = Oracle(global_index), [0]

    def upsert(batch: list[tuple]) -> None:
        upsert_arrow(
            as_arrow(batch), table, key="id", partition="dt", buckets=BucketSpec(capacity=7), cache_config=config
        )
        oracle.apply(batch)

    for _ in range(12):
        upsert(random_batch(rng, oracle, serial))
    assert current(table) == oracle.expected_rows()
    before = reads.plan_read(table)
    # 1. A compaction during which another writer commits a batch touching the same file groups.
    concurrent = random_batch(rng, oracle, serial)
    real_write_base = data_compaction.rewrite_file_group
    calls, first = [], threading.Lock()  # the pieces run on threads: exactly one of them commits the batch

    def write_base_while_an_upsert_commits(*args, **kwargs):
        with first:
            if not calls:
                upsert(concurrent)  # commits after the compaction's snapshot, before its publish
            calls.append(1)
        return real_write_base(*args, **kwargs)

    monkeypatch.setattr(data_compaction, "rewrite_file_group", write_base_while_an_upsert_commits)
    result = table.compact_data(min_files=2)
    monkeypatch.undo()
    assert result.record is not None and result.files_replaced > result.file_groups
    # 2. Same rows as the oracle (the concurrent batch included), from fewer files.
    assert current(table) == oracle.expected_rows()
    after = reads.plan_read(table)
    assert sum(len(u.files) for u in after.units) < sum(len(u.files) for u in before.units)
    # 3. Later upserts merge on top of the bases; a second compaction leaves one file per group.
    for _ in range(3):
        upsert(random_batch(rng, oracle, serial))
    table.compact_data(min_files=2)
    assert current(table) == oracle.expected_rows()
    assert all(len(u.files) == 1 for u in reads.plan_read(table).units)
    # 4. Clean deletes replaced files once they are old enough, and the table still verifies and reads the same.
    on_disk = data_files_on_disk(table) | {
        p.relative_to(tmp_path / "t").as_posix() for p in tmp_path.joinpath("t").glob("**/deletion_vector_*.bin")
    }
    clean_without_waiting(table)
    cleaned = table.clean(retain_completions=0)
    assert cleaned is not None and set(cleaned.deleted) <= on_disk  # data files and DV files no vector points into
    assert data_files_on_disk(table) == {f.path for u in reads.plan_read(table).units for f in u.files}
    assert verify_table(table).ok
    assert current(table) == oracle.expected_rows()


def test_clean_refuses_a_replaced_path_no_commit_listed(tmp_path: Path) -> None:
    """Crafted metadata naming a file outside the table's data must not make clean delete it."""
    from dataclasses import replace

    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    for v in range(2):
        upsert_arrow(as_arrow([("a", "d", v, False)]), table, key="id", partition="dt", cache_config=config)
    record = table.compact_data().record
    crafted = replace(record, replaced=record.replaced + ("dt=d/someone-elses.parquet",))
    with pytest.raises(CorruptFileError, match="not a live data file"):
        DataView().apply(table.timeline.completed()[:-1] + [crafted])


def test_cli_compact_data(tmp_path: Path) -> None:
    import json

    from click.testing import CliRunner

    from dbidx.cli import main

    table = Table.create(str(tmp_path / "t"), num_shards=2)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    for v in range(3):
        upsert_arrow(
            as_arrow([(f"k{i}", "d", v, False) for i in range(20)] + [("gone", "d", v, v == 2)]),
            table,
            key="id",
            partition="dt",
            cache_config=config,
        )
    before = current(table)
    clean_without_waiting(table)
    result = CliRunner().invoke(main, ["compact", table.uri, "--data", "--retain", "0", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["data"]["file_groups"] >= 1 and report["data"]["rows_written"] == 20
    assert report["files_deleted"] >= report["data"]["files_replaced"]
    assert current(table) == before and len(before) == 20
    text = CliRunner().invoke(main, ["compact", table.uri, "--data"])
    assert text.exit_code == 0 and "compacted 0 data file groups" in text.output


def test_a_compaction_published_between_snapshot_and_start_is_a_conflict(tmp_path: Path, monkeypatch) -> None:
    """Another compaction (and an upsert) landing after this compaction planned, before it started: this one must
    publish nothing, and the upsert's newer row must stay the answer."""
    from dbidx.errors import ConflictError
    from dbidx.storage import timeline as timeline_module

    table = Table.create(str(tmp_path / "t"), num_shards=1)
    other = Table.open(table.uri)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    for v in (1, 2):
        upsert_arrow(as_arrow([("k", "a", v, False)]), table, key="id", partition="dt", cache_config=config)
    real_start = timeline_module.Timeline.start
    done = []

    def start_after_another_compaction(self, action, ignore=(), **kw):
        if action == "data_compaction" and not done:
            done.append(1)
            assert other.compact_data().files_replaced == 2
            upsert_arrow(as_arrow([("k", "a", 3, False)]), other, key="id", partition="dt", cache_config=config)
        return real_start(self, action, ignore, **kw)

    monkeypatch.setattr(timeline_module.Timeline, "start", start_after_another_compaction)
    with pytest.raises(ConflictError, match="overlaps data compaction"):
        table.compact_data()
    monkeypatch.undo()
    assert current(Table.open(table.uri)) == {("k", "a", 3)}


def test_a_read_planned_before_a_clean_says_so(tmp_path: Path) -> None:
    """A reader whose plan predates a compaction + clean gets HistoryCompactedError (read again), not 'damaged'."""
    from dbidx.errors import HistoryCompactedError

    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    for v in range(2):
        upsert_arrow(as_arrow([("a", "d", v, False)]), table, key="id", partition="dt", cache_config=config)
    plan = reads.plan_read(table)
    schema = reads.output_schema(plan)
    table.compact_data()
    clean_without_waiting(table)
    table.clean(retain_completions=0)
    with pytest.raises(HistoryCompactedError, match="removed by a clean after this read was planned"):
        list(reads.read_units(table.io, plan.units, plan.key, schema, table))
    assert current(table) == {("a", "d", 1)}  # planned again: fine


def test_a_file_is_rewritten_once_enough_of_its_rows_are_deleted(tmp_path: Path) -> None:
    """The deleted-share rule alone (min_files out of reach), per file: 5 of the first file's 10 rows superseded."""
    from dbidx.errors import InvalidInputError

    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    upsert_arrow(
        as_arrow([(f"k{i}", "d", 0, False) for i in range(10)]), table, key="id", partition="dt", cache_config=config
    )
    upsert_arrow(
        as_arrow([(f"k{i}", "d", 1, False) for i in range(5)]), table, key="id", partition="dt", cache_config=config
    )
    before = current(table)
    assert table.compact_data(min_files=100, deleted_share=None).record is None
    assert table.compact_data(min_files=100, deleted_share=0.6).record is None
    with pytest.raises(InvalidInputError, match="deleted_share"):
        table.compact_data(deleted_share=0.0)
    with pytest.raises(InvalidInputError, match="target_file_bytes"):
        table.compact_data(target_file_bytes=0)
    result = table.compact_data(min_files=100, deleted_share=0.5)
    assert result.record is not None and result.files_replaced == 1 and result.rows_written == 5
    assert current(table) == before
    (unit,) = reads.plan_read(table).units
    assert len(unit.files) == 2 and unit.vectors == (None, None)


def test_files_at_the_target_size_are_left_alone(tmp_path: Path) -> None:
    """The size rule: only files under target_file_bytes count toward min_files, so a group's large base is not
    rewritten again because small files joined it; None makes every file small."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    upsert_arrow(
        as_arrow([(f"k{i}", "d", i, False) for i in range(2000)]), table, key="id", partition="dt", cache_config=config
    )
    for n in range(2):
        upsert_arrow(as_arrow([(f"n{n}", "d", 0, False)]), table, key="id", partition="dt", cache_config=config)
    before = current(table)
    sizes = sorted(f.size for f in reads.plan_read(table).units[0].files)
    assert table.compact_data(target_file_bytes=sizes[0]).record is None  # nothing is small
    result = table.compact_data(target_file_bytes=sizes[-1])  # the two one-row files only
    assert result.files_replaced == 2 and result.rows_written == 2
    assert current(table) == before
    assert len(reads.plan_read(table).units[0].files) == 2
    assert table.compact_data(target_file_bytes=None).files_replaced == 2  # now the base too
    assert current(table) == before
