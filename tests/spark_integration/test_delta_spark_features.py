"""The table features Delta Spark 4.4.0 turns on, on a dbidx table and on tables it creates (issue 60 section 3,
docs/FORMAT.md section 12d): each one dbidx cannot keep is refused by name, with the version that turned it on and
the remedy, when its version is absorbed (nothing written) and at adoption; the remedies work; the features dbidx
keeps leave Delta Spark reading and writing the table after dbidx's upserts."""

from __future__ import annotations

from pathlib import Path

import pytest

from dbidx.data.delta_log import listed_versions
from dbidx.errors import DeltaFeatureError
from dbidx.table.build_index import build_index
from dbidx.table.facade import Table
from dbidx.table.readopt import readopt

from tests.data.test_foreign_writers import COLUMNS, Writer, rows_of
from tests.delta_readers import via_delta_spark

pytestmark = [pytest.mark.spark, pytest.mark.delta_tier]  # `make test-delta-spark`


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Writer:
    return Writer(tmp_path_factory.mktemp("features-base"))


def _spark_rows(spark, path: str) -> set[tuple]:
    return set(via_delta_spark(spark, path, COLUMNS))


# Each: the SQL that turns the feature on, the feature the refusal names, and a word of its remedy.
REFUSED = {
    "appendOnly": ("SET TBLPROPERTIES ('delta.appendOnly' = 'true')", "appendOnly", "'delta.appendOnly' = 'false'"),
    "changeDataFeed": ("SET TBLPROPERTIES ('delta.enableChangeDataFeed' = 'true')", "changeDataFeed", "= 'false'"),
    "checkConstraints": ("ADD CONSTRAINT v_positive CHECK (v >= 0)", "checkConstraints", "DROP CONSTRAINT"),
    "typeWidening": ("SET TBLPROPERTIES ('delta.enableTypeWidening' = 'true')", "typeWidening", "TRUNCATE HISTORY"),
}


@pytest.mark.parametrize("feature", list(REFUSED))
def test_a_feature_dbidx_cannot_keep_is_refused_by_name_at_absorption_and_adoption(
    spark, base: Writer, tmp_path: Path, feature: str
) -> None:
    """Before: dbidx absorbed `delta.appendOnly=true` and its next upsert wrote removes into the append-only table;
    the others were refused with the protocol's repr and no remedy."""
    w = base.copy_to(tmp_path)
    sql, name, remedy = REFUSED[feature]
    first = max(listed_versions(w.table.io)) + 1
    spark.sql(f"ALTER TABLE delta.`{w.path}` {sql}")
    versions = listed_versions(w.table.io)
    pattern = rf"`{name}`.*turned on by Delta version {first} .*nothing was written. Remedy: .*{remedy}"
    with pytest.raises(DeltaFeatureError, match=pattern):
        Table.open(w.path).sync_delta_log()
    with pytest.raises(DeltaFeatureError, match=pattern):  # the next dbidx write absorbs first: refused the same
        w.upsert([("k1", "d2", 5)], table=Table.open(w.path))
    assert listed_versions(Table.open(w.path).io) == versions
    with pytest.raises(DeltaFeatureError, match=rf"`{name}`.*turned on by Delta version {first} .*build-index"):
        readopt(w.path, "id")  # the adoption's check (build-index --readopt)
    assert _spark_rows(spark, w.path) == rows_of(w.model)


def test_turning_the_feature_off_is_the_remedy_and_dbidx_writes_on(spark, base: Writer, tmp_path: Path) -> None:
    """Change data feed on (refused), then off again: `dbidx sync` absorbs the run (the feature stays listed, not in
    use); a constraint added and dropped: the same. dbidx's upsert then lands and Delta Spark reads and writes after
    it. (Delta Spark's DROP FEATURE inCommitTimestamp also works, probed by hand: 2026-12-07.)"""
    w = base.copy_to(tmp_path)
    spark.sql(f"ALTER TABLE delta.`{w.path}` SET TBLPROPERTIES ('delta.enableChangeDataFeed' = 'true')")
    with pytest.raises(DeltaFeatureError, match="changeDataFeed"):
        Table.open(w.path).sync_delta_log()
    spark.sql(f"ALTER TABLE delta.`{w.path}` SET TBLPROPERTIES ('delta.enableChangeDataFeed' = 'false')")
    spark.sql(f"ALTER TABLE delta.`{w.path}` ADD CONSTRAINT v_positive CHECK (v >= 0)")
    spark.sql(f"ALTER TABLE delta.`{w.path}` DROP CONSTRAINT v_positive")
    Table.open(w.path).sync_delta_log()
    w.upsert([("k1", "d2", 11), ("n1", "d1", 12)], table=Table.open(w.path))
    spark.sql(f"INSERT INTO delta.`{w.path}` VALUES ('s1', 'd3', 13)")
    w.model[("d3", "s1")] = 13
    assert _spark_rows(spark, w.path) == rows_of(w.model)
    w.quick_check()


def test_vacuum_protocol_check_is_kept(spark, base: Writer, tmp_path: Path) -> None:
    """vacuumProtocolCheck asks only that a vacuum checks the whole protocol first, which dbidx does before every
    write (its clean included): absorbed, and Delta Spark reads and writes after dbidx's upsert."""
    w = base.copy_to(tmp_path)
    spark.sql(f"ALTER TABLE delta.`{w.path}` SET TBLPROPERTIES ('delta.feature.vacuumProtocolCheck' = 'supported')")
    w.upsert([("k2", "d3", 21), ("k0", "d1", 0)], deletes=[False, True], table=Table.open(w.path))
    spark.sql(f"INSERT INTO delta.`{w.path}` VALUES ('s2', 'd1', 14)")
    w.model[("d1", "s2")] = 14
    assert _spark_rows(spark, w.path) == rows_of(w.model)
    w.quick_check()


@pytest.mark.parametrize(
    "ddl, name",
    [
        ("(id STRING, n BIGINT GENERATED ALWAYS AS IDENTITY, v BIGINT)", "identityColumns"),
        ("(id STRING, v BIGINT, w BIGINT GENERATED ALWAYS AS (v * 2))", "generatedColumns"),
        # Column mapping by id (Delta Spark cannot switch an existing table to it; by name is kept)
        ("(id STRING, v BIGINT) USING delta TBLPROPERTIES ('delta.columnMapping.mode' = 'id')", "columnMapping"),
    ],
    ids=["identity", "generated", "mapped-by-id"],  # clustering: test_delta_spark_kept_features.py
)
def test_tables_delta_spark_creates_with_features_dbidx_cannot_keep_are_refused_at_adoption(
    spark, tmp_path: Path, ddl: str, name: str
) -> None:
    path = str(tmp_path / "t")
    spark.sql(f"CREATE TABLE delta.`{path}` {ddl}" + ("" if "USING" in ddl else " USING delta"))
    spark.sql(f"INSERT INTO delta.`{path}` (id, v) VALUES ('a', 1), ('b', 2)")
    with pytest.raises(DeltaFeatureError, match=rf"`{name}`.*turned on by Delta version 0 .*Remedy: "):
        build_index(Table.create(path, num_shards=1), "id")
    assert not (Path(path) / ".dbidx" / "timeline" / "completed").exists() or not list(
        (Path(path) / ".dbidx" / "timeline" / "completed").glob("*.json")
    )
