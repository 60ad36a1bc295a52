"""Slim Delta checkpoints (data/delta_checkpoint.py): delta-rs's checkpoint of a dbidx table loses the tombstones of
deletion-vector updates (paths live again, inline vectors) and all but the newest tombstone of each removed path,
the tombstones kept lose their inline vectors, and nothing any reader or vacuum does changes. Real tables written by
`upsert_arrow`, compacted, read by delta-rs, polars and DuckDB."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable

from dbidx.config import CacheConfig
import pytest

from dbidx.data.delta_checkpoint import (
    COMPRESSION,
    _check_same_state,
    _strip_inline_vectors,
    _useless_tombstones,
    write_delta_checkpoint,
)
from dbidx.data.delta_log import DELTA_LOG_DIR, checkpoint_pointer
from dbidx.errors import CorruptFileError
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table
from dbidx.spark_integration.local import upsert_arrow

from tests.delta_readers import assert_readers_agree, via_deltalake


def churned_table(tmp_path: Path) -> tuple[Table, dict[str, int]]:
    """Updates that give the same files new vectors again and again, then a data compaction of some of them."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    cache = CacheConfig(base_path=str(tmp_path / "cache"))
    rows: dict[str, int] = {}
    for i in range(24):
        batch = {f"k{j}": i * 100 + j for j in range(i % 9, i % 9 + 30)}
        upsert_arrow(
            pa.table(
                {"id": list(batch), "dt": ["x" if int(k[1:]) % 2 else "y" for k in batch], "v": list(batch.values())}
            ),
            table,
            key="id",
            partition="dt",
            cache_config=cache,
        )
        rows.update(batch)
    table.compact_data(["dt=x"], min_files=2)
    return table, rows


def expected(rows: dict[str, int]) -> set[tuple]:
    return {(k, "x" if int(k[1:]) % 2 else "y", v) for k, v in rows.items()}


def checkpoint_rows(table: Table, version: int) -> pa.Table:
    return pq.read_table(table.io.path(f"{DELTA_LOG_DIR}/{version:020d}.checkpoint.parquet"))


def vacuum_lists(uri: str) -> list[set[str]]:
    """What delta-rs's VACUUM would delete, lite and full, with no retention and with an hour's (every tombstone
    is younger: the files they name must stay)."""
    return [
        set(DeltaTable(uri).vacuum(retention_hours=hours, dry_run=True, enforce_retention_duration=False, full=full))
        for hours in (0, 1)
        for full in (False, True)
    ]


@pytest.mark.slow
def test_the_slim_checkpoint_keeps_what_readers_and_vacuum_need(tmp_path: Path) -> None:
    table, rows = churned_table(tmp_path)
    before_vacuum = vacuum_lists(table.uri)
    replaced_with_vectors = {
        r["path"]
        for v in range(1, table.delta_version() + 1)
        for r in (
            json.loads(line).get("remove")
            for line in Path(table.io.path(f"{DELTA_LOG_DIR}/{v:020d}.json")).read_text().splitlines()
        )
        if r and r.get("deletionVector") and not r["dataChange"]
    }
    written = write_delta_checkpoint(table.io)
    assert written is not None and written.version == table.delta_version()
    assert written.tombstones_dropped > 0 and written.bytes_after < written.bytes_before
    slim = checkpoint_rows(table, written.version)
    removes = slim.column("remove").drop_null().to_pylist()
    live = {a["path"] for a in slim.column("add").drop_null().to_pylist()}
    assert removes and not {r["path"] for r in removes} & live  # no tombstone of a live path
    assert len({r["path"] for r in removes}) == len(removes)  # one per removed path
    # The compaction replaced files that had vectors: their tombstones stay, without the (inline) vector.
    assert replaced_with_vectors and replaced_with_vectors <= {r["path"] for r in removes}
    assert written.vectors_stripped == len(replaced_with_vectors)
    assert all(r["deletionVector"] is None for r in removes)
    assert any(a["deletionVector"] for a in slim.column("add").drop_null().to_pylist())  # the adds keep theirs
    pointer = json.loads(table.io.read_bytes(f"{DELTA_LOG_DIR}/_last_checkpoint"))
    assert pointer["version"] == written.version and pointer["sizeInBytes"] == written.bytes_after
    assert pointer["size"] == slim.num_rows
    # Readers: the latest version from the checkpoint, time travel across it, and vacuum's list unchanged.
    assert_readers_agree(table, ["id", "dt", "v"], expected(rows))
    assert set(via_deltalake(table.uri, ["id", "dt", "v"], version=3))
    assert vacuum_lists(table.uri) == before_vacuum
    assert verify_table(Table.open(table.uri)).damaged == []
    # A later checkpoint starts from the slim one.
    upsert_arrow(
        pa.table({"id": ["k3"], "dt": ["x"], "v": [9]}),
        table,
        key="id",
        partition="dt",
        cache_config=CacheConfig(base_path=str(tmp_path / "cache")),
    )
    rows["k3"] = 9
    assert write_delta_checkpoint(table.io).version == written.version + 1
    assert_readers_agree(table, ["id", "dt", "v"], expected(rows))


def test_tombstones_of_vectors_in_files_of_their_own_stay() -> None:
    vector = pa.struct([("storageType", pa.string()), ("pathOrInlineDv", pa.string())])
    add = pa.chunked_array([pa.array([{"path": "a"}, None, None, None, None], pa.struct([("path", pa.string())]))])
    remove_type = pa.struct([("path", pa.string()), ("deletionTimestamp", pa.int64()), ("deletionVector", vector)])
    remove = pa.chunked_array(
        [
            pa.array(
                [
                    None,
                    {
                        "path": "a",
                        "deletionTimestamp": 5,
                        "deletionVector": {"storageType": "i", "pathOrInlineDv": "x"},
                    },
                    {
                        "path": "a",
                        "deletionTimestamp": 6,
                        "deletionVector": {"storageType": "u", "pathOrInlineDv": "y"},
                    },
                    {"path": "b", "deletionTimestamp": 7, "deletionVector": None},
                    {
                        "path": "b",
                        "deletionTimestamp": 9,
                        "deletionVector": {"storageType": "i", "pathOrInlineDv": "z"},
                    },
                ],
                remove_type,
            )
        ]
    )
    # row 1: a live path's inline tombstone (dropped); row 2: a vector file (kept); rows 3-4: b's older one dropped
    assert _useless_tombstones(add, remove).tolist() == [False, True, False, True, False]


def checkpoint_like(removes: list[dict | None], adds: list[dict | None]) -> pa.Table:
    """A checkpoint's add and remove columns, typed as delta-rs writes them (non-nullable vector fields)."""
    vector = pa.struct(
        [
            pa.field("storageType", pa.string(), nullable=False),
            pa.field("pathOrInlineDv", pa.string(), nullable=False),
            pa.field("offset", pa.int32()),
            pa.field("sizeInBytes", pa.int32(), nullable=False),
            pa.field("cardinality", pa.int64(), nullable=False),
        ]
    )
    add = pa.struct([pa.field("path", pa.string(), nullable=False), pa.field("deletionVector", vector)])
    remove = pa.struct(
        [
            pa.field("path", pa.string(), nullable=False),
            pa.field("deletionTimestamp", pa.int64()),
            pa.field("dataChange", pa.bool_(), nullable=False),
            pa.field("size", pa.int64()),
            pa.field("deletionVector", vector),
        ]
    )
    return pa.table({"add": pa.array(adds, add), "remove": pa.array(removes, remove)})


def test_only_inline_vectors_of_tombstones_are_stripped_and_the_rest_is_unchanged() -> None:
    inline = {
        "storageType": "i",
        "pathOrInlineDv": "wi5b=000010000siXQKl0rr91000f55c8Xg0@@D72lkbi5=-{L",
        "offset": None,
        "sizeInBytes": 36,
        "cardinality": 3,
    }
    in_file = {
        "storageType": "u",
        "pathOrInlineDv": "ab^-aqEH.-t@S}K{vb[*k^",
        "offset": 1,
        "sizeInBytes": 36,
        "cardinality": 3,
    }
    fat = checkpoint_like(
        [
            None,
            None,
            {"path": "gone-inline", "deletionTimestamp": 5, "dataChange": False, "size": 10, "deletionVector": inline},
            {
                "path": "gone-in-file",
                "deletionTimestamp": 6,
                "dataChange": False,
                "size": 11,
                "deletionVector": in_file,
            },
            {"path": "gone-plain", "deletionTimestamp": 7, "dataChange": True, "size": 12, "deletionVector": None},
        ],
        [{"path": "live", "deletionVector": inline}, {"path": "live2", "deletionVector": None}, None, None, None],
    )
    slim, stripped = _strip_inline_vectors(fat)
    assert stripped == 1 and slim.schema == fat.schema
    assert slim.column("add").to_pylist() == fat.column("add").to_pylist()  # live files keep their vectors
    expected = fat.column("remove").to_pylist()
    expected[2] = dict(expected[2], deletionVector=None)
    assert slim.column("remove").to_pylist() == expected
    # Parquet takes it (a null vector over non-nullable fields) and gives it back the same.
    sink = pa.BufferOutputStream()
    pq.write_table(slim, sink, compression=COMPRESSION)
    back = pq.read_table(pa.BufferReader(sink.getvalue()))
    assert back.column("remove").to_pylist() == expected
    _check_same_state(fat, fat, back, 0, stripped, "here")
    # Nothing to strip: the table as it was.
    assert _strip_inline_vectors(slim) == (slim, 0)


def test_the_check_refuses_a_slim_checkpoint_that_lost_more_than_inline_tombstone_vectors() -> None:
    inline = {
        "storageType": "i",
        "pathOrInlineDv": "wi5b=000010000siXQKl0rr91000f55c8Xg0@@D72lkbi5=-{L",
        "offset": None,
        "sizeInBytes": 36,
        "cardinality": 3,
    }
    in_file = dict(inline, storageType="u", pathOrInlineDv="ab^-aqEH.-t@S}K{vb[*k^", offset=1)
    tomb = {"path": "gone", "deletionTimestamp": 5, "dataChange": False, "size": 10}
    fat = checkpoint_like(
        [None, dict(tomb, deletionVector=inline), dict(tomb, path="gone2", deletionVector=in_file)],
        [{"path": "live", "deletionVector": inline}, None, None],
    )
    slim, stripped = _strip_inline_vectors(fat)
    assert stripped == 1
    _check_same_state(fat, fat, slim, 0, stripped, "here")
    wrong = [
        checkpoint_like(
            [None, dict(tomb, deletionVector=None), dict(tomb, path="gone2", deletionVector=None)],
            [{"path": "live", "deletionVector": inline}, None, None],
        ),  # a vector in a file lost
        checkpoint_like(
            [None, dict(tomb, deletionVector=None), dict(tomb, path="gone2", deletionVector=in_file)],
            [{"path": "live", "deletionVector": None}, None, None],
        ),  # a live file's vector lost
        checkpoint_like(
            [
                None,
                dict(tomb, deletionVector=None, deletionTimestamp=9),
                dict(tomb, path="gone2", deletionVector=in_file),
            ],
            [{"path": "live", "deletionVector": inline}, None, None],
        ),  # a tombstone's time changed
        checkpoint_like(
            [None, dict(tomb, deletionVector=None, path="live"), dict(tomb, path="gone2", deletionVector=in_file)],
            [{"path": "live", "deletionVector": inline}, None, None],
        ),  # a tombstone's path changed
    ]
    for bad in wrong:
        with pytest.raises(CorruptFileError, match="slimming Delta checkpoint here went wrong"):
            _check_same_state(fat, fat, bad, 0, stripped, "here")


def test_the_publisher_writes_no_delta_checkpoint_right_after_another(tmp_path: Path) -> None:
    """The publisher's Delta checkpoint (every `checkpoint_interval` completions, for tables whose log cleanup
    service is off) is skipped while the newest one is fewer than delta.checkpointInterval versions old."""
    table = Table.create(str(tmp_path / "t"), num_shards=1, checkpoint_interval=3)
    table.configure_services(after_commit=False)
    table.set_delta_properties({"delta.checkpointInterval": "5"})
    cache = CacheConfig(base_path=str(tmp_path / "cache"))
    written = []
    for i in range(14):
        upsert_arrow(
            pa.table({"id": [f"k{i}"], "dt": ["x"], "v": [i]}), table, key="id", partition="dt", cache_config=cache
        )
        pointer = checkpoint_pointer(table.io)
        if pointer >= 0 and pointer not in written:
            written.append(pointer)
    assert len(written) >= 3, written  # the first at the first due completion: no Delta checkpoint yet
    assert all(b - a >= 5 for a, b in zip(written, written[1:])), written
    assert_readers_agree(table, ["id", "dt", "v"], {(f"k{i}", "x", i) for i in range(14)})
