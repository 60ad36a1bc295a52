"""Size-tiered index compaction (`base_share`): a group's base is left alone until the files after it hold a share
of its bytes, and until then its newest run of files is merged into one merged file that keeps tombstones. Real
Parquet files on a temp dir; the plan's rule alone is checked on file records (pure logic above the storage)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from dbidx.errors import CorruptFileError, InvalidInputError
from dbidx.index import compaction
from dbidx.index.compaction import plan_group
from dbidx.table.facade import Table
from dbidx.storage.records import ACTION_COMMIT, CompletedInstant, FileRecord

from tests.table.commit_during import commit_after_planning

P = "dt=2025-01-01"


def rec(kind: str, size: int, name: str = "", tombstones: int = 0) -> FileRecord:
    return FileRecord(
        path=f"{kind}-{name or size}.parquet",
        partition=P,
        shard=0,
        kind=kind,
        rows=size,
        inserts=size - tombstones,
        tombstones=tombstones,
        min_key="a",
        max_key="z",
        size=size,
        checksum="xxh64:" + "0" * 16,
    )


def as_map(table: Table) -> dict[str, str]:
    snap = table.snapshot(P)
    return dict(zip(snap.column("key").to_pylist(), snap.column("file_group").to_pylist()))


# --- the plan, on file records -----------------------------------------------------------------------------------


def test_plan_waits_below_min_files_and_leaves_a_clean_lone_base():
    assert plan_group([rec("base", 100), rec("delta", 1)], 3, 0.25) is None
    assert plan_group([rec("base", 100)], 1, 0.25) is None
    assert plan_group([rec("base", 100, tombstones=1)], 1, 0.25).into_base  # a base with tombstones: rewritten


def test_plan_merges_the_newest_run_until_the_share_is_reached():
    deltas = [rec("delta", 10, str(i)) for i in range(9)]
    plan = plan_group([rec("base", 1000), *deltas], 10, 0.25)
    assert plan is not None and not plan.into_base and plan.files == tuple(deltas)  # base left alone
    # A file much larger than the run after it waits; the run is merged on its own.
    big = rec("merged", 170, "big")  # more than twice the 80 entries after it
    plan = plan_group([rec("base", 2000), big, *deltas[:8]], 10, 0.25)
    assert plan.files == tuple(deltas[:8]) and not plan.into_base
    # Halving sizes (what repeated merges leave) merge whole: the group never piles up levels.
    halving = [rec("merged", 64 >> i, f"h{i}") for i in range(6)] + [rec("delta", 1, "d0"), rec("delta", 1, "d1")]
    plan = plan_group([rec("base", 1000), *halving], 8, 0.25)
    assert plan.files == tuple(halving)
    # At least two files, however lopsided: each compaction leaves the group with fewer files.
    lopsided = [rec("merged", 200, "m"), rec("delta", 1, "x")]
    plan = plan_group([rec("base", 1000), *lopsided], 2, 0.25)
    assert plan.files == tuple(lopsided) and not plan.into_base


def test_plan_rewrites_the_base_once_the_rest_holds_the_share_or_without_a_share():
    files = [rec("base", 100)] + [rec("delta", 3, str(i)) for i in range(9)]  # 27 entries >= 25% of 100
    assert plan_group(files, 10, 0.25).into_base and plan_group(files, 10, 0.25).files == tuple(files)
    assert plan_group(files, 10, 0.5).into_base is False
    assert plan_group(files, 10, None).into_base  # on demand (`dbidx compact`): always a new base
    no_base = [rec("delta", 3, str(i)) for i in range(10)]
    assert plan_group(no_base, 10, 0.25).into_base


# --- on a real table ---------------------------------------------------------------------------------------------


@pytest.fixture()
def table(tmp_path) -> Table:
    """One shard, a base of 3,000 keys, then nine small commits: inserts, deletes of base keys, re-pointed keys."""
    t = Table.create(str(tmp_path / "t"), num_shards=1, row_group_size=64)
    keys = [f"user-{i:05d}" for i in range(3000)]
    with t.new_commit() as w:
        w.insert(P, keys, "fg-base")
    assert t.compact(min_files=1).bases == 1
    rng = random.Random(5)
    for batch in range(9):
        with t.new_commit() as w:
            w.insert(P, [f"new-{batch}-{i}" for i in range(20)], f"fg-{batch}")
            if batch % 3 == 0:
                w.delete(P, rng.sample(keys, 15))
    return t


def test_a_tiered_compaction_keeps_the_base_and_the_answer(table):
    before = as_map(table)
    base = table.refresh().files(P, 0)[0]
    deltas_seen = table.incremental(2, None).num_rows  # what a cache catching up from seq 2 replays
    result = table.compact(min_files=10, base_share=0.25)
    assert (result.groups, result.bases, result.files_replaced) == (1, 0, 9)
    files = table.refresh().files(P, 0)
    assert [f.kind for f in files] == ["base", "merged"] and files[0] == base
    assert files[1].tombstones == 45  # deletes of base keys stay in the merged file: the base still holds the keys
    assert as_map(table) == before
    assert as_map(Table.open(table.uri)) == before  # a fresh open replays the same view
    # A merged file is not a delta: a cache's catch-up replays what it replayed before, nothing twice.
    assert table.incremental(2, None).num_rows == deltas_seen
    assert table.incremental(table.timeline.latest_seq - 1, None).num_rows == 0
    deleted = sorted(set(f"user-{i:05d}" for i in range(3000)) - set(before))[:3]
    assert table.lookup(deleted + ["new-3-0"], P).column("key").to_pylist() == ["new-3-0"]


def test_the_base_is_rewritten_once_the_rest_reaches_the_share(table):
    before = as_map(table)
    assert table.compact(min_files=10, base_share=5.0).bases == 0  # files after the base are far under 5x
    assert table.compact(min_files=2, base_share=0.001).bases == 1
    files = table.refresh().files(P, 0)
    assert [f.kind for f in files] == ["base"] and files[0].tombstones == 0
    assert as_map(table) == before


def test_a_commit_landing_during_a_tiered_compaction_stays_newer(table):
    """A key moved away and one deleted while the compaction ran must not come back from its merged file."""
    moved, gone = "new-8-1", "new-7-2"

    def other_writer(w) -> None:
        w.delete(P, [gone])
        w.move([moved], P, "fg-8", "dt=2025-01-02", "fg-late")

    with commit_after_planning(table, other_writer):
        result = compaction.compact(table, min_files=10, base_share=0.25)
    assert result.bases == 0
    now = as_map(table)
    assert moved not in now and gone not in now and "new-8-0" in now
    assert table.snapshot("dt=2025-01-02").column("key").to_pylist() == [moved]
    assert [f.kind for f in table.refresh().files(P, 0)] == ["base", "merged", "delta"]
    assert as_map(Table.open(table.uri)) == now


def test_merged_files_survive_a_checkpoint_and_clean(table):
    table.compact(min_files=10, base_share=0.25)
    before = as_map(table)
    assert table.clean(retain_completions=0) is not None
    table.checkpoint()
    reopened = Table.open(table.uri)
    assert [f.kind for f in reopened.refresh().files(P, 0)] == ["base", "merged"]
    assert as_map(reopened) == before


def test_bad_base_share_is_refused(table):
    for bad in (0, -1, True, "0.25", float("nan")):
        with pytest.raises(InvalidInputError, match="base_share"):
            table.compact(base_share=bad)


def test_a_record_with_a_file_of_the_wrong_kind_is_corrupt(table):
    """A commit naming a merged file (or a compaction naming a delta) is refused when read back."""
    good = table.timeline.completed()[-1]
    assert good.action == ACTION_COMMIT
    bad = replace(good, files=tuple(replace(f, kind="merged") for f in good.files))
    with pytest.raises(CorruptFileError, match="kind must be one of"):
        CompletedInstant.from_json(bad.to_json(), "crafted")


def test_the_index_compaction_service_is_size_tiered_by_its_setting(table):
    """The service merges the newest files beside the base by default; index_base_share=0 restores a new base."""
    from dbidx.table.service_settings import ServiceSettings
    from dbidx.table.services import run_services

    before = as_map(table)
    quiet = dict(data_compaction=False, clean=False, log_cleanup=False, vacuum=False, index_min_files=5)
    report = run_services(table, ServiceSettings(**quiet))
    (run,) = [r for r in report.ran if r.service == "index_compaction"]
    assert run.details["bases"] == 0 and run.details["groups"] == 1
    assert [f.kind for f in table.refresh().files(P, 0)] == ["base", "merged"]
    assert as_map(table) == before
    for batch in range(4):
        with table.new_commit() as w:
            w.insert(P, [f"more-{batch}-{i}" for i in range(5)], "fg-more")
    report = run_services(table, ServiceSettings(**quiet, index_base_share=0.0))
    (run,) = [r for r in report.ran if r.service == "index_compaction"]
    assert run.details["bases"] == 1
    assert [f.kind for f in table.refresh().files(P, 0)] == ["base"]
    assert len(as_map(table)) == len(before) + 20
