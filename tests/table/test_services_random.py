"""A randomized sweep of the table services with services ON (table/services.py after each upsert): random upsert
batches (inserts, updates, deletes, re-inserts, late days, moves in global mode) with aggressive settings (data and
index compaction every few files, a clean every 1-3 completions retaining 1-3, a Delta checkpoint every 2-3
versions, a one-hour log and deleted-file retention, a vacuum due at every step), interleaved with another engine's
commits on the same table (delta-rs append of new keys, OPTIMIZE compact, DELETE, ALTER TABLE SET TBLPROPERTIES),
fresh `Table.open`s and cold or stale caches. Time moves on by a virtual clock: before each step every file of the
Delta log and every data file is aged with os.utime as if written when it first appeared (20 virtual minutes a
step), so log cleanup really deletes versions and vacuum really deletes files.

After every step dbidx reads exactly what an independent oracle expects and no service reported an error or
yielded; every few steps delta-rs, polars and DuckDB agree, `verify_table` finds no damage, and time travel (dbidx,
delta-rs, polars) to each version that every retention must still keep (at or above the newest checkpoint older
than the log retention, committed within the deleted-file retention, and newer than the clean's horizon) returns
that version's rows.

DBIDX_RANDOM_ROUNDS=N runs N seeds (default 3), DBIDX_RANDOM_STEPS=M steps per seed (default 24),
DBIDX_RANDOM_SEED=S the first seed (default 20260400)."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake

from dbidx.config import CacheConfig
from dbidx.data import reads
from dbidx.data.delta_log import DELTA_LOG_DIR, listed_versions, version_file
from dbidx.data.log_retention import complete_checkpoints
from dbidx.table.service_settings import write_settings
from dbidx.table.services import VACUUM_STATE_FILE
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table
from dbidx.spark_integration.local import upsert_arrow

from tests.delta_readers import assert_readers_agree, via_deltalake, via_polars
from tests.spark_helpers import Oracle, random_batch

COLUMNS = ("id", "dt", "v")
ROUNDS = int(os.environ.get("DBIDX_RANDOM_ROUNDS", "3"))
STEPS = int(os.environ.get("DBIDX_RANDOM_STEPS", "24"))
SEED_BASE = int(os.environ.get("DBIDX_RANDOM_SEED", "20260400"))
STEP_MINUTES = 20  # virtual time per step
FULL_CHECK_EVERY = 4


def as_arrow(batch: list[tuple]) -> pa.Table:
    ids, days, values, deletes = zip(*batch)
    return pa.table(
        {"id": list(ids), "dt": list(days), "v": pa.array(values, pa.int64()), "_dbidx_delete": list(deletes)}
    )


def layout_dir(day: str) -> str:
    return f"dt={day}"


def rows_of(table: pa.Table) -> list[tuple]:
    return list(zip(*(table.column(c).to_pylist() for c in COLUMNS)))


class Sweep:
    """One seed's table, its oracle, its virtual clock and the rows of each recent Delta version."""

    def __init__(self, tmp_path: Path, seed: int) -> None:
        self.rng = rng = random.Random(seed)
        self.seed, self.tmp = seed, tmp_path
        self.global_mode = rng.random() < 0.3
        self.table = Table.create(
            str(tmp_path / "t"),
            num_shards=rng.choice([1, 2]),
            global_index=self.global_mode,
            checkpoint_interval=rng.choice([0, 3, 7]),
        )
        self.path = self.table.io.path("")
        self.retain = rng.randint(1, 3)
        self.settings = dict(
            data_min_small_files=rng.randint(2, 4),
            index_min_files=rng.randint(2, 4),
            clean_retain_completions=self.retain,
            clean_interval=rng.randint(1, 3),
            vacuum_interval_hours=0.001,
        )
        write_settings(self.table.io, self.settings)
        self.log_minutes, self.file_minutes = rng.choice([60, 120]), rng.choice([60, 120])
        self.retentions = {
            "delta.logRetentionDuration": f"interval {self.log_minutes} minutes",
            "delta.deletedFileRetentionDuration": f"interval {self.file_minutes // 60} hours",
        }
        self.table.set_delta_properties({"delta.checkpointInterval": str(rng.randint(2, 3)), **self.retentions})
        self.caches = [CacheConfig(base_path=str(tmp_path / name)) for name in ("cache-a", "cache-b")]
        self.cache = self.caches[0]
        self.oracle, self.serial = Oracle(self.global_mode), [0]
        self.now = 0  # virtual minutes
        self.born: dict[str, int] = {}  # table-relative path -> virtual minute it first appeared
        self.version_born: dict[int, int] = {}  # Delta version -> virtual minute of its commit
        self.snapshots: dict[int, set[tuple]] = {}  # Delta version -> its rows (recent versions only)
        self.last_version = self.delta_version()
        self.trace: list[str] = []
        self.foreign_versions: set[str] = set()  # log files of the other engine's versions
        self.orphans: set[str] = set()  # files a crashed writer left in a partition
        self.foreign_floor = 0  # versions below it may be gone by the other engine's log cleanup
        self.counts: dict[str, int] = {}  # services run and files they deleted; time travels checked
        self.record_versions()

    # ---- bookkeeping ----------------------------------------------------------------------------------------
    def delta_version(self) -> int:
        return max(listed_versions(self.table.io))

    def expected(self) -> set[tuple]:
        return self.oracle.expected_rows()

    def record_versions(self) -> None:
        """The versions committed by the last step all hold the rows after it (services change no row)."""
        latest = self.delta_version()
        for v in range(self.last_version + 1, latest + 1):
            self.snapshots[v] = self.expected()
            self.version_born[v] = self.now
        self.snapshots.setdefault(latest, self.expected())
        self.version_born.setdefault(latest, self.now)
        self.last_version = latest
        for v in [v for v in self.snapshots if v < latest - 12]:
            del self.snapshots[v]

    def age_files(self) -> None:
        """Advance the virtual clock; every Delta log file and data file gets the mtime of its virtual birth."""
        self.now += STEP_MINUTES
        real = time.time()
        root = Path(self.path)
        for file in root.rglob("*"):
            if not file.is_file():
                continue
            rel = file.relative_to(root).as_posix()
            if rel.startswith(".dbidx/"):
                continue
            born = self.born.setdefault(rel, self.now - STEP_MINUTES)
            then = real - (self.now - born) * 60
            if rel in self.foreign_versions:  # its tombstones age with it (Delta's vacuum goes by their time)
                lines = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
                for action in lines:
                    if "remove" in action:
                        action["remove"]["deletionTimestamp"] = int(then * 1000)
                file.write_text("".join(json.dumps(action) + "\n" for action in lines))
            os.utime(file, (then, then))

    # ---- the steps ------------------------------------------------------------------------------------------
    def upsert(self) -> None:
        batch = random_batch(self.rng, self.oracle, self.serial, size=self.rng.randint(5, 30))
        summary = upsert_arrow(as_arrow(batch), self.table, key="id", partition="dt", cache_config=self.cache)
        self.oracle.apply(batch)
        services = summary.services
        assert services is not None, "services are on: the summary must report them"
        assert "error" not in services, f"a service failed after the upsert: {services['error']}"
        assert services["yielded"] == [], f"a service yielded with no other writer: {services['yielded']}"
        for run in services["ran"]:
            self.counts[run["service"]] = self.counts.get(run["service"], 0) + 1
            for what in ("files_deleted",):
                if run["details"].get(what):
                    name = f"{run['service']}.{what}"
                    self.counts[name] = self.counts.get(name, 0) + run["details"][what]
        self.trace.append(f"upsert {len(batch)} rows, ran {[(r['service'], r['details']) for r in services['ran']]}")

    def live_by_day(self) -> dict[str, list[tuple[str, ...]]]:
        out: dict[str, list[tuple[str, ...]]] = {}
        for ident, (day, _) in sorted(self.oracle.rows.items()):
            out.setdefault(day, []).append(ident)
        return out

    def foreign_append(self) -> None:
        days = sorted(self.live_by_day())
        if not days:
            return self.upsert()
        day = self.rng.choice(days)
        rows = []
        for _ in range(self.rng.randint(1, 4)):
            self.serial[0] += 1
            rows.append((f"foreign-{self.serial[0]:06d}", day, self.rng.randrange(1_000_000)))
        write_deltalake(
            self.path,
            pa.table(
                {
                    "id": [r[0] for r in rows],
                    "dt": [r[1] for r in rows],
                    "v": pa.array([r[2] for r in rows], pa.int64()),
                }
            ),
            partition_by=["dt"],
            mode="append",
        )
        self.oracle.apply([(k, d, v, False) for k, d, v in rows])
        self.trace.append(f"delta-rs append {rows}")

    def foreign_compact(self) -> None:
        DeltaTable(self.path).optimize.compact()
        self.trace.append("delta-rs optimize.compact")

    def foreign_delete(self) -> None:
        live = sorted(self.oracle.rows)
        if not live:
            return self.upsert()
        gone = self.rng.sample(live, min(len(live), self.rng.randint(1, 3)))
        terms = []
        for ident in gone:
            day = self.oracle.rows[ident][0]
            terms.append(f"(id = '{ident[-1]}' and dt = '{day}')")
        DeltaTable(self.path).delete(" or ".join(terms))
        self.oracle.apply([(ident[-1], self.oracle.rows[ident][0], 0, True) for ident in gone])
        self.trace.append(f"delta-rs delete {' or '.join(terms)}")

    def foreign_properties(self) -> None:
        changes = self.rng.choice([{"delta.checkpointInterval": str(self.rng.randint(2, 3))}, dict(self.retentions)])
        DeltaTable(self.path).alter.set_table_properties(changes)
        self.trace.append(f"delta-rs set_table_properties {changes}")

    def foreign_committed(self) -> None:
        # delta-rs's post-commit log cleanup expires, by the same aged mtimes, everything below its newest checkpoint
        # (more than Delta's rule keeps): time travel below that is delta-rs's loss, not dbidx's.
        self.foreign_floor = max(
            self.foreign_floor, max(complete_checkpoints(self.table.io.list_entries(DELTA_LOG_DIR)), default=0)
        )
        latest = self.delta_version()
        self.foreign_versions.update(version_file(v) for v in range(self.last_version + 1, latest + 1))

    def orphan(self) -> None:
        days = sorted(self.live_by_day())
        if days:
            rel = f"{layout_dir(self.rng.choice(days))}/part-00000-orphan-{len(self.orphans)}.parquet"
            pq.write_table(pa.table({"id": ["orphan"], "v": pa.array([1], pa.int64())}), Path(self.path, rel))
            self.orphans.add(rel)
            self.trace.append(f"orphan {rel}")

    def own_properties(self) -> None:
        changes = {"delta.checkpointInterval": str(self.rng.randint(2, 3))}
        self.table.set_delta_properties(changes)
        self.trace.append(f"dbidx set_delta_properties {changes}")

    def step(self) -> None:
        self.age_files()
        roll = self.rng.random()
        if self.rng.random() < 0.25:
            self.table = Table.open(self.path)  # a new process's view
            self.trace.append("reopen")
        if self.rng.random() < 0.2:
            self.cache = self.caches[1] if self.cache is self.caches[0] else self.caches[0]  # stale or cold
            self.trace.append(f"cache {self.cache.base_path}")
        if self.rng.random() < 0.1:
            self.cache = CacheConfig(base_path=str(self.tmp / f"cache-cold-{len(self.trace)}"))
            self.trace.append("cold cache")
        if self.rng.random() < 0.5:
            self.table.io.delete(VACUUM_STATE_FILE)  # a vacuum due now
        if self.rng.random() < 0.1:
            self.orphan()
        if roll < 0.6 or self.last_version < 2:  # the other engines need a schema: a first upsert
            self.upsert()
        elif roll < 0.95:
            if roll < 0.72:
                self.foreign_append()
            elif roll < 0.82:
                self.foreign_delete()
            elif roll < 0.9:
                self.foreign_compact()
            else:
                self.foreign_properties()
            if self.trace[-1].startswith("delta-rs"):  # not a first upsert instead
                self.foreign_committed()
        else:
            self.own_properties()
        self.record_versions()

    # ---- the checks -----------------------------------------------------------------------------------------
    def quick_check(self) -> None:
        got = rows_of(reads.read_arrow(self.table, columns=list(COLUMNS)))
        assert sorted(got) == sorted(self.expected()), "dbidx reads other rows than the oracle"
        idents = [(r[0],) if self.global_mode else (r[1], r[0]) for r in got]
        assert len(idents) == len(set(idents)), "a record is live twice"

    def full_check(self) -> None:
        fresh = Table.open(self.path)
        assert_readers_agree(fresh, COLUMNS, self.expected())
        report = verify_table(Table.open(self.path))
        assert report.damaged == [], report.damaged
        self.time_travel()

    def log_floor(self) -> int:
        """The newest checkpoint older than the log retention: log cleanup must keep every version from it on."""
        real = time.time()
        old = [
            int(f.name.split(".")[0])
            for f in Path(self.path, DELTA_LOG_DIR).glob("*.checkpoint*.parquet")
            if f.stat().st_mtime <= real - self.log_minutes * 60
        ]
        return max(old, default=0)

    def time_travel(self) -> None:
        latest = self.delta_version()
        floor = max(self.log_floor(), latest - self.retain, self.foreign_floor)
        for version in sorted(self.snapshots):
            if version < floor or version >= latest or self.now - self.version_born[version] >= self.file_minutes:
                continue
            expected = sorted(self.snapshots[version])
            assert sorted(via_deltalake(self.path, COLUMNS, version)) == expected, f"delta-rs at version {version}"
            assert sorted(via_polars(self.path, COLUMNS, version)) == expected, f"polars at version {version}"
            got = rows_of(reads.read_arrow(Table.open(self.path), columns=list(COLUMNS), version=version))
            assert sorted(got) == expected, f"dbidx at version {version}"
            self.counts["time_travel"] = self.counts.get("time_travel", 0) + 1


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(ROUNDS))
def test_services_on_random_batches_and_other_engines(tmp_path: Path, seed: int, services_on: None) -> None:
    sweep = Sweep(tmp_path, SEED_BASE + seed)
    try:
        for n in range(1, STEPS + 1):
            sweep.step()
            sweep.quick_check()
            if n % FULL_CHECK_EVERY == 0 or n == STEPS:
                sweep.full_check()
        sweep.counts["orphans_left"] = sum(Path(sweep.path, rel).exists() for rel in sweep.orphans)
        sweep.counts["orphans"] = len(sweep.orphans)
        print(f"seed {SEED_BASE + seed}: {sweep.counts}")
    except BaseException:
        print(f"seed {SEED_BASE + seed} global={sweep.global_mode} settings={sweep.settings} {sweep.retentions}")
        print("\n".join(f"  {i}: {t}" for i, t in enumerate(sweep.trace)))
        raise


def _upserts_with_an_aged_log(tmp_path: Path, checkpoint_interval: int, batches: int = 25) -> Table:
    """`batches` one-row upserts with services on (only log cleanup), every log file aged past a one-hour
    delta.logRetentionDuration before each; default delta.checkpointInterval (10)."""
    table = Table.create(str(tmp_path / "t"), num_shards=1, checkpoint_interval=checkpoint_interval)
    write_settings(table.io, dict(data_compaction=False, index_compaction=False, clean=False, vacuum=False))
    table.set_delta_properties({"delta.logRetentionDuration": "interval 1 hours"})
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    log = Path(table.io.path(DELTA_LOG_DIR))
    for i in range(batches):
        then = time.time() - 3 * 3600
        for file in log.iterdir():
            os.utime(file, (then, then))
        upsert_arrow(
            pa.table({"id": [f"k{i}"], "dt": ["d1"], "v": pa.array([i], pa.int64())}),
            table,
            key="id",
            partition="dt",
            cache_config=config,
        )
    return table


def test_log_cleanup_expires_the_log_with_the_default_checkpoint_interval(tmp_path: Path, services_on: None) -> None:
    table = _upserts_with_an_aged_log(tmp_path, checkpoint_interval=100)
    assert 0 not in listed_versions(table.io)  # every version below a checkpoint older than an hour is gone


def test_log_cleanup_expires_the_log_when_others_write_the_checkpoints(tmp_path: Path, services_on: None) -> None:
    # The publisher writes a Delta checkpoint every 10 completions, so the service never has one due: it still
    # expires the log below each new one (found by the random sweep: the log grew for ever).
    table = _upserts_with_an_aged_log(tmp_path, checkpoint_interval=10)
    assert 0 not in listed_versions(table.io), (
        f"{len(listed_versions(table.io))} versions kept, all older than the retention, newest checkpoint at "
        f"{max(complete_checkpoints(table.io.list_entries(DELTA_LOG_DIR)))}"
    )
