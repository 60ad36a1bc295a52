"""`vacuum` (table/vacuum.py): Delta's VACUUM on a dbidx table. delta-rs lists what Delta semantics allow to delete;
dbidx deletes only what is on storage, older than the retention, and named by nothing it knows of. Real tables:
dbidx writes through `upsert_arrow`, other engines' commits through delta-rs; files and removals are aged (os.utime,
the removals' deletionTimestamp in the log) instead of waiting days."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet
import pytest
from deltalake import DeltaTable

from dbidx.config import CacheConfig
from dbidx.data.reads import read_arrow
from dbidx.errors import ConfigError, InvalidInputError
from dbidx.table.facade import Table
from dbidx.table.vacuum import VacuumIncompleteError, vacuum
from dbidx.table.verify_table import verify_table
from dbidx.spark_integration.local import upsert_arrow
from dbidx.storage import markers

from tests.data.test_delta_adopt import _delete_rows, _log
from tests.delta_readers import assert_readers_agree, via_deltalake
from tests.retention import clean_without_waiting

COLUMNS = ("id", "dt", "v")
DAY_S = 24 * 3600
PLAIN, SPACED, ESCAPED = "d1", "d 2", "x%y&ü"  # partition values: plain, with a space, with characters to escape


class Scene:
    """A dbidx table with history (inserts in three partitions, updates of the plain one: deletion vectors)."""

    def __init__(self, tmp_path: Path) -> None:
        self.table = Table.create(str(tmp_path / "t"), num_shards=2)
        self.root = Path(self.table.io.path(""))
        self.config = CacheConfig(base_path=str(tmp_path / "cache"))
        self.upsert([(f"k{i}", (PLAIN, SPACED, ESCAPED)[i % 3], i) for i in range(12)])
        self.upsert([(f"k{i}", PLAIN, 100 + i) for i in range(0, 12, 3)])  # updates: vectors in the plain one

    def upsert(self, rows: list[tuple[str, str, int]]) -> None:
        ids, days, values = (list(c) for c in zip(*rows))
        upsert_arrow(
            pa.table({"id": ids, "dt": days, "v": pa.array(values, pa.int64())}),
            self.table,
            key="id",
            partition="dt",
            cache_config=self.config,
        )

    def files(self) -> set[str]:
        """Every file under the table, table-relative."""
        return {str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file()}

    def orphan(self, rel: str, age_s: float) -> str:
        """A Parquet file no commit names (a crashed writer's), modified age_s ago."""
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"PAR1junk")
        age(path, age_s)
        return rel

    def rows(self) -> set[tuple]:
        return set(assert_readers_agree(Table.open(str(self.root)), COLUMNS))

    def check(self, rows: set[tuple]) -> None:
        """Every reader (dbidx, delta-rs, polars, DuckDB) reads `rows`, and verify finds nothing wrong."""
        assert self.rows() == rows
        check = verify_table(Table.open(str(self.root)))
        assert check.ok, check.damaged


def age(path: Path, age_s: float) -> None:
    when = time.time() - age_s
    os.utime(path, (when, when))


def age_everything(root: Path, age_s: float) -> None:
    """Every file of the table (data, Delta log, .dbidx) modified age_s ago."""
    for path in root.rglob("*"):
        if path.is_file():
            age(path, age_s)


def age_removals(root: Path, version: int, age_s: float) -> None:
    """The removes of one Delta version stamped age_s earlier (what waiting that long would give), the rest of the
    version, and its file's modification time, as they were."""
    path = root / "_delta_log" / f"{version:020d}.json"
    stat = path.stat()
    lines = []
    for line in path.read_text().splitlines():
        action = json.loads(line)
        if "remove" in action:
            action["remove"]["deletionTimestamp"] -= int(age_s * 1000)
            line = json.dumps(action, sort_keys=True, separators=(",", ":"))
        lines.append(line)
    path.write_text("\n".join(lines) + "\n")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def removed_in(root: Path, version: int) -> set[str]:
    """Table-relative paths on storage of the files a Delta version removes."""
    lines = (root / "_delta_log" / f"{version:020d}.json").read_text().splitlines()
    return {unquote(json.loads(line)["remove"]["path"]) for line in lines if '"remove"' in line}


def test_orphans_older_than_the_retention_go_young_ones_and_the_tables_own_files_stay(tmp_path: Path) -> None:
    s = Scene(tmp_path)
    rows = s.rows()
    age_everything(s.root, 30 * DAY_S)  # live files, Delta log, .dbidx: all a month old, none may go
    kept = s.files()
    assert any(p.startswith(".dbidx/dv/") for p in kept) and any(p.startswith(".dbidx/rli/") for p in kept)
    old = {
        s.orphan(f"dt={PLAIN}/part-crashed-1.parquet", 10 * DAY_S),
        s.orphan(f"dt={SPACED}/part-crashed-2.parquet", 10 * DAY_S),
        s.orphan(f"dt={ESCAPED}/part-crashed-3.parquet", 2 * DAY_S),
    }
    young = s.orphan(f"dt={SPACED}/part-running.parquet", 3600)  # another engine is writing it: an hour old
    hidden = s.orphan(f"dt={PLAIN}/.tmp-1234", 10 * DAY_S)  # delta-rs lists it (only first levels are hidden to it)
    report = vacuum(s.table, retention_hours=24)
    assert sorted(report.deleted) == sorted(old) and report.bytes == 3 * len(b"PAR1junk")
    assert report.protected == [{"path": hidden, "reason": report.protected[0]["reason"]}]
    assert "hidden" in report.protected[0]["reason"]
    assert s.files() == kept | {young, hidden}
    s.check(rows)
    # A retention of one hour lets the (now two-hour-old) orphan go, and still no file of the table.
    age(s.root / young, 2 * 3600)
    assert vacuum(s.table, retention_hours=1).deleted == [young]
    assert s.files() == kept | {hidden}
    s.check(rows)


def test_files_another_engine_removed_go_only_once_the_removal_is_older_than_the_retention(tmp_path: Path) -> None:
    s = Scene(tmp_path)
    first = DeltaTable(str(s.root)).version()
    DeltaTable(str(s.root)).optimize.compact()  # a nightly OPTIMIZE by delta-rs: every dbidx file replaced
    DeltaTable(str(s.root)).delete("v = 103")  # a GDPR delete: copy-on-write of one compacted file
    last = DeltaTable(str(s.root)).version()
    rows = s.rows()
    assert len(rows) == 11
    removed = set().union(*(removed_in(s.root, v) for v in range(first + 1, last + 1)))
    live = {
        unquote(str(p))
        for p in pa.table(DeltaTable(str(s.root)).get_add_actions(flatten=True)).column("path").to_pylist()
    }
    on_storage = removed & s.files()
    assert (
        on_storage and any(p.startswith(f"dt={SPACED}/") for p in on_storage) and any("%" in p for p in on_storage)
    )  # delta-rs's own files live under escaped partition directories
    age_everything(s.root, 10 * DAY_S)  # the files are old, but they left the log moments ago
    report = vacuum(s.table, retention_hours=24)
    assert report.deleted == [] and report.protected == []  # delta-rs does not even name them
    assert on_storage <= s.files()
    for version in range(first + 1, last + 1):
        age_removals(s.root, version, 2 * DAY_S)  # two days have passed since
    dry = vacuum(s.table, retention_hours=72, dry_run=True)
    assert dry.deleted == [] and on_storage <= s.files()  # a 3-day retention keeps them another day
    touched = sorted(on_storage)[0]
    age(s.root / touched, 3600)  # modified an hour ago (a store's clock, a copy): kept whatever the log says
    report = vacuum(s.table, retention_hours=24)
    assert sorted(report.deleted) == sorted(on_storage - {touched})
    assert [p["path"] for p in report.protected] == [touched] and "modified" in report.protected[0]["reason"]
    age(s.root / touched, 2 * DAY_S)
    assert vacuum(s.table, retention_hours=24).deleted == [touched]
    assert not on_storage & s.files() and live <= s.files()
    s.check(rows)
    assert vacuum(s.table, retention_hours=24).deleted == []  # delta-rs still names them (gone): nothing to do


def test_replaced_files_dv_files_and_metadata_are_kept_even_when_aged(tmp_path: Path) -> None:
    s = Scene(tmp_path)
    s.upsert([(f"k{i}", PLAIN, 200 + i) for i in range(0, 12, 3)])
    result = s.table.compact_data(min_files=2)
    assert result.files_replaced >= 2
    replaced = [p for p, _ in s.table.data_view().replaced(s.table.timeline.latest_seq)]
    assert replaced
    rows = s.rows()
    age_everything(s.root, 10 * DAY_S)
    age_removals(s.root, s.table.delta_version(), 2 * DAY_S)  # the compaction's removes are two days old
    before = s.files()
    report = vacuum(s.table, retention_hours=24)
    assert report.deleted == []
    assert {p["path"] for p in report.protected} == set(replaced)  # delta-rs named them; the table still does
    assert all("still names it" in p["reason"] for p in report.protected)
    assert s.files() == before
    s.check(rows)
    # Once dbidx's clean has deleted them (its retention, which goes by the completions' times, cut to a
    # millisecond), delta-rs still names them (tombstones): they are simply not there.
    clean_without_waiting(s.table)
    assert s.table.clean(retain_completions=0) is not None
    assert not set(replaced) & s.files()
    listed = DeltaTable(str(s.root)).vacuum(
        retention_hours=24, dry_run=True, enforce_retention_duration=False, full=True
    )
    assert {unquote(p) for p in listed} >= set(replaced)
    after = vacuum(s.table, retention_hours=24)
    assert after.deleted == [] and after.protected == []
    s.check(rows)


def test_another_engines_deletion_vector_file_stays_while_a_version_within_the_retention_needs_it(
    tmp_path: Path,
) -> None:
    s = Scene(tmp_path)
    # A file without a vector yet (polars ignores the vectors of files in escaped partitions: a plain one).
    add = next(
        a["add"]
        for a in reversed(_log(s.root))
        if "add" in a and a["add"]["path"].startswith(f"dt={PLAIN}/") and not a["add"].get("deletionVector")
    )
    _delete_rows(s.root, add, [0], inline=False)  # Spark's DELETE by vector: a DV file at the table root
    dv_file = next(p for p in s.files() if p.startswith("deletion_vector_"))
    rows = s.rows()
    age_everything(s.root, 10 * DAY_S)  # the version naming it is old too: only the live descriptor protects it
    report = vacuum(s.table, retention_hours=24)
    assert report.deleted == [] and [p["path"] for p in report.protected] == [dv_file]
    assert "live data file" in report.protected[0]["reason"]
    # dbidx updates that file's rows: its new vector is inline, and its version's remove names the old DV file.
    ids = pa.parquet.read_table(s.root / unquote(add["path"])).column("id").to_pylist()
    assert len(ids) >= 2
    s.upsert([(ids[1], PLAIN, 999)])  # row 0 is the one the other engine deleted
    rows = s.rows()
    report = vacuum(s.table, retention_hours=24)
    assert report.deleted == [] and "committed within the retention" in report.protected[0]["reason"]
    age_everything(s.root, 2 * DAY_S)
    age_removals(s.root, s.table.delta_version(), 2 * DAY_S)
    report = vacuum(s.table, retention_hours=24)
    assert report.deleted == [dv_file] and dv_file not in s.files()
    s.check(rows)


def test_an_in_flight_instants_announced_files_survive(tmp_path: Path) -> None:
    s = Scene(tmp_path)
    rows = s.rows()
    writer = s.table.new_commit()  # a dbidx writer whose commit is still running (its job took two days)
    rel = f"dt={PLAIN}/00000000-0123456789abcdef01234567_{writer.instant}_0.parquet"
    markers.announce(s.table.io, writer.instant, rel)
    s.orphan(rel, 2 * DAY_S)
    stray = s.orphan(f"dt={PLAIN}/part-stray.parquet", 2 * DAY_S)
    report = vacuum(s.table, retention_hours=24)
    assert report.deleted == [stray]
    assert report.protected == [{"path": rel, "reason": report.protected[0]["reason"]}]
    assert writer.instant in report.protected[0]["reason"]
    assert rel in s.files()
    writer.rollback()
    assert rel not in s.files()
    s.check(rows)


def test_dry_run_deletes_nothing_and_lists_what_the_run_then_deletes(tmp_path: Path) -> None:
    s = Scene(tmp_path)
    orphans = {s.orphan(f"dt={p}/part-{i}.parquet", (10 + i) * DAY_S) for i, p in enumerate((PLAIN, SPACED, ESCAPED))}
    hidden = s.orphan(f"dt={PLAIN}/_started_123", 10 * DAY_S)
    before = s.files()
    dry = vacuum(s.table, retention_hours=24, dry_run=True)
    assert s.files() == before and dry.dry_run
    assert dry.deleted == sorted(orphans, key=lambda p: -int(p.rsplit("-", 1)[1].split(".")[0]))  # oldest first
    real = vacuum(s.table, retention_hours=24)
    assert (real.deleted, real.bytes, real.protected) == (dry.deleted, dry.bytes, dry.protected)
    assert [p["path"] for p in real.protected] == [hidden]
    assert s.files() == before - orphans
    assert set(real.to_dict()) == {"retention_hours", "dry_run", "deleted", "bytes", "protected", "seconds"}


@pytest.mark.parametrize("bad", [0, -5, 1.5, "24", True, None])
def test_the_retention_must_be_a_whole_number_of_hours_of_at_least_one(tmp_path: Path, bad: object) -> None:
    s = Scene(tmp_path)
    orphan = s.orphan(f"dt={PLAIN}/part-old.parquet", 10 * DAY_S)
    with pytest.raises(ConfigError, match="retention_hours") as raised:
        vacuum(s.table, retention_hours=bad)  # type: ignore[arg-type]
    assert repr(bad) in str(raised.value)
    assert orphan in s.files()


def test_a_table_never_written_has_nothing_to_vacuum(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=1)  # delta-rs refuses its log (an empty schema)
    report = vacuum(table, retention_hours=1)
    assert (report.deleted, report.protected, report.dry_run) == ([], [], False)


def test_a_table_delta_rs_cannot_reach_is_refused(tmp_path: Path) -> None:
    table = Table.create("mem/t", num_shards=1, fs=pafs._MockFileSystem())
    with pytest.raises(InvalidInputError, match="delta-rs"):
        vacuum(table)


def test_reads_of_the_latest_version_are_unchanged_by_a_vacuum(tmp_path: Path) -> None:
    """After an OPTIMIZE by another engine, a vacuum with everything aged: dbidx's read and delta-rs's are the rows of
    before, and the index still answers for every key."""
    s = Scene(tmp_path)
    DeltaTable(str(s.root)).optimize.compact()
    before = sorted(read_arrow(Table.open(str(s.root)), columns=list(COLUMNS)).to_pylist(), key=repr)
    age_everything(s.root, 10 * DAY_S)
    age_removals(s.root, DeltaTable(str(s.root)).version(), 2 * DAY_S)
    assert vacuum(s.table, retention_hours=24).deleted
    table = Table.open(str(s.root))
    assert sorted(read_arrow(table, columns=list(COLUMNS)).to_pylist(), key=repr) == before
    assert sorted(via_deltalake(str(s.root), COLUMNS)) == sorted((r["id"], r["dt"], r["v"]) for r in before)
    s.upsert([("k3", PLAIN, 7), ("new", PLAIN, 8)])  # the index still finds every key: an update, not a duplicate
    assert len(s.rows()) == len(before) + 1


def test_a_failed_delete_raises_with_the_report_of_what_went_before_it(tmp_path: Path) -> None:
    """A partition directory that is a symlink out of the table: its file is listed (by delta-rs and by dbidx), but
    dbidx's path guard refuses to delete through the link. The file before it in age order is gone, and said so."""
    s = Scene(tmp_path)
    first = s.orphan(f"dt={PLAIN}/part-oldest.parquet", 20 * DAY_S)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "part-x.parquet").write_bytes(b"PAR1junk")
    age(outside / "part-x.parquet", 15 * DAY_S)
    (s.root / "dt=linked").symlink_to(outside, target_is_directory=True)
    last = s.orphan(f"dt={PLAIN}/part-newest.parquet", 10 * DAY_S)
    with pytest.raises(VacuumIncompleteError, match="dt=linked/part-x.parquet") as raised:
        vacuum(s.table, retention_hours=24)
    assert raised.value.report.deleted == [first] and raised.value.exit_code == 5
    assert "deleted 1 files" in str(raised.value) and "the other 2 stay" in str(raised.value)
    assert first not in s.files() and last in s.files() and (outside / "part-x.parquet").exists()
