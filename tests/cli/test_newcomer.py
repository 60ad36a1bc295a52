"""Issue 31, a newcomer's first hour, through the CLI (click's CliRunner) with state checked through the library:
progress on stderr for long work (never in --json stdout), one way to name a table (URI first), one default
cache directory shown by `dbidx cache info`, lookups in a partition the table lacks, and errors
that name their remedy."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dbidx.cache.base_dir import base_path_choice, default_base_path
from dbidx.cache.inspect import find_cache_dirs
from dbidx.cli import main
from dbidx.config import CacheConfig
from dbidx.errors import UnsafeConcurrencyError
from dbidx.table.build_index import build_index
from dbidx.table.facade import Table
from dbidx.table.upgrade import upgrade_table
from dbidx.spark_integration.local import upsert_arrow
from dbidx.storage import markers

from tests.bootstrap.test_loading import make_daily_table
from tests.table.test_upgrade import unpack

DAYS = ("2025-01-01", "2025-01-02", "2025-01-03")


def invoke(args: list[str], env: dict[str, str | None] | None = None):
    return CliRunner().invoke(main, args, env=env)


@pytest.fixture()
def dataset(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    for day in DAYS:
        (root / f"dt={day}").mkdir(parents=True)
        for part in range(2):
            keys = [f"{day}-{part}-{i}" for i in range(100)]
            pq.write_table(pa.table({"id": keys}), root / f"dt={day}" / f"part-{part}.parquet")
    return root


def built(dataset: Path) -> Table:
    result = invoke(["build-index", str(dataset), "--key", "id", "--num-shards", "2", "--json"])
    assert result.exit_code == 0, result.output
    return Table.open(str(dataset))


def batch(keys: list[str], day: str, v: int) -> pa.Table:
    return pa.table({"id": keys, "dt": [day] * len(keys), "v": pa.array([v] * len(keys), pa.int64())})


# 1. Progress -------------------------------------------------------------------------------------------------------


def test_build_index_shows_progress_on_stderr_with_rows_per_second_and_none_with_json(dataset: Path) -> None:
    result = invoke(["build-index", str(dataset), "--key", "id", "--num-shards", "2"])
    assert result.exit_code == 0, result.output
    assert "build-index: 1/6" in result.stderr and "build-index: 6/6" in result.stderr
    assert "600 rows" in result.stderr and "rows/s" in result.stderr
    assert "build-index" not in result.stdout
    assert Table.open(str(dataset)).snapshot("dt=2025-01-02").num_rows == 200

    result = invoke(["verify", str(dataset), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["ok"] is True and result.stderr == ""


def test_the_library_reports_each_step_with_rows(dataset: Path, tmp_path: Path) -> None:
    events: list[tuple[int, int, str, int]] = []
    table = Table.create(str(dataset), num_shards=2)
    result = build_index(table, "id", progress=lambda *e: events.append(e))
    assert [e[0] for e in events] == list(range(1, 7)) and {e[1] for e in events} == {6}
    assert events[-1][3] == result.keys == 600 and "dt=2025-01-01 part-0.parquet" in events[0][2]

    events.clear()
    other = Table.create(str(tmp_path / "t"), num_shards=3)
    summary = upsert_arrow(
        batch([f"k{i}" for i in range(50)], "2025-01-01", 1),
        other,
        key="id",
        partition="dt",
        cache_config=CacheConfig(base_path=str(tmp_path / "c")),
        progress=lambda *e: events.append(e),
    )
    assert [e[:2] for e in events] == [(1, 3), (2, 3), (3, 3)] and events[-1][3] == summary.input_rows == 50


def test_compact_index_and_data_show_progress(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    config = CacheConfig(base_path=str(tmp_path / "c"))
    keys = [f"k{i}" for i in range(40)]
    for v in range(3):
        new = [f"n{v}-{i}" for i in range(20)]  # inserts: index deltas to compact
        upsert_arrow(batch(keys + new, "2025-01-01", v), table, key="id", partition="dt", cache_config=config)
    files_before = len(Table.open(table.uri).data_view().live())
    result = invoke(["compact", table.uri, "--data", "--retain", "0"])
    assert result.exit_code == 0, result.output
    assert "compact index: 2/2" in result.stderr and "compact data:" in result.stderr
    after = Table.open(table.uri)
    assert len(after.data_view().live()) < files_before
    assert after.lookup(keys, "dt=2025-01-01").num_rows == 40


def test_upgrade_and_bootstrap_show_progress(tmp_path: Path) -> None:
    root, expected = unpack(tmp_path / "u", "partitioned")
    result = invoke(["upgrade", root])
    assert result.exit_code == 0, result.output
    assert "upgrade: " in result.stderr and "rows/s" in result.stderr
    assert Table.open(root).data_view().live_rows() == len(expected)

    table = make_daily_table(tmp_path / "b", keys_per_day=50, num_shards=2)
    result = invoke(
        ["cache", "bootstrap", table.uri, "--days", "2", "--now", "2025-01-10", "--cache-dir", str(tmp_path / "caches")]
    )
    assert result.exit_code == 0, result.output
    assert "bootstrap: " in result.stderr and "entries" not in result.stderr.split("\n")[0][:10]
    assert len(find_cache_dirs(tmp_path / "caches")) == 2


def test_upgrade_library_progress_ends_at_its_total(tmp_path: Path) -> None:
    root, _expected = unpack(tmp_path, "global")
    events: list[tuple[int, int, str, int]] = []
    report = upgrade_table(root, progress=lambda *e: events.append(e))
    assert report.status == "upgraded" and events and events[-1][0] == events[-1][1]
    assert events[-1][3] >= report.live_rows


# 2. One way to name a table ----------------------------------------------------------------------------------------


def test_every_table_command_takes_the_uri_first_and_only_there(dataset: Path, tmp_path: Path) -> None:
    table = built(dataset)
    uri = table.uri
    result = invoke(["lookup", uri, "2025-01-01-0-7", "--partition", "dt=2025-01-01", "--json"])
    assert result.exit_code == 0, result.output
    assert [r["key"] for r in json.loads(result.stdout)["found"]] == ["2025-01-01-0-7"]
    # No other spelling: a --table option is unknown, a missing URI a usage error (exit 2) naming it.
    for args in (
        ["verify", uri, "--table", str(tmp_path / "other")],
        ["lookup", "--table", uri, "k"],
        ["cache", "sync", uri, "--table", str(tmp_path / "other")],
    ):
        result = invoke(args)
        assert result.exit_code == 2 and "No such option '--table'" in result.output, (args, result.output)
    result = invoke(["verify"])
    assert result.exit_code == 2 and "Missing argument 'URI'" in result.output


# 3. One default cache directory -------------------------------------------------------------------------------------


def test_local_spark_and_the_cli_share_one_default_cache_dir(tmp_path: Path) -> None:
    uid = str(uuid.uuid4())
    home = {"HOME": "/home/u"}
    local_job = default_base_path(environ=home | {"SPARK_LOCAL_DIRS": f"/tmp/spark-{uid}/blockmgr-{uid}"})
    assert local_job == default_base_path(environ=home) == Path("/home/u/.cache/dbidx")
    path, rule = base_path_choice(environ={"SPARK_LOCAL_DIRS": "/ssd/local"})
    assert path == Path("/ssd/local/dbidx-cache") and "SPARK_LOCAL_DIRS" in rule


def test_cache_info_shows_the_default_and_the_cache_commands_use_it(tmp_path: Path) -> None:
    env = {
        "HOME": str(tmp_path / "home"),
        "XDG_CACHE_HOME": None,
        "SPARK_LOCAL_DIRS": None,
        "DBIDX_CACHE_BASE_PATH": None,
    }
    result = invoke(["cache", "info", "--json"], env)
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    base = tmp_path / "home" / ".cache" / "dbidx"
    assert info["base_path"] == str(base) and not info["exists"] and info["caches"] == []
    assert "user cache dir" in info["chosen_by"]

    table = make_daily_table(tmp_path / "t", keys_per_day=30, num_shards=2)
    result = invoke(["cache", "bootstrap", table.uri, "--days", "1", "--now", "2025-01-10", "--json"], env)
    assert result.exit_code == 0, result.output
    assert len(find_cache_dirs(base)) == 2
    info = json.loads(invoke(["cache", "info", "--json"], env).stdout)
    assert info["exists"] and len(info["caches"]) == 2 and info["disk_bytes"] > 0
    assert info["key_files"] == []  # a bootstrap reads no data file
    keys_dir = find_cache_dirs(base)[0].parent / "keys"
    keys_dir.mkdir()
    (keys_dir / f"{'0' * 16}-7.keys").write_bytes(b"x" * 100)
    info = json.loads(invoke(["cache", "info", "--json"], env).stdout)
    assert info["key_files"] == [{"path": str(keys_dir), "files": 1, "disk_bytes": 100}]
    stats = invoke(["cache", "stats", "--json"], env)  # no --cache-dir: the same default
    assert stats.exit_code == 0, stats.output
    assert {c["shard"] for c in json.loads(stats.stdout)["caches"]} == {0, 1}
    text = invoke(["cache", "info"], env)
    assert text.exit_code == 0 and f"base path: {base}" in text.output
    assert f"key files: {keys_dir} (1 files, 100 bytes)" in text.output


# 4. A partition the table does not have ----------------------------------------------------------------------------


def test_lookup_in_a_missing_partition_says_so_and_lists_the_nearest(dataset: Path) -> None:
    table = built(dataset)
    result = invoke(["lookup", table.uri, "2025-01-04-0-1", "--partition", "dt=2025-01-04"])
    assert result.exit_code == 1
    assert "partition 'dt=2025-01-04' is not in the table" in result.output and "new key" not in result.output
    assert "dt=2025-01-03" in result.output
    result = invoke(["lookup", table.uri, "k", "--partition", "dt=2025-1-02", "--json"])
    report = json.loads(result.stdout)
    assert report["partition_in_table"] is False and "dt=2025-01-02" in report["nearest_partitions"]
    result = invoke(["lookup", table.uri, "brand-new", "--partition", "dt=2025-01-02", "--json"])
    report = json.loads(result.stdout)
    assert report["partition_in_table"] is True and report["missing"] == ["brand-new"]
    assert report["nearest_partitions"] == []


# 5./6. Errors that name their remedy --------------------------------------------------------------------------------


def test_a_stale_marker_names_the_rollback_command(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    dead = table.new_commit()  # a writer that died after announcing a file
    markers.announce(table.io, dead.instant, f"dt=1/part-{dead.instant}.parquet")
    bad = f"{markers.marker_dir(dead.instant)}/..%2F..%2Fescape"
    table.io.write_atomic(bad, b"")  # a damaged marker: names a path outside the instant's files
    result = invoke(["rollback", table.uri, "--all-pending", "--force"])  # the "dead" writer is this process
    assert result.exit_code == 4, result.output
    assert f"dbidx rollback {table.io.root} --all-pending" in result.output and "delete it" in result.output
    assert Table.open(table.uri).timeline.pending() == []  # the rollback was published; its cleanup stopped
    table.io.delete(bad)
    result = invoke(["repair", table.uri, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["leftovers_deleted"] >= 1
    assert not table.io.list_names(markers.marker_dir(dead.instant))


def test_a_dead_writers_presence_marker_names_the_rollback_command() -> None:
    import pyarrow.fs as pafs

    fs = pafs._MockFileSystem()
    table = Table.create("mem/t", num_shards=2, fs=fs)
    dead = table.new_commit()
    with pytest.raises(UnsafeConcurrencyError, match="dbidx rollback .*--all-pending") as caught:
        Table.open("mem/t", fs=fs).new_commit()
    assert dead.instant in str(caught.value) and "stale" in str(caught.value)


def test_a_missing_table_says_what_to_do(tmp_path: Path) -> None:
    result = invoke(["stats", str(tmp_path / "nope")])
    assert result.exit_code == 3 and "check the URI" in result.output and "dbidx init URI" in result.output
    result = invoke(["cache", "stats", "--cache-dir", str(tmp_path / "nowhere")])
    assert result.exit_code == 6 and "dbidx cache info" in result.output


# 7. The demo's chart ------------------------------------------------------------------------------------------------


def test_the_demo_chart_is_a_png_of_time_and_hit_rate_per_batch(tmp_path: Path) -> None:
    from dbidx.charts import demo_chart

    batches = [
        {"batch": 0, "via": "batch", "seconds": 4.0, "hit_rate": 0.0},
        {"batch": 1, "via": "streaming", "seconds": 2.5, "hit_rate": 0.8},
        {"batch": 2, "via": "batch", "seconds": 1.9, "hit_rate": 0.95},
    ]
    path = demo_chart(batches, tmp_path / "out" / "demo.png", "3 batches, a test")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5_000
