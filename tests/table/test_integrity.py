"""Damaged bytes and a damaged timeline are loud: every read raises CorruptFileError naming the file, never a
smaller table (issue: silent failures at the edges)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dbidx.cache.catchup import sync
from dbidx.cache.loading import load_from_snapshot
from dbidx.cache.record_cache import RecordIndexCache
from dbidx.cli import main
from dbidx.config import CacheConfig
from dbidx.data.files import read_data_file
from dbidx.errors import CorruptFileError
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table
from dbidx.spark_integration.local import upsert_arrow
from dbidx.storage import layout
from dbidx.storage.records import _record_checksum

DAY = "dt=2025-03-01"


def make_table(root: Path, keys: int = 3000) -> tuple[Table, CacheConfig]:
    """A one-shard table with an upsert (data + index files) and a second commit; rows of 64 keys per row group."""
    table = Table.create(str(root / "t"), num_shards=1, row_group_size=64)
    config = CacheConfig(base_path=str(root / "cache"))
    upsert_arrow(
        pa.table({"id": [f"k{i:05d}" for i in range(keys)], "dt": ["2025-03-01"] * keys, "v": list(range(keys))}),
        table,
        key="id",
        partition="dt",
        cache_config=config,
    )
    upsert_arrow(
        pa.table({"id": ["k00001", "new-1"], "dt": ["2025-03-01"] * 2, "v": [7, 8]}),
        table,
        key="id",
        partition="dt",
        cache_config=config,
    )
    return table, config


def index_file(table: Table) -> str:
    table.refresh()
    return table.timeline.completed()[0].files[0].path


def data_file(table: Table) -> str:
    return table.timeline.completed()[0].data_files[0].path


def every_index_read(table: Table, config: CacheConfig, tmp: Path) -> list[tuple[str, object]]:
    """Each read path of the library, as a callable over a freshly opened table (no state carried over)."""

    def fresh() -> Table:
        return Table.open(table.uri)

    def bootstrap_load() -> None:
        cache_dir = tmp / "fresh-cache"
        shutil.rmtree(cache_dir, ignore_errors=True)
        other = fresh()
        other.refresh()
        with RecordIndexCache.for_table(other, 0, CacheConfig(base_path=str(cache_dir))) as cache:
            try:
                load_from_snapshot(cache, other, DAY, other.timeline.latest_seq)
            finally:
                assert DAY not in cache.partitions()  # nothing from a failed file is ever installed

    def catch_up() -> None:
        other = fresh()
        with RecordIndexCache.for_table(other, 0, config) as cache:
            cache.load_partition(DAY, pa.array([], pa.string()), pa.array([], pa.string()), synced_seq=0)
            sync(cache, other, max_catchup_entries=10**9)

    return [
        ("snapshot", lambda: fresh().snapshot(DAY)),
        ("incremental", lambda: fresh().incremental(0, partitions=[DAY])),
        ("lookup seek", lambda: fresh().lookup(["k00010"], DAY, mode="seek")),
        ("lookup scan", lambda: fresh().lookup(["k00010", "zzz"], DAY, mode="scan")),
        ("bootstrap", bootstrap_load),
        ("catch-up", catch_up),
    ]


@pytest.fixture(scope="module")
def damaged_table(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("flips")
    table, config = make_table(root)
    return table, config, root


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fraction=st.floats(min_value=0.0, max_value=1.0, exclude_max=True), mask=st.integers(1, 255))
def test_a_flipped_byte_anywhere_in_an_index_file_fails_every_read(damaged_table, fraction, mask) -> None:
    table, config, root = damaged_table
    path = table.io.path(index_file(table))
    raw = bytearray(Path(path).read_bytes())
    offset = int(fraction * len(raw))
    raw[offset] ^= mask
    Path(path).write_bytes(bytes(raw))
    try:
        for name, read in every_index_read(table, config, root):
            with pytest.raises(CorruptFileError, match=index_file(table).replace(".", r"\.")):
                read()
    finally:
        raw[offset] ^= mask
        Path(path).write_bytes(bytes(raw))
    assert Table.open(table.uri).snapshot(DAY).num_rows == 3001


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fraction=st.floats(min_value=0.0, max_value=1.0, exclude_max=True), mask=st.integers(1, 255))
def test_a_flipped_byte_anywhere_in_a_data_file_fails_its_read(damaged_table, fraction, mask) -> None:
    table, _config, _root = damaged_table
    record = table.timeline.completed()[0].data_files[0]
    path = Path(table.io.path(record.path))
    raw = bytearray(path.read_bytes())
    offset = int(fraction * len(raw))
    raw[offset] ^= mask
    path.write_bytes(bytes(raw))
    try:
        with pytest.raises(CorruptFileError, match=f"data file .*{record.path}.*checksum"):
            read_data_file(table.io, record)
    finally:
        raw[offset] ^= mask
        path.write_bytes(bytes(raw))
    assert read_data_file(table.io, record).num_rows == record.rows


def test_truncated_files_and_verify_reports_every_damaged_file(tmp_path: Path) -> None:
    table, _config = make_table(tmp_path)
    assert verify_table(table).ok
    result = CliRunner().invoke(main, ["verify", table.uri])
    assert result.exit_code == 0, result.output
    assert "0 damaged" in result.output
    for rel in (index_file(table), data_file(table)):
        with open(table.io.path(rel), "r+b") as fh:
            fh.truncate(os.path.getsize(table.io.path(rel)) - 3)
    check = verify_table(Table.open(table.uri))
    assert sorted(d["path"] for d in check.damaged) == sorted([index_file(table), data_file(table)])
    assert all("bytes but its commit recorded" in d["problem"] for d in check.damaged)
    with pytest.raises(CorruptFileError, match="bytes but its commit recorded"):
        Table.open(table.uri).snapshot(DAY)
    result = CliRunner().invoke(main, ["verify", table.uri, "--json"])
    assert result.exit_code == 4, result.output
    payload = json.loads(result.stdout)
    assert payload["ok"] is False and len(payload["damaged"]) == 2


def test_deleting_the_newest_completion_record_is_an_error_not_a_smaller_table(tmp_path: Path) -> None:
    table, config = make_table(tmp_path)
    os.remove(table.io.path(layout.completed_file(2)))
    with pytest.raises(CorruptFileError, match="completion records 2..2 are missing"):
        Table.open(table.uri).snapshot(DAY)
    for args in (
        ["stats", table.uri],
        ["verify", table.uri],
        ["cache", "bootstrap", table.uri, "--cache-dir", str(tmp_path / "c2"), "--days", "100000"],
    ):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 4, (args, result.output)
        assert "missing" in result.output and "Traceback" not in result.output
    # With every record gone but the pointer left, the table is still not "empty".
    shutil.rmtree(table.io.path(layout.COMPLETED_DIR))
    with pytest.raises(CorruptFileError, match="are missing"):
        Table.open(table.uri).partitions()


def test_a_missing_pointer_beside_records_is_damage(tmp_path: Path) -> None:
    table, _config = make_table(tmp_path)
    shutil.rmtree(table.io.path(layout.LATEST_DIR))
    with pytest.raises(CorruptFileError, match="pointer .* is missing while the completion log has records"):
        Table.open(table.uri).refresh()


@pytest.mark.parametrize(
    "damage",
    [
        "seq as string",
        "rows as string",
        "unknown action",
        "path outside",
        "bad checksum",
        "other table",
        "missing field",
    ],
)
def test_wrongly_typed_completion_records_are_named(tmp_path: Path, damage: str) -> None:
    table, _config = make_table(tmp_path)
    path = table.io.path(layout.completed_file(1))
    record = json.loads(Path(path).read_text())
    if damage == "seq as string":
        record["seq"] = "1"
    elif damage == "rows as string":
        record["files"][0]["rows"] = "3000"
    elif damage == "unknown action":
        record["action"] = "upsert"
    elif damage == "path outside":
        record["data_files"][0]["path"] = "../victim.txt"
    elif damage == "bad checksum":
        record["files"][0]["checksum"] = "crc:0"
    elif damage == "other table":
        record["table_id"] = "0" * 32
    else:
        del record["start_seq"]
    record.pop("checksum")
    record["checksum"] = _record_checksum(record)  # crafted, not damaged: only the field checks can catch it
    Path(path).write_text(json.dumps(record))
    with pytest.raises(CorruptFileError, match="000000000001.json"):
        Table.open(table.uri).refresh()
    result = CliRunner().invoke(main, ["stats", table.uri, "--json"])
    assert result.exit_code == 4 and json.loads(result.stdout)["error"] == "CorruptFileError", result.output


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(fraction=st.floats(min_value=0.0, max_value=1.0, exclude_max=True), mask=st.integers(1, 127))
def test_a_flipped_byte_in_a_completion_record_is_caught(tmp_path_factory, fraction, mask) -> None:
    """Even where the damaged record is still valid JSON (a key range, a path, a count), never a silent change."""
    table, _config = make_table(tmp_path_factory.mktemp("rec"), keys=50)
    path = Path(table.io.path(layout.completed_file(1)))
    raw = bytearray(path.read_bytes())
    raw[int(fraction * len(raw))] ^= mask
    try:
        flipped = json.loads(bytes(raw))
    except ValueError:
        flipped = None
    if flipped == json.loads(path.read_bytes()):
        return  # the same record spelled differently (0.0 -> 0e0): nothing changed, nothing to catch
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptFileError, match="000000000001.json"):
        Table.open(table.uri).refresh()


def test_a_table_json_that_does_not_match_its_timeline_is_refused(tmp_path: Path) -> None:
    table, _config = make_table(tmp_path)
    other = Table.create(str(tmp_path / "other"))
    shutil.copy(other.io.path(layout.PROPERTIES_FILE), table.io.path(layout.PROPERTIES_FILE))
    with pytest.raises(CorruptFileError, match="latest-seq pointer|belongs to table"):
        Table.open(table.uri).refresh()
    Path(table.io.path(layout.PROPERTIES_FILE)).write_text('{"table_id": 5}')
    with pytest.raises(CorruptFileError, match="table.json"):
        Table.open(table.uri)


def restored_after_one_more_commit(tmp_path: Path) -> tuple[Table, CacheConfig]:
    """A table whose caches saw seq 3, restored from a backup taken at seq 2."""
    table, config = make_table(tmp_path)
    backup = tmp_path / "backup"
    shutil.copytree(table.uri, backup)
    upsert_arrow(
        pa.table({"id": ["later"], "dt": ["2025-03-01"], "v": [1]}),
        table,
        key="id",
        partition="dt",
        cache_config=config,
    )
    with RecordIndexCache.for_table(table, 0, config) as cache:
        assert sync(cache, table).to_seq == 3 and cache.watermark == 3
    shutil.rmtree(table.uri)
    shutil.copytree(backup, table.uri)
    return Table.open(table.uri), config


def test_a_cache_ahead_of_its_table_is_dropped_and_rebuilt(tmp_path: Path) -> None:
    restored, config = restored_after_one_more_commit(tmp_path)
    with RecordIndexCache.for_table(restored, 0, config) as cache:
        assert cache.lookup(DAY, ["later"]) != [None]  # what the cache saw of the lost history
        result = sync(cache, restored)
        assert result.dropped_partitions == [DAY] and cache.partitions() == {} and cache.watermark == 2
    summary = upsert_arrow(
        pa.table({"id": ["later", "k00002"], "dt": ["2025-03-01"] * 2, "v": [1, 2]}),
        restored,
        key="id",
        partition="dt",
        cache_config=config,
    )
    assert (summary.inserts, summary.updates, summary.on_demand_loads) == (1, 1, 1)
