"""Issue 29, point 3 after the audit: writes never follow a symlink out of the table (reads did not already), and
`dbidx verify` exits 4 on a partition directory swapped for a symlink."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from dbidx.cli import main
from dbidx.config import CacheConfig
from dbidx.data.reads import read_arrow
from dbidx.errors import CorruptFileError
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table
from dbidx.spark_integration.local import upsert_arrow
from dbidx.storage import markers


def rows(ids: list[str], day: str = "2025-03-01") -> pa.Table:
    return pa.table({"id": ids, "dt": [day] * len(ids), "v": pa.array([1] * len(ids), pa.int64())})


def test_an_upsert_into_a_symlinked_partition_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "c"))
    upsert_arrow(rows(["a"]), table, key="id", partition="dt", cache_config=config)
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "t" / "dt=2025-03-02").symlink_to(outside, target_is_directory=True)
    with pytest.raises(CorruptFileError, match="outside the table.*symlink.*real directory"):
        upsert_arrow(rows(["b"], day="2025-03-02"), table, key="id", partition="dt", cache_config=config)
    # Nothing outside, nothing published, nothing pending, no markers: the instant was rolled back whole.
    assert list(outside.iterdir()) == []
    reopened = Table.open(table.uri)
    reopened.timeline.refresh()
    assert [r.action for r in reopened.timeline.completed()] == ["commit", "rollback"]
    assert reopened.timeline.pending() == [] and reopened.io.list_dirs(markers.MARKERS_DIR) == []
    assert read_arrow(reopened).column("id").to_pylist() == ["a"] and verify_table(reopened).ok
    # The fix the message names: a real directory instead of the symlink; the same upsert then goes through.
    (tmp_path / "t" / "dt=2025-03-02").unlink()
    upsert_arrow(rows(["b"], day="2025-03-02"), reopened, key="id", partition="dt", cache_config=config)
    assert sorted(read_arrow(Table.open(table.uri)).column("id").to_pylist()) == ["a", "b"]


def test_writes_through_the_file_io_are_guarded(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "t" / "p").symlink_to(outside, target_is_directory=True)
    for write in (
        lambda: table.io.write_atomic("p/x", b"x"),
        lambda: table.io.create_exclusive("p/x", b"x"),
        lambda: table.io.open_output_stream("p/x"),
        lambda: table.io.write_atomic("p/deeper/x", b"x"),
    ):
        with pytest.raises(CorruptFileError, match="refusing to write"):
            write()
    assert list(outside.iterdir()) == []  # not even a directory was created there


def test_verify_exits_4_on_a_partition_swapped_for_a_symlink(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    upsert_arrow(
        rows(["a", "b"]), table, key="id", partition="dt", cache_config=CacheConfig(base_path=str(tmp_path / "c"))
    )
    part = tmp_path / "t" / "dt=2025-03-01"
    shutil.move(str(part), str(tmp_path / "copy"))  # the same bytes, outside the table
    part.symlink_to(tmp_path / "copy", target_is_directory=True)
    result = CliRunner().invoke(main, ["verify", table.uri])
    assert result.exit_code == 4 and "outside the table" in result.output, result.output
