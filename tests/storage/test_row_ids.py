"""Row tracking's pieces below the Delta log (storage/row_ids.py): fresh ids numbered from above the mark in the
record's file order, the fields a data file record carries (and refuses when damaged), the mark read from a domain
checked, and a Delta log whose add carries a damaged row id refused at adoption."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from dbidx.errors import CorruptFileError
from dbidx.storage.records import DataFileRecord, FieldError, record_dict
from dbidx.storage.row_ids import assign, domain_action, high_water_mark_of, row_fields, tracks_rows
from dbidx.table.build_index import build_index
from dbidx.table.facade import Table

CHECKSUM = "xxh64:" + "0" * 16


def _file(path: str, rows: int) -> DataFileRecord:
    return DataFileRecord(path, "dt=d1", "g", rows, 10, CHECKSUM)


def test_fresh_ids_follow_the_mark_in_file_order() -> None:
    files, mark = assign([_file("a", 3), _file("b", 0), _file("c", 2)], 9, 7)
    assert [(f.base_row_id, f.row_commit_version) for f in files] == [(10, 7), (13, 7), (13, 7)]
    assert mark == 14
    assert row_fields(files[0]) == {"baseRowId": 10, "defaultRowCommitVersion": 7} and row_fields(_file("x", 1)) == {}
    assert high_water_mark_of(domain_action(14)["domainMetadata"]["configuration"], "t") == 14


def test_only_a_listed_unsuspended_feature_assigns_ids() -> None:
    listed = {"writerFeatures": ["deletionVectors", "domainMetadata", "rowTracking"]}
    assert tracks_rows(listed, {}) and tracks_rows(listed, {"delta.enableRowTracking": "true"})
    assert not tracks_rows(listed, {"delta.rowTrackingSuspended": "TRUE"})
    assert not tracks_rows({"writerFeatures": ["deletionVectors"]}, {}) and not tracks_rows(None, {})


def test_record_fields_round_trip_and_damage_is_refused() -> None:
    f = assign([_file("a", 3)], -1, 4)[0][0]
    assert DataFileRecord.parse(record_dict(f), "f") == f
    assert "base_row_id" not in record_dict(_file("b", 1))  # a table without row tracking: the JSON as before
    for bad in (-1, "3", True, 1.5):
        with pytest.raises(FieldError, match="base_row_id"):
            DataFileRecord.parse(record_dict(f) | {"base_row_id": bad}, "f")
    for bad in ('{"rowIdHighWaterMark": "1"}', "{}", "nope", '{"rowIdHighWaterMark": -2}'):
        with pytest.raises(CorruptFileError, match="rowIdHighWaterMark"):
            high_water_mark_of(bad, "here")


def test_a_damaged_row_id_in_the_log_is_refused_at_adoption(tmp_path: Path) -> None:
    path = tmp_path / "t"
    write_deltalake(str(path), pa.table({"id": ["a"], "v": pa.array([1], pa.int64())}))
    add = pa.table(DeltaTable(str(path)).get_add_actions(flatten=True)).to_pylist()[0]
    version = DeltaTable(str(path)).version() + 1
    actions = [
        {"commitInfo": {"operation": "ROW TRACKING BACKFILL"}},
        {
            "add": {
                "path": add["path"],
                "partitionValues": {},
                "size": add["size_bytes"],
                "modificationTime": 1,
                "dataChange": False,
                "baseRowId": -3,
                "defaultRowCommitVersion": version,
            }
        },
    ]
    (path / "_delta_log" / f"{version:020d}.json").write_text("".join(json.dumps(a) + "\n" for a in actions))
    with pytest.raises(CorruptFileError, match=r"invalid baseRowId \(-3\)"):
        build_index(Table.create(str(path), num_shards=1), "id")


def test_a_row_tracking_domain_with_a_wrong_type_is_named_exit_4(tmp_path: Path) -> None:
    """A crafted `delta.rowTracking` domain (the mark a string): `dbidx build-index` names the version file, exit 4,
    and nothing is written."""
    from click.testing import CliRunner

    from dbidx.cli import main

    path = tmp_path / "t"
    write_deltalake(str(path), pa.table({"id": ["a"], "v": pa.array([1], pa.int64())}))
    protocol = {
        "minReaderVersion": 3,
        "minWriterVersion": 7,
        "readerFeatures": ["deletionVectors"],
        "writerFeatures": ["deletionVectors", "domainMetadata", "rowTracking"],
    }
    domain = {"domain": "delta.rowTracking", "configuration": '{"rowIdHighWaterMark":"9"}', "removed": False}
    actions = [{"commitInfo": {"operation": "crafted"}}, {"protocol": protocol}, {"domainMetadata": domain}]
    (path / "_delta_log" / f"{1:020d}.json").write_text("".join(json.dumps(a) + "\n" for a in actions))
    result = CliRunner().invoke(main, ["build-index", str(path), "--key", "id"])
    assert result.exit_code == 4, result.output
    assert "00000000000000000001.json" in result.output and "rowIdHighWaterMark" in result.output
    assert not (path / ".dbidx" / "timeline" / "completed").exists() or not list(
        (path / ".dbidx" / "timeline" / "completed").glob("*.json")
    )
