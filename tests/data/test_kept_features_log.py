"""The kept Delta features where the log is crafted (no Spark): in-commit timestamps stay pure when Delta's log
cleanup deleted the version before dbidx's and the other engine's clock ran ahead; row tracking absorbed from a V2
checkpoint whose versions expired keeps the backfilled ids and the mark (found by review, 2026-12-08)."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pyarrow as pa

from dbidx.config import CacheConfig
from dbidx.data.delta_checkpoint import write_delta_checkpoint
from dbidx.spark_integration.local import upsert_arrow
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table


def _up(path: Path, ids: list[str], values: list[int]) -> None:
    batch = pa.table({"id": ids, "dt": ["d1"] * len(ids), "v": pa.array(values, pa.int64())})
    upsert_arrow(
        batch, Table.open(str(path)), key="id", partition="dt", cache_config=CacheConfig(base_path=str(path) + "-c")
    )


def _actions(path: Path, version: int) -> list[dict]:
    return [json.loads(line) for line in (path / "_delta_log" / f"{version:020d}.json").read_text().splitlines()]


def _write(path: Path, name: str, actions: list[dict]) -> None:
    (path / "_delta_log" / name).write_text("".join(json.dumps(a) + "\n" for a in actions))


def _in_force(path: Path, kind: str) -> dict:
    return [a[kind] for v in (0, 1) for a in _actions(path, v) if kind in a][-1]


def test_stamps_stay_pure_after_a_log_cleanup_with_a_clock_ahead(tmp_path: Path) -> None:
    """Before: the stamp of dbidx's version was read from the version before it, so once Delta's log cleanup
    deleted that one, the version derived again with another stamp and every open refused (ForeignCommitError)."""
    p = tmp_path / "t"
    Table.create(str(p), num_shards=1)
    _up(p, ["a"], [1])
    protocol = _in_force(p, "protocol")
    protocol = dict(protocol, writerFeatures=sorted({*protocol.get("writerFeatures", []), "inCommitTimestamp"}))
    future = int(time.time() * 1000) + 3_600_000  # the other engine's clock is an hour ahead
    meta = _in_force(p, "metaData")
    meta = dict(meta, configuration=dict(meta["configuration"], **{"delta.enableInCommitTimestamps": "true"}))
    info = {"inCommitTimestamp": future, "timestamp": future, "operation": "SET TBLPROPERTIES"}
    _write(p, f"{2:020d}.json", [{"commitInfo": info}, {"protocol": protocol}, {"metaData": meta}])
    _up(p, ["b"], [2])  # version 3, dbidx's: absorbs version 2 first
    assert _actions(p, 3)[0]["commitInfo"]["inCommitTimestamp"] == future + 1
    assert write_delta_checkpoint(Table.open(str(p)).io) is not None
    for v in (0, 1, 2):  # Delta's log cleanup at checkpoint 3 (its JSON kept, as PROTOCOL.md asks)
        os.remove(p / "_delta_log" / f"{v:020d}.json")
    Table.open(str(p)).sync_delta_log()  # version 3 derived again: the same bytes
    _up(p, ["c"], [3])
    assert _actions(p, 4)[0]["commitInfo"]["inCommitTimestamp"] == future + 2
    assert verify_table(Table.open(str(p))).ok


def test_row_tracking_absorbed_from_an_expired_run_keeps_ids_and_mark(tmp_path: Path) -> None:
    """Before: a run absorbed from a checkpoint lost its domains (the mark) and the backfilled ids of files whose
    vector did not change; dbidx's next file then reused row ids 0-1 and lowered the mark."""
    p = tmp_path / "t"
    Table.create(str(p), num_shards=1)
    _up(p, ["a", "b", "c"], [1, 2, 3])
    adds = [a["add"] for a in _actions(p, 1) if "add" in a]
    protocol = {
        "minReaderVersion": 3,
        "minWriterVersion": 7,
        "readerFeatures": ["deletionVectors"],
        "writerFeatures": ["deletionVectors", "domainMetadata", "rowTracking"],
    }
    base, backfilled = 0, []
    for a in adds:
        backfilled.append(dict(a, baseRowId=base, defaultRowCommitVersion=2, dataChange=False))
        base += json.loads(a["stats"])["numRecords"]
    mark = {
        "domain": "delta.rowTracking",
        "configuration": json.dumps({"rowIdHighWaterMark": base - 1}),
        "removed": False,
    }
    name = f"{2:020d}.checkpoint.{uuid.uuid4()}.json"  # V2, UUID-named; version 2's own JSON expired
    checkpoint = [
        {"checkpointMetadata": {"version": 2}},
        {"protocol": protocol},
        {"metaData": _in_force(p, "metaData")},
    ]
    _write(p, name, checkpoint + [{"domainMetadata": mark}] + [{"add": a} for a in backfilled])
    pointer = {"version": 2, "size": 4, "v2Checkpoint": {"path": name, "sizeInBytes": 1, "modificationTime": 1}}
    (p / "_delta_log" / "_last_checkpoint").write_text(json.dumps(pointer))
    Table.open(str(p)).sync_delta_log()
    view = Table.open(str(p)).data_view()
    assert view.tracks_rows() and view.row_id_high_water_mark == base - 1
    assert [f.record.base_row_id for f in view.live()] == [0]
    _up(p, ["d", "e"], [4, 5])
    actions = _actions(p, 3)
    assert [a["add"]["baseRowId"] for a in actions if "add" in a and a["add"]["dataChange"]] == [base]
    domains = [json.loads(a["domainMetadata"]["configuration"]) for a in actions if "domainMetadata" in a]
    assert domains and domains[-1]["rowIdHighWaterMark"] == base + 1
