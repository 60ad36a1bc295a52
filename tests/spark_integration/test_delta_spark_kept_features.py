"""The Delta features dbidx keeps as a writer beyond deletion vectors (issue 60 sections 3 and 4, docs/FORMAT.md
section 12d): in-commit timestamps (every dbidx commit stamped, monotonic, and Delta Spark's time travel by timestamp
lands on dbidx's versions), domain metadata (kept through dbidx's versions and checkpoints), liquid clustering by
the key (a table Delta Spark created clustered, with deletion vectors and in-commit timestamps, adopted, upserted,
re-clustered by Delta Spark's OPTIMIZE and absorbed; clustering by another column refused by name, with the remedy
working) and row tracking (Delta Spark's row ids unique and the untouched rows' ids stable through dbidx's upserts
and data compaction, on a dbidx table Delta Spark turned it on for and on an adopted one)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pytest

from dbidx.config import CacheConfig
from dbidx.data.delta_checkpoint import write_delta_checkpoint
from dbidx.data.delta_derive import commit_stamp
from dbidx.storage.commit_stamps import next_stamp as in_commit_timestamp
from dbidx.data.delta_domains import clustering_columns, domains_at
from dbidx.data.delta_log import listed_versions, version_file
from dbidx.errors import DeltaFeatureError
from dbidx.spark_integration.local import upsert_arrow
from dbidx.table.build_index import build_index
from dbidx.table.facade import Table
from dbidx.table.verify_table import verify_table

from tests.data.test_foreign_writers import COLUMNS, Writer, rows_of
from tests.delta_readers import assert_readers_agree, via_delta_spark

pytestmark = [pytest.mark.spark, pytest.mark.delta_tier]  # `make test-delta-spark`


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Writer:
    return Writer(tmp_path_factory.mktemp("kept-base"))


def _commit_info(table: Table, version: int) -> dict:
    return json.loads(table.io.read_bytes(version_file(version)).split(b"\n", 1)[0])["commitInfo"]


def test_the_stamp_is_monotonic_whatever_the_clock_says() -> None:
    assert in_commit_timestamp(1_000, None) == 1_000
    assert in_commit_timestamp(1_000, 5_000) == 5_001  # a clock behind the previous commit's stamp
    assert in_commit_timestamp(9_000, 5_000) == 9_000
    for line in (b"", b"{", b'{"commitInfo":{"inCommitTimestamp":"5"}}', b'{"commitInfo":{"inCommitTimestamp":true}}'):
        assert commit_stamp(line) is None  # read back as untrusted: no stamp, never a wrong one
    assert commit_stamp(b'{"commitInfo":{"inCommitTimestamp":7}}') == 7


def test_in_commit_timestamps_stamp_every_dbidx_commit_and_time_travel_lands_on_them(
    spark, base: Writer, tmp_path: Path
) -> None:
    """Delta Spark turns in-commit timestamps on; dbidx's upserts (one with a delete) and its data compaction each
    carry an inCommitTimestamp as their first action's, above the previous version's; Delta Spark's TIMESTAMP AS OF
    at each dbidx stamp reads that version's rows; Delta Spark and dbidx keep writing after each other."""
    w = base.copy_to(tmp_path)
    spark.sql(f"ALTER TABLE delta.`{w.path}` SET TBLPROPERTIES ('delta.enableInCommitTimestamps' = 'true')")
    enabled = max(listed_versions(w.table.io))
    snapshots: dict[int, set[tuple]] = {}
    w.upsert(
        [("k1", "d2", 41), ("k2", "d3", 0), ("n1", "d1", 42)], deletes=[False, True, False], table=Table.open(w.path)
    )
    snapshots[max(listed_versions(w.table.io))] = rows_of(w.model)
    spark.sql(f"INSERT INTO delta.`{w.path}` VALUES ('s1', 'd3', 43)")
    w.model[("d3", "s1")] = 43
    w.upsert([("s1", "d3", 44), ("k5", "d3", 45)], table=Table.open(w.path))
    snapshots[max(listed_versions(w.table.io))] = rows_of(w.model)
    table = Table.open(w.path)
    versions = [v for v in listed_versions(table.io) if v >= enabled]
    stamps = [_commit_info(table, v).get("inCommitTimestamp") for v in versions]
    assert all(isinstance(s, int) for s in stamps), stamps
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
    ours = [v for v in versions if "dbidx" in _commit_info(table, v)]
    assert len(ours) >= 2 and all(
        _commit_info(table, v)["timestamp"] == _commit_info(table, v)["inCommitTimestamp"] for v in ours
    )
    history = {r["version"]: r["timestamp"] for r in spark.sql(f"DESCRIBE HISTORY delta.`{w.path}`").collect()}
    for version, expected in snapshots.items():
        stamp = _commit_info(table, version)["inCommitTimestamp"]
        when = datetime.fromtimestamp(stamp / 1000, tz=timezone.utc)
        assert history[version].replace(tzinfo=timezone.utc) == when  # the session's time zone is UTC
        got = (
            spark.read.format("delta").option("timestampAsOf", when.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]).load(w.path)
        )
        assert set(tuple(r) for r in got.select(*COLUMNS).collect()) == expected
    assert set(assert_readers_agree(table, COLUMNS, spark=spark)) == rows_of(w.model)
    assert verify_table(table).ok


def _clustered(spark, path: str, by: str) -> dict[str, int]:
    """A table as Delta Spark creates one on Databricks' defaults: liquid-clustered, deletion vectors and in-commit
    timestamps on; written, clustered (OPTIMIZE), and a DELETE that writes a deletion vector."""
    spark.sql(
        f"CREATE TABLE delta.`{path}` (id STRING, v BIGINT) USING delta CLUSTER BY ({by}) TBLPROPERTIES "
        "('delta.enableDeletionVectors' = 'true', 'delta.enableInCommitTimestamps' = 'true')"
    )
    model = {f"c{i:02d}": i for i in range(40)}
    spark.createDataFrame(sorted(model.items()), "id STRING, v BIGINT").repartition(3).write.format("delta").mode(
        "append"
    ).save(path)
    spark.sql(f"OPTIMIZE delta.`{path}`")
    spark.sql(f"DELETE FROM delta.`{path}` WHERE id IN ('c03', 'c17')")
    for gone in ("c03", "c17"):
        model.pop(gone)
    return model


def _upsert(table: Table, rows: list[tuple[str, int]], deletes: list[bool], cache: Path, model: dict[str, int]) -> None:
    batch = pa.table(
        {
            "id": [i for i, _ in rows],
            "v": pa.array([v for _, v in rows], pa.int64()),
            "p": [""] * len(rows),  # an unpartitioned table takes its upserts at its root
            "_dbidx_delete": deletes,
        }
    )
    upsert_arrow(
        batch, table, key="id", partition="p", hive_style=False, cache_config=CacheConfig(base_path=str(cache))
    )
    for (i, v), gone in zip(rows, deletes):
        model.pop(i, None) if gone else model.__setitem__(i, v)


def _rows(model: dict[str, int]) -> set[tuple]:
    return set(model.items())


def test_a_table_delta_spark_clustered_by_its_key_is_adopted_and_stays_clustered(spark, tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    model = _clustered(spark, path, "id")
    build_index(Table.create(path, num_shards=2), "id")
    table = Table.open(path)
    assert set(assert_readers_agree(table, ("id", "v"), spark=spark)) == _rows(model)
    _upsert(table, [("c01", 101), ("c02", 0), ("n01", 1000)], [False, True, False], tmp_path / "c", model)
    spark.sql(f"OPTIMIZE delta.`{path}`")  # clusters dbidx's files (no clusteringProvider) with Delta's
    spark.sql(
        f"MERGE INTO delta.`{path}` t USING (SELECT 'c05' AS id, 505L AS v UNION ALL SELECT 's01', 7L) s "
        "ON t.id = s.id WHEN MATCHED THEN UPDATE SET v = s.v WHEN NOT MATCHED THEN INSERT (id, v) VALUES (s.id, s.v)"
    )
    model.update({"c05": 505, "s01": 7})
    _upsert(Table.open(path), [("c05", 5005), ("s01", 0), ("c30", 3)], [False, True, False], tmp_path / "c", model)
    table = Table.open(path)
    assert write_delta_checkpoint(table.io) is not None  # delta-rs's checkpoint, slimmed: the domain in it
    latest = max(listed_versions(table.io))
    assert clustering_columns(domains_at(table.io, latest), "test") == [["id"]]
    detail = spark.sql(f"DESCRIBE DETAIL delta.`{path}`").collect()[0]
    assert list(detail["clusteringColumns"]) == ["id"]
    ours = [v for v in listed_versions(table.io) if "dbidx" in _commit_info(table, v)]
    assert ours and all(isinstance(_commit_info(table, v).get("inCommitTimestamp"), int) for v in ours)
    assert set(assert_readers_agree(table, ("id", "v"), spark=spark)) == _rows(model)
    assert set(via_delta_spark(spark, path, ("id", "v"))) == _rows(model)
    assert verify_table(table).ok


def test_clustering_by_another_column_is_refused_by_name_and_clustering_by_the_key_is_the_remedy(
    spark, tmp_path: Path
) -> None:
    """At adoption (nothing written) and when Delta Spark's ALTER TABLE ... CLUSTER BY is absorbed (nothing
    absorbed); clustering by the key again (or not at all) is the remedy the refusal names, and dbidx writes on."""
    path = str(tmp_path / "t")
    model = _clustered(spark, path, "v")
    refused = r"liquid-clustered by \['v'\].*nothing was written. Remedy: .*CLUSTER BY \(id\)"
    with pytest.raises(DeltaFeatureError, match=refused):
        build_index(Table.create(path, num_shards=1), "id")
    assert not list((tmp_path / "t" / ".dbidx" / "timeline" / "completed").glob("*.json"))
    spark.sql(f"ALTER TABLE delta.`{path}` CLUSTER BY (id)")
    build_index(Table.open(path), "id")
    _upsert(Table.open(path), [("c01", 11), ("n01", 12)], [False, False], tmp_path / "c", model)
    spark.sql(f"ALTER TABLE delta.`{path}` CLUSTER BY (v)")
    versions = listed_versions(Table.open(path).io)
    with pytest.raises(DeltaFeatureError, match=r"Delta version \d+ \(CLUSTER BY.*liquid-clustered by \['v'\]"):
        Table.open(path).sync_delta_log()
    assert listed_versions(Table.open(path).io) == versions
    spark.sql(f"ALTER TABLE delta.`{path}` CLUSTER BY NONE")
    Table.open(path).sync_delta_log()
    _upsert(Table.open(path), [("c01", 21), ("c02", 0)], [False, True], tmp_path / "c", model)
    table = Table.open(path)
    assert clustering_columns(domains_at(table.io, max(listed_versions(table.io))), "test") == []
    assert set(assert_readers_agree(table, ("id", "v"), spark=spark)) == _rows(model)


def _row_ids(spark, path: str) -> dict[str, tuple[int, int]]:
    """Delta Spark's stable row id and row commit version of every live row, by key (each must be unique)."""
    rows = spark.read.format("delta").load(path).select("id", "_metadata.row_id", "_metadata.row_commit_version")
    got = [tuple(r) for r in rows.collect()]
    assert all(r[1] is not None and r[2] is not None for r in got), "a row without a row id"
    assert len({r[1] for r in got}) == len(got), "two rows share a row id"
    assert len({r[0] for r in got}) == len(got)
    return {r[0]: (r[1], r[2]) for r in got}


def _check_row_tracking(spark, table: Table, since: int) -> None:
    """From version `since` on: the `delta.rowTracking` mark never goes down and covers every id assigned so far;
    every add and remove dbidx logged carries the file's ids, a remove or re-add exactly those of the path's last
    add, a new file's commit version its own version; commitInfo says whether ids were preserved; Delta Spark's ids
    are unique and under the mark."""
    from dbidx.storage.row_ids import ROW_TRACKING_DOMAIN, high_water_mark_of

    mark, last_add, top = -1, {}, -1
    for v in [v for v in listed_versions(table.io) if v >= since]:
        actions = [json.loads(line) for line in table.io.read_bytes(version_file(v)).splitlines() if line.strip()]
        info = actions[0]["commitInfo"]
        ours = "dbidx" in info
        for a in actions:
            if "remove" in a and ours and a["remove"]["path"] in last_add:
                r = a["remove"]
                assert (r.get("baseRowId"), r.get("defaultRowCommitVersion")) == last_add[r["path"]], (v, r)
        for a in actions:
            if "add" in a:
                add = a["add"]
                ids = (add.get("baseRowId"), add.get("defaultRowCommitVersion"))
                if ours:
                    assert all(isinstance(x, int) for x in ids), (v, add)
                    if add["path"] in last_add:  # a re-add (a new vector, a vector moved): the file's own ids
                        assert ids == last_add[add["path"]], (v, add)
                    else:  # a new file: fresh ids, this version as its commit version
                        assert ids[1] == v, (v, add)
                if ids[0] is not None:
                    top = max(top, ids[0] + json.loads(add["stats"])["numRecords"] - 1)
                last_add[add["path"]] = ids
            if "domainMetadata" in a and a["domainMetadata"]["domain"] == ROW_TRACKING_DOMAIN:
                new = high_water_mark_of(a["domainMetadata"]["configuration"], str(v))
                assert new >= mark, f"version {v} lowers the row-id mark from {mark} to {new}"
                mark = new
        if ours and any("add" in a for a in actions):
            assert info["tags"]["delta.rowTracking.preserved"] in ("true", "false")
        assert mark >= top, f"version {v}: ids up to {top} assigned, the mark says {mark}"
    ids = _row_ids(spark, table.io.path(""))
    assert max(r for r, _ in ids.values()) <= mark


def test_row_tracking_turned_on_by_delta_spark_keeps_row_ids_unique_and_stable(
    spark, base: Writer, tmp_path: Path
) -> None:
    """Delta Spark turns row tracking on (protocol, backfill of every file's baseRowId, the property); dbidx
    absorbs it, upserts (an update, a delete, inserts) and compacts; Delta Spark inserts in between. Row ids stay
    unique; a row neither engine touched keeps its id and commit version; an updated row gets a fresh id."""
    w = base.copy_to(tmp_path)
    since = max(listed_versions(w.table.io)) + 1
    spark.sql(f"ALTER TABLE delta.`{w.path}` SET TBLPROPERTIES ('delta.enableRowTracking' = 'true')")
    Table.open(w.path).sync_delta_log()
    before = _row_ids(spark, w.path)
    untouched = sorted(before)[:3]
    w.upsert(
        [("k5", "d3", 51), ("k6", "d1", 0), ("r1", "d2", 52)], deletes=[False, True, False], table=Table.open(w.path)
    )
    spark.sql(f"INSERT INTO delta.`{w.path}` VALUES ('s1', 'd3', 53)")
    w.model[("d3", "s1")] = 53
    w.upsert([("s1", "d3", 54), ("r2", "d1", 55)], table=Table.open(w.path))
    after = _row_ids(spark, w.path)
    assert all(after[k] == before[k] for k in untouched if k not in ("k5", "k6"))
    assert after["k5"][0] not in before.values() and after["k5"][1] > before["k5"][1]
    assert Table.open(w.path).compact_data(min_files=2, deleted_share=0.01).record is not None
    spark.sql(f"INSERT INTO delta.`{w.path}` VALUES ('s2', 'd1', 56)")
    w.model[("d1", "s2")] = 56
    w.upsert([("s2", "d1", 57)], table=Table.open(w.path))
    table = Table.open(w.path)
    _check_row_tracking(spark, table, since)
    view = table.data_view()
    assert view.tracks_rows() and view.row_id_high_water_mark >= max(r for r, _ in _row_ids(spark, w.path).values())
    assert table.checkpoint() is not None  # the view's row ids and mark survive its checkpoint form
    assert Table.open(w.path).data_view().to_dict() == view.to_dict()
    assert set(assert_readers_agree(table, COLUMNS, spark=spark)) == rows_of(w.model)
    assert verify_table(table).ok


def test_a_delta_spark_table_with_row_tracking_is_adopted_and_keeps_it(spark, tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    spark.sql(
        f"CREATE TABLE delta.`{path}` (id STRING, dt STRING, v BIGINT) USING delta PARTITIONED BY (dt) TBLPROPERTIES "
        "('delta.enableRowTracking' = 'true', 'delta.enableDeletionVectors' = 'true')"
    )
    model = {(f"d{i % 3}", f"a{i:02d}"): i for i in range(30)}
    spark.createDataFrame([(i, d, v) for (d, i), v in model.items()], "id STRING, dt STRING, v BIGINT").write.format(
        "delta"
    ).mode("append").save(path)
    spark.sql(f"UPDATE delta.`{path}` SET v = v + 100 WHERE id = 'a04'")  # a materialized row id in Delta's file
    model[("d1", "a04")] += 100
    build_index(Table.create(path, num_shards=2), "id")
    before = _row_ids(spark, path)
    w = Writer.over(path, tmp_path / "c", model)
    w.upsert([("a04", "d1", 7), ("a05", "d2", 0), ("b01", "d0", 8)], deletes=[False, True, False])
    spark.sql(f"INSERT INTO delta.`{path}` VALUES ('s1', 'd0', 9)")
    w.model[("d0", "s1")] = 9
    w.upsert([("s1", "d0", 10)], table=Table.open(path))
    after = _row_ids(spark, path)
    assert after["a07"] == before["a07"] and after["a10"] == before["a10"]
    table = Table.open(path)
    _check_row_tracking(spark, table, 0)
    assert set(assert_readers_agree(table, COLUMNS, spark=spark)) == rows_of(w.model)
    assert verify_table(table).ok


# DuckDB 1.5's delta extension reads the partition column of a column-mapped table as null (its partition values
# are keyed by physical names) and refuses Delta Spark's legacy column-mapping protocol (reader 2 / writer 5) outright
# (probed 2026-12-08 on a table only Delta Spark wrote): it is left out of these comparisons.
NO_DUCKDB = ("duckdb",)


def _file_columns(table: Table) -> set[str]:
    """The column names of dbidx's newest data file as stored (physical under column mapping)."""
    import pyarrow.parquet as pq

    newest = max(table.data_view().live(), key=lambda f: f.seq).record
    return set(pq.read_schema(table.io.path(newest.path)).names)


def test_a_table_delta_spark_created_with_column_mapping_is_adopted_and_written_by_physical_names(
    spark, tmp_path: Path
) -> None:
    """Column mapping by name from the start (every column's physical name a `col-<uuid>`), deletion vectors on:
    adopted; dbidx's files name the columns physically, its adds key partition values so; Delta Spark's ADD
    COLUMNS and MERGE are absorbed and dbidx writes the new column; a new column from dbidx and Delta Spark's
    RENAME COLUMN are refused by name."""
    from dbidx.errors import SchemaError

    path = str(tmp_path / "t")
    spark.sql(
        f"CREATE TABLE delta.`{path}` (id STRING, dt STRING, v BIGINT) USING delta PARTITIONED BY (dt) TBLPROPERTIES "
        "('delta.columnMapping.mode' = 'name', 'delta.enableDeletionVectors' = 'true')"
    )
    model = {(f"d{i % 3}", f"m{i:02d}"): i for i in range(24)}
    spark.createDataFrame([(i, d, v) for (d, i), v in model.items()], "id STRING, dt STRING, v BIGINT").write.format(
        "delta"
    ).mode("append").save(path)
    spark.sql(f"DELETE FROM delta.`{path}` WHERE id = 'm05'")
    model.pop(("d2", "m05"))
    build_index(Table.create(path, num_shards=2), "id")
    w = Writer.over(path, tmp_path / "c", model)
    w.upsert([("m01", "d1", 101), ("m02", "d2", 0), ("n01", "d0", 7)], deletes=[False, True, False])
    table = Table.open(path)
    table.data_view()  # (refreshed: its FileIO knows the physical names)
    physical = {n: p for n, (p, _i) in table.io.column_names.columns.items()}
    assert (
        physical["v"].startswith("col-") and physical["v"] in _file_columns(table) and "v" not in _file_columns(table)
    )
    latest = max(listed_versions(table.io))
    adds = [json.loads(x)["add"] for x in table.io.read_bytes(version_file(latest)).splitlines() if b'"add"' in x]
    assert adds and all(set(a["partitionValues"]) == {physical["dt"]} for a in adds)
    assert set(
        assert_readers_agree(table, COLUMNS, spark=spark, polars_refuses="columnMapping", without=NO_DUCKDB)
    ) == rows_of(w.model)
    spark.sql(f"ALTER TABLE delta.`{path}` ADD COLUMNS (note STRING)")
    spark.sql(
        f"MERGE INTO delta.`{path}` t USING (SELECT 'm07' AS id, 'd1' AS dt, 77L AS v, 'merged' AS note) s "
        "ON t.id = s.id AND t.dt = s.dt WHEN MATCHED THEN UPDATE SET * WHEN NOT MATCHED THEN INSERT *"
    )
    w.model[("d1", "m07")] = 77
    batch = pa.table({"id": ["m08"], "dt": ["d2"], "v": pa.array([88], pa.int64()), "note": ["dbidx"]})
    upsert_arrow(batch, Table.open(path), key="id", partition="dt", cache_config=w.config)
    w.model[("d2", "m08")] = 88
    notes = dict(spark.read.format("delta").load(path).select("id", "note").collect())
    assert notes["m08"] == "dbidx" and notes["m07"] == "merged" and notes["m01"] is None
    table = Table.open(path)
    assert set(
        assert_readers_agree(table, COLUMNS, spark=spark, polars_refuses="columnMapping", without=NO_DUCKDB)
    ) == rows_of(w.model)
    assert verify_table(table).ok
    more = batch.append_column("extra", pa.array(["x"]))
    with pytest.raises(SchemaError, match=r"adds column\(s\) \['extra'\] to a table that maps its columns"):
        upsert_arrow(more, Table.open(path), key="id", partition="dt", cache_config=w.config)
    spark.sql(f"ALTER TABLE delta.`{path}` RENAME COLUMN v TO amount")
    with pytest.raises(DeltaFeatureError, match=r"drops column\(s\) \['v'\]"):
        Table.open(path).sync_delta_log()


def test_column_mapping_turned_on_for_a_dbidx_table(spark, base: Writer, tmp_path: Path) -> None:
    """Delta Spark turns column mapping on for a dbidx table (its columns keep their names as physical names) and
    adds a column (a `col-<uuid>` one): dbidx writes both as the mapping says, and every reader agrees."""
    w = base.copy_to(tmp_path)
    spark.sql(
        f"ALTER TABLE delta.`{w.path}` SET TBLPROPERTIES ('delta.columnMapping.mode' = 'name', "
        "'delta.minReaderVersion' = '3', 'delta.minWriterVersion' = '7')"
    )
    w.upsert([("k1", "d2", 61), ("k2", "d3", 0)], deletes=[False, True], table=Table.open(w.path))
    spark.sql(f"ALTER TABLE delta.`{w.path}` ADD COLUMNS (note STRING)")
    rows = [(i, d) for (d, i) in sorted(w.model)][:3]
    batch = pa.table(
        {
            "id": [i for i, _ in rows],
            "dt": [d for _, d in rows],
            "v": pa.array([1, 2, 3], pa.int64()),
            "note": ["a", "b", "c"],
        }
    )
    upsert_arrow(batch, Table.open(w.path), key="id", partition="dt", cache_config=w.config)
    w.model.update({(d, i): v for (i, d), v in zip(rows, [1, 2, 3])})
    table = Table.open(w.path)
    table.data_view()
    note = table.io.column_names.physical("note")
    assert note.startswith("col-") and note in _file_columns(table) and "v" in _file_columns(table)
    notes = dict(spark.read.format("delta").load(w.path).select("id", "note").collect())
    assert [notes[i] for i, _ in rows] == ["a", "b", "c"]
    assert set(
        assert_readers_agree(table, COLUMNS, spark=spark, polars_refuses="columnMapping", without=NO_DUCKDB)
    ) == rows_of(w.model)
    assert verify_table(table).ok
