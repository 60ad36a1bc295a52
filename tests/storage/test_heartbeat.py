"""Issue 43 item 2: an unfinished attempt is visible with its writer (host, pid, Spark application id, heartbeat),
its age and files; the writer renews a heartbeat while it runs; the next upsert rolls back the attempts whose
heartbeat expired and says how many it saw; `rollback --all-pending` skips writers that look alive unless --force.

The writers here are real processes (a child running `upsert_arrow`, stopped after it wrote its first files), and a
writer "on another host" is a real child whose claim names another host: only its heartbeat can tell whether it
runs then, as for a Spark driver on another machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pytest
from click.testing import CliRunner

from dbidx.cli import main
from dbidx.config import CacheConfig
from dbidx.data.reads import read_arrow
from dbidx.errors import InstantStateError
from dbidx.table.facade import Table
from dbidx.spark_integration.local import upsert_arrow
from dbidx.storage import layout
from dbidx.storage.heartbeat import EXPIRY_INTERVALS, read_heartbeat
from dbidx.storage.records import ACTION_ROLLBACK

INTERVAL = 0.2  # the child's heartbeat interval: expired after EXPIRY_INTERVALS * 0.2 = 1.2 s

CHILD = textwrap.dedent("""
    import sys, time
    import pyarrow as pa
    from dbidx.config import CacheConfig
    from dbidx.table.facade import Table
    from dbidx.spark_integration.local import upsert_arrow

    path, cache, interval = sys.argv[1], sys.argv[2], float(sys.argv[3])
    table = Table.open(path)
    table.timeline.heartbeat_interval_s = interval

    def stop_after_first_shard(step, total, message, rows):
        if step:  # shard 0's files are written: the writer stays here, mid-upsert, until it is killed
            print("WROTE", table.timeline.pending()[-1], flush=True)
            time.sleep(600)

    data = pa.table({"id": ["a", "b", "n1", "n2"], "dt": ["2025-03-01"] * 4, "v": pa.array([9] * 4, pa.int64())})
    upsert_arrow(data, table, key="id", partition="dt", cache_config=CacheConfig(base_path=cache),
                 progress=stop_after_first_shard)
""")


def rows(ids: list[str], v: int = 1) -> pa.Table:
    return pa.table({"id": ids, "dt": ["2025-03-01"] * len(ids), "v": pa.array([v] * len(ids), pa.int64())})


class Writer:
    """A child process in the middle of an upsert (its first shard's files written), killed at the end."""

    def __init__(self, path: str, cache: str, interval: float = INTERVAL) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, path, cache, str(interval)], stdout=subprocess.PIPE, text=True
        )
        line = self.proc.stdout.readline()
        assert line.startswith("WROTE "), line
        self.instant = line.split()[1]

    def elsewhere(self, path: str) -> None:
        """Make its claim name another host (as a driver on another machine would): its pid says nothing here."""
        claim = Path(path, layout.requested_file(self.instant))
        claim.write_text(json.dumps(json.loads(claim.read_text()) | {"host": "driver-7.example"}))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


@pytest.fixture()
def setup(tmp_path: Path) -> Iterator[tuple[Table, CacheConfig, list[Writer]]]:
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    upsert_arrow(rows(["a", "b", "c", "d"]), table, key="id", partition="dt", cache_config=config)
    writers: list[Writer] = []
    yield table, config, writers
    for w in writers:
        w.kill()


def start_writer(table: Table, config: CacheConfig, writers: list[Writer], **kw) -> Writer:
    writer = Writer(table.uri, str(Path(config.base_path).parent / f"cache-{len(writers)}"), **kw)
    writers.append(writer)
    return writer


def test_a_running_writer_renews_its_heartbeat_and_settling_removes_it(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    table.timeline.heartbeat_interval_s = 0.05
    writer = table.new_commit(tags={"spark_app_id": "app-20261126-0007"})
    first = read_heartbeat(table.io, writer.instant)
    assert first is not None and first.interval_s == 0.05 and not first.expired
    time.sleep(0.3)
    renewed = read_heartbeat(table.io, writer.instant)
    assert renewed.renewed_at_ms > first.renewed_at_ms
    [attempt] = table.pending_attempts()
    assert attempt.alive is True and attempt.tags == {"spark_app_id": "app-20261126-0007"}
    assert attempt.heartbeat_age_seconds is not None and attempt.heartbeat_age_seconds < 1
    writer.insert("p", ["k"], "fg-0")
    writer.commit()
    assert not Path(table.io.path(layout.heartbeat_file(writer.instant))).exists()
    time.sleep(0.2)  # no renewal after the settle brings it back
    assert not Path(table.io.path(layout.heartbeat_file(writer.instant))).exists()
    rolled = table.new_commit()
    rolled.rollback()
    assert not list(Path(table.io.path(layout.HEARTBEAT_DIR)).iterdir())


def test_an_instant_dropped_unsettled_stops_beating_and_expires(tmp_path: Path) -> None:
    """A process that forgets an instant (an exception path that never rolled it back) stops renewing its heartbeat
    when the instant's handle is garbage: the attempt then expires instead of looking alive for ever."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    table.timeline.heartbeat_interval_s = 0.05
    instant = table.new_commit().instant  # the writer object is dropped at once
    time.sleep(0.2 + EXPIRY_INTERVALS * 0.05)
    beat = read_heartbeat(table.io, instant)
    assert beat is not None and beat.expired
    [attempt] = table.pending_attempts()
    assert attempt.alive is False and attempt.abandoned and "next upsert rolls it back" in attempt.advice


@pytest.mark.slow
def test_the_next_upsert_rolls_back_a_dead_writer_of_another_host_once_its_heartbeat_expires(setup) -> None:
    table, config, writers = setup
    writer = start_writer(table, config, writers)
    writer.elsewhere(table.uri)
    files = table.pending_attempts()[0].files
    assert files and all(Path(table.io.path(f)).exists() for f in files)
    # 1. Alive (its heartbeat is renewed): the next upsert sees it and leaves it alone.
    summary = upsert_arrow(rows(["c"], v=2), table, key="id", partition="dt", cache_config=config)
    assert summary.abandoned == {"seen": 1, "rolled_back": [], "running": [writer.instant], "settled": [], "failed": []}
    [attempt] = table.pending_attempts()
    assert attempt.alive is True and attempt.host == "driver-7.example"
    # 2. Killed: once its heartbeat expired, the next upsert rolls it back with its files, and says so.
    writer.kill()
    time.sleep(EXPIRY_INTERVALS * INTERVAL + 0.5)
    assert table.pending_attempts()[0].alive is False
    summary = upsert_arrow(rows(["d"], v=3), table, key="id", partition="dt", cache_config=config)
    assert summary.abandoned == {"seen": 1, "rolled_back": [writer.instant], "running": [], "settled": [], "failed": []}
    assert table.timeline.record_of(writer.instant).action == ACTION_ROLLBACK
    assert not [f for f in files if Path(table.io.path(f)).exists()]
    assert table.pending_attempts() == []
    assert not list(Path(table.io.path(layout.HEARTBEAT_DIR)).iterdir())
    # The stored record of that upsert says it too (`dbidx commits`).
    assert table.timeline.completed()[-1].extra["metrics"]["abandoned"]["rolled_back"] == [writer.instant]
    got = read_arrow(Table.open(table.uri)).sort_by("id")
    assert got.column("id").to_pylist() == ["a", "b", "c", "d"] and got.column("v").to_pylist() == [1, 1, 2, 3]


def test_a_killed_writer_on_this_host_is_rolled_back_at_once(setup) -> None:
    """On the writer's own host its pid says it is gone, without waiting for the heartbeat to expire."""
    table, config, writers = setup
    writer = start_writer(table, config, writers, interval=30.0)
    writer.kill()
    [attempt] = table.pending_attempts()
    assert attempt.alive is False and attempt.heartbeat_expires_in_seconds > 0
    summary = upsert_arrow(rows(["c"], v=2), table, key="id", partition="dt", cache_config=config)
    assert summary.abandoned["rolled_back"] == [writer.instant]


@pytest.mark.slow
def test_rollback_all_pending_skips_a_live_writer_unless_forced_and_the_writer_then_fails(setup) -> None:
    table, config, writers = setup
    writer = start_writer(table, config, writers)
    writer.elsewhere(table.uri)
    runner = CliRunner()
    result = runner.invoke(main, ["commits", table.uri])
    assert result.exit_code == 0, result.output
    line = next(ln for ln in result.output.splitlines() if ln.startswith("PENDING"))
    assert writer.instant in line and "driver-7.example" in line and "(alive: heartbeat" in line, line
    for command in (["stats", table.uri, "--json"], ["verify", table.uri, "--json"]):
        result = runner.invoke(main, command)
        assert result.exit_code == 0, result.output
        [pending] = json.loads(result.output)["pending"]
        assert pending["instant"] == writer.instant and pending["alive"] is True and pending["files"]
    result = runner.invoke(main, ["rollback", table.uri, "--all-pending", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == {"rolled_back": [], "published": [], "skipped_alive": [writer.instant]}
    result = runner.invoke(main, ["rollback", table.uri, "--all-pending", "--force"])
    assert result.exit_code == 0, result.output
    assert f"rolled back {writer.instant}" in result.output
    # The heartbeat thread of the (stopped, still running) writer notices its claim is gone and stops: nothing
    # it renews brings a heartbeat back after the sweep.
    time.sleep(3 * INTERVAL)
    Table.open(table.uri).sweep_leftovers()
    time.sleep(3 * INTERVAL)
    assert not list(Path(table.io.path(layout.HEARTBEAT_DIR)).iterdir())


def test_a_live_writer_rolled_back_by_force_cannot_publish(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    writer = table.new_commit()
    writer.insert("p", ["k"], "fg-0")
    other = Table.open(table.uri)
    assert other.rollback_pending(force=True) == ([writer.instant], [])
    with pytest.raises(InstantStateError, match="rolled back"):
        writer.commit()


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        b'{"renewed_at_ms": "soon", "interval_s": 1}',
        b'{"renewed_at_ms": 1, "interval_s": 1e9}',
        b'{"renewed_at_ms": true}',
        b'{"renewed_at_ms": 1, "interval_s": NaN}',
    ],
    ids=str,
)
def test_a_heartbeat_that_is_not_what_dbidx_writes_is_not_trusted(tmp_path: Path, body: bytes) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    writer = table.new_commit()
    table.timeline.stop_heartbeat(writer.instant, delete=False)
    Path(table.io.path(layout.heartbeat_file(writer.instant))).write_bytes(body)
    assert read_heartbeat(table.io, writer.instant) is None
    [attempt] = table.pending_attempts()
    assert attempt.heartbeat_age_seconds is None and attempt.alive is True  # its pid on this host runs
    writer.rollback()


def test_the_claim_records_tags_and_refuses_unfit_ones(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    with pytest.raises(InstantStateError, match="writer tag"):
        table.new_commit(tags={"spark_app_id": 7})
    assert table.timeline.pending() == []
    writer = table.new_commit(tags={"spark_app_id": "app-1"})
    claim = json.loads(Path(table.io.path(layout.requested_file(writer.instant))).read_text())
    assert claim["tags"] == {"spark_app_id": "app-1"} and claim["pid"] == os.getpid()
    writer.rollback()
