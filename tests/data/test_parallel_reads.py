"""Full reads run one job per data file on a thread pool (data/reads.py, data/file_rows.py): the rows, their order
and types are those of reading each file group one file after another, every check still applies, and a damaged
file anywhere is still a typed error."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from dbidx.config import CacheConfig
from dbidx.data import reads
from dbidx.data.file_rows import FILE_GROUP_COLUMN
from dbidx.data.files import INSTANT_COLUMN
from dbidx.errors import CorruptFileError
from dbidx.table.facade import Table
from dbidx.spark_integration.local import upsert_arrow


def batch(keys: range, days: int, version: int, delete: bool = False) -> pa.Table:
    ids = [f"k{i:05d}" for i in keys]
    return pa.table(
        {
            "id": ids,
            "dt": [f"2025-01-{1 + i % days:02d}" for i in keys],
            "v": pa.array([version] * len(ids), pa.int64()),
            "note": [f"n{i % 3}" for i in keys],
            "_dbidx_delete": [delete] * len(ids),
        }
    )


@pytest.fixture()
def table(tmp_path: Path) -> Table:
    """Four partitions, two shards, several files per file group, deletion vectors from updates and deletes."""
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    cache = CacheConfig(base_path=str(tmp_path / "cache"))
    for data in (
        batch(range(400), 4, 1),
        batch(range(0, 400, 3), 4, 2),
        batch(range(0, 400, 7), 4, 0, delete=True),
        batch(range(350, 450), 4, 3),
        batch(range(0, 40), 4, 4),
    ):
        upsert_arrow(data, table, key="id", partition="dt", cache_config=cache)
    return table


def serial_read(table: Table, **options: object) -> pa.Table:
    """Each file group read by `read_unit`, one after another, in plan order (the reference the pool must equal)."""
    plan = reads.plan_read(table)
    schema = reads.output_schema(plan, **options)  # type: ignore[arg-type]
    return pa.concat_tables([reads.read_unit(table.io, u, plan.key or "", schema, table) for u in plan.units])


def expected_versions() -> dict[str, int]:
    state: dict[str, int] = {}
    for keys, version in ((range(400), 1), (range(0, 400, 3), 2)):
        state.update({f"k{i:05d}": version for i in keys})
    for i in range(0, 400, 7):
        state.pop(f"k{i:05d}")
    state.update({f"k{i:05d}": 3 for i in range(350, 450)})
    state.update({f"k{i:05d}": 4 for i in range(40)})
    return state


def test_the_pool_reads_what_a_serial_read_does_in_the_same_order(table: Table) -> None:
    plan = reads.plan_read(table)
    assert len(plan.units) >= 8 and any(len(u.files) > 2 for u in plan.units)  # several groups of several files
    assert any(v is not None for u in plan.units for v in u.vectors)  # and deletion vectors to apply
    for options in ({}, {"with_meta": True}, {"columns": ["v", "id"]}):
        pooled = reads.read_arrow(table, **options)  # type: ignore[arg-type]
        serial = serial_read(table, **options)
        assert pooled.equals(serial) and pooled.schema == serial.schema
        streamed = reads.record_batch_reader(table, **options).read_all()  # type: ignore[arg-type]
        assert streamed.equals(serial)
    current = reads.read_arrow(table)
    assert current.schema.names == ["id", "dt", "v", "note"]
    assert dict(zip(current.column("id").to_pylist(), current.column("v").to_pylist())) == expected_versions()


def test_meta_columns_come_from_each_files_group_and_commit(table: Table) -> None:
    plan = reads.plan_read(table)
    data = reads.read_arrow(table, with_meta=True)
    groups = {u.file_group for u in plan.units}
    assert set(data.column(FILE_GROUP_COLUMN).to_pylist()) == groups
    instants = {c.instant for c in table.timeline.completed()}
    assert set(data.column(INSTANT_COLUMN).to_pylist()) <= instants
    latest = {k: i for k, i in zip(data.column("id").to_pylist(), data.column(INSTANT_COLUMN).to_pylist())}
    assert latest["k00000"] == table.timeline.completed()[-1].instant  # rewritten by the last batch


def test_a_damaged_file_among_many_is_a_corrupt_file_error(table: Table) -> None:
    plan = reads.plan_read(table)
    victim = plan.units[len(plan.units) // 2].files[-1]
    path = Path(table.io.path(victim.path))
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptFileError, match="checksum"):
        reads.read_arrow(table)
    with pytest.raises(CorruptFileError, match="checksum"):
        reads.record_batch_reader(table).read_all()


def test_a_missing_dv_file_is_a_corrupt_file_error(table: Table) -> None:
    plan = reads.plan_read(table)
    ref = next(v for u in plan.units for v in u.vectors if v is not None)
    Path(table.io.path(ref.file.path)).unlink()
    with pytest.raises(CorruptFileError, match="missing"):
        reads.read_arrow(table)


def test_a_stream_left_early_stops_without_waiting_for_the_rest(table: Table) -> None:
    stream = reads.read_units(
        table.io, reads.plan_read(table).units, "id", reads.output_schema(reads.plan_read(table)), table
    )
    first = next(stream)
    assert first.num_rows > 0
    stream.close()  # the pool shuts down with at most the next group in flight


def test_a_single_file_read_still_works_with_pyarrows_threads(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "one"), num_shards=1)
    upsert_arrow(
        batch(range(50), 1, 1),
        table,
        key="id",
        partition="dt",
        cache_config=CacheConfig(base_path=str(tmp_path / "cache")),
    )
    assert sum(len(u.files) for u in reads.plan_read(table).units) == 1
    data = reads.read_arrow(table)
    assert data.num_rows == 50 and data.equals(serial_read(table))
