"""A typo, an odd value, a stale file or a hostile neighbour never bricks a table: each is refused with a typed
error or swept, and the table stays usable."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from dbidx.cli import main
from dbidx.config import CacheConfig
from dbidx.data.reads import read_arrow
from dbidx.errors import (
    ConfigError,
    CorruptFileError,
    InstantStateError,
    InvalidInputError,
    InvalidKeyError,
    InvalidPartitionError,
)
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table
from dbidx.spark_integration.local import upsert_arrow
from dbidx.storage import layout, markers


def rows(ids: list[str], day: str = "2025-03-01", v: int = 1) -> pa.Table:
    return pa.table({"id": ids, "dt": [day] * len(ids), "v": pa.array([v] * len(ids), pa.int64())})


def test_a_rollback_of_an_instant_never_started_is_refused(tmp_path: Path) -> None:
    """A typo (or another table's id) used to publish a rollback record; after the next checkpoint every writer
    claimed an 18-digit instant and failed for ever."""
    table = Table.create(str(tmp_path / "t"), num_shards=1, checkpoint_interval=2)
    config = CacheConfig(base_path=str(tmp_path / "c"))
    upsert_arrow(rows(["a"]), table, key="id", partition="dt", cache_config=config)
    result = CliRunner().invoke(main, ["rollback", table.uri, "99999999999999999"])
    assert result.exit_code == InstantStateError.exit_code, result.output
    assert "never started" in result.output
    assert [r.action for r in table.timeline.completed()] == ["commit"]
    for v in range(2, 5):  # checkpoints come and go; instants stay allocatable
        upsert_arrow(rows(["a", "b"], v=v), table, key="id", partition="dt", cache_config=config)
    assert verify_table(table).ok


def test_an_instant_id_pushed_to_the_end_of_its_range_is_a_typed_error(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    (Path(table.io.path(layout.TIMELINE_DIR)) / "99999999999999999.requested").write_text("{}")
    with pytest.raises(CorruptFileError, match="17-digit range"):
        table.timeline.start("commit")


def test_a_partition_value_longer_than_a_directory_name_is_refused_before_any_write(tmp_path: Path) -> None:
    from dbidx.errors import InvalidPartitionError

    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "c"))
    upsert_arrow(rows(["a"]), table, key="id", partition="dt", cache_config=config)
    with pytest.raises(InvalidPartitionError, match="at most 255 bytes"):
        upsert_arrow(rows(["b"], day="x" * 300), table, key="id", partition="dt", cache_config=config)
    with pytest.raises(InvalidPartitionError, match="at most 255 bytes"):  # multi-byte characters count as bytes
        upsert_arrow(rows(["b"], day="é" * 130), table, key="id", partition="dt", cache_config=config)
    upsert_arrow(rows(["b"], day="y" * 250), table, key="id", partition="dt", cache_config=config)  # still fits
    assert all(not table.io.list_names(markers.marker_dir(i)) for i in table.io.list_dirs(markers.MARKERS_DIR))
    assert verify_table(table).ok
    assert [r.action for r in table.timeline.completed()] == ["commit", "rollback", "rollback", "commit"]


def test_deleting_a_path_whose_name_cannot_exist_is_not_an_error(tmp_path: Path) -> None:
    """A marker naming such a path (left by a version of dbidx that wrote before checking) never blocks a sweep."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    assert table.io.delete(f"dt={'x' * 300}/file.parquet") is False


def test_reads_never_follow_a_symlink_out_of_the_table(tmp_path: Path) -> None:
    """A partition directory swapped for a symlink to a copy outside the table: the bytes would even verify, but
    reads, verify and compaction refuse them (typed), instead of returning the outside rows."""
    import shutil

    from dbidx.data import reads

    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "c"))
    upsert_arrow(rows(["a", "b"]), table, key="id", partition="dt", cache_config=config)
    upsert_arrow(rows(["a"], v=2), table, key="id", partition="dt", cache_config=config)
    inside = tmp_path / "t" / "dt=2025-03-01"
    outside = tmp_path / "elsewhere"
    shutil.move(str(inside), str(outside))
    inside.symlink_to(outside, target_is_directory=True)
    reopened = Table.open(table.uri)
    with pytest.raises(CorruptFileError, match="outside the table"):
        reads.read_arrow(reopened)
    assert not verify_table(reopened).ok
    with pytest.raises(CorruptFileError, match="outside the table"):
        reopened.compact_data()


def test_a_cache_base_others_can_write_is_refused(tmp_path: Path) -> None:
    """A base directory others may write (a shared /tmp path made 0777) lets them swap our shard directories: the
    upsert refuses it, naming the fix, and publishes nothing; once private again it works."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    base = tmp_path / "shared-base"
    config = CacheConfig(base_path=str(base))
    upsert_arrow(rows(["a"]), table, key="id", partition="dt", cache_config=config)  # the first load opens no cache
    base.mkdir(exist_ok=True)
    base.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by group or others.*chmod go-w"):
        upsert_arrow(rows(["a", "b"], v=2), table, key="id", partition="dt", cache_config=config)
    assert Table.open(table.uri).latest().action == "rollback"  # the failed instant is rolled back, not left
    assert read_arrow(Table.open(table.uri)).column("v").to_pylist() == [1]
    base.chmod(0o700)
    upsert_arrow(rows(["a", "b"], v=2), table, key="id", partition="dt", cache_config=config)
    assert sorted(read_arrow(Table.open(table.uri)).column("v").to_pylist()) == [2, 2]


def test_a_cache_dir_another_user_owns_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen as another uid (we cannot chown without root), our own private directories are someone else's."""
    from dbidx.cache.base_dir import prepare_dir

    made = prepare_dir(tmp_path / "base" / "table")
    real_uid = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: real_uid + 1)
    with pytest.raises(ConfigError, match=f"owned by uid {real_uid}, not by this user"):
        prepare_dir(made)


def test_keys_that_are_not_exact_text_are_typed_errors(tmp_path: Path) -> None:
    """Float keys (1.0 -> "1", NaN -> "nan"), binary keys that are not UTF-8 and duplicated column names were
    accepted or gave raw Arrow/KeyErrors; each is a typed error naming the column, and nothing is written."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "c"))
    day = ["2025-03-01"] * 2
    floats = pa.table({"id": [1.0, float("nan")], "dt": day})
    with pytest.raises(InvalidKeyError, match="key column 'id' of the upsert table is double.*cast it"):
        upsert_arrow(floats, table, key="id", partition="dt", cache_config=config)
    binary = pa.table({"id": pa.array([b"ok", b"\xff\xfe"], pa.binary()), "dt": day})
    with pytest.raises(InvalidKeyError, match="at row 1 .*not valid UTF-8"):
        upsert_arrow(binary, table, key="id", partition="dt", cache_config=config)
    twice = pa.Table.from_arrays([pa.array(["a", "b"]), pa.array(day), pa.array(["x", "y"])], names=["id", "dt", "id"])
    with pytest.raises(InvalidInputError, match="more than one column named 'id'"):
        upsert_arrow(twice, table, key="id", partition="dt", cache_config=config)
    assert table.latest() is None
    text = pa.table({"id": pa.array([b"a", b"b"], pa.binary()), "dt": day})  # binary UTF-8 keys stay usable
    upsert_arrow(text, table, key="id", partition="dt", cache_config=config)
    assert sorted(read_arrow(Table.open(table.uri)).column("id").to_pylist()) == [b"a", b"b"]


def test_cli_numbers_out_of_range_and_an_empty_rollback(tmp_path: Path) -> None:
    """Negative --retain (acted as 0), --last and --ttl-hours are usage errors (exit 2) that change nothing;
    rollback --all-pending with nothing pending says so and exits 0."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    upsert_arrow(rows(["a"]), table, key="id", partition="dt", cache_config=CacheConfig(base_path=str(tmp_path / "c")))
    runner = CliRunner()
    for args in (
        ["compact", table.uri, "--retain", "-1"],
        ["commits", table.uri, "--last", "-5"],
        ["cache", "reap", "--ttl-hours", "-1", "--cache-dir", str(tmp_path / "c")],
        ["init", str(tmp_path / "u"), "--num-shards", "0"],
    ):
        result = runner.invoke(main, args)
        assert result.exit_code == 2 and "Invalid value" in result.output, (args, result.output)
    assert Table.open(table.uri).latest().seq == 1 and not (tmp_path / "u").exists()
    result = runner.invoke(main, ["rollback", table.uri, "--all-pending"])
    assert result.exit_code == 0, result.output
    assert "nothing to roll back" in result.output
    result = runner.invoke(main, ["rollback", table.uri, "--all-pending", "--json"])
    assert result.exit_code == 0 and json.loads(result.output) == {
        "rolled_back": [],
        "published": [],
        "skipped_alive": [],
    }
    assert runner.invoke(main, ["rollback", table.uri]).exit_code == 2


def test_leftovers_of_dead_writers_are_swept_and_a_live_writer_keeps_its_files(tmp_path: Path) -> None:
    """A writer killed between a temp write and its rename left `.tmp-<hex>`; one killed after publishing left its
    .requested/.inflight, markers and an unlisted touched file. Clean (and the next upsert, for the instant's files)
    sweeps them; a live writer's pending instant and a fresh temp file stay."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "c"))
    upsert_arrow(rows(["a", "b"]), table, key="id", partition="dt", cache_config=config)
    settled = table.timeline.completed()[-1].instant
    root = tmp_path / "t"
    old_tmp, fresh_tmp = root / "dt=2025-03-01" / ".tmp-0a1b", root / ".dbidx" / "rli" / ".tmp-2c3d"
    for path in (old_tmp, fresh_tmp):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"partial")
    os.utime(old_tmp, (1e9, 1e9))  # 2001: a dead writer's
    touched = f"dt=2025-03-01/touched-{settled}-a0.parquet"
    for rel in (layout.requested_file(settled), layout.inflight_file(settled), touched):
        table.io.write_atomic(rel, b"{}")
    markers.announce(table.io, settled, touched)
    live = table.new_commit()  # a writer still running: its instant is pending
    live_requested = layout.requested_file(live.instant)
    assert table.io.exists(live_requested)
    # 1. Clean sweeps everything older than the age guard; the live writer's files stay.
    table.clean()
    assert not old_tmp.exists() and fresh_tmp.exists()
    for rel in (layout.requested_file(settled), layout.inflight_file(settled), touched, markers.marker_dir(settled)):
        assert not table.io.exists(rel), rel
    assert table.io.exists(live_requested) and Table.open(table.uri).timeline.pending() == [live.instant]
    live.rollback()
    # 2. `dbidx repair` sweeps too, and says how much; the table reads the same and verifies.
    os.utime(fresh_tmp, (1e9, 1e9))
    result = CliRunner().invoke(main, ["repair", table.uri, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["leftovers_deleted"] >= 1 and not fresh_tmp.exists()
    reopened = Table.open(table.uri)
    assert sorted(read_arrow(reopened).column("id").to_pylist()) == ["a", "b"] and verify_table(reopened).ok


def test_the_next_upsert_sweeps_a_settled_instants_timeline_files(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "c"))
    upsert_arrow(rows(["a"]), table, key="id", partition="dt", cache_config=config)
    settled = table.timeline.completed()[-1].instant
    for rel in (layout.requested_file(settled), layout.inflight_file(settled)):
        table.io.write_atomic(rel, b"{}")
    upsert_arrow(rows(["b"]), table, key="id", partition="dt", cache_config=config)
    assert table.io.list_names(layout.TIMELINE_DIR) == []


def test_partition_values_that_are_hive_paths_already_are_refused(tmp_path: Path) -> None:
    """A newcomer's first hour: `dt=2025-01-10` values in column dt would make dt=dt=2025-01-10 directories."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    batch = pa.table({"id": ["a", "b"], "dt": ["2025-01-10", "dt=2025-01-10"]})
    with pytest.raises(InvalidPartitionError, match=r"hive paths already \('dt=2025-01-10' at row 1.*hive_style=False"):
        upsert_arrow(batch, table, key="id", partition="dt", cache_config=config)
    assert table.timeline.pending() == [] and not list((tmp_path / "t").glob("dt=dt=*"))
    summary = upsert_arrow(batch, table, key="id", partition="dt", hive_style=False, cache_config=config)
    assert summary.inserts == 2 and (tmp_path / "t" / "dt=2025-01-10").is_dir()
