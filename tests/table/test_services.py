"""Table services that run by themselves (table/services.py): settings, triggers, budget, yielding, and the writer's
run after each upsert, on real tables written by `upsert_arrow` and read by delta-rs, polars and DuckDB."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pytest

from dbidx.config import CacheConfig
from dbidx.errors import ConfigError, CorruptFileError
from dbidx.table.service_settings import SERVICES_FILE, ServiceSettings, read_settings, write_settings
from dbidx.table.services import ServicesReport, run_services
from dbidx.table.facade import Table
from dbidx.storage.records import ACTION_CLEAN, ACTION_DATA_COMPACTION
from dbidx.spark_integration import driver
from dbidx.spark_integration.local import upsert_arrow

from tests.delta_readers import assert_readers_agree
from tests.retention import clean_without_waiting
from tests.spark_helpers import Oracle, random_batch

SMALL = dict(data_min_small_files=4, index_min_files=4, clean_retain_completions=3, clean_interval=3)


def as_arrow(batch: list[tuple]) -> pa.Table:
    ids, days, values, deletes = zip(*batch)
    return pa.table(
        {"id": list(ids), "dt": list(days), "v": pa.array(values, pa.int64()), "_dbidx_delete": list(deletes)}
    )


def expected_rows(oracle: Oracle) -> set[tuple]:
    return {(ident[-1], day, value) for ident, (day, value) in oracle.rows.items()}


def live_data_files(table: Table) -> int:
    return len(table.data_view().live())


def maintain(table: Table, **budget: object) -> ServicesReport:
    return run_services(table, read_settings(table.io), progress=budget.pop("progress", None), **budget)


def configure(table: Table, **changes: object) -> ServiceSettings:
    return write_settings(table.io, changes)


def live_index_files(table: Table) -> int:
    view = table.refresh()
    return sum(len(view.files(partition, shard)) for partition, shard in view.groups())


class Writer:
    """Random change batches upserted into one table and applied to a model of it."""

    def __init__(self, tmp_path: Path, name: str, seed: int, shards: int = 2, **settings: object) -> None:
        self.table = Table.create(str(tmp_path / name), num_shards=shards)
        write_settings(self.table.io, settings)
        self.config = CacheConfig(base_path=str(tmp_path / f"cache-{name}"))
        self.oracle, self.serial, self.rng = Oracle(False), [0], random.Random(seed)

    def upsert(self, size: int = 12) -> dict:
        batch = random_batch(self.rng, self.oracle, self.serial, size=size)
        summary = upsert_arrow(as_arrow(batch), self.table, key="id", partition="dt", cache_config=self.config)
        self.oracle.apply(batch)
        return summary.services


def test_settings_round_trip_and_strict_parsing(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    assert read_settings(table.io) == ServiceSettings()  # no file: the defaults, all on
    configure(table, clean=False, budget_seconds=2, data_deleted_share=0.5)
    again = read_settings(Table.open(table.uri).io)
    assert (again.clean, again.budget_seconds, again.data_deleted_share) == (False, 2.0, 0.5)
    assert json.loads(table.io.read_bytes(SERVICES_FILE))["settings"] == {
        "budget_seconds": 2.0,
        "clean": False,
        "data_deleted_share": 0.5,
    }
    assert configure(table, clean=None).clean is True  # None: back to the default
    # Values set from Python are checked before anything is written.
    for bad in (
        {"clean": "yes"},
        {"data_min_small_files": 1},
        {"budget_files": 2.5},
        {"nope": 1},
        {"data_deleted_share": 0.0},
        {"budget_seconds": float("nan")},
    ):
        with pytest.raises(ConfigError):
            configure(table, **bad)
    assert read_settings(table.io).clean is True and read_settings(table.io).budget_seconds == 2.0
    # Read back, the file is untrusted: the error names the key and the file.
    for content, named in (
        ({"format": 1, "settings": {"cleen": True}}, "cleen"),
        ({"format": 1, "settings": {"index_min_files": "4"}}, "index_min_files"),
        ({"format": 1, "settings": {"clean": 1}}, "clean"),
        ({"format": 2, "settings": {}}, "format"),
        ({"format": 1, "settings": {}, "x": 1}, "settings"),
        ("[1, 2", "JSON"),
    ):
        raw = content if isinstance(content, str) else json.dumps(content)
        table.io.write_atomic(SERVICES_FILE, raw.encode())
        with pytest.raises(CorruptFileError, match=named) as err:
            read_settings(table.io)
        assert "services.json" in str(err.value)


def small_files_per_group(table: Table) -> dict[tuple[str, str], int]:
    groups: dict[tuple[str, str], int] = {}
    for live in table.data_view().live():
        key = (live.record.partition, live.record.file_group)
        groups[key] = groups.get(key, 0) + 1
    return groups


def data_files_on_disk(table: Table) -> set[str]:
    return {
        r
        for r, _ in table.io.list_files_recursive("")
        if r.endswith(".parquet") and not r.startswith((".dbidx/", "_delta_log/"))
    }


@pytest.mark.slow
def test_services_keep_the_table_small_and_exact(tmp_path: Path, services_on: None) -> None:
    on = Writer(tmp_path, "on", seed=44, shards=1, **SMALL)
    clean_without_waiting(on.table)  # the count alone decides (how long the retention keeps: test_clean_retention)
    off = Writer(tmp_path, "off", seed=44, shards=1, after_commit=False)
    ran: list[str] = []
    retain = int(SMALL["clean_retain_completions"])
    for batch in range(1, 61):
        report = on.upsert()
        assert "error" not in report and report["left"] == [], report
        ran += [r["service"] for r in report["ran"]]
        if batch <= 10:  # the same first 10 batches without services
            assert off.upsert() is None
        if batch % 4:
            continue
        # Bounded after every run that left nothing: no file group holds as many small files as trigger a compaction
        # (every file of this test is small), whatever order the batches' keys came in.
        groups = small_files_per_group(on.table)
        assert max(groups.values()) < SMALL["data_min_small_files"], groups
        # The cleans deleted what the compactions replaced: a data file on disk that is not live was replaced by a
        # data compaction the last clean had to keep (fewer than clean_retain_completions completions before it).
        timeline = on.table.timeline
        timeline.refresh()
        records = timeline.kept()
        cleans = [r.seq for r in records if r.action == ACTION_CLEAN]
        if cleans:
            kept_from = cleans[-1] - 1 - retain
            recent = {
                p for r in records if r.action == ACTION_DATA_COMPACTION and r.seq > kept_from for p in r.replaced
            }
            live = {live.record.path for live in on.table.data_view().live()}
            assert data_files_on_disk(on.table) - live <= recent, (
                batch,
                sorted(data_files_on_disk(on.table) - live - recent),
            )
    assert {"data_compaction", "index_compaction", "clean"} <= set(ran)
    # Fewer files after 60 batches than after 10 without services.
    assert live_data_files(on.table) < live_data_files(off.table), (
        live_data_files(on.table),
        live_data_files(off.table),
    )
    assert live_index_files(on.table) < live_index_files(off.table)
    assert_readers_agree(on.table, ["id", "dt", "v"], expected_rows(on.oracle))
    # A clean that keeps nothing leaves exactly the live files: nothing leaked.
    on.table.clean(retain_completions=0)
    assert data_files_on_disk(on.table) == {live.record.path for live in on.table.data_view().live()}
    assert_readers_agree(on.table, ["id", "dt", "v"], expected_rows(on.oracle))


def test_budget_leaves_work_for_later_and_says_so(tmp_path: Path) -> None:
    w = Writer(tmp_path, "t", seed=7, after_commit=False, **SMALL)
    for _ in range(8):
        w.upsert()
    before = live_data_files(w.table)
    report = maintain(w.table, budget_seconds=1e-9)  # out of time before the first step
    assert report.ran == [] and [x["service"] for x in report.left][:1] == ["data_compaction"]
    assert report.left[0]["reason"] == "budget_seconds" and report.left[0]["files"] > 0
    one = maintain(w.table, budget_files=1)  # the worst partition only, the rest left
    assert [r.service for r in one.ran][:1] == ["data_compaction"] and len(one.ran[0].details["partitions"]) == 1
    assert one.left[0] | {"partitions": 0, "files": 0} == {
        "service": "data_compaction",
        "reason": "budget_files",
        "partitions": 0,
        "files": 0,
    }
    rest = maintain(w.table)
    assert rest.left == [] and "data_compaction" in [r.service for r in rest.ran]
    assert maintain(w.table).ran == []  # nothing left to do: nothing published
    assert live_data_files(w.table) < before
    assert_readers_agree(w.table, ["id", "dt", "v"], expected_rows(w.oracle))


def test_a_service_yields_to_a_concurrent_run_and_the_upsert_commits(tmp_path: Path, services_on: None) -> None:
    w = Writer(tmp_path, "t", seed=11, after_commit=False, **SMALL)
    for _ in range(8):
        w.upsert()
    other = Writer.__new__(Writer)  # a second writer of the same table, whose services run after its upsert
    other.table, other.config = Table.open(w.table.uri), CacheConfig(base_path=str(tmp_path / "cache-other"))
    other.oracle, other.serial, other.rng = w.oracle, w.serial, w.rng
    inner: list[dict] = []

    def meanwhile(done: int, total: int, step: str = "", rows: int = 0) -> None:
        if not inner:  # while this run writes its first base: an upsert commits and its services compact first
            write_settings(other.table.io, {"after_commit": True})
            inner.append(other.upsert())

    report = maintain(w.table, progress=meanwhile)
    assert "data_compaction" in [r["service"] for r in inner[0]["ran"]]
    assert [y["service"] for y in report.yielded] == ["data_compaction"] and "data compaction" in report.yielded[0][
        "error"
    ]
    assert "data_compaction" not in [r.service for r in report.ran]
    write_settings(w.table.io, {"after_commit": False})
    maintain(w.table)  # the next run takes what is left
    assert_readers_agree(w.table, ["id", "dt", "v"], expected_rows(w.oracle))


def test_a_failing_service_never_fails_the_upsert(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, services_on: None
) -> None:
    w = Writer(tmp_path, "t", seed=3)

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(driver, "run_services", broken)
    with pytest.warns(RuntimeWarning, match="disk on fire"):
        services = w.upsert()
    assert services == {"error": "OSError: disk on fire"}
    assert_readers_agree(w.table, ["id", "dt", "v"], expected_rows(w.oracle))


def test_vacuum_runs_at_most_once_per_interval_by_the_tables_retention(tmp_path: Path) -> None:
    import os
    import time

    from dbidx.table.services import VACUUM_STATE_FILE, vacuum_wait

    w = Writer(
        tmp_path,
        "t",
        seed=9,
        shards=1,
        after_commit=False,
        data_compaction=False,
        index_compaction=False,
        clean=False,
        log_cleanup=False,
    )
    w.upsert()
    w.table.set_delta_properties({"delta.deletedFileRetentionDuration": "interval 1 days"})
    partition = sorted(p for p in os.listdir(w.table.io.path("")) if "=" in p)[0]

    def orphan(name: str, days: float) -> Path:
        path = Path(w.table.io.path(f"{partition}/{name}.parquet"))
        path.write_bytes(b"PAR1 not a real file of the table PAR1")
        then = time.time() - days * 86_400
        os.utime(path, (then, then))
        return path

    old, young = orphan("old", 2), orphan("young", 0.5)
    ran = {r.service: r.details for r in maintain(w.table).ran}
    assert ran["vacuum"]["files_deleted"] == 1 and ran["vacuum"]["retention_hours"] == 24
    assert not old.exists() and young.exists()
    assert vacuum_wait(w.table.io, read_settings(w.table.io)) is not None  # ran now: not due for 24 hours
    second = orphan("second", 2)
    assert "vacuum" not in {r.service for r in maintain(w.table).ran} and second.exists()
    state = json.loads(w.table.io.read_bytes(VACUUM_STATE_FILE))
    assert state["files_deleted"] == 1
    configure(w.table, vacuum_interval_hours=12)
    state["last_run_ms"] -= 13 * 3_600_000  # the last run, 13 hours ago
    w.table.io.write_atomic(VACUUM_STATE_FILE, json.dumps(state).encode())
    assert "vacuum" in {r.service for r in maintain(w.table).ran} and not second.exists()
    assert_readers_agree(w.table, ["id", "dt", "v"], expected_rows(w.oracle))
    w.table.io.write_atomic(VACUUM_STATE_FILE, b'{"format": 1}')
    with pytest.raises(CorruptFileError, match="vacuum.json"):
        maintain(w.table)
