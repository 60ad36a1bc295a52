"""Other engines write to a dbidx table: every kind of commit delta-rs and polars make is absorbed into the index
(docs/FORMAT.md section 12c), and dbidx's next upserts (which update keys in the files the other engine touched)
leave exactly the rows an independent model expects, the same in dbidx, deltalake's QueryBuilder, polars and
DuckDB, with no key live twice and no update lost."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Callable

import polars as pl
import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from dbidx.config import CacheConfig
from dbidx.data import delta_log, reads
from dbidx.errors import ConflictError, DeltaFeatureError, ForeignDuplicateError
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table
from dbidx.spark_integration.local import upsert_arrow

from tests.data.test_delta_adopt import _delete_rows, _log
from tests.delta_readers import assert_readers_agree
from tests.retention import clean_without_waiting

COLUMNS = ("id", "dt", "v")
DAYS = ("d1", "d2", "d3")
Model = dict[tuple[str, str], int]  # (dt, id) -> v


def rows_of(model: Model) -> set[tuple]:
    return {(i, d, v) for (d, i), v in model.items()}


def arrow(rows: list[tuple[str, str, int]], deletes: list[bool] | None = None) -> pa.Table:
    ids, days, values = (list(c) for c in zip(*rows)) if rows else ([], [], [])
    data = {"id": ids, "dt": days, "v": pa.array(values, pa.int64())}
    if deletes is not None:
        data["_dbidx_delete"] = deletes
    return pa.table(data)


class Writer:
    """A dbidx table with history, its model, and one dbidx upsert at a time."""

    def __init__(self, tmp_path: Path, global_index: bool = False) -> None:
        self.table = Table.create(str(tmp_path / "t"), num_shards=2, global_index=global_index)
        self.path = self.table.io.path("")
        self.config = CacheConfig(base_path=str(tmp_path / "cache"))
        self.model: Model = {}
        self.rng = random.Random(42)
        for batch in range(3):  # history: inserts, then updates and a delete (deletion vectors in the log)
            rows = [(f"k{i}", DAYS[i % 3], batch * 100 + i) for i in range(batch * 4, batch * 4 + 12)]
            self.upsert(rows)
        self.upsert([("k0", "d1", 0)], deletes=[True])

    @classmethod
    def over(cls, path: str, cache: Path, model: Model) -> "Writer":
        """The same helpers over a table that exists already (one dbidx adopted), its model given."""
        w = cls.__new__(cls)
        w.table, w.path, w.model = Table.open(path), path, dict(model)
        w.config, w.rng = CacheConfig(base_path=str(cache)), random.Random(42)
        return w

    def copy_to(self, tmp_path: Path) -> "Writer":
        """A copy of this table's directory (its history: upserts with a delete), with its own cache and model."""
        import shutil

        shutil.copytree(Path(self.path).parent, tmp_path, dirs_exist_ok=True)
        return Writer.over(str(tmp_path / "t"), tmp_path / "cache-copy", self.model)

    def upsert(
        self, rows: list[tuple[str, str, int]], deletes: list[bool] | None = None, table: Table | None = None
    ) -> None:
        deletes = deletes or [False] * len(rows)
        upsert_arrow(arrow(rows, deletes), table or self.table, key="id", partition="dt", cache_config=self.config)
        for (i, d, v), gone in zip(rows, deletes):
            if gone:
                self.model.pop((d, i), None)
            else:
                self.model[(d, i)] = v

    def touched_update(self, value: int) -> None:
        """dbidx updates every live key (so every file another engine touched), inserts two and deletes one."""
        live = sorted(self.model)
        rows = [(i, d, value + n) for n, (d, i) in enumerate(live[1:])] + [("new1", "d1", value), ("new2", "d3", 1)]
        deletes = [False] * (len(rows) - 0)
        rows.append((live[0][1], live[0][0], 0))
        deletes.append(True)
        self.upsert(rows, deletes, Table.open(self.path))

    def quick_check(self) -> None:
        """dbidx's own read against the model (the full check adds the three Delta readers and verify)."""
        rows = reads.read_arrow(Table.open(self.path), columns=list(COLUMNS))
        got = [(r["id"], r["dt"], r["v"]) for r in rows.to_pylist()]
        assert sorted(got) == sorted(rows_of(self.model)) and len(got) == len(set(got))

    def check(self) -> None:
        table = Table.open(self.path)
        assert set(assert_readers_agree(table, COLUMNS)) == rows_of(self.model)
        ids = [(r[1], r[0]) for r in assert_readers_agree(table, COLUMNS)]
        assert len(ids) == len(set(ids)), "a key is live twice"
        assert verify_table(table).ok


def _append(w: Writer) -> None:
    rows = [(f"a{i}", DAYS[i % 3], 500 + i) for i in range(5)]
    write_deltalake(w.path, arrow(rows), partition_by=["dt"], mode="append")
    w.model.update({(d, i): v for i, d, v in rows})


def _polars_append(w: Writer) -> None:
    rows = [(f"p{i}", DAYS[i % 3], 600 + i) for i in range(4)]
    pl.from_arrow(arrow(rows)).write_delta(w.path, mode="append")
    w.model.update({(d, i): v for i, d, v in rows})


def _overwrite(w: Writer) -> None:
    rows = [(f"k{i}", DAYS[i % 3], 700 + i) for i in range(3, 9)] + [("o1", "d2", 1)]
    write_deltalake(w.path, arrow(rows), partition_by=["dt"], mode="overwrite")
    w.model = {(d, i): v for i, d, v in rows}


def _delete(w: Writer) -> None:
    DeltaTable(w.path).delete("v >= 210")
    w.model = {k: v for k, v in w.model.items() if v < 210}


def _update(w: Writer) -> None:
    DeltaTable(w.path).update(predicate="dt = 'd2'", updates={"v": "v + 1000"})
    w.model = {k: (v + 1000 if k[0] == "d2" else v) for k, v in w.model.items()}


def _merge(w: Writer) -> None:
    source = arrow([("k5", "d3", 55), ("k7", "d2", 77), ("m1", "d1", 1)])
    (
        DeltaTable(w.path)
        .merge(source, predicate="t.id = s.id and t.dt = s.dt", source_alias="s", target_alias="t")
        .when_matched_update_all()
        .when_not_matched_insert_all()
        .execute()
    )
    w.model.update({(d, i): v for i, d, v in zip(*(source.column(c).to_pylist() for c in COLUMNS))})


def _compact(w: Writer) -> None:
    DeltaTable(w.path).optimize.compact()


def _z_order(w: Writer) -> None:
    DeltaTable(w.path).optimize.z_order(["id"])


def _vacuum(w: Writer) -> None:
    DeltaTable(w.path).optimize.compact()
    DeltaTable(w.path).vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)


def _checkpoint(w: Writer) -> None:
    DeltaTable(w.path).create_checkpoint()


def _cleanup_metadata(w: Writer) -> None:
    table = DeltaTable(w.path)
    table.alter.set_table_properties({"delta.logRetentionDuration": "interval 0 seconds"})
    DeltaTable(w.path).create_checkpoint()
    DeltaTable(w.path).cleanup_metadata()


def _dv_delete(w: Writer) -> None:
    """A Spark/Databricks DELETE by deletion vector (written by hand: delta-rs writes none)."""
    adds = {}
    for action in _log(Path(w.path)):
        if "add" in action:
            adds[action["add"]["path"]] = action["add"]
        if "remove" in action:
            adds.pop(action["remove"]["path"], None)
    live = DeltaTable(w.path).file_uris()
    plain = [a for p, a in sorted(adds.items()) if "deletionVector" not in a and any(u.endswith(p) for u in live)]
    target = plain[0]
    ids = pl.read_parquet(Path(w.path) / target["path"]).get_column("id").to_list()
    _delete_rows(Path(w.path), target, [0], inline=True)
    day = target["partitionValues"]["dt"]
    w.model.pop((day, ids[0]), None)


OPERATIONS: dict[str, Callable[[Writer], None]] = {
    "append": _append,
    "polars-append": _polars_append,
    "overwrite": _overwrite,
    "delete": _delete,
    "update": _update,
    "merge": _merge,
    "optimize-compact": _compact,
    "z-order": _z_order,
    "vacuum": _vacuum,
    "checkpoint": _checkpoint,
    "cleanup-metadata": _cleanup_metadata,
    "dv-delete": _dv_delete,
}


@pytest.mark.parametrize("name", sorted(OPERATIONS))
def test_another_engines_commit_is_absorbed_and_dbidx_writes_on(tmp_path: Path, name: str) -> None:
    w = Writer(tmp_path)
    OPERATIONS[name](w)
    w.quick_check()  # dbidx reads the other engine's version (absorbed on read)
    w.touched_update(2000)
    w.quick_check()
    w.touched_update(3000)  # and once more, from files dbidx itself wrote over the absorbed ones
    w.check()


def test_a_run_of_mixed_operations_matches_the_model(tmp_path: Path) -> None:
    """Several engines' commits in a row, then dbidx, then more: absorbed one version at a time."""
    w = Writer(tmp_path)
    for name in ("append", "optimize-compact", "update", "vacuum", "merge", "polars-append", "delete"):
        OPERATIONS[name](w)
    w.touched_update(5000)
    for name in ("z-order", "dv-delete", "append"):
        OPERATIONS[name](w)
    w.touched_update(6000)
    w.check()
    table = Table.open(w.path)
    table.refresh()
    actions = [r.action for r in table.timeline.completed()]
    assert actions.count("absorb") >= 10


def test_global_index_absorbs_a_rewrite(tmp_path: Path) -> None:
    w = Writer(tmp_path, global_index=True)
    _compact(w)
    _update(w)
    w.touched_update(2000)
    w.check()


def test_a_blind_append_of_a_live_key_is_refused_by_name_and_nothing_is_absorbed(tmp_path: Path) -> None:
    w = Writer(tmp_path)
    write_deltalake(w.path, arrow([("k5", "d3", 1), ("fresh", "d1", 2)]), partition_by=["dt"], mode="append")
    latest = Table.open(w.path)
    latest.refresh()
    before = latest.timeline.latest_seq
    with pytest.raises(ForeignDuplicateError, match=r"WRITE by delta-rs.*'k5'.*--readopt") as caught:
        w.upsert([("k1", "d2", 9)])
    assert "part-" in str(caught.value)
    again = Table.open(w.path)
    again.refresh()
    assert again.timeline.latest_seq == before  # nothing absorbed, nothing published
    assert not verify_table(again).ok
    # The remedy the error names: the repeated row removed with the engine that wrote it; dbidx then absorbs the
    # append and the delete together (their net effect repeats no key) and writes on.
    DeltaTable(w.path).delete("id = 'k5' and v = 1")
    w.model[("d1", "fresh")] = 2
    w.upsert([("k1", "d2", 9)])
    w.check()


def test_a_duplicate_then_readopt_rebuilds_the_index_from_the_current_snapshot(tmp_path: Path) -> None:
    """The other remedy: fix the data with the other engine, then re-adopt (CLI), keeping shards and data."""
    from click.testing import CliRunner

    from dbidx.cli import main

    w = Writer(tmp_path)
    write_deltalake(w.path, arrow([("k5", "d3", 1)]), partition_by=["dt"], mode="append")
    DeltaTable(w.path).delete("id = 'k5' and v <> 1")  # keep the appended row (the other engine's choice)
    w.model[("d3", "k5")] = 1
    result = CliRunner().invoke(main, ["build-index", w.path, "--key", "id", "--readopt", "--json"])
    assert result.exit_code == 0, result.output
    moved = json.loads(result.output)["old_index_moved_to"]
    assert moved.startswith(".dbidx-replaced-") and Path(w.path, moved, "table.json").exists()
    table = Table.open(w.path)
    assert table.num_shards == 2
    w.check()
    w.touched_update(40)
    w.check()


def test_a_changed_partitioning_is_refused_by_name_and_readopt_takes_it(tmp_path: Path) -> None:
    from dbidx.table.readopt import readopt

    w = Writer(tmp_path)
    rows = arrow([("x", "d1", 1), ("y", "d2", 2)])
    write_deltalake(w.path, rows, mode="overwrite", schema_mode="overwrite", partition_by=[])
    with pytest.raises(DeltaFeatureError, match="partition columns"):
        w.upsert([("k1", "d2", 9)])
    done = readopt(w.path, "id")
    assert done.build.keys == 2
    table = Table.open(w.path)
    assert set(assert_readers_agree(table, COLUMNS)) == {("x", "d1", 1), ("y", "d2", 2)}
    assert table.lookup(["x", "k1"], "").column("key").to_pylist() == ["x"]


def test_an_update_racing_another_engines_rewrite_of_its_keys_conflicts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OPTIMIZE lands while dbidx's tasks run and re-points the keys the batch updates: the batch's rows were
    written against the old file groups, so it conflicts with nothing published; a retry succeeds."""
    from dbidx.spark_integration import task

    w = Writer(tmp_path)
    real = task.upsert_batches
    fired: list[bool] = []

    def tasks_then_optimize(*args, **kwargs):
        result = real(*args, **kwargs)
        if not fired:
            fired.append(True)
            _compact(w)
        return result

    monkeypatch.setattr(task, "upsert_batches", tasks_then_optimize)
    versions = delta_log.listed_versions(w.table.io)
    with pytest.raises(ConflictError, match="conflicts"):
        w.upsert([("k5", "d3", 1)], table=Table.open(w.path))
    # The OPTIMIZE's version, then the rollback's (commitInfo only): the batch added no row.
    assert delta_log.listed_versions(w.table.io) == versions + [versions[-1] + 1, versions[-1] + 2]
    w.check()
    w.upsert([("k5", "d3", 1)], table=Table.open(w.path))
    w.check()


def test_a_commit_staged_by_a_writer_that_died_is_published_by_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer put its Delta version (the commit point) and died before publishing its record: the next reader
    publishes the record from the staged copy, so dbidx and the Delta readers never disagree for long."""
    from dbidx.storage import timeline as timeline_module

    w = Writer(tmp_path)
    real = timeline_module.Timeline._after_publish
    original_create = w.table.io.create_exclusive

    class Died(BaseException):  # like the process's end: nothing catches it
        pass

    def create(rel: str, data: bytes) -> bool:
        if rel.startswith(".dbidx/timeline/completed/"):
            raise Died()
        return original_create(rel, data)

    table = Table.open(w.path)
    monkeypatch.setattr(table.io, "create_exclusive", create)
    with pytest.raises(Died):
        upsert_arrow(arrow([("k5", "d3", 1)], [False]), table, key="id", partition="dt", cache_config=w.config)
    monkeypatch.undo()
    del real
    staged = list(Path(w.path, ".dbidx/timeline/staged").glob("*.json"))
    assert len(staged) == 1
    w.model[("d3", "k5")] = 1  # its Delta version is the table's now
    w.check()
    assert not list(Path(w.path, ".dbidx/timeline/staged").glob("*.json"))
    w.touched_update(100)
    w.check()


def test_the_version_of_an_absorbed_record_is_never_written_by_dbidx(tmp_path: Path) -> None:
    w = Writer(tmp_path)
    _append(w)
    Table.open(w.path).follow_delta_log()
    log = Path(w.path, "_delta_log")
    newest = max(delta_log.listed_versions(w.table.io))
    first = json.loads((log / f"{newest:020d}.json").read_text().splitlines()[0])
    assert first["commitInfo"].get("engineInfo", "").startswith("delta-rs")
    fresh = Table.open(w.path)
    assert fresh.sync_delta_log() == 0


def test_a_data_compaction_racing_another_engines_optimize_conflicts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dbidx's data compaction and another engine's OPTIMIZE rewrite the same files: the one that commits second
    (dbidx here) publishes nothing and says so; the table stays whole and a second run compacts what is left."""
    from dbidx.data import compaction

    w = Writer(tmp_path)
    real = compaction.rewrite_file_group
    fired: list[bool] = []
    first = threading.Lock()  # the pieces run on threads: exactly one of them runs the OPTIMIZE

    def base_then_optimize(*args, **kwargs):
        with first:
            if not fired:
                fired.append(True)
                _compact(w)
        return real(*args, **kwargs)

    monkeypatch.setattr(compaction, "rewrite_file_group", base_then_optimize)
    with pytest.raises(ConflictError, match="another engine"):
        Table.open(w.path).compact_data(min_files=1, target_file_bytes=1 << 30)
    monkeypatch.undo()
    w.check()
    Table.open(w.path).compact_data(min_files=2)
    w.touched_update(10)
    w.check()


def test_a_long_lived_writer_beside_another_process_compactions_and_cleans(tmp_path: Path) -> None:
    """A streaming writer keeps one Table open while another process compacts the data and cleans: the writer cannot
    derive the versions whose DV files the clean removed, and needs not (they are on storage); it keeps writing."""
    w = Writer(tmp_path)
    streaming = Table.open(w.path)
    w.upsert([("k1", "d2", 1)], table=streaming)
    other = Table.open(w.path)
    clean_without_waiting(other)
    w.upsert([("k2", "d3", 2), ("k4", "d2", 4)], table=other)
    other.compact_data(min_files=1, target_file_bytes=1 << 30, deleted_share=0.01)
    assert other.clean(retain_completions=0) is not None
    for i in range(3):
        w.upsert([("k1", "d2", 10 + i), (f"s{i}", "d1", i)], table=streaming)
    w.check()


def test_staged_records_of_settled_instants_are_swept_and_pending_ones_kept(tmp_path: Path) -> None:
    w = Writer(tmp_path)
    table = Table.open(w.path)
    staged = Path(w.path, ".dbidx/timeline/staged")
    done = table.latest()
    assert done is not None
    staged.mkdir(parents=True, exist_ok=True)
    (staged / f"{done.instant}.json").write_bytes(done.to_json())  # its writer died after publishing
    pending = table.timeline.start("commit")
    (staged / f"{pending.instant}.json").write_bytes(b"{}")  # a live writer between staging and its put
    report = table.sweep_leftovers()
    assert f".dbidx/timeline/staged/{done.instant}.json" in report.timeline_files
    assert sorted(p.name for p in staged.iterdir()) == [f"{pending.instant}.json"]
    table.rollback(pending.instant)  # once rolled back, its staged copy goes with its claim
    assert not list(staged.iterdir())
    w.check()


def test_verify_compares_the_index_with_the_delta_log(tmp_path: Path) -> None:
    """A Delta log edited behind dbidx's back (an `add` dropped from its newest version) is reported by verify."""
    w = Writer(tmp_path)
    _append(w)
    assert verify_table(Table.open(w.path)).ok
    newest = max(delta_log.listed_versions(w.table.io))
    path = Path(w.path, "_delta_log", f"{newest:020d}.json")
    lines = path.read_text().splitlines()
    dropped = next(json.loads(line)["add"]["path"] for line in lines if '"add"' in line)
    path.write_text("\n".join(line for line in lines if dropped not in line) + "\n")
    check = verify_table(Table.open(w.path))
    assert not check.ok
    assert any(d["path"] == dropped and "the Delta log does not" in d["problem"] for d in check.damaged)


@pytest.mark.spark
def test_spark_upsert_and_read_table_after_other_engines_commits(tmp_path: Path, spark) -> None:
    """The Spark path: an upsert absorbs an append and an OPTIMIZE first (on the driver), its tasks catch their caches
    up from the absorb records, and read_table reads the latest Delta version."""
    from dbidx.spark_integration.api import upsert
    from dbidx.spark_integration.reads import read_table

    w = Writer(tmp_path)
    _append(w)
    _compact(w)
    rows = [("a1", "d2", 1), ("k3", "d1", 33), ("k7", "d2", 77), ("s1", "d3", 5)]
    df = spark.createDataFrame(arrow(rows).to_pandas())
    upsert(df, Table.open(w.path), key="id", partition="dt", cache_config=w.config)
    w.model.update({(d, i): v for i, d, v in rows})
    w.check()
    _update(w)
    got = {(r.id, r.dt, r.v) for r in read_table(spark, Table.open(w.path)).select("id", "dt", "v").collect()}
    assert got == rows_of(w.model)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_a_random_interleaving_of_dbidx_upserts_and_other_engines_matches_the_model(tmp_path: Path, seed: int) -> None:
    """dbidx upserts (updates of random live keys, new keys, deletes) and other engines' operations in a random
    order; the readers equal the model after every dbidx write."""
    rng = random.Random(seed)
    w = Writer(tmp_path)
    names = sorted(set(OPERATIONS) - {"overwrite"})
    serial = 0
    for step in range(12):
        if rng.random() < 0.5:
            OPERATIONS[rng.choice(names)](w)
            continue
        live = sorted(w.model)
        picked = rng.sample(live, min(len(live), 4))
        serial += 1
        rows = [(i, d, 10_000 * seed + 100 * step + n) for n, (d, i) in enumerate(picked)]
        rows.append((f"r{seed}-{serial}", rng.choice(DAYS), step))
        deletes = [False] * len(rows)
        if len(picked) > 2:
            deletes[0] = True
        w.upsert(rows, deletes, Table.open(w.path))
        w.quick_check()
    w.touched_update(99_000)
    w.check()


def test_versions_a_log_cleanup_expired_before_dbidx_absorbed_them(tmp_path: Path) -> None:
    """Another engine commits, checkpoints and cleans the log up (retention 0) twice before dbidx looks: the JSON of
    the versions dbidx has not absorbed is gone, so they are absorbed from the checkpoint's snapshot, and dbidx never
    puts a version below the checkpoint (Delta readers would never see it)."""
    w = Writer(tmp_path)
    _append(w)
    _cleanup_metadata(w)
    _compact(w)
    _cleanup_metadata(w)
    w.touched_update(70)
    w.check()
    table = Table.open(w.path)
    assert DeltaTable(w.path).version() == table.delta_version()
    w.touched_update(80)
    w.check()


def test_a_dead_absorbers_claim_and_files_are_swept_after_an_hour(tmp_path: Path) -> None:
    from dbidx.storage import layout

    w = Writer(tmp_path)
    table = Table.open(w.path)
    claims = [table.timeline.start("absorb", hooks=False) for _ in range(2)]
    for claim in claims:
        rel = layout.delta_file("dt=d1", 0, claim.instant)
        table.timeline.mark_inflight(claim, [rel])
        table.io.write_atomic(rel, b"index file of a dead absorber")
    marker = Path(w.path, layout.requested_file(claims[0].instant))
    data = json.loads(marker.read_text())
    marker.write_text(json.dumps(data | {"started_at_ms": data["started_at_ms"] - 2 * 3600 * 1000}))
    report = table.sweep_leftovers()
    assert layout.delta_file("dt=d1", 0, claims[0].instant) in report.settled_files
    assert not Path(w.path, layout.delta_file("dt=d1", 0, claims[0].instant)).exists()
    assert not marker.exists()
    assert Path(w.path, layout.delta_file("dt=d1", 0, claims[1].instant)).exists()  # an hour not over: kept
    assert table.timeline.pending() == [claims[1].instant]
    w.check()


def test_a_killed_writers_pending_attempt_is_shown_with_its_writer_age_files_and_advice(tmp_path: Path) -> None:
    """kill -9 of a process mid-upsert: `commits`, `stats` and `verify` list the attempt (writer host and pid, gone;
    age; the files it left) and say what to run; `rollback --all-pending` then removes it."""
    import signal
    import subprocess
    import sys
    import textwrap

    from click.testing import CliRunner

    from dbidx.cli import main

    w = Writer(tmp_path)
    child = textwrap.dedent(f"""
        import os, signal
        import pyarrow as pa
        from dbidx.config import CacheConfig
        from dbidx.table.facade import Table
        from dbidx.spark_integration import task
        from dbidx.spark_integration.local import upsert_arrow
        real, calls = task.upsert_batches, []
        def die(*args, **kwargs):
            result = real(*args, **kwargs)
            calls.append(1)
            if len(calls) == 2:  # both shard tasks wrote their files; the driver dies before publishing
                os.kill(os.getpid(), signal.SIGKILL)
            return result
        task.upsert_batches = die
        upsert_arrow(pa.table({{"id": ["k1", "z9"], "dt": ["d2", "d1"], "v": pa.array([5, 6], pa.int64())}}),
                     Table.open({w.path!r}), key="id", partition="dt",
                     cache_config=CacheConfig(base_path={str(tmp_path / "child-cache")!r}))
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    runner = CliRunner()
    for command in ("commits", "stats", "verify"):
        result = runner.invoke(main, [command, w.path, "--json"])
        assert result.exit_code == 0, result.output
        (attempt,) = json.loads(result.output)["pending"]
        assert attempt["action"] == "commit" and attempt["alive"] is False and attempt["age_seconds"] >= 0
        assert attempt["files"] and "dbidx rollback" in attempt["advice"]
    text = runner.invoke(main, ["commits", w.path]).output
    assert "PENDING" in text and "gone" in text
    result = runner.invoke(main, ["rollback", w.path, "--all-pending", "--json"])
    assert json.loads(result.output)["rolled_back"] == [attempt["instant"]]
    assert not any(Path(w.path, f).exists() for f in attempt["files"])
    w.check()
