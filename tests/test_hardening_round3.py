"""Hardening, round 3 (issue 29): a typo, an odd value, a stale file or a hostile neighbour never bricks a table."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from dbidx.cli import main
from dbidx.config import CacheConfig
from dbidx.errors import CorruptFileError, InstantStateError
from dbidx.mdt import layout, markers
from dbidx.mdt.table import Table
from dbidx.mdt.verify_table import verify_table
from dbidx.spark_integration.local import upsert_arrow


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

    from dbidx.mdt import data_reader

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
        data_reader.read_arrow(reopened)
    assert not verify_table(reopened).ok
    with pytest.raises(CorruptFileError, match="outside the table"):
        reopened.compact_data()
