"""Crafted metadata never reaches outside the table, bad keys and partitions get typed errors, and a copied table
never shares caches with its original."""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import quote

import pyarrow as pa
import pytest
from click.testing import CliRunner

from dbidx.cache.record_cache import RecordIndexCache
from dbidx.cli import main
from dbidx.config import CacheConfig
from dbidx.errors import (
    ConflictError,
    CorruptFileError,
    FormatUpgradeError,
    HookError,
    InvalidKeyError,
    InvalidPartitionError,
)
from dbidx.index import compaction
from dbidx.table.facade import Table
from dbidx.spark_integration.local import upsert_arrow
from dbidx.storage import layout, leftovers, markers

DAY = "dt=2025-03-01"


@pytest.fixture()
def table(tmp_path: Path) -> Table:
    return Table.create(str(tmp_path / "t"), num_shards=2)


def victim(tmp_path: Path, name: str = "victim.txt") -> Path:
    path = tmp_path / name
    path.write_text("precious")
    return path


def test_a_crafted_rollback_plan_leaves_files_outside_the_table_intact(table: Table, tmp_path: Path) -> None:
    target = victim(tmp_path)
    started = table.timeline.start("commit")
    plan = {"action": "commit", "files": ["../victim.txt"]}
    table.io.write_atomic(layout.inflight_file(started.instant), json.dumps(plan).encode())
    result = CliRunner().invoke(main, ["rollback", table.uri, started.instant])
    assert result.exit_code == 4, result.output
    assert "../victim.txt" in result.output and "Traceback" not in result.output
    assert target.read_text() == "precious"
    # The table's own metadata is not fair game either.
    plan["files"] = [layout.PROPERTIES_FILE]
    table.io.write_atomic(layout.inflight_file(started.instant), json.dumps(plan).encode())
    with pytest.raises(CorruptFileError, match="table.json"):
        table.rollback(started.instant)
    assert table.io.exists(layout.PROPERTIES_FILE)


@pytest.mark.parametrize(
    "crafted",
    [
        "..%2Fvictim2.txt",
        "%2E%2E%2Fvictim2.txt",
        quote(".dbidx/table.json", safe=""),
        quote("dt=x/../../victim2.txt", safe=""),
    ],
)
def test_a_crafted_marker_is_refused_by_the_sweep_every_upsert_runs(table: Table, tmp_path: Path, crafted: str) -> None:
    target = victim(tmp_path, "victim2.txt")
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    upsert_arrow(pa.table({"id": ["a"], "dt": ["2025-03-01"]}), table, key="id", partition="dt", cache_config=config)
    settled = table.timeline.completed()[-1].instant
    table.io.write_atomic(f"{markers.marker_dir(settled)}/{crafted}", b"")
    with pytest.raises(CorruptFileError, match="marker"):
        leftovers.sweep_settled(table.io, table.timeline)
    assert target.read_text() == "precious" and table.io.exists(layout.PROPERTIES_FILE)


def test_a_symlink_out_of_the_table_is_not_followed_by_a_delete(table: Table, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    started = table.timeline.start("commit")
    kept = outside / f"fg_{started.instant}_0.parquet"
    kept.write_text("precious")
    os.symlink(outside, Path(table.uri) / "dt=x")
    # A crafted marker (announce itself refuses such a path since writes are guarded too)
    table.io.write_atomic(markers.marker_of(started.instant, f"dt=x/fg_{started.instant}_0.parquet"), b"")
    with pytest.raises(CorruptFileError, match="outside the table"):
        table.rollback(started.instant)
    assert kept.read_text() == "precious"


def test_keys_are_lists_of_strings_everywhere(table: Table, tmp_path: Path) -> None:
    writer = table.new_commit()
    with pytest.raises(InvalidKeyError, match="pass a list"):
        writer.insert(DAY, "ord-1", "fg")
    with pytest.raises(InvalidKeyError, match="pass a list"):
        writer.delete(DAY, "ord-1")
    for bad, message in [
        ([1, 2], "position 0 is of type int"),
        (["a", b"b"], "position 1 is of type bytes"),
        (["a", "\ud800"], "position 1 .* not valid UTF-8"),
        ([float("nan")], "position 0 is NaN"),
        (["a", None], "position 1 is None"),
        (["a", ""], "position 1 is empty"),
        (pa.array([1, 2]), "type int64"),
        (pa.array([b"a"]), "type binary"),
    ]:
        with pytest.raises(InvalidKeyError, match=message):
            writer.insert(DAY, bad, "fg")
        with pytest.raises(InvalidKeyError, match=message):
            table.lookup(bad, DAY)
    writer.rollback()
    with RecordIndexCache.for_table(table, 0, CacheConfig(base_path=str(tmp_path / "c"))) as cache:
        with pytest.raises(InvalidKeyError, match="empty"):
            cache.load_partition(DAY, ["a", ""], ["fg", "fg"], synced_seq=0)
        cache.load_partition(DAY, ["a"], ["fg"], synced_seq=0)
        with pytest.raises(InvalidKeyError, match="pass a list"):
            cache.lookup(DAY, "a")
        with pytest.raises(InvalidKeyError, match="empty"):
            cache.lookup(DAY, [""])


@pytest.mark.parametrize("bad", ["dt=1\n", "dt=1\t2", "dt=1\r", ".dbidx", "a/.dbidx/b", "dt=\x7f"])
def test_partition_values_with_control_characters_or_a_metadata_segment_are_refused(table: Table, bad: str) -> None:
    with pytest.raises(InvalidPartitionError):
        layout.validate_partition(bad)
    with pytest.raises(InvalidPartitionError):
        with table.new_commit() as writer:
            writer.insert(bad, ["k"], "fg")


def test_key_and_partition_are_required_keywords_of_upsert_arrow_and_tag_options(table: Table, tmp_path: Path) -> None:
    """No guessed defaults ("id", "dt"): naming the key and partition columns is part of every call."""
    from dbidx.spark_integration.tagger import TagOptions

    config = CacheConfig(base_path=str(tmp_path / "cache"))
    data = pa.table({"id": ["a"], "dt": ["2025-03-01"]})
    with pytest.raises(TypeError, match="missing 2 required keyword-only arguments: 'key' and 'partition'"):
        upsert_arrow(data, table, cache_config=config)
    with pytest.raises(TypeError, match="takes 2 positional arguments but 4"):
        upsert_arrow(data, table, "id", "dt", cache_config=config)
    with pytest.raises(TypeError, match="missing 2 required positional arguments: 'key' and 'partition'"):
        TagOptions(cache=config)
    assert table.timeline.pending() == [] and table.timeline.completed() == []


def test_a_hook_error_marker_carries_any_message_and_rebuilds_only_exception_types() -> None:
    """The text a failing on_task_written leaves in a task's error brings back its type and exact message; a marker
    naming something that is not an Exception subclass, or nothing importable, is reported as HookError."""
    from dbidx.spark_integration.task_errors import hook_error, run_hook

    def hook(partition_id: int, attempt_number: int) -> None:
        raise ValueError('two\nlines, "quotes" and a ] bracket')

    with pytest.raises(RuntimeError, match=r"^dbidx-hook-error\[builtins:ValueError\] shard=3 attempt=1 ") as raised:
        run_hook(hook, 3, 1)
    error = hook_error(raised.value)
    assert type(error) is ValueError and str(error) == 'two\nlines, "quotes" and a ] bracket'
    assert error.__notes__[0].startswith("raised by on_task_written in the task of shard 3, attempt 1")
    for named in ("os:system", "builtins:SystemExit", "builtins:int", "no_such_module_xyz:Error"):
        crafted = RuntimeError(f'Traceback ... dbidx-hook-error[{named}] shard=0 attempt=0 "what it said"\n ...')
        error = hook_error(crafted)
        assert type(error) is HookError and str(error).startswith(
            f"on_task_written raised {named.replace(':', '.')}: what it said (that type cannot be"
        ), error
    assert hook_error(RuntimeError("a task failed without a marker")) is None


def test_a_non_partitioned_table_writes_its_data_at_the_root(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    first = upsert_arrow(
        pa.table({"id": ["a", "b"], "p": ["", ""]}),
        table,
        key="id",
        partition="p",
        hive_style=False,
        cache_config=config,
    )
    again = upsert_arrow(
        pa.table({"id": ["a", "c"], "p": ["", ""]}),
        table,
        key="id",
        partition="p",
        hive_style=False,
        cache_config=config,
    )
    assert (first.inserts, again.updates, again.inserts) == (2, 1, 1)
    assert all("/" not in f.path for rec in table.timeline.completed() for f in rec.data_files)
    assert sorted(table.snapshot("").column("key").to_pylist()) == ["a", "b", "c"]


def test_a_copied_table_never_shares_caches_with_its_original(tmp_path: Path) -> None:
    import shutil

    original = Table.create(str(tmp_path / "orig"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    upsert_arrow(pa.table({"id": ["a"], "dt": ["2025-03-01"]}), original, key="id", partition="dt", cache_config=config)
    shutil.copytree(original.uri, tmp_path / "copy")
    copy = Table.open(str(tmp_path / "copy"))
    assert copy.props.table_id == original.props.table_id
    upsert_arrow(
        pa.table({"id": ["only-in-copy"], "dt": ["2025-03-01"]}), copy, key="id", partition="dt", cache_config=config
    )
    summary = upsert_arrow(
        pa.table({"id": ["only-in-copy", "a"], "dt": ["2025-03-01"] * 2}),
        original,
        key="id",
        partition="dt",
        cache_config=config,
    )
    assert (summary.inserts, summary.updates) == (1, 1)  # the copy's key is new to the original
    assert RecordIndexCache.for_table(copy, 0, config).path != RecordIndexCache.for_table(original, 0, config).path
    result = CliRunner().invoke(main, ["cache", "verify", original.uri, "--cache-dir", str(tmp_path / "cache")])
    assert result.exit_code == 0, result.output


def test_a_check_that_needs_cleaned_history_conflicts_instead_of_failing_as_corrupt(table: Table) -> None:
    later = table.new_commit()
    later.insert(DAY, ["k1", "k2"], "fg-b")
    with table.new_commit() as first:
        first.insert(DAY, ["k1"], "fg-a")
    compaction.compact(table, min_files=1)
    assert compaction.clean(table, retain_completions=0) is not None
    with pytest.raises(ConflictError, match="compacted and cleaned"):
        later.commit()


def test_the_delete_column_is_checked_before_anything_starts(table: Table, tmp_path: Path) -> None:
    from dbidx.errors import InvalidInputError

    config = CacheConfig(base_path=str(tmp_path / "cache"))
    data = pa.table({"id": ["a"], "dt": ["2025-03-01"], "is_deleted": [True]})
    with pytest.raises(InvalidInputError, match="no delete column 'is_delted'"):
        upsert_arrow(data, table, key="id", partition="dt", delete_column="is_delted", cache_config=config)
    with pytest.raises(InvalidInputError, match="must be boolean"):
        upsert_arrow(
            pa.table({"id": ["a"], "dt": ["2025-03-01"], "_dbidx_delete": ["yes"]}),
            table,
            key="id",
            partition="dt",
            cache_config=config,
        )
    assert table.timeline.completed() == [] and table.timeline.pending() == []
    # A delete whose partition does not hold the key deletes nothing, and says so.
    upsert_arrow(data, table, key="id", partition="dt", delete_column=None, cache_config=config)
    summary = upsert_arrow(
        pa.table({"id": ["a"], "dt": ["2025-03-02"], "is_deleted": [True]}),
        table,
        key="id",
        partition="dt",
        delete_column="is_deleted",
        cache_config=config,
    )
    assert (summary.deletes, summary.deletes_missing) == (0, 1)
    assert table.snapshot(DAY).column("key").to_pylist() == ["a"]


def test_caches_are_private_whatever_the_umask(table: Table, tmp_path: Path) -> None:
    import stat

    old = os.umask(0o022)
    try:
        base = tmp_path / "deep" / "base"
        config = CacheConfig(base_path=str(base))
        for _ in range(2):  # the table's first write takes the bulk path (no cache); the second opens the caches
            upsert_arrow(
                pa.table({"id": ["a", "b"], "dt": ["2025-03-01"] * 2}),
                table,
                key="id",
                partition="dt",
                cache_config=config,
            )
    finally:
        os.umask(old)
    for path in [tmp_path / "deep", base, *base.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        expected = 0o700 if path.is_dir() else 0o600
        assert mode == expected, (path, oct(mode))


def test_a_failing_close_is_a_cache_error_and_releases_the_lock(
    table: Table, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dbidx.cache.store import Store
    from dbidx.errors import CacheError

    config = CacheConfig(base_path=str(tmp_path / "cache"), lock_timeout_s=1.0)
    cache = RecordIndexCache.for_table(table, 0, config).open()
    cache.load_partition(DAY, ["a"], ["fg"], synced_seq=0)

    def full(*_args, **_kwargs):
        raise Exception("IO error: No space left on device")  # what rocksdict raises

    monkeypatch.setattr(Store, "write", full)
    with pytest.raises(CacheError, match="disk full"):
        cache.close()
    monkeypatch.undo()
    with RecordIndexCache.for_table(table, 0, config) as again:  # the lock was released
        assert again.lookup(DAY, ["a"]) == ["fg"]


def test_one_table_one_cache_however_its_path_is_spelled(table: Table, tmp_path: Path) -> None:
    link = tmp_path / "link"
    os.symlink(table.uri, link)
    via_link = Table.open(str(link))
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    assert RecordIndexCache.for_table(via_link, 0, config).path == RecordIndexCache.for_table(table, 0, config).path


def test_a_table_of_the_previous_format_is_refused_by_name(table: Table) -> None:
    props = json.loads(Path(table.io.path(layout.PROPERTIES_FILE)).read_text())
    for old in (1, 2, 3):
        props["format_version"] = old
        Path(table.io.path(layout.PROPERTIES_FILE)).write_text(json.dumps(props))
        if old == 3:  # convertible: the error names the command (tests/table/test_upgrade.py converts real ones)
            with pytest.raises(FormatUpgradeError, match="format 3 .* reads format 4 .*dbidx upgrade URI"):
                Table.open(table.uri)
            continue
        with pytest.raises(CorruptFileError, match=f"uses format {old} .* reads format 4"):
            Table.open(table.uri)


def test_deep_partitions_get_hashed_marker_names(table: Table, tmp_path: Path) -> None:
    day = "x" * 180
    summary = upsert_arrow(
        pa.table({"id": ["a", "b"], "dt": [day, day]}),
        table,
        key="id",
        partition="dt",
        cache_config=CacheConfig(base_path=str(tmp_path / "cache")),
    )
    assert summary.inserts == 2 and table.io.list_dirs(markers.MARKERS_DIR) == []
    assert markers.marker_name(f"dt={day}/{'0' * 8}-fg_{'1' * 17}_0.parquet").startswith("h-")


def test_verbose_is_accepted_anywhere(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["stats", str(tmp_path / "missing"), "--verbose"])
    assert result.exit_code == 3, result.output


def test_files_vanishing_under_the_permission_pass_do_not_fail_an_open(
    table: Table, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RocksDB compacts in the background: an SST listed a moment ago may be gone when it is chmod-ed (found by
    benchmarks/commit_bench.py at 10 M keys)."""
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    with RecordIndexCache.for_table(table, 0, config) as cache:
        cache.load_partition(DAY, ["a"], ["fg"], synced_seq=0)
    real_chmod = os.chmod

    def racing_chmod(path, mode, *args, **kwargs):
        if str(path).endswith(".sst") or "OPTIONS" in str(path):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_chmod(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "chmod", racing_chmod)
    for entry in (tmp_path / "cache").rglob("*"):
        if entry.is_file():
            real_chmod(entry, 0o644)  # as RocksDB leaves new files
    with RecordIndexCache.for_table(table, 0, config) as cache:
        assert cache.lookup(DAY, ["a"]) == ["fg"]
