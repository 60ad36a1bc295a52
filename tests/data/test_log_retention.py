"""Delta log retention (data/log_retention.py) and the services' log cleanup: log files below the newest checkpoint
older than the retention go, oldest first, and every engine still reads the table and time-travels to the versions
kept; dbidx reopens and writes on. Real tables (`upsert_arrow`), real delta-rs checkpoints; files aged with utime."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pyarrow as pa
import pytest

from dbidx.config import CacheConfig
from dbidx.data.delta_checkpoint import write_delta_checkpoint
from dbidx.data.delta_log import DELTA_LOG_DIR, listed_versions
from dbidx.data.log_retention import still_young, LogExpiry, complete_checkpoints, expire_log
from dbidx.errors import CorruptFileError
from dbidx.table.service_settings import write_settings
from dbidx.table.services import run_services
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table
from dbidx.spark_integration.local import upsert_arrow
from dbidx.storage.fileio import FileEntry

from tests.delta_readers import assert_readers_agree, via_deltalake, via_polars

DAY_MS = 86_400_000


def write(table: Table, tmp_path: Path, i: int) -> None:
    upsert_arrow(
        pa.table({"id": [f"k{i % 7}", f"n{i}"], "dt": ["x", "y"], "v": [i, i]}),
        table,
        key="id",
        partition="dt",
        cache_config=CacheConfig(base_path=str(tmp_path / "cache")),
    )


def expected(n: int) -> set[tuple]:
    rows = {f"k{i % 7}": i for i in range(n)}
    return {(k, "x", v) for k, v in rows.items()} | {(f"n{i}", "y", i) for i in range(n)}


def age_log(table: Table, days: float) -> None:
    """Make every log file `days` old (what time does to a long-running table)."""
    then = time.time() - days * 86_400
    log = Path(table.io.path(DELTA_LOG_DIR))
    for f in log.iterdir():
        os.utime(f, (then, then))


def table_with_checkpoints(tmp_path: Path, writes: int, every: int) -> Table:
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    for i in range(writes):
        write(table, tmp_path, i)
        if (i + 1) % every == 0:
            assert write_delta_checkpoint(table.io)
    return table


def test_expired_log_files_go_below_the_newest_old_checkpoint_and_every_engine_reads_on(tmp_path: Path) -> None:
    table = table_with_checkpoints(tmp_path, writes=12, every=5)  # checkpoints at versions 5 and 10
    age_log(table, days=40)
    write(table, tmp_path, 12)  # version 13: young
    report = expire_log(table.io, 30 * DAY_MS)
    assert report.kept_from == 10
    assert listed_versions(table.io) == list(range(10, 14))
    names = os.listdir(table.io.path(DELTA_LOG_DIR))
    assert not any(n.startswith("00000000000000000005.checkpoint") for n in names)
    assert any(n.startswith("00000000000000000010.checkpoint") for n in names)
    assert report.bytes > 0 and len(report.deleted) == 10 + 1  # versions 0-9 and the checkpoint at 5
    # Every engine reads the latest version, and time travel to a kept version works.
    assert_readers_agree(table, ["id", "dt", "v"], expected(13))
    assert set(via_deltalake(table.uri, ["id", "dt", "v"], version=11)) == expected(11)
    assert set(via_polars(table.uri, ["id", "dt", "v"], version=10)) == expected(10)
    # dbidx: a fresh process opens it (its version 0 is gone), verifies it and writes on.
    again = Table.open(table.uri)
    assert verify_table(again).damaged == []
    write(again, tmp_path, 13)
    assert_readers_agree(again, ["id", "dt", "v"], expected(14))


def test_nothing_goes_without_a_checkpoint_old_enough(tmp_path: Path) -> None:
    table = table_with_checkpoints(tmp_path, writes=6, every=5)
    now_ms = time.time() * 1000
    young = expire_log(table.io, 30 * DAY_MS)  # the checkpoint is young: nothing, and what to wait for
    assert (young.kept_from, young.deleted) == (None, [])
    assert young.waits_on == (f"{DELTA_LOG_DIR}/{5:020d}.checkpoint.parquet",)
    assert young.next_due_ms is not None and abs(young.next_due_ms - (now_ms + 30 * DAY_MS)) < 60_000
    assert still_young(table.io, young.waits_on, 30 * DAY_MS)
    age_log(table, days=40)
    assert not still_young(table.io, young.waits_on, 30 * DAY_MS)  # time passed: list again
    longer = expire_log(table.io, 50 * DAY_MS)  # retention longer than the age: due in 10 days
    assert (longer.kept_from, longer.deleted) == (None, [])
    assert longer.next_due_ms is not None and abs(longer.next_due_ms - (now_ms + 10 * DAY_MS)) < 60_000
    assert still_young(table.io, longer.waits_on, 50 * DAY_MS)
    Path(table.io.path(longer.waits_on[0])).unlink()
    assert not still_young(table.io, longer.waits_on, 50 * DAY_MS)  # another engine's cleanup took it: list again
    plain = Table.create(str(tmp_path / "plain"), num_shards=1)
    write(plain, tmp_path, 0)
    age_log(plain, days=40)
    assert expire_log(plain.io, DAY_MS) == LogExpiry()  # no checkpoint at all: every version is needed
    assert listed_versions(plain.io) == [0, 1]


def test_a_file_younger_than_the_cutoff_stops_the_cleanup_and_leaves_a_contiguous_log(tmp_path: Path) -> None:
    table = table_with_checkpoints(tmp_path, writes=10, every=10)
    age_log(table, days=40)
    young = Path(table.io.path(f"{DELTA_LOG_DIR}/{4:020d}.json"))
    os.utime(young, None)  # version 4 looks new (a clock step, a copy)
    report = expire_log(table.io, 30 * DAY_MS)
    assert report.kept_from == 10 and listed_versions(table.io) == list(range(4, 11))
    assert_readers_agree(table, ["id", "dt", "v"], expected(10))


def test_a_damaged_checkpoint_pointer_stops_the_cleanup(tmp_path: Path) -> None:
    table = table_with_checkpoints(tmp_path, writes=5, every=5)
    age_log(table, days=40)
    Path(table.io.path(f"{DELTA_LOG_DIR}/_last_checkpoint")).write_text('{"version": "five"}')
    with pytest.raises(CorruptFileError, match="_last_checkpoint"):
        expire_log(table.io, DAY_MS)
    assert listed_versions(table.io) == list(range(0, 6))


def test_partly_written_multi_part_checkpoints_do_not_count() -> None:
    def entry(name: str) -> FileEntry:
        return FileEntry(f"{DELTA_LOG_DIR}/{name}", 1, 0)

    entries = [
        entry(f"{7:020d}.checkpoint.0000000001.0000000002.parquet"),
        entry(f"{9:020d}.checkpoint.0000000001.0000000002.parquet"),
        entry(f"{9:020d}.checkpoint.0000000002.0000000002.parquet"),
        entry(f"{3:020d}.checkpoint.parquet"),
        entry(f"{3:020d}.json"),
    ]
    assert sorted(complete_checkpoints(entries)) == [3, 9]


def test_the_services_write_checkpoints_by_the_tables_interval_and_expire_by_its_retention(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    write_settings(
        table.io,
        {"after_commit": False, "vacuum": False, "data_compaction": False, "index_compaction": False, "clean": False},
    )
    write(table, tmp_path, 0)
    table.set_delta_properties({"delta.checkpointInterval": "3", "delta.logRetentionDuration": "interval 1 days"})
    for i in range(1, 4):
        write(table, tmp_path, i)
    ran = {r.service: r.details for r in run_services(table, table.service_settings()).ran}
    assert ran["log_cleanup"]["checkpoint"] == table.delta_version() == 5
    assert ran["log_cleanup"]["files_deleted"] == 0  # nothing older than a day yet
    assert "log_cleanup" not in {r.service for r in run_services(table, table.service_settings()).ran}  # not due
    age_log(table, days=2)
    for i in range(4, 7):
        write(table, tmp_path, i)
    ran = {r.service: r.details for r in run_services(table, table.service_settings()).ran}
    assert ran["log_cleanup"]["checkpoint"] == 8 and ran["log_cleanup"]["kept_from"] == 5
    assert listed_versions(table.io) == list(range(5, 9))
    # Off by the table's property: checkpoints still, deletes nothing.
    table.set_delta_properties({"delta.enableExpiredLogCleanup": "false"})
    age_log(table, days=2)
    for i in range(7, 10):
        write(table, tmp_path, i)
    ran = {r.service: r.details for r in run_services(table, table.service_settings()).ran}
    assert ran["log_cleanup"]["checkpoint"] == 12 and "files_deleted" not in ran["log_cleanup"]
    assert listed_versions(table.io)[0] == 5
    assert_readers_agree(table, ["id", "dt", "v"], expected(10))
