"""`dbidx upgrade`: format-3 tables written by the last format-3 dbidx (tests/fixtures/format3-*.tar.gz, made with
commit 2b30d3f~1: seven upserts with updates, deletes and, in global mode, partition moves; a data compaction, a
clean, checkpoints every 4 completions and an archive bundle) become format-4 Delta tables that every reader reads
whole, and a crash at any step leaves a table that the old or the new reader reads whole."""

from __future__ import annotations

import hashlib
import socket
import json
import tarfile
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from dbidx.cli import main
from dbidx.config import CacheConfig
from dbidx.data import reads
from dbidx.errors import FormatUpgradeError, InvalidInputError
from dbidx.table import upgrade
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table
from dbidx.spark_integration.local import upsert_arrow
from dbidx.storage import layout
from dbidx.storage.records import CompletedInstant, _record_checksum

from tests.delta_readers import assert_readers_agree

FIXTURES = Path(__file__).parents[1] / "fixtures"
COLUMNS = ("id", "dt", "v")


class Crash(BaseException):
    """A process dying at a step (BaseException: nothing in dbidx catches it)."""


def unpack(tmp_path: Path, name: str) -> tuple[str, set[tuple]]:
    with tarfile.open(FIXTURES / f"format3-{name}.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    expected = {tuple(r) for r in json.loads((tmp_path / f"{name}.expected.json").read_text())}
    return str(tmp_path / name), expected


def format3_state(root: str) -> dict[str, str]:
    """What a format-3 reader reads: table.json and the timeline's records, checkpoints and bundles (by digest)."""
    base = Path(root) / ".dbidx"
    files = [base / "table.json"] + sorted(
        p
        for d in ("completed", "checkpoints", "archive")
        for p in (base / "timeline" / d).glob("*")
        if not p.name.startswith(".")
    )
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.mark.parametrize("name", ["partitioned", "global"])
def test_upgrade_makes_a_delta_table_that_every_reader_reads_whole(tmp_path: Path, name: str) -> None:
    root, expected = unpack(tmp_path, name)
    with pytest.raises(FormatUpgradeError, match="dbidx upgrade URI"):
        Table.open(root)
    result = CliRunner().invoke(main, ["upgrade", root, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["status"] == "upgraded" and report["live_rows"] == len(expected)
    assert report["rows_hidden"] > 0 and report["files_with_vectors"] > 0
    table = Table.open(root)
    assert set(assert_readers_agree(table, COLUMNS)) == expected
    assert verify_table(table).ok
    # An upsert after the upgrade (updates of format-3 rows, deletes, new keys): every reader agrees with the model.
    rows = sorted(expected)
    model = {(r[1], r[0]) if name == "partitioned" else r[0]: r for r in rows}
    batch = [(r[0], r[1], 9000 + i, i % 5 == 0) for i, r in enumerate(rows[:30])] + [
        (f"new{i}", "2025-01-02", 9100 + i, False) for i in range(5)
    ]
    upsert_arrow(
        pa.table(
            {
                "id": [b[0] for b in batch],
                "dt": [b[1] for b in batch],
                "v": pa.array([b[2] for b in batch], pa.int64()),
                "_dbidx_delete": [b[3] for b in batch],
            }
        ),
        table,
        key="id",
        partition="dt",
        cache_config=CacheConfig(base_path=str(tmp_path / "cache")),
    )
    for ident, dt, v, deleted in batch:
        model.pop((dt, ident) if name == "partitioned" else ident, None)
        if not deleted:
            model[(dt, ident) if name == "partitioned" else ident] = (ident, dt, v)
    assert set(assert_readers_agree(Table.open(root), COLUMNS)) == set(model.values())
    # Time travel stops at the upgrade: format-3 states were merged by key, not read as of then.
    with pytest.raises(InvalidInputError, match="predates its upgrade"):
        reads.read_arrow(Table.open(root), as_of=report["upgraded_at_seq"] - 1)
    assert reads.read_arrow(Table.open(root), as_of=report["upgraded_at_seq"]).num_rows == len(expected)
    again = CliRunner().invoke(main, ["upgrade", root])
    assert again.exit_code == 0 and "format 4 already" in again.output, again.output


@pytest.mark.parametrize("step", ["vectors written", "record staged", "switched", "published"])
def test_a_crash_at_any_step_leaves_a_table_the_old_or_the_new_reader_reads_whole(
    tmp_path: Path, monkeypatch, step: str
) -> None:
    root, expected = unpack(tmp_path, "partitioned")
    before = format3_state(root)
    real = {
        "vectors written": upgrade.write_vectors,
        "record staged": upgrade.properties_json,
        "switched": upgrade.publish,
        "published": upgrade._settle,
    }[step]

    def crash_around(*args, **kwargs):
        if step in ("vectors written", "published"):
            real(*args, **kwargs)  # the step ran, the process died right after it
        raise Crash(step)

    attr = {
        "vectors written": "write_vectors",
        "record staged": "properties_json",
        "switched": "publish",
        "published": "_settle",
    }[step]
    with monkeypatch.context() as patched:
        patched.setattr(upgrade, attr, crash_around)
        with pytest.raises(Crash):
            upgrade.upgrade_table(root)
    if step in ("vectors written", "record staged"):
        # Before the switch: a format-3 reader finds everything it reads exactly as it was.
        assert format3_state(root) == before
        with pytest.raises(FormatUpgradeError):
            Table.open(root)
    else:
        # After the switch: the new reader reads the whole table (opening publishes a staged record first).
        table = Table.open(root)
        assert {
            tuple(r)
            for r in zip(*(reads.read_arrow(table, columns=list(COLUMNS)).column(c).to_pylist() for c in COLUMNS))
        } == expected
    report = upgrade.upgrade_table(root)
    assert report.status in ("upgraded", "finished", "already")
    table = Table.open(root)
    assert set(assert_readers_agree(table, COLUMNS)) == expected
    assert verify_table(table).ok
    assert not Path(table.io.path(upgrade.STAGED_RECORD)).exists()


def test_pending_instants_refuse_the_upgrade_unless_rolled_back(tmp_path: Path) -> None:
    root, expected = unpack(tmp_path, "global")
    dead = "20250101000000000"
    Path(root, layout.requested_file(dead)).write_text(json.dumps({"action": "commit", "start_seq": 1}))
    before = format3_state(root)
    result = CliRunner().invoke(main, ["upgrade", root])
    assert result.exit_code == 3 and dead in result.output and "--rollback-pending" in result.output, result.output
    assert format3_state(root) == before
    result = CliRunner().invoke(main, ["upgrade", root, "--rollback-pending", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["rolled_back"] == [dead]
    table = Table.open(root)
    assert table.timeline.pending() == [] and set(assert_readers_agree(table, COLUMNS)) == expected


def format3_commit_at(root: str, seq: int) -> None:
    """A format-3 writer publishes `seq`, the one the upgrade wanted (its record: the last one, renumbered)."""
    last = json.loads(Path(root, layout.completed_file(seq - 1)).read_bytes())
    last.pop("checksum")
    last.update(seq=seq, instant="2099" + last["instant"][4:], start_seq=seq - 1)
    last["checksum"] = _record_checksum(last)
    Path(root, layout.completed_file(seq)).write_text(json.dumps(last))
    CompletedInstant.from_json(json.dumps(last).encode(), "crafted", legacy=True)  # a valid format-3 record


def test_a_format3_commit_during_the_upgrade_takes_the_switch_back(tmp_path: Path, monkeypatch) -> None:
    root, expected = unpack(tmp_path, "partitioned")
    original = Path(root, layout.PROPERTIES_FILE).read_bytes()
    real_publish = upgrade.publish

    def writer_wins(timeline, started, record) -> None:
        format3_commit_at(root, record.seq)
        real_publish(timeline, started, record)

    monkeypatch.setattr(upgrade, "publish", writer_wins)
    with pytest.raises(FormatUpgradeError, match="while it was being upgraded"):
        upgrade.upgrade_table(root)
    assert Path(root, layout.PROPERTIES_FILE).read_bytes() == original  # format 3 again
    assert not Path(root, upgrade.STAGED_RECORD).exists()
    assert not list(Path(root).glob("**/deletion_vector_*.bin"))


def test_one_upgrade_at_a_time_and_a_dead_ones_lock_is_taken_over(tmp_path: Path) -> None:
    root, expected = unpack(tmp_path, "partitioned")
    lock = Path(root, upgrade.UPGRADE_LOCK)
    lock.write_text(json.dumps({"host": "another-host", "pid": 1, "started_at_ms": 0}))
    with pytest.raises(FormatUpgradeError, match="another `dbidx upgrade`.*upgrade.lock"):
        upgrade.upgrade_table(root)
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": 2**22 + 12345, "started_at_ms": 0}))
    assert upgrade.upgrade_table(root).status == "upgraded"  # a dead process of this host: taken over
    assert not lock.exists()
    assert set(assert_readers_agree(Table.open(root), COLUMNS)) == expected


def test_a_format3_commit_after_the_switch_and_a_crash_takes_the_switch_back_at_open(
    tmp_path: Path, monkeypatch
) -> None:
    root, _expected = unpack(tmp_path, "partitioned")
    seen: dict[str, int] = {}

    def format3_writer_wins_then_crash(timeline, started, record) -> None:
        format3_commit_at(root, record.seq)
        seen["seq"] = record.seq
        raise Crash("died before publishing")

    with monkeypatch.context() as patched:
        patched.setattr(upgrade, "publish", format3_writer_wins_then_crash)
        with pytest.raises(Crash):
            upgrade.upgrade_table(root)
    with pytest.raises(FormatUpgradeError, match="format 3 again"):
        Table.open(root)
    assert json.loads(Path(root, layout.PROPERTIES_FILE).read_text())["format_version"] == 3
    assert "upgraded_at_seq" not in json.loads(Path(root, layout.PROPERTIES_FILE).read_text())
    assert not Path(root, upgrade.STAGED_RECORD).exists() and not list(Path(root).glob("**/deletion_vector_*.bin"))
    report = upgrade.upgrade_table(root)  # with the writers stopped, it upgrades the grown format-3 table
    assert report.status == "upgraded" and report.upgraded_at_seq == seen["seq"] + 1
