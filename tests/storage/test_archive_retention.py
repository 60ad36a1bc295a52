"""Archive retention (issue 44): bundles of completion records older than the table's log retention and below the
oldest kept checkpoint are deleted after a floor records it; a table with an expired archive opens, reads, time
travels to kept versions, refuses expired ones with HistoryCompactedError, verifies clean and takes new upserts,
and a gap above the floor (or a damaged floor) is still a CorruptFileError. Real tables on a temp dir, no mocks."""

from __future__ import annotations

import copy
import random
import shutil
import time
from pathlib import Path
from typing import Callable

import pytest

from dbidx.buckets.assigner import BucketSpec
from dbidx.config import CacheConfig
from dbidx.data import reads
from dbidx.errors import CorruptFileError, HistoryCompactedError, InstantStateError, InvalidInputError
from dbidx.table.delta_properties import retention_of
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table
from dbidx.spark_integration import shard_sessions
from dbidx.spark_integration.local import upsert_arrow
from dbidx.storage import checkpoint, history_floor, layout
from dbidx.storage.archive_retention import data_view_at, expire_archive

from tests.data.test_compaction import as_arrow, current
from tests.spark_helpers import random_batch
from tests.storage.test_checkpoints import build, reseal

FAR_FUTURE_MS = 4_000_000_000_000  # every record is older than any retention below, seen from here
DAY_MS = 86_400_000


def upserts(table: Table, oracle, config, seed: int, first_key: int, count: int) -> None:
    """`count` more random upserts (new keys from `first_key`), applied to the oracle too."""
    rng = random.Random(seed)
    for _ in range(count):
        batch = random_batch(rng, oracle, [first_key], size=20)
        upsert_arrow(
            as_arrow(batch), table, key="id", partition="dt", buckets=BucketSpec(capacity=5), cache_config=config
        )
        oracle.apply(batch)


def expired_table(tmp_path: Path, global_index: bool = False):
    """A table written by a random stream (upserts, compactions, cleans), with data-view snapshots of every seq
    taken before its archive is expired up to the oldest checkpoint."""
    table, oracle, config = build(tmp_path, global_index)
    before = {s: reads.view_at(table, as_of=s).to_dict() for s in range(1, table.timeline.latest_seq + 1)}
    report = expire_archive(table, retention_ms=DAY_MS, now_ms=FAR_FUTURE_MS)
    return table, oracle, config, before, report


@pytest.fixture(scope="module")
def made_once(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple]:
    """`made_once(tmp_path, kind)`: a copy in `tmp_path` (table dir and cache dir) of a table this module makes
    once per kind, opened anew, with a copy of its oracle (and, for "expired", the snapshots and the expiry
    report): `build(.., False, batches=14)` ("built-14") or `expired_table(.., False)` ("expired"). Each test
    changes its own copy; the ones that need the process that wrote the table make theirs (building one is most
    of these tests' time)."""
    made: dict[str, tuple[Path, tuple]] = {}

    def copy_of(tmp_path: Path, kind: str) -> tuple:
        if kind not in made:
            source = tmp_path_factory.mktemp(kind)
            if kind == "expired":
                _table, oracle, _config, before, report = expired_table(source)
                made[kind] = source, (oracle, before, report)
            else:
                _table, oracle, _config = build(source, False, batches=14)
                made[kind] = source, (oracle,)
        source, extras = made[kind]
        for name in ("t", "cache"):
            shutil.copytree(source / name, tmp_path / name)
        table = Table.open(str(tmp_path / "t"))
        table.refresh()
        config = CacheConfig(base_path=str(tmp_path / "cache"))
        oracle, *rest = copy.deepcopy(extras)
        return (table, oracle, config, *rest)

    return copy_of


@pytest.mark.slow
@pytest.mark.parametrize("global_index", [False, True], ids=["partitioned", "global"])
def test_an_expired_archive_opens_reads_time_travels_verifies_and_takes_upserts(
    tmp_path: Path, global_index: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    table, oracle, config, before, report = expired_table(tmp_path, global_index)
    oldest = checkpoint.checkpoint_seqs(table.io)[0]
    # 1. Every bundle wholly below the oldest checkpoint went; the floor says so, with the state at it.
    assert report.floor == oldest and report.floor_before == 0 and report.records_expired == oldest
    assert report.deleted and report.bytes > 0
    assert all(first > report.floor for first, _ in checkpoint.archive_ranges(table.io))
    assert history_floor.floor_seqs(table.io) == [report.floor]
    # 2. A new process opens it, reads the current rows, and verifies it clean (saying what it can no longer check).
    fresh = Table.open(table.uri)
    assert current(fresh) == oracle.expected_rows()
    check = verify_table(fresh)
    assert check.ok, check.damaged
    assert check.history_floor == report.floor and check.checkpoint_seq is not None
    assert "expired by archive retention" in check.not_checked[0]
    assert check.to_dict()["history_floor"] == report.floor
    # 3. Time travel to every kept seq gives what it gave before the expiry; an expired seq is refused by name.
    latest = fresh.timeline.latest_seq
    for seq in range(report.floor, latest + 1):
        assert data_view_at(fresh.timeline, seq).to_dict() == before[seq], seq
    for seq in (1, report.floor - 1):
        with pytest.raises(HistoryCompactedError, match="delta.logRetentionDuration"):
            reads.view_at(fresh, as_of=seq)
        with pytest.raises(HistoryCompactedError, match=f"up to seq {report.floor}"):
            data_view_at(fresh.timeline, seq)
    kept_seq = report.floor + 1
    partition = fresh.partitions()[0].partition if not global_index else None
    fresh.snapshot(partition, as_of=kept_seq)  # the index's own time travel reads the view, not the log
    # 4. History: what is kept is listed, an expired record is refused, never a gap (CorruptFileError).
    assert [r.seq for r in fresh.timeline.kept()] == list(range(report.floor + 1, latest + 1))
    with pytest.raises(HistoryCompactedError, match="archive retention expired"):
        fresh.timeline.completed()
    first_kept = fresh.timeline.kept()[0]
    assert fresh.timeline.seq_of(first_kept.instant) == first_kept.seq
    expired_instant = history_floor.current_floor(table.io, table.props.table_id).max_instant
    with pytest.raises(HistoryCompactedError):
        fresh.timeline.seq_of(expired_instant)
    # 5. New upserts land (checkpoints and archiving go on), and expiry runs again from the floor's saved state.
    upserts(fresh, oracle, config, seed=44, first_key=50_000, count=9)
    again = expire_archive(fresh, retention_ms=DAY_MS, now_ms=FAR_FUTURE_MS)
    assert again.floor_before == report.floor and again.floor > report.floor
    assert history_floor.floor_seqs(table.io) == [again.floor]  # the older floor went after the newer was written
    reopened = Table.open(table.uri)
    assert current(reopened) == oracle.expected_rows()
    assert verify_table(reopened).ok
    # 6. The process that wrote the table and loaded its history before the expiry keeps working.
    table.refresh()
    assert table.timeline.latest_seq == reopened.timeline.latest_seq
    # 7. A task's warm table that last read before records it never saw expired starts over from the task's copy
    #    (a worker, or a cache service, idle while the table moved on).
    idle = Table.open(table.uri)
    idle.refresh()
    upserts(fresh, oracle, config, seed=45, first_key=60_000, count=12)
    assert expire_archive(fresh, retention_ms=DAY_MS, now_ms=FAR_FUTURE_MS).floor > idle.timeline.latest_seq
    reopened = Table.open(table.uri)
    reopened.refresh()
    with pytest.raises(HistoryCompactedError):
        idle.refresh()
    monkeypatch.setitem(shard_sessions._TABLES, (idle.props.table_id, idle.uri), idle)
    warm = shard_sessions.warm_table(Table.open(table.uri))
    assert warm is not idle and warm.timeline.latest_seq == reopened.timeline.latest_seq


@pytest.mark.slow
def test_retention_keeps_records_newer_than_it_and_the_checkpoints(tmp_path: Path, made_once) -> None:
    table, _, _ = made_once(tmp_path, "built-14")
    records = table.timeline.completed()
    # 1. Nothing is older than the retention: nothing goes.
    report = expire_archive(table, retention_ms=DAY_MS, now_ms=records[-1].completed_at_ms)
    assert report.floor == 0 and not report.deleted and "newer than the retention" in report.stopped
    # 2. Only bundles all of whose records are older go: the cutoff inside the second bundle stops there.
    ranges = checkpoint.archive_ranges(table.io)
    assert len(ranges) >= 2
    cutoff = records[ranges[1][0] - 1].completed_at_ms  # the first record of the second bundle is not older
    report = expire_archive(table, retention_ms=0, now_ms=cutoff)
    assert report.floor == ranges[0][1] and report.deleted == [layout.archive_file(*ranges[0])]
    # 3. However old, nothing at or above the oldest checkpoint goes (the table opens from the checkpoints).
    expire_archive(table, retention_ms=0, now_ms=FAR_FUTURE_MS)
    oldest = checkpoint.checkpoint_seqs(table.io)[0]
    assert history_floor.current_floor(table.io, table.props.table_id).seq <= oldest
    assert Table.open(table.uri).timeline.kept()[0].seq == history_floor.floor_seqs(table.io)[-1] + 1
    # 4. A bad retention is refused before anything is read.
    with pytest.raises(InvalidInputError, match="retention_ms"):
        expire_archive(table, retention_ms=-1)
    with pytest.raises(InvalidInputError, match="retention_ms"):
        expire_archive(table, retention_ms=None)


def test_the_table_retention_property_decides(tmp_path: Path, made_once) -> None:
    """What the log cleanup service passes: the table's delta.logRetentionDuration, as Delta's own log expiry."""
    table, _, _ = made_once(tmp_path, "built-14")

    def log_retention_ms() -> int:
        return retention_of(table.data_view().configuration()).log_retention_ms

    assert expire_archive(table, log_retention_ms()).floor == 0  # Delta's 30 days: records of a moment ago stay
    table.set_delta_properties({"delta.logRetentionDuration": "interval 1 milliseconds"})
    time.sleep(0.01)
    report = expire_archive(table, log_retention_ms())
    assert report.retention_ms == 1 and report.floor > 0


def test_a_claimed_instant_holds_the_floor_below_it(tmp_path: Path, made_once) -> None:
    """A settled instant's leftover claim (its writer died after publishing) needs its record until the sweep
    removes it: the floor stops below it, so no sweep or rollback ever meets an instant it cannot place."""
    table, _, _ = made_once(tmp_path, "built-14")
    records = table.timeline.completed()
    ranges = checkpoint.archive_ranges(table.io)
    held = records[ranges[1][0]]  # a record inside the second bundle
    table.io.write_atomic(layout.requested_file(held.instant), b"{}")
    report = expire_archive(table, retention_ms=0, now_ms=FAR_FUTURE_MS)
    assert report.floor == ranges[0][1] and held.instant in report.stopped
    table.io.delete(layout.requested_file(held.instant))
    assert expire_archive(table, retention_ms=0, now_ms=FAR_FUTURE_MS).floor > ranges[1][1] - 1


@pytest.mark.slow
def test_an_expired_instant_is_never_rolled_back(tmp_path: Path, made_once) -> None:
    table, _, _, _, report = made_once(tmp_path, "expired")
    floor = history_floor.current_floor(table.io, table.props.table_id)
    # A claim file of an expired instant appearing later (an older dbidx's leftover): rolling it back could delete a
    # committed instant's files, so it is refused, and nothing is deleted.
    table.io.write_atomic(layout.requested_file(floor.max_instant), b"{}")
    fresh = Table.open(table.uri)
    with pytest.raises(HistoryCompactedError, match="rolling back"):
        fresh.timeline.rollback(floor.max_instant)
    assert current(fresh)  # the table still reads
    with pytest.raises(InstantStateError):  # a completed, kept instant: as before
        fresh.timeline.rollback(fresh.timeline.kept()[0].instant)


def test_a_gap_above_the_floor_is_still_corruption(tmp_path: Path, made_once) -> None:
    table, _, _, _, report = made_once(tmp_path, "expired")
    newest = checkpoint.checkpoint_seqs(table.io)[-1]
    assert report.floor + 1 < newest  # a record the newest checkpoint sums up, kept above the floor
    Path(table.io.path(layout.completed_file(report.floor + 1))).unlink()
    fresh = Table.open(table.uri)
    fresh.refresh()  # the newest checkpoint does not need the history
    with pytest.raises(CorruptFileError, match="gap"):
        fresh.timeline.kept()


@pytest.mark.slow
def test_a_damaged_or_missing_floor_is_loud(tmp_path: Path, made_once) -> None:
    table, _, _, _, report = made_once(tmp_path, "expired")
    path = Path(table.io.path(history_floor.floor_file(report.floor)))
    raw = path.read_bytes()
    # 1. A flipped byte: CorruptFileError naming the floor file, in every reader that needs history, and in verify.
    damaged = bytearray(raw)
    damaged[len(damaged) // 2] ^= 0x01
    path.write_bytes(bytes(damaged))
    fresh = Table.open(table.uri)
    assert current(fresh)  # opening needs only the newest checkpoint
    with pytest.raises(CorruptFileError, match="floor"):
        fresh.timeline.kept()
    check = verify_table(Table.open(table.uri))
    assert not check.ok and any("floor" in d["path"] for d in check.damaged)
    # 2. No floor at all (what an older dbidx sees, which never reads it): the expired records are a gap.
    path.unlink()
    with pytest.raises(CorruptFileError, match="gap"):
        Table.open(table.uri).timeline.kept()
    # 3. A stray name in the floor folder is refused by name.
    path.write_bytes(raw)
    Path(table.io.path(history_floor.FLOOR_DIR), "notes.txt").write_text("x")
    with pytest.raises(CorruptFileError, match="notes.txt"):
        Table.open(table.uri).timeline.kept()


def test_verify_still_finds_a_crafted_checkpoint_above_the_floor(tmp_path: Path, made_once) -> None:
    table, _, _, _, _ = made_once(tmp_path, "expired")
    newest = checkpoint.checkpoint_seqs(table.io)[-1]
    reseal(table, newest, lambda p: p["data"].update(writes=p["data"]["writes"] + 1))
    check = verify_table(Table.open(table.uri))
    assert not check.ok and any("differs from a replay" in d["problem"] for d in check.damaged)


@pytest.mark.slow
def test_a_process_behind_the_floor_must_reopen(tmp_path: Path) -> None:
    """A process that last read a record the floor has since passed cannot catch up: HistoryCompactedError telling
    it to open the table again, never a silently shorter log and never a false gap."""
    table, oracle, config = build(tmp_path, False, batches=6)
    behind = Table.open(table.uri)
    behind.refresh()
    upserts(table, oracle, config, seed=5, first_key=80_000, count=14)
    report = expire_archive(table, retention_ms=0, now_ms=FAR_FUTURE_MS)
    assert report.floor > behind.timeline.latest_seq
    with pytest.raises(HistoryCompactedError, match="open the table again"):
        behind.refresh()
    assert current(Table.open(table.uri)) == oracle.expected_rows()


def test_time_travel_reads_reach_kept_versions(tmp_path: Path, made_once) -> None:
    table, _, _, before, report = made_once(tmp_path, "expired")
    fresh = Table.open(table.uri)
    assert reads.view_at(fresh, as_of=report.floor + 1).to_dict() == before[report.floor + 1]


def test_a_range_starting_below_zero_is_the_whole_log(tmp_path: Path) -> None:
    """`completed(after_seq=latest - 1)` on an empty table asks from -1: the whole (empty) log, not a refusal."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    table.refresh()
    assert table.timeline.completed(after_seq=-1) == []
    assert table.latest() is None


@pytest.mark.slow
def test_the_log_cleanup_service_expires_the_archive_by_the_table_retention(tmp_path: Path, made_once) -> None:
    """The services' log cleanup step runs archive retention with the Delta log's own retention, and the table opens,
    reads and verifies afterwards."""
    table, oracle, _ = made_once(tmp_path, "built-14")
    table.set_delta_properties({"delta.logRetentionDuration": "interval 1 milliseconds"})
    time.sleep(0.01)
    report = table.maintain()
    [run] = [r for r in report.ran if r.service == "log_cleanup"]
    assert run.details["archive"]["deleted"] > 0 and run.details["archive"]["floor"] > 0
    fresh = Table.open(table.uri)
    assert current(fresh) == oracle.expected_rows()
    assert verify_table(fresh).ok
