"""Two upserts racing on one key (real Spark, real files): the later publisher fails with ConflictError, publishes
nothing, and its retry re-tags against the new state; then data, index and caches agree. Also: a job that returns
fewer results than shard tasks publishes nothing."""

from __future__ import annotations

import threading
import time
from functools import partial
from pathlib import Path

import pytest

from dbidx.cache.catchup import sync
from dbidx.cache.record_cache import RecordIndexCache
from dbidx.cache.verify import verify
from dbidx.config import CacheConfig
from dbidx.errors import CommitError, ConflictError
from dbidx.table.facade import Table
from dbidx.spark_integration import api
from dbidx.spark_integration.api import upsert
from dbidx.spark_integration.reads import read_table
from dbidx.storage import markers
from dbidx.storage.keyhash import shard_of_one
from dbidx.storage.records import ACTION_ROLLBACK

from tests.delta_readers import assert_readers_agree
from tests.spark_helpers import SCHEMA, index_state

pytestmark = pytest.mark.spark
D1, D2 = "2025-03-01", "2025-03-02"


def wait_in_task(partition_id: int, attempt_number: int, flags: str, shard: int) -> None:
    """on_task_written hook: the task of `shard` says it has written its files, then waits for the go-ahead."""
    if partition_id != shard:
        return
    Path(flags, "written").touch()
    deadline = time.monotonic() + 120
    while not Path(flags, "go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the test never gave the go-ahead")
        time.sleep(0.02)


def race(
    spark, table: Table, config: CacheConfig, tmp_path: Path, later: list[tuple], first: list[tuple], key: str
) -> BaseException | None:
    """Run `later` until its tasks have written, commit `first` meanwhile, then let `later` publish."""
    flags = tmp_path / f"flags-{time.monotonic_ns()}"
    flags.mkdir()
    outcome: list[BaseException | None] = []

    def run_later() -> None:
        try:
            upsert(
                spark.createDataFrame(later, SCHEMA),
                table,
                key="id",
                partition="dt",
                cache_config=config,
                on_task_written=partial(wait_in_task, flags=str(flags), shard=int(table.shard_of([key])[0])),
            )
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run_later)
    thread.start()
    deadline = time.monotonic() + 120
    while not (flags / "written").exists():
        assert time.monotonic() < deadline and thread.is_alive(), outcome
        time.sleep(0.02)
    upsert(spark.createDataFrame(first, SCHEMA), table, key="id", partition="dt", cache_config=config)
    (flags / "go").touch()
    thread.join(180)
    return outcome[0]


def caches_agree(table: Table, config: CacheConfig) -> None:
    for shard in range(table.num_shards):
        with RecordIndexCache.for_table(table, shard, config) as cache:
            sync(cache, table)
            assert verify(cache, table).ok, shard


K1_TWIN = next(k for k in (f"twin{i}" for i in range(100)) if shard_of_one(k, 2) == shard_of_one("k1", 2))
CASES = {
    # name: (global index, existing rows, later writer's batch, first writer's batch, expected rows after retry)
    "update vs delete": (False, [("k1", D1, 1, False)], [("k1", D1, 2, False)], [("k1", D1, 0, True)], {("k1", D1, 2)}),
    "update vs move": (True, [("k1", D1, 1, False)], [("k1", D1, 2, False)], [("k1", D2, 3, False)], {("k1", D1, 2)}),
    "delete of a missing key vs re-insert": (
        False,
        [("k1", D1, 1, False), ("k1", D1, 1, True)],
        [("k1", D1, 0, True)],
        [("k1", D1, 5, False)],
        set(),
    ),
    "insert vs insert": (False, [], [("k9", D1, 2, False)], [("k9", D1, 1, False)], {("k9", D1, 2)}),
    # The later task's touched keys span two partitions of one shard: one touched file holds both groups.
    "updates in two partitions vs a delete in one": (
        False,
        [("k1", D1, 1, False), (K1_TWIN, D2, 1, False)],
        [("k1", D1, 2, False), (K1_TWIN, D2, 2, False)],
        [(K1_TWIN, D2, 0, True)],
        {("k1", D1, 2), (K1_TWIN, D2, 2)},
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_racing_writers_on_one_key(spark, tmp_path: Path, case: str) -> None:
    global_index, existing, later, first, expected = CASES[case]
    table = Table.create(str(tmp_path / "t"), num_shards=2, global_index=global_index)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    other = [("other", D1, 1, False)]  # a second key so every commit has data
    for row in [other] + [[r] for r in existing]:
        upsert(spark.createDataFrame(row, SCHEMA), table, key="id", partition="dt", cache_config=config)
    before = table.timeline.latest_seq
    error = race(spark, table, config, tmp_path, later, first, key=later[0][0])
    assert isinstance(error, ConflictError), error
    assert "re-tag the batch" in str(error)
    # The loser published nothing: after the winner's commit comes its rollback record only.
    assert [r.action for r in table.timeline.completed()[before:]] == ["commit", ACTION_ROLLBACK]
    assert table.io.list_dirs(markers.MARKERS_DIR) == []
    # Its retry re-tags against the new state and lands.
    upsert(spark.createDataFrame(later, SCHEMA), table, key="id", partition="dt", cache_config=config)
    rows = {(r.id, r.dt, r.v) for r in read_table(spark, table).select("id", "dt", "v").collect()}
    assert rows == expected | {("other", D1, 1)}
    assert_readers_agree(
        table, ("id", "dt", "v"), rows, spark=spark
    )  # the loser's rolled-back files are in no Delta version
    index = index_state(table)
    assert {ident[-1] for ident in index} == {r[0] for r in rows}
    if global_index:
        assert {ident[0]: loc.split("|")[0] for ident, loc in index.items()} == {k: f"dt={d}" for k, d, _ in rows}
    caches_agree(table, config)


def test_a_lost_task_result_publishes_nothing(spark, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    upsert(
        spark.createDataFrame([(f"k{i}", D1, i, False) for i in range(50)], SCHEMA),
        table,
        key="id",
        partition="dt",
        cache_config=config,
    )
    files_before = {rel for rel, _ in table.io.list_files_recursive("") if not rel.startswith(".dbidx/timeline")}
    collect = api._collect_results
    monkeypatch.setattr(api, "_collect_results", lambda results: collect(results)[:-1])  # one result lost
    batch = [(f"k{i}", D1, 100 + i, False) for i in range(25, 100)]
    with pytest.raises(CommitError, match="returned 1 task results for 2 shard tasks"):
        upsert(spark.createDataFrame(batch, SCHEMA), table, key="id", partition="dt", cache_config=config)
    assert table.timeline.completed()[-1].action == ACTION_ROLLBACK
    files_after = {rel for rel, _ in table.io.list_files_recursive("") if not rel.startswith(".dbidx/timeline")}
    # No data, index, DV, touched or marker file of the instant remains; the rollback is a Delta version of its own.
    assert files_after == files_before | {"_delta_log/00000000000000000002.json"}
    assert_readers_agree(table, ("id", "dt", "v"), {(f"k{i}", D1, i) for i in range(50)}, spark=spark)
    monkeypatch.setattr(api, "_collect_results", collect)
    summary = upsert(spark.createDataFrame(batch, SCHEMA), table, key="id", partition="dt", cache_config=config)
    assert (summary.updates, summary.inserts) == (25, 50)
    assert len(index_state(table)) == 100
    assert_readers_agree(
        table, ("id", "dt", "v"), {(f"k{i}", D1, i) for i in range(25)} | {r[:3] for r in batch}, spark=spark
    )


def test_read_table_fails_loudly_on_a_damaged_data_file(spark, tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    upsert(
        spark.createDataFrame([(f"k{i}", D1, i, False) for i in range(40)], SCHEMA),
        table,
        key="id",
        partition="dt",
        cache_config=config,
    )
    record = table.timeline.completed()[-1].data_files[0]
    path = Path(table.io.path(record.path))
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(Exception, match=f"CorruptFileError: data file .*{record.path}.* fails its checksum"):
        read_table(spark, table).collect()
