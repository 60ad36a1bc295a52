"""The table services after a Spark upsert (`api.upsert`): they run in the driver after the publish and report in
the summary; the rows stay exactly the model's, read by Spark and by the other engines."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from dbidx.config import CacheConfig
from dbidx.mdt.service_settings import write_settings
from dbidx.mdt.table import Table
from dbidx.spark_integration.api import upsert
from dbidx.spark_integration.reads import read_table

from tests.delta_readers import assert_readers_agree
from tests.spark_helpers import SCHEMA, Oracle, random_batch

pytestmark = pytest.mark.spark


def test_services_run_after_a_spark_upsert(spark, tmp_path: Path, services_on: None) -> None:
    table = Table.create(str(tmp_path / "t"), num_shards=2)
    write_settings(table.io, {"data_min_small_files": 2, "index_min_files": 2})
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    oracle, serial, rng = Oracle(False), [0], random.Random(4402)
    ran: list[str] = []
    for _ in range(3):
        batch = random_batch(rng, oracle, serial, size=20)
        summary = upsert(spark.createDataFrame(batch, SCHEMA), table, key="id", partition="dt", cache_config=config)
        oracle.apply(batch)
        ran += [r["service"] for r in summary.services["ran"]]
        assert summary.to_dict()["services"] == summary.services
    assert {"data_compaction", "index_compaction"} <= set(ran)
    expected = {(ident[-1], day, value) for ident, (day, value) in oracle.rows.items()}
    got = {(r.id, r.dt.split("=", 1)[-1], r.v) for r in read_table(spark, table).select("id", "dt", "v").collect()}
    assert got == expected
    assert_readers_agree(table, ["id", "dt", "v"], expected)
