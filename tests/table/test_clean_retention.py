"""The clean keeps what Delta readers of older versions read for the table's `delta.deletedFileRetentionDuration`
(index/clean.py): data files a data compaction replaced and DV files no live vector points into stay until the
completion that replaced them is older than the retention; index files go by `retain_completions` alone. On real
tables written by `upsert_arrow` with the services on, time travelled by delta-rs and polars."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pytest

from dbidx.config import CacheConfig
from dbidx.data import reads
from dbidx.index.clean import plan_clean
from dbidx.spark_integration.local import upsert_arrow
from dbidx.storage import layout
from dbidx.storage.archive_retention import expire_archive
from dbidx.storage.completion_times import completed_at
from dbidx.storage.records import ACTION_CLEAN
from dbidx.table.facade import Table
from dbidx.table.service_settings import write_settings
from dbidx.table.services import clean_due

from tests.delta_readers import via_deltalake, via_polars

COLUMNS = ["id", "v"]
WEEK_MS = 7 * 86_400_000


class Writer:
    """Batches into one partition: 60 keys, then per batch an update of one of them and a new key. Each batch gives
    the first file a new deletion vector (so the DV file of the batch before leaves the state) and the file group one
    more small file (so the data compaction's count is reached every ten batches)."""

    def __init__(self, tmp_path: Path, name: str = "t", **create: object) -> None:
        self.table = Table.create(str(tmp_path / name), num_shards=1, **create)  # type: ignore[arg-type]
        self.config = CacheConfig(base_path=str(tmp_path / f"cache-{name}"))
        self.model: dict[str, int] = {}
        self.batches = 0
        # (the last Delta version that holds this state, its rows): services after an upsert change no rows.
        self.states: list[tuple[int, set[tuple[str, int]]]] = []

    def upsert(self) -> dict:
        k = self.batches = self.batches + 1
        rows = {f"base-{i}": i for i in range(60)} if k == 1 else {f"base-{k}": 1000 + k, f"new-{k}": k}
        summary = upsert_arrow(
            pa.table(
                {"id": list(rows), "dt": ["2025-01-01"] * len(rows), "v": pa.array(list(rows.values()), pa.int64())}
            ),
            self.table,
            key="id",
            partition="dt",
            cache_config=self.config,
        )
        self.model.update(rows)
        self.states.append((self.table.delta_version(), set(self.model.items())))
        return summary.services or {}

    def rows_at(self, version: int) -> set[tuple[str, int]]:
        return next(rows for last, rows in self.states if last >= version)


def via_dbidx_at(table: Table, version: int) -> list[tuple]:
    out = reads.read_arrow(table, columns=COLUMNS, version=version)
    return list(zip(*(out.column(c).to_pylist() for c in COLUMNS)))


def on_disk(table: Table, paths: list[str]) -> list[str]:
    return [p for p in paths if Path(table.io.path(p)).exists()]


@pytest.mark.slow  # ~3 s each on 2 cores: the 30 upserts' services
@pytest.mark.parametrize("data_compaction", [True, False], ids=["data-compaction", "vectors-only"])
def test_time_travel_within_the_retention_reads_every_version_after_the_services(
    tmp_path: Path, services_on: None, data_compaction: bool
) -> None:
    """Issue 63, item 4: ~30 upserts with the services at their defaults (clean every 10 completions, keeping 10),
    then a reader goes back to the first versions, seconds old, well within Delta's default week: every file they
    name is there, every version reads what it held. Without data compaction, what the versions need are the DV
    files each batch left behind."""
    w = Writer(tmp_path)
    if not data_compaction:
        write_settings(w.table.io, {"data_compaction": False})
    ran: list[str] = []
    for _ in range(30):
        report = w.upsert()
        assert "error" not in report, report
        ran += [r["service"] for r in report["ran"]]
    assert {"index_compaction", "clean"} <= set(ran) and ("data_compaction" in ran) == data_compaction, ran
    # The cleans ran and deleted what dbidx alone reads (index files a compaction replaced 10 completions before),
    # none of the data or DV files a Delta version within the week names.
    deleted = [p for r in w.table.timeline.kept() if r.action == ACTION_CLEAN for p in r.deleted]
    assert deleted and all(p.startswith(layout.RLI_DIR + "/") for p in deleted), deleted
    replaced = [p for p, _ in w.table.data_view().replaced(w.table.timeline.latest_seq)]
    released = [p for p, _ in w.table.data_view().unreferenced_dv_files(w.table.timeline.latest_seq)]
    assert len(released) >= 25 and (len(replaced) >= 10) == data_compaction, (replaced, released)
    assert on_disk(w.table, replaced + released) == replaced + released
    path = w.table.io.path("")
    for version in range(1, w.table.delta_version() + 1):
        assert set(via_deltalake(path, COLUMNS, version=version)) == w.rows_at(version), version
        # dbidx's own time travel reads its DV files (its Delta versions carry the vectors inline).
        assert set(via_dbidx_at(w.table, version)) == w.rows_at(version), version
    for version in (1, 2, 5):  # another engine's reader of the oldest versions
        assert set(via_polars(path, COLUMNS, version=version)) == w.rows_at(version), version


def test_a_short_retention_lets_the_clean_take_replaced_files_once_they_are_older(tmp_path: Path) -> None:
    """With the table's delta.deletedFileRetentionDuration set short, the clean keeps what a data compaction just
    replaced (and says why, and so does clean_due), then deletes it once it is older than the retention; time travel
    to before the compaction then fails, as Delta's contract allows, and the table's own state reads on."""
    w = Writer(tmp_path)
    assert w.table.set_delta_properties({"delta.deletedFileRetentionDuration": "interval 2 seconds"}) is not None
    for _ in range(4):
        w.upsert()
    before = w.table.delta_version()
    w.table.compact_data(min_files=2)
    latest = w.table.timeline.latest_seq
    replaced = [p for p, _ in w.table.data_view().replaced(latest)]
    released = [p for p, _ in w.table.data_view().unreferenced_dv_files(latest)]
    assert len(replaced) >= 4 and released
    young = replaced + [p for p, seq in w.table.data_view().unreferenced_dv_files(latest) if seq == latest]
    # 1. Within the retention: the clean leaves them, and says so; the services do not start a clean.
    record = w.table.clean(retain_completions=0)
    assert record is None or not set(record.deleted) & set(young), record
    assert on_disk(w.table, young) == young
    plan = plan_clean(w.table, retain_completions=0)
    assert plan.waiting >= len(young) and "delta.deletedFileRetentionDuration" in plan.nothing_to_do()
    settings = write_settings(w.table.io, {"clean_retain_completions": 0, "clean_interval": 1})
    reason = clean_due(w.table, settings)
    assert reason is not None and "'interval 2 seconds'" in reason, reason
    assert set(via_deltalake(w.table.io.path(""), COLUMNS, version=before)) == w.rows_at(before)
    # 2. Once older than the retention: due, and deleted.
    time.sleep(2.1)
    assert clean_due(w.table, settings) is None
    record = w.table.clean(retain_completions=0)
    assert record is not None and set(replaced + released) <= set(record.deleted)
    assert on_disk(w.table, replaced + released) == []
    assert plan_clean(w.table, 0).doomed == () and plan_clean(w.table, 0).waiting == 0
    with pytest.raises(Exception, match=r"(?i)not found|no such file"):
        via_deltalake(w.table.io.path(""), COLUMNS, version=before)
    assert set(via_deltalake(w.table.io.path(""), COLUMNS)) == set(w.model.items())


def test_clean_due_waits_for_the_default_week_and_the_count_still_holds(tmp_path: Path) -> None:
    """At Delta's default retention a data compaction's replaced files make no clean due (the services do not spin
    after every batch) until a week after the compaction; `clean_retain_completions` keeps its meaning as a floor
    on top of the retention, and is the only rule for index files."""
    w = Writer(tmp_path)
    for _ in range(3):
        w.upsert()
    w.table.compact_data(min_files=2)
    compaction = w.table.timeline.latest_seq
    week_later = completed_at(w.table.timeline, compaction) + WEEK_MS
    compacted = {p for p, seq in w.table.data_view().replaced(compaction) if seq == compaction}
    assert len(compacted) >= 3
    settings = write_settings(w.table.io, {"clean_retain_completions": 0, "clean_interval": 1})
    reason = clean_due(w.table, settings)
    assert reason is not None and "'interval 1 weeks'" in reason, reason
    # The oldest replacement (a DV file an upsert's new vector left behind) is the first due, a week after it.
    oldest = min(seq for _, seq in w.table.data_view().unreferenced_dv_files(compaction))
    oldest_due = completed_at(w.table.timeline, oldest) + WEEK_MS
    assert clean_due(w.table, settings, now_ms=oldest_due - 1) is not None
    assert clean_due(w.table, settings, now_ms=oldest_due) is None
    assert not compacted & set(plan_clean(w.table, 0, now_ms=week_later - 1).data_files)
    later = plan_clean(w.table, 0, now_ms=week_later)
    assert later.index_files == () and compacted <= set(later.data_files) and later.waiting == 0
    # The count on top of the retention: a week later, what the newest completion replaced waits for one more.
    assert not compacted & set(plan_clean(w.table, 1, now_ms=week_later).data_files)
    # Index files go by the count alone, whatever the retention.
    w.table.compact(min_files=2)
    for _ in range(2):
        w.upsert()
    plan = plan_clean(w.table, 2)
    assert plan.index_files and all(p.startswith(layout.RLI_DIR + "/") for p in plan.index_files)
    assert plan.data_files == () and plan.waiting >= len(compacted)
    assert clean_due(w.table, settings) is None
    record = w.table.clean(retain_completions=2)
    assert record is not None and set(record.deleted) == set(plan.index_files)
    assert on_disk(w.table, sorted(compacted)) == sorted(compacted)


def test_completion_times_of_a_reopened_table_come_from_records_bundles_and_memory(tmp_path: Path) -> None:
    """A process that opened the table from a checkpoint reads the time of an older replacement from its record
    file, or from the archive bundle that holds it: the plan is the one a process that saw every record makes."""
    w = Writer(tmp_path, checkpoint_interval=3)
    for _ in range(4):
        w.upsert()
    w.table.compact_data(min_files=2)
    for _ in range(8):
        w.upsert()
    records = {r.seq: r.completed_at_ms for r in w.table.timeline.kept()}
    reopened = Table.open(w.table.uri)
    reopened.refresh()
    assert reopened.timeline.base_seq > 5 and list(Path(reopened.io.path(layout.ARCHIVE_DIR)).iterdir())
    assert {seq: completed_at(reopened.timeline, seq) for seq in records} == records
    now = max(records.values()) + WEEK_MS
    assert plan_clean(Table.open(w.table.uri), 0, now_ms=now) == plan_clean(w.table, 0, now_ms=now)
    # Records archive retention expired: the floor's newest time stands for each (never older than theirs).
    floor = expire_archive(w.table, retention_ms=1, now_ms=now).floor
    assert floor > 1
    expired = Table.open(w.table.uri)
    newest = max(records[seq] for seq in range(1, floor + 1))
    assert [completed_at(expired.timeline, seq) for seq in range(1, floor + 1)] == [newest] * floor
    assert [completed_at(expired.timeline, seq) for seq in range(floor + 1, max(records) + 1)] == [
        records[seq] for seq in range(floor + 1, max(records) + 1)
    ]


def test_a_retention_made_longer_while_a_clean_starts_stops_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process makes delta.deletedFileRetentionDuration longer between the clean's choice of files and its
    publish: the clean publishes nothing and deletes nothing (ConflictError), and the next one keeps the files."""
    from dbidx.errors import ConflictError
    from dbidx.storage import timeline as timeline_module

    w = Writer(tmp_path)
    w.table.set_delta_properties({"delta.deletedFileRetentionDuration": "interval 1 milliseconds"})
    for _ in range(3):
        w.upsert()
    w.table.compact_data(min_files=2)
    replaced = [p for p, _ in w.table.data_view().replaced(10**9)]
    other = Table.open(w.table.uri)
    real_start = timeline_module.Timeline.start

    def start_after_a_longer_retention(self, action, *args, **kwargs):  # type: ignore[no-untyped-def]
        if action == ACTION_CLEAN:
            other.set_delta_properties({"delta.deletedFileRetentionDuration": "interval 30 days"})
        return real_start(self, action, *args, **kwargs)

    monkeypatch.setattr(timeline_module.Timeline, "start", start_after_a_longer_retention)
    with pytest.raises(ConflictError, match="deletedFileRetentionDuration grew"):
        w.table.clean(retain_completions=0)
    monkeypatch.undo()
    assert on_disk(w.table, replaced) == replaced
    assert not any(r.action == ACTION_CLEAN for r in w.table.timeline.kept())
    assert w.table.clean(retain_completions=0) is None  # 30 days now: nothing is old enough
    assert on_disk(w.table, replaced) == replaced
