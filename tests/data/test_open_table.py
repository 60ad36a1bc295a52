"""The table is a Delta Lake table: after every kind of commit, deltalake's QueryBuilder, polars and DuckDB read
exactly the rows dbidx reads (and the oracle expects), with no repeated record."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dbidx.buckets.assigner import BucketSpec
from dbidx.config import CacheConfig
from dbidx.data import compaction as data_compaction, delta_log, reads
from dbidx.errors import CorruptFileError, HistoryCompactedError, InvalidInputError
from dbidx.table.build_index import build_index
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table
from dbidx.spark_integration.local import upsert_arrow

from tests.delta_readers import assert_readers_agree, via_deltalake, via_polars
from tests.retention import clean_without_waiting
from tests.spark_helpers import Oracle, random_batch

COLUMNS = ("id", "dt", "v")


def as_arrow(batch: list[tuple]) -> pa.Table:
    ids, days, values, deletes = zip(*batch)
    return pa.table(
        {"id": list(ids), "dt": list(days), "v": pa.array(values, pa.int64()), "_dbidx_delete": list(deletes)}
    )


def check(table: Table, oracle: Oracle) -> None:
    rows = assert_readers_agree(table, COLUMNS, oracle.expected_rows())
    idents = [(r[0],) if table.global_index else (r[1], r[0]) for r in rows]
    assert len(idents) == len(set(idents)), "a record is live twice"


@pytest.mark.parametrize(
    "global_index,buckets",
    [
        (False, BucketSpec(capacity=7)),
        (True, BucketSpec(capacity=7)),
        (False, BucketSpec(mode="simple", num_buckets=3)),
        (True, BucketSpec(mode="simple", num_buckets=3)),
    ],
    ids=["partitioned-dynamic", "global-dynamic", "partitioned-simple", "global-simple"],
)
@pytest.mark.slow
def test_every_commit_kind_reads_the_same_in_every_engine(
    tmp_path: Path, global_index: bool, buckets: BucketSpec
) -> None:
    rng = random.Random(20261124 + global_index)
    table = Table.create(str(tmp_path / "t"), num_shards=3, global_index=global_index, checkpoint_interval=7)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    oracle, serial, moves = Oracle(global_index), [0], [0]

    def upsert(batch: list[tuple]) -> None:
        summary = upsert_arrow(as_arrow(batch), table, key="id", partition="dt", buckets=buckets, cache_config=config)
        moves[0] += summary.moves
        oracle.apply(batch)

    # 1. Inserts (the bulk first load), then updates, deletes, re-inserts, moves (global), repeats, ghosts.
    for _ in range(6):
        upsert(random_batch(rng, oracle, serial))
        check(table, oracle)
    # 2. A data compaction during which another commit supersedes rows of the files it rewrites.
    concurrent = random_batch(rng, oracle, serial)
    real_write_base, calls = data_compaction.rewrite_file_group, []
    first = threading.Lock()  # the pieces run on threads: exactly one of them commits the batch

    def write_base_then_commit(*args, **kwargs):
        with first:
            if not calls:
                calls.append(1)
                upsert(concurrent)
        return real_write_base(*args, **kwargs)

    data_compaction.rewrite_file_group = write_base_then_commit
    try:
        result = table.compact_data()
    finally:
        data_compaction.rewrite_file_group = real_write_base
    assert result.record is not None and calls
    check(table, oracle)
    # 3. An index compaction, a clean, a rollback of a pending instant: no row changes, versions still follow.
    table.compact()
    clean_without_waiting(table)
    table.clean(retain_completions=0)
    view = table.data_view()  # DV files no live vector points into are gone with the replaced data files
    live_refs = {ref.file.path for f in view.live() if (ref := view.vector_of(f.record.path)) is not None}
    root = Path(table.io.path(""))
    assert {p.relative_to(root).as_posix() for p in root.glob("**/deletion_vector_*.bin")} == live_refs
    assert not list(root.glob("deletion_vector_*.bin"))  # under .dbidx/dv/, out of a Delta VACUUM's reach
    pending = table.timeline.start("commit")
    table.rollback(pending.instant)
    for _ in range(3):
        upsert(random_batch(rng, oracle, serial))
    check(table, oracle)
    # 4. One Delta version per completion (version 0: the table's creation), checkpoints of both logs included.
    assert delta_log.listed_versions(table.io) == list(range(table.timeline.latest_seq + 1))
    assert (moves[0] > 0) == global_index  # global mode: records moved partition (a delete row plus a new row)


def test_time_travel_reads_each_version(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    states = []
    for value in (1, 2, 3):
        upsert_arrow(
            pa.table({"id": ["a", "b"], "dt": ["2025-01-01", "2025-01-02"], "v": [value, value * 10]}),
            table,
            key="id",
            partition="dt",
            cache_config=config,
        )
        states.append(sorted(via_deltalake(table.io.path(""), COLUMNS)))
    for version, expected in enumerate(states, start=1):
        assert sorted(via_deltalake(table.io.path(""), COLUMNS, version)) == expected
        assert sorted(via_polars(table.io.path(""), COLUMNS, version)) == expected
        # dbidx reads the same version by Delta version, by completion seq and by instant id
        instant = table.timeline.completed(after_seq=version - 1, upto_seq=version)[0].instant
        for point in ({"version": version}, {"as_of": version}, {"as_of": instant}):
            got = reads.read_arrow(Table.open(table.uri), columns=list(COLUMNS), **point)
            assert sorted(zip(*(got.column(c).to_pylist() for c in COLUMNS))) == expected, point
    assert states[-1] == [("a", "2025-01-01", 3), ("b", "2025-01-02", 30)]
    assert reads.read_arrow(table, version=0).num_rows == 0  # the creation: no rows yet
    with pytest.raises(InvalidInputError, match="does not exist yet"):
        reads.read_arrow(table, version=9)
    with pytest.raises(InvalidInputError, match="not both"):
        reads.read_arrow(table, version=1, as_of=1)
    # 2. Once a compaction rewrote the files and a clean removed them (the table's retention of removed files cut
    #    to a millisecond), the old version is gone, loudly.
    clean_without_waiting(table)
    table.compact_data()
    table.clean(retain_completions=0)
    assert sorted(via_deltalake(table.io.path(""), COLUMNS)) == states[-1]
    with pytest.raises(HistoryCompactedError, match="older than the table retains"):
        reads.read_arrow(Table.open(table.uri), version=1)


def test_build_index_adopts_hive_files_and_upserts_update_them(tmp_path: Path) -> None:
    root = tmp_path / "t"
    for day, keys in (("2025-01-01", ["a", "b"]), ("2025-01-02", ["c"])):
        (root / f"dt={day}").mkdir(parents=True)
        pq.write_table(pa.table({"id": keys, "v": list(range(len(keys)))}), root / f"dt={day}" / "part-0.parquet")
    table = Table.create(str(root), num_shards=2)
    build_index(table, "id", ["dt"])
    assert_readers_agree(table, COLUMNS, {("a", "2025-01-01", 0), ("b", "2025-01-01", 1), ("c", "2025-01-02", 0)})
    upsert_arrow(
        pa.table(
            {
                "id": ["a", "c", "d"],
                "dt": ["2025-01-01", "2025-01-02", "2025-01-02"],
                "v": [7, 8, 9],
                "_dbidx_delete": [False, True, False],
            }
        ),
        table,
        key="id",
        partition="dt",
        cache_config=CacheConfig(base_path=str(tmp_path / "cache")),
    )
    assert_readers_agree(table, COLUMNS, {("a", "2025-01-01", 7), ("b", "2025-01-01", 1), ("d", "2025-01-02", 9)})


def test_build_index_in_global_mode_then_upserts_that_move_records(tmp_path: Path) -> None:
    """Global mode over adopted hive files: upserts that move keys to another day (a delete row in the old file
    group, the live row in the new partition) read the same in every engine, twice in a row."""
    root = tmp_path / "t"
    for day, keys in (("2025-01-01", ["a", "b", "c"]), ("2025-01-02", ["d"])):
        (root / f"dt={day}").mkdir(parents=True)
        pq.write_table(pa.table({"id": keys, "v": list(range(len(keys)))}), root / f"dt={day}" / "part-0.parquet")
    table = Table.create(str(root), num_shards=2, global_index=True)
    build_index(table, "id", ["dt"])
    assert_readers_agree(
        table, COLUMNS, {("a", "2025-01-01", 0), ("b", "2025-01-01", 1), ("c", "2025-01-01", 2), ("d", "2025-01-02", 0)}
    )
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    first = upsert_arrow(
        pa.table(
            {
                "id": ["a", "b", "d", "e"],
                "dt": ["2025-01-02", "2025-01-01", "2025-01-03", "2025-01-01"],
                "v": [10, 11, 12, 13],
            }
        ),
        table,
        key="id",
        partition="dt",
        cache_config=config,
    )
    assert (first.moves, first.updates, first.inserts) == (2, 3, 1)  # a move counts as an update too
    assert_readers_agree(
        table,
        COLUMNS,
        {
            ("a", "2025-01-02", 10),
            ("b", "2025-01-01", 11),
            ("c", "2025-01-01", 2),
            ("d", "2025-01-03", 12),
            ("e", "2025-01-01", 13),
        },
    )
    second = upsert_arrow(
        pa.table(
            {
                "id": ["a", "c", "e"],
                "dt": ["2025-01-01", "2025-01-03", "2025-01-01"],
                "v": [20, 21, 22],
                "_dbidx_delete": [False, False, True],
            }
        ),
        table,
        key="id",
        partition="dt",
        cache_config=config,
    )
    assert (second.moves, second.deletes) == (2, 1)  # a back to its first day, c away from the adopted file
    assert_readers_agree(
        table,
        COLUMNS,
        {("a", "2025-01-01", 20), ("b", "2025-01-01", 11), ("c", "2025-01-03", 21), ("d", "2025-01-03", 12)},
    )
    assert verify_table(table).ok


def _files_outside_timeline(table: Table) -> set[str]:
    return {rel for rel, _ in table.io.list_files_recursive("") if not rel.startswith(".dbidx/timeline")}


@pytest.mark.parametrize("how", ["library", "cli"])
def test_a_crashed_upsert_rolled_back_leaves_no_file_and_readers_agree(tmp_path: Path, monkeypatch, how: str) -> None:
    """A writer dies after its tasks wrote data, index and touched files but before the publish (no except block
    ran: no rollback): the pending instant is invisible to every reader; `rollback` then deletes all its files."""
    from click.testing import CliRunner

    from dbidx.cli import main
    from dbidx.table.writer import CommitWriter
    from dbidx.spark_integration import driver

    table = twice_updated(tmp_path, ("d1", "d2"))
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    expected = {("a", "d1", 2), ("b", "d2", 2)}
    before = _files_outside_timeline(table)

    class Crash(BaseException):
        """The process dying between the tasks and the publish."""

    def crash(*args, **kwargs):
        raise Crash("killed before the publish")

    monkeypatch.setattr(driver, "commit_results", crash)
    monkeypatch.setattr(CommitWriter, "rollback", lambda self: None)  # a dead process cleans nothing up
    with pytest.raises(Crash):
        upsert_arrow(
            pa.table({"id": ["a", "b", "c"], "dt": ["d1", "d2", "d1"], "v": [3, 3, 3]}),
            table,
            key="id",
            partition="dt",
            cache_config=config,
        )
    monkeypatch.undo()
    reopened = Table.open(table.uri)
    [instant] = reopened.timeline.pending()
    left = _files_outside_timeline(reopened) - before
    assert any(p.endswith(".parquet") and instant in p and not p.startswith(".dbidx") for p in left), left
    assert any(p.startswith(".dbidx/rli/") for p in left), left
    assert_readers_agree(reopened, COLUMNS, expected)  # the pending instant's files are in no version
    if how == "library":
        assert reopened.rollback(instant).rolled_back == instant
    else:
        # the crashed writer was this test's own process (alive): --force
        result = CliRunner().invoke(main, ["rollback", table.uri, "--all-pending", "--force", "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["rolled_back"] == [instant]
    reopened = Table.open(table.uri)
    assert reopened.timeline.pending() == []
    # Every file the crashed instant wrote is gone; what is new is the rollback's own Delta version.
    assert _files_outside_timeline(reopened) == before | {delta_log.version_file(3)}
    assert_readers_agree(reopened, COLUMNS, expected)
    assert verify_table(reopened).ok
    upsert_arrow(
        pa.table({"id": ["a", "c"], "dt": ["d1", "d1"], "v": [4, 4]}),
        reopened,
        key="id",
        partition="dt",
        cache_config=config,
    )
    assert_readers_agree(reopened, COLUMNS, {("a", "d1", 4), ("b", "d2", 2), ("c", "d1", 4)})


@pytest.mark.slow
def test_time_travel_inside_the_retention_window_reads_the_same_everywhere(tmp_path: Path) -> None:
    """After clean(retain_completions=4) on a table whose delta.deletedFileRetentionDuration is a millisecond (the
    count alone decides), every version inside the window reads the rows it had when written, in dbidx, deltalake
    and polars alike; an older version whose files the clean removed is HistoryCompactedError in dbidx, never fewer
    rows."""
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    clean_without_waiting(table)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    oracle, rng, serial = Oracle(False), random.Random(77), [0]
    states: dict[int, list[tuple]] = {}

    def upsert() -> None:
        batch = random_batch(rng, oracle, serial, size=25)
        upsert_arrow(as_arrow(batch), table, key="id", partition="dt", cache_config=config)
        oracle.apply(batch)

    def remember() -> None:  # each version's rows as all readers saw them when it was the newest
        states[table.timeline.latest_seq] = sorted(assert_readers_agree(table, COLUMNS, oracle.expected_rows()))

    for step in range(9):  # upserts (deletion vectors replaced commit by commit) and data compactions
        if step in (3, 6):
            assert table.compact_data(min_files=2, deleted_share=0.01).record is not None
        else:
            upsert()
        remember()
    latest = table.timeline.latest_seq
    cleaned = table.clean(retain_completions=4)
    assert cleaned is not None and any(p.startswith(".dbidx/dv/") for p in cleaned.deleted)  # data and DV files
    horizon = latest - 4
    states[table.timeline.latest_seq] = states[latest]  # the clean changes no row
    fresh, uri = Table.open(table.uri), table.uri
    for version, rows in sorted(states.items()):
        if version >= horizon:
            got = sorted(via_dbidx_at(fresh, version))
            assert got == rows, version
            assert sorted(via_deltalake(uri, COLUMNS, version)) == rows, version
            assert sorted(via_polars(uri, COLUMNS, version)) == rows, version
        else:
            try:
                got = sorted(via_dbidx_at(fresh, version))
            except HistoryCompactedError:  # never stricter than Delta: its readers miss the same files
                with pytest.raises(Exception, match="(?i)not found|no such file"):
                    via_deltalake(uri, COLUMNS, version)
                continue
            assert got == rows, f"version {version}, older than the window, reads other rows"
    with pytest.raises(HistoryCompactedError, match="older than the table retains"):
        via_dbidx_at(fresh, 2)  # before the first data compaction: its replaced files are gone


def via_dbidx_at(table: Table, version: int) -> list[tuple]:
    got = reads.read_arrow(table, columns=list(COLUMNS), version=version)
    return list(zip(*(got.column(c).to_pylist() for c in COLUMNS)))


def twice_updated(tmp_path: Path, days: tuple[str, str]) -> Table:
    """A one-shard table whose two keys were written twice (the second time superseding the first)."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    for value in (1, 2):
        upsert_arrow(
            pa.table({"id": ["a", "b"], "dt": list(days), "v": [value, value]}),
            table,
            key="id",
            partition="dt",
            cache_config=config,
        )
    return table


def test_a_damaged_deletion_vector_is_loud(tmp_path: Path) -> None:
    table = twice_updated(tmp_path, ("d1", "d1"))
    record = table.latest()
    assert record is not None and record.dv_files
    dv = Path(table.io.path(record.dv_files[0].path))
    raw = bytearray(dv.read_bytes())
    raw[-6] ^= 0xFF
    dv.write_bytes(bytes(raw))
    with pytest.raises(CorruptFileError, match="DV file"):
        reads.read_arrow(table)
    report = verify_table(table)
    assert not report.ok and report.damaged[0]["path"] == record.dv_files[0].path
    from click.testing import CliRunner

    from dbidx.cli import main

    result = CliRunner().invoke(main, ["verify", table.uri, "--json"])
    assert result.exit_code == 4, result.output
    assert [d["path"] for d in json.loads(result.output)["damaged"]] == [record.dv_files[0].path]


def test_a_commit_another_engine_wrote_is_absorbed(tmp_path: Path) -> None:
    """A commitInfo-only version of another engine (a VACUUM START/END) gets an absorb record of its own; the next
    upsert writes the version after it."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    upsert_arrow(pa.table({"id": ["a"], "dt": ["d1"], "v": [1]}), table, key="id", partition="dt", cache_config=config)
    _foreign_version(table, 2)
    upsert_arrow(pa.table({"id": ["a"], "dt": ["d1"], "v": [2]}), table, key="id", partition="dt", cache_config=config)
    assert [r.action for r in table.timeline.completed()] == ["commit", "absorb", "commit"]
    assert delta_log.listed_versions(table.io) == [0, 1, 2, 3]
    assert reads.read_arrow(table, columns=["v"]).column("v").to_pylist() == [2]
    assert_readers_agree(Table.open(table.uri), COLUMNS, {("a", "d1", 2)})


def _foreign_version(table: Table, version: int) -> None:
    foreign = {"commitInfo": {"timestamp": 1, "operation": "VACUUM START", "engineInfo": "another"}}
    Path(table.io.path(delta_log.version_file(version))).write_text(json.dumps(foreign) + "\n")


def test_a_foreign_commit_landing_while_the_tasks_run_is_absorbed_at_publish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another engine commits while the upsert's tasks run: the publish absorbs it (it touched none of the batch's
    keys) and the upsert commits at the next Delta version; every reader agrees."""
    from dbidx.spark_integration import task

    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    upsert_arrow(pa.table({"id": ["a"], "dt": ["d1"], "v": [1]}), table, key="id", partition="dt", cache_config=config)
    real = task.upsert_batches

    def tasks_then_foreign(*args, **kwargs):
        result = real(*args, **kwargs)
        _foreign_version(table, 2)  # completion 2 would be Delta version 2
        return result

    monkeypatch.setattr(task, "upsert_batches", tasks_then_foreign)
    upsert_arrow(pa.table({"id": ["a"], "dt": ["d1"], "v": [2]}), table, key="id", partition="dt", cache_config=config)
    reopened = Table.open(table.uri)
    reopened.refresh()
    assert [r.action for r in reopened.timeline.completed()] == ["commit", "absorb", "commit"]
    assert reads.read_arrow(reopened, columns=["v"]).column("v").to_pylist() == [2]
    assert via_deltalake(table.uri, ["id", "v"], version=2) == [("a", 1)]
    assert via_deltalake(table.uri, ["id", "v"], version=3) == [("a", 2)]


def test_a_foreign_commit_taking_the_version_at_the_commit_point_is_absorbed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last window of the old protocol: another engine takes the Delta version right before dbidx puts it.
    The Delta put is the commit point, so dbidx loses it cleanly (nothing of its record is visible), absorbs the
    other version, checks again and commits at the next one."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    upsert_arrow(pa.table({"id": ["a"], "dt": ["d1"], "v": [1]}), table, key="id", partition="dt", cache_config=config)
    taken: list[int] = []

    def take(record) -> None:
        if not taken:
            taken.append(record.seq)
            _foreign_version(table, record.seq)

    monkeypatch.setattr(table.timeline, "before_publish", table.timeline.before_publish + [take])
    upsert_arrow(pa.table({"id": ["a"], "dt": ["d1"], "v": [2]}), table, key="id", partition="dt", cache_config=config)
    assert taken == [2]
    reopened = Table.open(table.uri)
    reopened.refresh()
    assert [r.action for r in reopened.timeline.completed()] == ["commit", "absorb", "commit"]
    assert not list(Path(table.io.path(".dbidx/timeline")).glob("staged/*"))
    assert_readers_agree(reopened, COLUMNS, {("a", "d1", 2)})


def test_delta_log_cleanup_below_a_checkpoint_is_not_a_foreign_commit(tmp_path: Path) -> None:
    """Delta's expired-log cleanup deletes the JSON versions a checkpoint sums up: dbidx keeps writing (it neither
    calls the table foreign nor writes the deleted versions back), and every reader still agrees."""
    table = Table.create(str(tmp_path / "t"), num_shards=1, checkpoint_interval=3)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    for v in range(1, 5):
        upsert_arrow(
            pa.table({"id": ["a", f"k{v}"], "dt": ["d1", "d2"], "v": [v, v]}),
            table,
            key="id",
            partition="dt",
            cache_config=config,
        )
    log = Path(table.io.path(delta_log.DELTA_LOG_DIR))
    assert delta_log.checkpoint_floor(table.io) == 3
    for v in range(0, 3):  # what Delta's log cleanup removes: the JSON before the checkpoint
        (log / f"{v:020d}.json").unlink()
    reopened = Table.open(table.uri)
    upsert_arrow(
        pa.table({"id": ["a"], "dt": ["d1"], "v": [9]}), reopened, key="id", partition="dt", cache_config=config
    )
    assert not (log / f"{0:020d}.json").exists()
    assert verify_table(Table.open(table.uri)).ok
    expected = [("a", "d1", 9)] + [(f"k{v}", "d2", v) for v in range(1, 5)]
    assert sorted(via_deltalake(table.uri, COLUMNS)) == sorted(expected)
    assert sorted(via_polars(table.uri, COLUMNS)) == sorted(expected)
    assert sorted(reads.read_arrow(reopened, columns=list(COLUMNS)).to_pylist(), key=lambda r: r["id"]) == [
        dict(zip(COLUMNS, r)) for r in sorted(expected)
    ]


def test_a_delta_vacuum_by_another_engine_leaves_dbidx_whole(tmp_path: Path) -> None:
    """delta-rs VACUUM (full, retention 0) deletes what the current Delta snapshot does not list; dbidx's DV files,
    index and timeline live under the hidden `.dbidx/`, so dbidx still reads, verifies and writes the same table."""
    from deltalake import DeltaTable

    table = Table.create(str(tmp_path / "t"), num_shards=2)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    oracle, rng, serial = Oracle(False), random.Random(5), [0]

    def upsert(target: Table) -> None:
        batch = random_batch(rng, oracle, serial)
        upsert_arrow(as_arrow(batch), target, key="id", partition="dt", cache_config=config)
        oracle.apply(batch)

    for _ in range(4):
        upsert(table)
    view = table.data_view()
    assert any(view.vector_of(f.record.path) is not None for f in view.live()), "the case needs deletion vectors"
    deleted = DeltaTable(table.uri).vacuum(
        retention_hours=0, enforce_retention_duration=False, dry_run=False, full=True
    )  # untracked files too, as Spark's VACUUM does
    assert not [p for p in deleted if ".dbidx" in p]
    reopened = Table.open(table.uri)
    check(reopened, oracle)
    assert verify_table(reopened).ok
    upsert(reopened)
    check(reopened, oracle)


def test_a_hive_partition_value_holding_a_slash_is_refused(tmp_path: Path) -> None:
    """A value `x/y` would make nested `dt=x/y` directories, which path-reading Delta readers (polars) take for
    `dt=x`: refused before anything is written; the same values as plain paths (hive_style=False) are fine, and
    Delta's partitionValues of a one-column layout hold the whole value."""
    from dbidx.errors import InvalidPartitionError
    from dbidx.storage.layout import hive_values

    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    with pytest.raises(InvalidPartitionError, match="hive_style=False"):
        upsert_arrow(
            pa.table({"id": ["a", "b"], "dt": ["z", "x/y"], "v": [1, 2]}),
            table,
            key="id",
            partition="dt",
            cache_config=config,
        )
    assert [r.action for r in table.timeline.completed()] == ["rollback"]  # the instant rolled back, no data
    assert reads.read_arrow(table).num_rows == 0
    assert hive_values("dt=x/y", ["dt"]) == {"dt": "x/y"}
    assert hive_values("region=eu/dt=1", ["region", "dt"]) == {"region": "eu", "dt": "1"}


def test_a_commit_landing_right_after_a_task_found_its_superseded_rows_is_not_missed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Global index: the task of a move finds the rows it supersedes, then (before its result is stamped) another
    writer sharing the worker's warm table updates the same key in its old partition. The task's rows must be
    stamped with the state they saw, so the publisher sees the update and recomputes: the key stays live once."""
    from dbidx.spark_integration import shard_sessions, task

    table = Table.create(str(tmp_path / "t"), num_shards=1, global_index=True)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    upsert_arrow(
        pa.table({"id": ["k", "other"], "dt": ["a", "a"], "v": [1, 1]}),
        table,
        key="id",
        partition="dt",
        cache_config=config,
    )
    real, calls = task.superseded_rows, []

    def then_another_writer(*args, **kwargs):
        found = real(*args, **kwargs)
        if not calls:
            calls.append(1)  # the other writer: an update of k where it lives (no conflict with a move)
            upsert_arrow(
                pa.table({"id": ["k"], "dt": ["a"], "v": [2]}),
                shard_sessions.warm_table(table),
                key="id",
                partition="dt",
                cache_config=config,
            )
        return found

    monkeypatch.setattr(task, "superseded_rows", then_another_writer)
    upsert_arrow(pa.table({"id": ["k"], "dt": ["b"], "v": [3]}), table, key="id", partition="dt", cache_config=config)
    assert calls
    assert_readers_agree(Table.open(table.uri), COLUMNS, {("k", "b", 3), ("other", "a", 1)})


def test_a_missing_delta_version_is_written_by_the_next_writer(tmp_path: Path) -> None:
    table = twice_updated(tmp_path, ("d1", "d2"))
    written = Path(table.io.path(delta_log.version_file(2))).read_bytes()
    Path(table.io.path(delta_log.version_file(2))).unlink()  # a crash between the publish and the Delta version
    assert "dbidx repair" in verify_table(Table.open(table.uri)).damaged[0]["problem"]
    fresh = Table.open(table.uri)
    assert fresh.sync_delta_log() == 1
    assert Path(table.io.path(delta_log.version_file(2))).read_bytes() == written  # derived again, same bytes
    assert_readers_agree(fresh, COLUMNS, {("a", "d1", 2), ("b", "d2", 2)})


def test_two_writers_interleave_without_a_false_alarm(tmp_path: Path) -> None:
    first = Table.create(str(tmp_path / "t"), num_shards=2)
    second = Table.open(first.uri)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    for i, writer in enumerate([first, second, first, first, second, second, first]):
        upsert_arrow(
            pa.table({"id": [f"k{i}", "shared"], "dt": ["d1", "d1"], "v": [i, i]}),
            writer,
            key="id",
            partition="dt",
            cache_config=config,
        )
    expected = {(f"k{i}", "d1", i) for i in range(7)} | {("shared", "d1", 6)}
    assert_readers_agree(first, COLUMNS, expected)
    assert delta_log.listed_versions(first.io) == list(range(8))


def test_inline_vectors_round_trip() -> None:
    from pyroaring import BitMap

    from dbidx.data.deletion_vectors import decode_vector, encode_vector, inline_form, z85_decode

    for positions in ([], [0], [1, 5, 4095, 4096, 70000], list(range(0, 9000, 2))):
        body = encode_vector(BitMap(positions))
        back = z85_decode(inline_form(body))[: len(body)]
        assert list(decode_vector(back, "test")) == positions
    with pytest.raises(CorruptFileError, match="malformed"):
        decode_vector(b"\x00" * 16, "test")


def test_the_tasks_superseded_rows_are_used_unless_a_commit_changed_their_groups(tmp_path: Path, monkeypatch) -> None:
    from dbidx.data import superseded
    from dbidx.spark_integration import task

    table = Table.create(str(tmp_path / "t"), num_shards=1)
    other = Table.open(table.uri)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    other_config = CacheConfig(base_path=str(tmp_path / "cache-other"))

    def upsert(target: Table, keys: list[str], value: int, cfg: CacheConfig = config) -> None:
        upsert_arrow(
            pa.table({"id": keys, "dt": ["d1"] * len(keys), "v": [value] * len(keys)}),
            target,
            key="id",
            partition="dt",
            cache_config=cfg,
        )

    upsert(table, ["a", "b", "c"], 1)
    # 1. Uncontended: the publisher never reads the new files; the tasks' positions are the vectors.
    real_read = superseded.read_new_rows
    monkeypatch.setattr(superseded, "read_new_rows", lambda *a: pytest.fail("the publisher read the new files"))
    upsert(table, ["a", "b"], 2)
    assert_readers_agree(table, COLUMNS, {("a", "d1", 2), ("b", "d1", 2), ("c", "d1", 1)})
    # 2. Another writer commits to the same file group between this upsert's tasks and its publish: the publisher
    #    computes the vectors itself against the table as it now stands.
    calls = []
    monkeypatch.setattr(superseded, "read_new_rows", lambda *a: calls.append(1) or real_read(*a))
    real_batches = task.upsert_batches

    def tasks_then_another_commit(*args, **kwargs):
        result = real_batches(*args, **kwargs)
        if not getattr(tasks_then_another_commit, "done", False):
            tasks_then_another_commit.done = True
            upsert(other, ["c"], 3, other_config)
        return result

    monkeypatch.setattr(task, "upsert_batches", tasks_then_another_commit)
    upsert(table, ["a"], 4)
    assert calls, "the publisher used task positions computed against an older table"
    assert_readers_agree(table, COLUMNS, {("a", "d1", 4), ("b", "d1", 2), ("c", "d1", 3)})


def test_a_task_result_naming_rows_of_another_file_publishes_nothing(tmp_path: Path, monkeypatch) -> None:
    from pyroaring import BitMap

    from dbidx.errors import CommitError
    from dbidx.spark_integration import task

    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    upsert_arrow(
        pa.table({"id": ["a", "b"], "dt": ["d1", "d2"], "v": [1, 1]}),
        table,
        key="id",
        partition="dt",
        cache_config=config,
    )
    other_day = next(f.record.path for f in table.data_view().live() if f.record.partition == "dt=d2")
    real_batches = task.upsert_batches

    def lying(*args, **kwargs):
        result = real_batches(*args, **kwargs)
        result.superseded[other_day] = BitMap([0])  # b's row, which this batch never touched
        return result

    monkeypatch.setattr(task, "upsert_batches", lying)
    with pytest.raises(CommitError, match="neither a file of this commit"):
        upsert_arrow(
            pa.table({"id": ["a"], "dt": ["d1"], "v": [2]}), table, key="id", partition="dt", cache_config=config
        )
    assert_readers_agree(table, COLUMNS, {("a", "d1", 1), ("b", "d2", 1)})
