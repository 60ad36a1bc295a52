"""The Delta features dbidx keeps as a writer beyond deletion vectors (issue 60 sections 3 and 4, docs/FORMAT.md
section 12d): in-commit timestamps (every dbidx commit stamped, monotonic, and Delta Spark's time travel by timestamp
lands on dbidx's versions), domain metadata (kept through dbidx's versions and checkpoints) and liquid clustering by
the key (a table Delta Spark created clustered, with deletion vectors and in-commit timestamps, adopted, upserted,
re-clustered by Delta Spark's OPTIMIZE and absorbed; clustering by another column refused by name, with the remedy
working)."""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pytest

from dbidx.config import CacheConfig
from dbidx.data.delta_checkpoint import write_delta_checkpoint
from dbidx.data.delta_derive import commit_stamp, in_commit_timestamp
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


def _copy(base: Writer, tmp_path: Path) -> Writer:
    shutil.copytree(Path(base.path).parent, tmp_path, dirs_exist_ok=True)
    return Writer.over(str(tmp_path / "t"), tmp_path / "cache-copy", base.model)


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
    w = _copy(base, tmp_path)
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
