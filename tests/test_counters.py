"""The one counters type: summing by field name, gauges left alone, the strict wire form."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dbidx.cache.metrics import CacheMetrics
from dbidx.counters import Counters, gauge
from dbidx.spark_integration.driver import CommitSummary
from dbidx.spark_integration.tagger import TagCounts
from dbidx.spark_integration.task_result import ShardMetrics, TaskCounts


@dataclass
class Small(Counters):
    """A test counters class."""

    rows: int = 0
    seconds: float = 0.0
    shard: int = gauge()


def test_add_sums_the_fields_both_declare_and_never_a_gauge():
    total = Small(rows=1, shard=3)
    total.add(Small(rows=2, seconds=0.5, shard=4), TagCounts(rows=10, inserts=7), rows=1)
    assert (total.rows, total.seconds, total.shard) == (14, 0.5, 3)
    with pytest.raises(TypeError, match="Small has no counter 'shard'"):
        total.add(shard=1)


def test_a_shard_takes_the_cache_and_tagging_counters_by_name_and_the_summary_sums_shards():
    cache = CacheMetrics()
    cache.add(partition="dt=1", hits=5, misses=2, lookups=7, catchup_entries=3, sync_seconds=0.25)
    shard = ShardMetrics(shard=1, tagged_seq=9)
    shard.add(cache, TagCounts(rows=7, inserts=2, updates=5))
    assert (shard.hits, shard.misses, shard.catchup_entries, shard.sync_seconds, shard.rows, shard.inserts) == (
        5,
        2,
        3,
        0.25,
        7,
        2,
    )
    assert (shard.shard, shard.tagged_seq) == (1, 9)
    assert cache.to_dict()["per_partition"]["dt=1"]["hits"] == 5
    summary = CommitSummary(instant="x").add(*(TaskCounts.from_dict(shard.to_dict()) for _ in range(2)))
    assert (summary.hits, summary.rows, summary.seq) == (10, 14, 0)
    assert summary.to_dict()["hit_rate"] == round(10 / 14, 4)


def test_from_dict_is_strict_about_numbers_and_ignores_what_it_does_not_declare():
    data = ShardMetrics(shard=2, hits=4).to_dict()
    assert TaskCounts.from_dict(data).hits == 4  # a richer record reads as a narrower one
    with pytest.raises(KeyError):
        TaskCounts.from_dict({k: v for k, v in data.items() if k != "misses"})
    for bad in ("4", True, None, [1]):
        with pytest.raises(ValueError, match="TaskCounts.hits must be a whole number >= 0"):
            TaskCounts.from_dict({**data, "hits": bad})
