"""An upsert's task keeps the key indexes of the data files it writes and reads as key files beside the shard caches,
and a task in another process finds superseded rows through them without decoding a data file (data/key_files.py);
`key.files.mb = 0` keeps none. The table read back is the same either way."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pytest

from dbidx.config import CacheConfig
from dbidx.data import reads, superseded
from dbidx.data.key_columns import KeyColumns
from dbidx.data.key_files import KEY_FILES_DIR, wait_for_saves
from dbidx.table.facade import Table
from dbidx.spark_integration.local import upsert_arrow


def rows(ids: list[str], v: int) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(ids),
            "dt": pa.array(["d1" if int(i[1:]) % 3 else "d2" for i in ids]),
            "v": pa.array([v] * len(ids), pa.int64()),
        }
    )


def key_dir(cache: Path) -> Path:
    found = list(cache.glob(f"*/{KEY_FILES_DIR}"))
    assert len(found) <= 1
    return found[0] if found else cache / "none"


def test_another_process_finds_superseded_rows_through_the_key_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    upsert_arrow(rows([f"k{i}" for i in range(3000)], 1), table, key="id", partition="dt", cache_config=config)
    wait_for_saves()  # the task saves on the worker's saver thread, after it returned
    live = [f.record for f in table.data_view().live()]
    kept = {p.name for p in key_dir(tmp_path / "cache").iterdir()}
    assert kept == {f"{r.checksum.split(':')[1]}-{r.rows}.keys" for r in live}
    # 1. A process that never saw these files (empty memory) whose data files cannot be decoded for keys.
    monkeypatch.setattr(superseded, "KEYS", KeyColumns(1 << 30))

    def no_decoding(*_args: object, **_kwargs: object) -> pa.Array:
        raise AssertionError("a data file was decoded although its key file is there")

    monkeypatch.setattr(superseded, "read_key_column", no_decoding)
    summary = upsert_arrow(
        rows([f"k{i}" for i in range(0, 3000, 7)], 2), table, key="id", partition="dt", cache_config=config
    ).to_dict()
    assert sum(s["keys_from_key_files"] for s in summary["per_shard"]) == len(live)
    assert sum(s["keys_from_data_files"] for s in summary["per_shard"]) == 0
    # 2. The rows it superseded are gone from the table: each key once, at its new version.
    current = reads.read_arrow(table)
    assert current.num_rows == 3000
    versions = dict(zip(current.column("id").to_pylist(), current.column("v").to_pylist()))
    assert versions == {f"k{i}": 2 if i % 7 == 0 else 1 for i in range(3000)}


def test_no_key_files_when_turned_off(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "cache"), key_files_mb=0)
    for v in (1, 2):
        upsert_arrow(rows([f"k{i}" for i in range(100)], v), table, key="id", partition="dt", cache_config=config)
    assert not key_dir(tmp_path / "cache").exists()
    assert reads.read_arrow(table).num_rows == 100


def test_an_unusable_key_directory_only_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The first write (the bulk path opens no cache) with a cache base path under a regular file: no key files and
    no staging, each said in a warning, and the load itself succeeds."""
    (tmp_path / "afile").write_text("not a directory")
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "afile" / "cache"))
    with caplog.at_level(logging.WARNING):
        upsert_arrow(rows([f"k{i}" for i in range(50)], 1), table, key="id", partition="dt", cache_config=config)
    assert "keeps no key files" in caplog.text
    assert reads.read_arrow(table).num_rows == 50


def test_a_symlinked_key_directory_is_refused_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    upsert_arrow(rows([f"k{i}" for i in range(50)], 1), table, key="id", partition="dt", cache_config=config)
    wait_for_saves()
    keys = key_dir(tmp_path / "cache")
    elsewhere = tmp_path / "bigger-disk"
    keys.rename(elsewhere)
    keys.symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING):
        upsert_arrow(rows([f"k{i}" for i in range(50)], 2), table, key="id", partition="dt", cache_config=config)
    assert "is a symbolic link" in caplog.text
    assert reads.read_arrow(table).column("v").to_pylist() == [2] * 50
