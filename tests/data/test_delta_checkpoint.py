"""Slim Delta checkpoints (data/delta_checkpoint.py): delta-rs's checkpoint of a dbidx table loses the tombstones of
deletion-vector updates (paths live again, inline vectors) and all but the newest tombstone of each removed path,
and nothing any reader or vacuum does changes. Real tables written by `upsert_arrow`, compacted, read by delta-rs,
polars and DuckDB."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable

from dbidx.config import CacheConfig
from dbidx.data.delta_checkpoint import _useless_tombstones, write_delta_checkpoint
from dbidx.data.delta_log import DELTA_LOG_DIR
from dbidx.mdt.table import Table
from dbidx.mdt.verify_table import verify_table
from dbidx.spark_integration.local import upsert_arrow

from tests.delta_readers import assert_readers_agree, via_deltalake


def churned_table(tmp_path: Path) -> tuple[Table, dict[str, int]]:
    """Updates that give the same files new vectors again and again, then a data compaction of some of them."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    cache = CacheConfig(base_path=str(tmp_path / "cache"))
    rows: dict[str, int] = {}
    for i in range(24):
        batch = {f"k{j}": i * 100 + j for j in range(i % 9, i % 9 + 30)}
        upsert_arrow(pa.table({"id": list(batch), "dt": ["x" if int(k[1:]) % 2 else "y" for k in batch],
                               "v": list(batch.values())}), table, key="id", partition="dt", cache_config=cache)
        rows.update(batch)
    table.compact_data(["dt=x"], min_files=2)
    return table, rows


def expected(rows: dict[str, int]) -> set[tuple]:
    return {(k, "x" if int(k[1:]) % 2 else "y", v) for k, v in rows.items()}


def checkpoint_rows(table: Table, version: int) -> pa.Table:
    return pq.read_table(table.io.path(f"{DELTA_LOG_DIR}/{version:020d}.checkpoint.parquet"))


def test_the_slim_checkpoint_keeps_what_readers_and_vacuum_need(tmp_path: Path) -> None:
    table, rows = churned_table(tmp_path)
    before_vacuum = set(DeltaTable(table.uri).vacuum(retention_hours=0, dry_run=True,
                                                     enforce_retention_duration=False))
    written = write_delta_checkpoint(table.io)
    assert written is not None and written.version == table.delta_version()
    assert written.tombstones_dropped > 0 and written.bytes_after < written.bytes_before
    slim = checkpoint_rows(table, written.version)
    removes = slim.column("remove").drop_null().to_pylist()
    live = {a["path"] for a in slim.column("add").drop_null().to_pylist()}
    assert removes and not {r["path"] for r in removes} & live  # no tombstone of a live path
    assert len({r["path"] for r in removes}) == len(removes)  # one per removed path
    pointer = json.loads(table.io.read_bytes(f"{DELTA_LOG_DIR}/_last_checkpoint"))
    assert pointer["version"] == written.version and pointer["sizeInBytes"] == written.bytes_after
    assert pointer["size"] == slim.num_rows
    # Readers: the latest version from the checkpoint, time travel across it, and vacuum's list unchanged.
    assert_readers_agree(table, ["id", "dt", "v"], expected(rows))
    assert set(via_deltalake(table.uri, ["id", "dt", "v"], version=3))
    assert set(DeltaTable(table.uri).vacuum(retention_hours=0, dry_run=True,
                                            enforce_retention_duration=False)) == before_vacuum
    assert verify_table(Table.open(table.uri)).damaged == []
    # A later checkpoint starts from the slim one.
    upsert_arrow(pa.table({"id": ["k3"], "dt": ["x"], "v": [9]}), table, key="id", partition="dt",
                 cache_config=CacheConfig(base_path=str(tmp_path / "cache")))
    rows["k3"] = 9
    assert write_delta_checkpoint(table.io).version == written.version + 1
    assert_readers_agree(table, ["id", "dt", "v"], expected(rows))


def test_tombstones_of_vectors_in_files_of_their_own_stay() -> None:
    vector = pa.struct([("storageType", pa.string()), ("pathOrInlineDv", pa.string())])
    add = pa.chunked_array([pa.array([{"path": "a"}, None, None, None, None], pa.struct([("path", pa.string())]))])
    remove_type = pa.struct([("path", pa.string()), ("deletionTimestamp", pa.int64()), ("deletionVector", vector)])
    remove = pa.chunked_array([pa.array([
        None,
        {"path": "a", "deletionTimestamp": 5, "deletionVector": {"storageType": "i", "pathOrInlineDv": "x"}},
        {"path": "a", "deletionTimestamp": 6, "deletionVector": {"storageType": "u", "pathOrInlineDv": "y"}},
        {"path": "b", "deletionTimestamp": 7, "deletionVector": None},
        {"path": "b", "deletionTimestamp": 9, "deletionVector": {"storageType": "i", "pathOrInlineDv": "z"}},
    ], remove_type)])
    # row 1: a live path's inline tombstone (dropped); row 2: a vector file (kept); rows 3-4: b's older one dropped
    assert _useless_tombstones(add, remove).tolist() == [False, True, False, True, False]
