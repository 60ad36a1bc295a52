"""Both compactions through a WorkRunner (dbidx/runner.py), the seam that lets a Spark writer run them as Spark jobs:
a piece run twice (a retried or speculative task's second try) publishes the kept try's files and deletes the
other's; a result that does not fit its piece is refused before anything is published; the rows never change."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Iterator, Sequence

import msgpack
import numpy as np
import pytest

from dbidx.buckets.assigner import BucketSpec
from dbidx.config import CacheConfig
from dbidx.errors import CommitError
from dbidx.table.service_settings import write_settings
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table
from dbidx.runner import Work
from dbidx.spark_integration.local import upsert_arrow
from dbidx.storage import markers

from tests.data.test_compaction import as_arrow, current, data_files_on_disk
from tests.spark_helpers import Oracle, random_batch


class TwoTries:
    """Runs every piece twice, as attempts 0 and 1 (a speculative copy), and keeps attempt 1's result."""

    where = "test"

    def __init__(self) -> None:
        self.items = 0

    def run(self, work: Work, items: Sequence[Any], what: str, weights: Any = None) -> Iterator[bytes]:
        for item in items:
            self.items += 1
            work(item, 0)
            yield work(item, 1)


class Tampering:
    """Runs each piece once and hands back a result changed by `change` (what a broken task could report)."""

    where = "test"

    def __init__(self, change: Any) -> None:
        self.change = change

    def run(self, work: Work, items: Sequence[Any], what: str, weights: Any = None) -> Iterator[bytes]:
        for item in items:
            yield self.change(msgpack.unpackb(work(item, 0), raw=False))


def loaded_table(tmp_path: Path, seed: int) -> tuple[Table, Oracle]:
    rng = random.Random(seed)
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    oracle, serial = Oracle(False), [0]
    for _ in range(8):
        batch = random_batch(rng, oracle, serial)
        upsert_arrow(
            as_arrow(batch), table, key="id", partition="dt", buckets=BucketSpec(capacity=7), cache_config=config
        )
        oracle.apply(batch)
    return table, oracle


def test_a_second_try_of_every_piece_publishes_its_files_and_deletes_the_first(tmp_path: Path) -> None:
    table, oracle = loaded_table(tmp_path, 4405)
    runner = TwoTries()
    # 1. Data compaction: every base is the second try's (`_1`), the first try's files are gone.
    result = table.compact_data(min_files=2, runner=runner)
    assert result.record is not None and runner.items == result.file_groups
    bases = {f.path for f in result.record.data_files}
    assert bases and all(p.endswith(f"_{result.record.instant}_1.parquet") for p in bases)
    written = {p for p in data_files_on_disk(table) if result.record.instant in p}
    assert written == bases
    assert not table.io.exists(markers.marker_dir(result.record.instant))
    assert current(table) == oracle.expected_rows()
    # 2. Index compaction: the same for the index bases (`base-<instant>-a1`).
    merged = table.compact(min_files=2, runner=runner)
    assert merged.record is not None
    paths = {f.path for f in merged.record.files}
    assert paths and all(p.endswith(f"base-{merged.record.instant}-a1.parquet") for p in paths)
    on_disk = {rel for rel, _ in table.io.list_files_recursive(".dbidx/rli") if merged.record.instant in rel}
    assert on_disk == paths
    # 3. A fresh open reads the same rows, finds every key where the index says, and verifies clean.
    fresh = Table.open(table.uri)
    assert current(fresh) == oracle.expected_rows()
    assert verify_table(fresh).ok


def _other_group(result: dict) -> dict:
    result["base"]["file_group"] = result["base"]["file_group"] + "x"
    return result


def _row_sent_twice(result: dict) -> dict:
    for entry in result["moved"]:
        rows = np.frombuffer(entry[1], dtype="<i8").copy()
        live = np.flatnonzero(rows >= 0)
        if len(live) >= 2:
            rows[live[1]] = rows[live[0]]  # two rows go to one base row, and one base row gets none
            entry[1] = rows.tobytes()
            break
    return result


def _garbage(result: dict) -> bytes:
    return b"\xc1not msgpack"


@pytest.mark.parametrize("change", [_other_group, _row_sent_twice, _garbage], ids=["group", "rows", "bytes"])
def test_a_result_that_does_not_fit_its_piece_publishes_nothing(tmp_path: Path, change) -> None:
    table, oracle = loaded_table(tmp_path, 4406)
    before = data_files_on_disk(table)
    latest = table.timeline.latest_seq

    def tamper(result: dict) -> bytes:
        changed = change(result)
        return changed if isinstance(changed, bytes) else msgpack.packb(changed, use_bin_type=True)

    with pytest.raises(CommitError, match="data compaction .*nothing was published"):
        table.compact_data(min_files=2, runner=Tampering(tamper))
    fresh = Table.open(table.uri)
    fresh.timeline.refresh()
    assert [r.action for r in fresh.timeline.completed(after_seq=latest)] == ["rollback"]
    assert data_files_on_disk(fresh) == before  # the rollback deleted every base it had written
    assert current(fresh) == oracle.expected_rows()


@pytest.mark.slow
def test_spark_jobs_off_keeps_the_pieces_in_the_driver(tmp_path: Path, services_on: None) -> None:
    """The `spark_jobs` and `spark_jobs_min_mb` settings decide where a writer's services after its upsert run their
    pieces: in the driver when off or when a compaction reads less than the minimum, else by the writer's runner."""
    from dbidx.spark_integration import driver

    table, oracle = loaded_table(tmp_path, 4409)
    rng, serial = random.Random(4410), [10_000]
    runner = TwoTries()

    def two_batches() -> None:  # with the services after each upsert off, so the work waits for ran_on()
        write_settings(table.io, {"after_commit": False})
        for _ in range(2):
            batch = random_batch(rng, oracle, serial)
            upsert_arrow(
                as_arrow(batch),
                table,
                key="id",
                partition="dt",
                buckets=BucketSpec(capacity=7),
                cache_config=CacheConfig(base_path=str(tmp_path / "cache")),
            )
            oracle.apply(batch)
        write_settings(table.io, {"after_commit": True})

    def ran_on() -> set[str]:
        report = driver.services_after_commit(table, runner)
        compactions = [r for r in report["ran"] if r["service"] in ("data_compaction", "index_compaction")]
        assert compactions, report
        return {r["details"]["ran_on"] for r in compactions}

    # 1. Off: the driver.
    write_settings(table.io, {"data_min_small_files": 2, "index_min_files": 2, "spark_jobs": False})
    assert ran_on() == {"driver"} and runner.items == 0
    assert table.service_settings().spark_jobs is False
    # 2. On, but each compaction reads less than spark_jobs_min_mb: still the driver.
    two_batches()
    write_settings(table.io, {"spark_jobs": True, "spark_jobs_min_mb": 1})
    assert ran_on() == {"driver"} and runner.items == 0
    # 3. On with no minimum: the writer's runner.
    two_batches()
    write_settings(table.io, {"spark_jobs_min_mb": 0})
    assert ran_on() == {"test"} and runner.items > 0
    assert current(table) == oracle.expected_rows()


def _unit(sizes: list[int], deleted: dict[int, int] | None = None) -> Any:
    """A file group of files of these sizes (100 rows each), file i with deleted[i] rows in its vector."""
    from dbidx.data.reads import ReadUnit
    from dbidx.storage.data_view import DvRef
    from dbidx.storage.records import DataFileRecord, DeletionVectorRecord, DvFileRecord

    files = tuple(
        DataFileRecord(f"dt=x/g_{i:017d}_0.parquet", "dt=x", "g", 100, size, "xxh64:" + "0" * 16)
        for i, size in enumerate(sizes)
    )
    vectors = tuple(
        DvRef(DeletionVectorRecord(f.path, "d.bin", 0, 0, (deleted or {})[i]), DvFileRecord("d.bin", 0, "x"))
        if i in (deleted or {})
        else None
        for i, f in enumerate(files)
    )
    return ReadUnit(
        "dt=x", "g", files, tuple(range(len(files))), tuple(f"{i:017d}" for i in range(len(files))), vectors
    )


@pytest.mark.parametrize(
    "sizes, deleted, share, kept",
    [
        ([1000] + [10] * 9, {}, 0.25, [1, 2, 3, 4, 5, 6, 7, 8, 9]),  # the rest is 9% of the base: the base stays
        ([1000] + [10] * 9, {}, None, list(range(10))),  # no share: everything, one file results
        ([1000] + [30] * 9, {}, 0.25, list(range(10))),  # the rest is 27%: the base is rewritten with it
        ([1000, 10], {}, 0.25, [0, 1]),  # one small file alone is not worth a rewrite: both
        ([1000, 10], {1: 50}, 0.25, [1]),  # ... unless it is rewritten for its deletes
        ([1000] + [10] * 9, {0: 30}, 0.25, list(range(10))),  # a base with 30% deleted is rewritten anyway
        ([10] * 5 + [1000], {}, 0.25, [0, 1, 2, 3, 4]),  # the largest stays wherever it stands in the group
    ],
)
def test_a_large_base_stays_while_the_rest_is_small_beside_it(sizes, deleted, share, kept) -> None:
    from dbidx.data.compaction import _to_rewrite

    unit = _unit(sizes, deleted)
    chosen = _to_rewrite(unit, 2, 0.2, 1 << 30, share)
    assert chosen is not None and [unit.files.index(f) for f in chosen.files] == kept


@pytest.mark.slow
def test_compaction_with_a_base_share_merges_beside_the_base_and_reads_the_same(tmp_path: Path) -> None:
    table, oracle = loaded_table(tmp_path, 4412)
    table.compact_data(min_files=2)  # one file per group
    bases = {live.record.path for live in table.data_view().live()}
    rng, serial = random.Random(4413), [30_000]
    for _ in range(3):
        batch = random_batch(rng, oracle, serial, size=10)
        upsert_arrow(
            as_arrow(batch),
            table,
            key="id",
            partition="dt",
            buckets=BucketSpec(capacity=7),
            cache_config=CacheConfig(base_path=str(tmp_path / "cache")),
        )
        oracle.apply(batch)
    result = table.compact_data(min_files=2, base_share=1.0)
    assert result.record is not None
    kept_bases = set(bases) - set(result.record.replaced)
    assert kept_bases, "some group's base was small beside its new files and stayed"
    live = {live.record.path for live in table.data_view().live()}
    assert kept_bases <= live
    assert current(table) == oracle.expected_rows()
    assert current(Table.open(table.uri)) == oracle.expected_rows()
