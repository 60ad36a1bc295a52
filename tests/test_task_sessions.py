"""The tag path's shard sessions end on the failure path when tagging fails: the success epilogue (reaper run,
metrics) never runs for a task that raised, and the cache is closed either way."""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from dbidx.cache.record_cache import RecordIndexCache
from dbidx.config import CacheConfig
from dbidx.errors import InvalidKeyError
from dbidx.mdt.table import Table
from dbidx.spark_integration import task
from dbidx.spark_integration.local import upsert_arrow
from dbidx.spark_integration.tagger import TagOptions


def batch(keys: list) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({"id": pa.array(keys, pa.string()), "dt": ["2025-03-01"] * len(keys)})


@pytest.fixture()
def setup(tmp_path: Path):
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "cache"), reaper_interval_s=0.0)
    upsert_arrow(pa.table({"id": ["a", "b"], "dt": ["2025-03-01"] * 2}), table, key="id", partition="dt",
                 cache_config=config)
    with RecordIndexCache.for_table(table, 0, config) as cache:
        cache.set_info(task.REAPER_INFO, {"last_ms": 0, "dropped": []})
    return table, config


def test_a_failing_batch_skips_the_session_epilogue_and_releases_the_cache(setup) -> None:
    table, config = setup
    options = TagOptions(key="id", partition="dt", cache=config)
    tagged = task.tag_batches([batch(["a", "x"]), batch(["b", None])], table, options)
    assert next(tagged).num_rows == 2
    with pytest.raises(InvalidKeyError, match="null"):
        list(tagged)
    with RecordIndexCache.for_table(table, 0, config) as cache:  # reopens: the lock was released
        assert cache.info(task.REAPER_INFO)["last_ms"] == 0  # the reaper epilogue did not run


def test_a_clean_task_runs_the_epilogue(setup) -> None:
    table, config = setup
    rows = list(task.tag_batches([batch(["a", "x"])], table, TagOptions(key="id", partition="dt", cache=config)))
    assert rows[0].column("_dbidx_is_update").to_pylist() == [True, False]
    with RecordIndexCache.for_table(table, 0, config) as cache:
        assert cache.info(task.REAPER_INFO)["last_ms"] > 0
