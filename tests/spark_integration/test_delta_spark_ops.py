"""Delta Lake on Spark's other writes and maintenance on a dbidx table (issue 60, section 2; MERGE, UPDATE, DELETE,
INSERT, OPTIMIZE, Z-order, REORG, checkpoints, ADD COLUMNS, RESTORE and VACUUM are test_delta_spark.py's), each
followed by dbidx upserts over the keys it touched and the readers against a model. What dbidx does with each:

- overwrite with `replaceWhere` (a partition's, a data predicate's): absorbed (the replaced rows' keys leave, the new
  rows are indexed); one that leaves a key live twice (a data predicate that misses the key's old row) is refused by
  name (ForeignDuplicateError), and the remedy it names (delete one of the two rows with that engine) lets dbidx
  absorb both versions and write on;
- auto compaction (`delta.autoOptimize.autoCompact`) and optimized writes (`delta.autoOptimize.optimizeWrite`):
  Delta Spark's write, then its own OPTIMIZE (operationParameters auto=true, dataChange=false, compacting dbidx's
  files too), absorbed as a write and a data-neutral rewrite;
- SET / UNSET TBLPROPERTIES of user properties and of the retention dbidx honours: absorbed, honoured, and carried on
  by dbidx's own later metaData;
- SHALLOW CLONE: the clone's log names the source's files (and, of a table whose vectors are in files, the vectors)
  by absolute path: build-index refuses it by name (DeltaFeatureError); the remedy it names, a copy (CREATE TABLE
  ... AS SELECT), is adopted and written by dbidx while the source writes on;
- a Delta Spark writer in another process committing MERGE and UPDATE while dbidx upserts run: other keys (in the
  same files) land; the same key conflicts with nothing published (ConflictError), and a retry lands.
"""

from __future__ import annotations

import json
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

import pytest

from dbidx.data.deletion_vectors import VECTOR_STORAGE
from dbidx.data.delta_log import listed_versions, version_file
from dbidx.data.delta_retention import retention_of
from dbidx.errors import ConflictError, DeltaFeatureError, ForeignDuplicateError
from dbidx.storage.records import ACTION_ABSORB
from dbidx.table.build_index import build_index
from dbidx.table.facade import Table

from tests.data.test_foreign_writers import Model, Writer, rows_of
from tests.spark_integration.test_delta_spark import _insert, _merge, full_check, spark_rows

pytestmark = [pytest.mark.spark, pytest.mark.delta_tier]  # `make test-delta-spark`

DAY_MS = 24 * 3600 * 1000


def _replace_where(spark, w: Writer, rows: list[tuple[str, str, int]], where: str, replaced: Callable) -> None:
    """Delta Spark's overwrite of the rows matching `where` (`replaced`, the same test on a model row) by `rows`."""
    frame = spark.createDataFrame(rows, "id string, dt string, v long")
    frame.write.format("delta").mode("overwrite").option("replaceWhere", where).save(w.path)
    w.model = {k: v for k, v in w.model.items() if not replaced(k[0], v)}
    w.model.update({(d, i): v for i, d, v in rows})


def _absorbed_operations(w: Writer) -> list[str]:
    table = Table.open(w.path)
    table.refresh()
    return [r.extra["absorbed"]["operation"] for r in table.timeline.completed() if r.action == ACTION_ABSORB]


def test_replace_where_is_absorbed_and_a_key_it_repeats_is_refused_by_name(spark, tmp_path: Path) -> None:
    w = Writer(tmp_path)
    _replace_where(spark, w, [("r1", "d2", 1), ("k1", "d2", 2)], "dt = 'd2'", lambda d, v: d == "d2")
    w.quick_check()  # (Delta Spark's read of the model: full_check at the end; each Spark read costs seconds)
    w.touched_update(100)
    d3 = sorted(i for (d, i), v in w.model.items() if d == "d3" and v >= 110)
    _replace_where(
        spark, w, [(d3[0], "d3", 900), ("r2", "d3", 901)], "dt = 'd3' AND v >= 110", lambda d, v: d == "d3" and v >= 110
    )
    w.quick_check()
    w.touched_update(200)
    assert _absorbed_operations(w) == ["WRITE", "WRITE"]
    # A data predicate that misses a key's live row while the new rows bring the key again: two live rows of it.
    old = w.model[("d1", "new1")]
    frame = spark.createDataFrame([("new1", "d1", 5000)], "id string, dt string, v long")
    frame.write.format("delta").mode("overwrite").option("replaceWhere", "dt = 'd1' AND v >= 5000").save(w.path)
    with pytest.raises(ForeignDuplicateError, match=r"WRITE by Apache-Spark.*'new1'.*--readopt"):
        w.upsert([("k1", "d2", 9)], table=Table.open(w.path))
    # The remedy the error names: the repeated row deleted with the engine that wrote it; both versions absorbed.
    spark.sql(f"DELETE FROM delta.`{w.path}` WHERE id = 'new1' AND v = 5000")
    w.upsert([("k1", "d2", 9)], table=Table.open(w.path))
    assert w.model[("d1", "new1")] == old
    w.touched_update(300)
    full_check(spark, w)


def test_auto_compaction_and_optimized_writes_are_absorbed(spark, tmp_path: Path) -> None:
    """With both on, each small Delta Spark write is a WRITE/MERGE/UPDATE version and then (when its partition has
    enough small files, dbidx's among them) an OPTIMIZE of Delta Spark's own, auto=true, dataChange=false: absorbed
    as a rewrite, and dbidx's upserts over the rewritten keys land."""
    w = Writer(tmp_path)
    spark.sql(
        f"ALTER TABLE delta.`{w.path}` SET TBLPROPERTIES "
        "('delta.autoOptimize.autoCompact' = 'true', 'delta.autoOptimize.optimizeWrite' = 'true')"
    )
    since = max(listed_versions(Table.open(w.path).io))
    for write in (_insert, _merge):  # (MERGE: deletion vectors, which the OPTIMIZE after it purges)
        write(spark, w)
    w.quick_check()
    w.touched_update(100)
    spark.sql(f"INSERT INTO delta.`{w.path}` VALUES ('a3', 'd1', 3)")  # then an OPTIMIZE of dbidx's fresh files
    w.model[("d1", "a3")] = 3
    w.touched_update(200)
    history = spark.sql(f"DESCRIBE HISTORY delta.`{w.path}`").collect()
    ops = {r["version"]: (r["operation"], dict(r["operationParameters"] or {})) for r in history}
    auto = [v for v, (op, params) in ops.items() if v > since and op == "OPTIMIZE" and params.get("auto") == "true"]
    assert auto, ops
    for version in auto:
        lines = Table.open(w.path).io.read_bytes(version_file(version)).decode().splitlines()
        files = [a for a in map(json.loads, lines) if "add" in a or "remove" in a]
        assert files and not any(next(iter(a.values()))["dataChange"] for a in files)
    # Absorbed as a rewrite (the last one compacted dbidx's fresh files). Versions at or below a Delta checkpoint the
    # index has not absorbed yet are absorbed from its snapshot as one run (table/absorb.collect_run).
    table = Table.open(w.path)
    table.refresh()
    records = [r.extra["absorbed"] for r in table.timeline.completed() if r.action == ACTION_ABSORB]
    assert {a["version"]: a["operation"] for a in records}[max(auto)] == "OPTIMIZE"
    full_check(spark, w)


def test_table_properties_that_change_no_writer_duty_are_absorbed_and_carried_on(spark, tmp_path: Path) -> None:
    w = Writer(tmp_path)
    spark.sql(
        f"ALTER TABLE delta.`{w.path}` SET TBLPROPERTIES ('team.owner' = 'ingest', 'team.old' = 'x', "
        "'delta.logRetentionDuration' = 'interval 45 days', 'delta.deletedFileRetentionDuration' = 'interval 3 days',"
        " 'delta.checkpointInterval' = '7')"
    )
    spark.sql(f"ALTER TABLE delta.`{w.path}` UNSET TBLPROPERTIES ('team.old')")
    w.touched_update(100)
    configuration = Table.open(w.path).data_view().configuration()
    assert configuration["team.owner"] == "ingest" and "team.old" not in configuration
    retention = retention_of(configuration)  # what dbidx's clean, log cleanup and checkpoints act on
    assert (retention.log_retention_ms, retention.deleted_file_retention_ms) == (45 * DAY_MS, 3 * DAY_MS)
    assert retention.checkpoint_interval == 7
    # dbidx's own next metaData (a properties change) keeps every property Delta Spark set.
    Table.open(w.path).set_delta_properties({"team.note": "dbidx"})
    newest = max(listed_versions(Table.open(w.path).io))
    lines = Table.open(w.path).io.read_bytes(version_file(newest)).decode().splitlines()
    (meta,) = [a["metaData"] for a in map(json.loads, lines) if "metaData" in a]
    assert {k: meta["configuration"].get(k) for k in ("team.owner", "team.note", "delta.logRetentionDuration")} == {
        "team.owner": "ingest",
        "team.note": "dbidx",
        "delta.logRetentionDuration": "interval 45 days",
    }
    shown = {r["key"]: r["value"] for r in spark.sql(f"SHOW TBLPROPERTIES delta.`{w.path}`").collect()}
    assert shown["team.owner"] == "ingest" and shown["delta.checkpointInterval"] == "7" and "team.old" not in shown
    w.touched_update(200)
    full_check(spark, w)


def _adopted(path: str, model: Model, tmp_path: Path) -> Writer:
    """A Writer over a table build-index just adopted (its model as given)."""
    from dbidx.config import CacheConfig

    w = Writer.__new__(Writer)
    w.table, w.path, w.model = Table.open(path), path, dict(model)
    w.config = CacheConfig(base_path=str(tmp_path / f"cache-{Path(path).name}"))
    return w


def test_a_shallow_clone_is_refused_by_name_and_the_copy_it_names_is_adopted(spark, tmp_path: Path) -> None:
    """Delta Spark's clone lists the source's files by absolute `file:/` path, with the vectors as they were logged:
    inline ones stay inline, file-backed ones (dbidx.deletionVectors.storage=file) become absolute `p` paths into
    the source's `.dbidx/dv`. build-index refuses either by name; the error's own CREATE TABLE ... AS SELECT makes a
    copy dbidx adopts and writes, while the source writes on and the clone still reads the rows it cloned."""
    w = Writer(tmp_path)
    for form in ("inline", "file"):
        if form == "file":
            Table.open(w.path).set_delta_properties({VECTOR_STORAGE: "file"})
            Table.open(w.path).match_vector_storage()
        clone = str(tmp_path / f"clone-{form}")
        spark.sql(f"CREATE TABLE delta.`{clone}` SHALLOW CLONE delta.`{w.path}`")
        lines = Path(clone, version_file(0)).read_text().splitlines()
        adds = [a["add"] for a in map(json.loads, lines) if "add" in a]
        assert {(a.get("deletionVector") or {}).get("storageType") for a in adds} - {None} == {
            "i" if form == "inline" else "p"
        }
        assert all(a["path"].startswith(f"file:{w.path}/") for a in adds)
        with pytest.raises(DeltaFeatureError, match=r"outside its directory \(a shallow clone") as refused:
            build_index(Table.create(clone, num_shards=2), "id")
        assert not list(Path(clone, ".dbidx/timeline/completed").glob("*.json"))
    cloned = dict(w.model)
    w.touched_update(100)  # the source writes on
    assert spark_rows(spark, clone) == rows_of(cloned)
    # The remedy, as the error spells it: a copy of the clone's rows in a table of its own, adopted.
    (sql,) = re.findall(r"CREATE TABLE .* AS SELECT \* FROM delta\.`[^`]+`", str(refused.value))
    copy = str(tmp_path / "copy")
    spark.sql(sql.replace("`NEW`", f"`{copy}`").replace("its partition columns", "dt"))
    build_index(Table.create(copy, num_shards=2), "id")
    c = _adopted(copy, cloned, tmp_path)
    c.touched_update(500)
    w.touched_update(200)
    full_check(spark, c)
    full_check(spark, w)


class SparkProcess:
    """tests/spark_integration/delta_spark_process.py in a subprocess: SQL in, one reply per statement out."""

    def __init__(self, tmp_path: Path, ivy_dir: str) -> None:
        script = Path(__file__).with_name("delta_spark_process.py")
        self.err = tmp_path / "delta-spark-process.err"
        local = tmp_path / "spark-local-process"
        local.mkdir()
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(script), ivy_dir, str(local)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        self.replies: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("REPLY "):
                self.replies.put(json.loads(line[len("REPLY ") :]))
        self.replies.put(None)

    def send(self, sql: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"sql": sql}) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict:
        got = self.replies.get(timeout=180)
        assert got is not None, f"the Delta Spark process ended: {self.err.read_text()[-3000:]}"
        return got

    def run(self, sql: str) -> dict:
        self.send(sql)
        got = self.reply()
        assert got["ok"], got["error"]
        return got

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def test_a_delta_spark_writer_in_another_process_beside_dbidx_upserts(
    spark, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process's Delta Spark (its own JVM and log cache) commits while dbidx's upsert tasks run, through the
    same hook as test_delta_spark.py's in-process race: an UPDATE and a MERGE of other keys (in the files dbidx's
    keys are in) leave each upsert to commit at the next version; an UPDATE of the key an upsert writes makes it
    conflict with nothing published, and a retry lands. Then both run freely, Delta Spark retrying what loses a race
    (Delta's own check), dbidx's upserts of other keys never conflicting; every reader against the model."""
    from dbidx.spark_integration import task

    process = SparkProcess(tmp_path, spark.conf.get("spark.jars.ivy"))  # its JVM starts beside the table's set-up
    try:
        w = Writer(tmp_path)
        assert process.reply() == {"ready": True}
        pending: list[str] = []
        real = task.upsert_batches

        def tasks_then_delta_spark(*args, **kwargs):
            result = real(*args, **kwargs)
            if pending:
                process.run(pending.pop())
            return result

        monkeypatch.setattr(task, "upsert_batches", tasks_then_delta_spark)
        table = f"delta.`{w.path}`"

        def spark_merge(rows: list[tuple[str, str, int]], day: str | None = None) -> str:
            source = " UNION ALL ".join(f"SELECT '{i}' id, '{d}' dt, {v}L v" for i, d, v in rows)
            on = "t.dt = s.dt AND t.id = s.id" + (f" AND t.dt = '{day}'" if day else "")
            w.model.update({(d, i): v for i, d, v in rows})
            return (
                f"MERGE INTO {table} t USING ({source}) s ON {on} "
                "WHEN MATCHED THEN UPDATE SET * WHEN NOT MATCHED THEN INSERT *"
            )

        def spark_update(day: str = "d1", ids: tuple[str, ...] = ("k3", "k9")) -> str:
            for i in ids:
                w.model[(day, i)] += 1
            return f"UPDATE {table} SET v = v + 1 WHERE dt = '{day}' AND id IN ({', '.join(repr(i) for i in ids)})"

        # 1. Rounds through the hook: other keys (k3, k9 share d1's files with k6, k12), then the same key.
        rounds: list[tuple[Callable[[], str], list[tuple[str, str, int]]]] = [
            (spark_update, [("k6", "d1", 61), ("k12", "d1", 121), ("k4", "d2", 41)]),
            (
                lambda: spark_merge([("k5", "d3", 5000), ("k7", "d2", 7000), ("s1", "d1", 1)]),
                [("k8", "d3", 81), ("k10", "d2", 101), ("k6", "d1", 62)],
            ),
        ]
        for round_, (sql, rows) in enumerate(rounds):
            pending.append(sql())
            before = max(listed_versions(w.table.io))
            w.upsert(rows, table=Table.open(w.path))
            assert not pending and max(listed_versions(w.table.io)) == before + 2, round_
            w.quick_check()
        pending.append(f"UPDATE {table} SET v = -13 WHERE id = 'k13'")
        with pytest.raises(ConflictError):
            w.upsert([("k13", "d2", 130)], table=Table.open(w.path))
        w.model[("d2", "k13")] = -13
        w.quick_check()
        w.upsert([("k13", "d2", 131)], table=Table.open(w.path))
        w.quick_check()
        # 2. Free-running: three statements queued, dbidx upserting other keys until all three have landed. Delta
        #    Spark's own check refuses its commit when a commit since its read added files to what it read (here a
        #    partition dbidx does not write to: it would lose every race to a writer that never pauses).
        statements = [
            spark_update("d3", ("k2", "k14")),
            spark_merge([("k5", "d3", 5001), ("s2", "d3", 2)], "d3"),
            spark_update("d3", ("k2",)),
        ]
        for sql in statements:
            process.send(sql)
        replies, upserts = [], 0
        while (len(replies) < len(statements) or upserts < 2) and upserts < 200:
            upserts += 1
            w.upsert([("k6", "d1", 600 + upserts), ("k4", "d2", 400 + upserts)], table=Table.open(w.path))
            while len(replies) < len(statements) and not process.replies.empty():
                replies.append(process.reply())
        assert all(r["ok"] for r in replies), replies
    finally:
        process.close()
    w.touched_update(900)
    full_check(spark, w)
