"""The task result: what a real shard task built comes back from its bytes the same, and bad bytes are refused."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pyarrow as pa
import pytest

from dbidx.config import CacheConfig
from dbidx.table.facade import Table
from dbidx.spark_integration import task
from dbidx.spark_integration.job_report import TaskAttempt
from dbidx.spark_integration.local import upsert_arrow
from dbidx.spark_integration.tagger import TagOptions
from dbidx.spark_integration.task_result import TaskResult, pack_payload


def _rows(n: int, version: int) -> pa.Table:
    return pa.table(
        {"id": [f"k{i:04d}" for i in range(n)], "dt": [f"2025-03-0{1 + i % 3}" for i in range(n)], "v": [version] * n}
    )


def test_a_real_result_survives_its_wire_form(tmp_path: Path) -> None:
    """Files, index files, touched keys, index changes, superseded rows, metrics and the attempt: all parsed back."""
    table = Table.create(str(tmp_path / "t"), num_shards=1)
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    upsert_arrow(_rows(60, 1), table, key="id", partition="dt", cache_config=config)  # rows to supersede
    writer = table.new_commit()
    options = TagOptions(key="id", partition="dt", cache=config)
    result = task.upsert_batches(_rows(90, 2).to_batches(), table, options, writer.instant, attempt=3)
    result.attempt = TaskAttempt(attempt_number=1, stage_id=4, host="worker-1")
    assert result.files and result.index_files and result.superseded and result.metrics
    parsed = TaskResult.parse(result.pack(), writer.started.start_seq, table.timeline.latest_seq)
    assert parsed.files == result.files and parsed.index_files == result.index_files
    assert parsed.touched == result.touched and parsed.changes == result.changes
    assert parsed.superseded_seq == result.superseded_seq and parsed.superseded == result.superseded
    assert parsed.sent_metrics == [m.to_dict() for m in result.metrics]  # as sent: the summary's per-shard part
    numbers = [{k: v for k, v in m.to_dict().items() if k != "partitions"} for m in result.metrics]
    assert [{k: v for k, v in m.to_dict().items() if k != "partitions"} for m in parsed.metrics] == numbers
    assert parsed.attempt == result.attempt
    writer.rollback()


@pytest.mark.parametrize("wire", [[1, 2], {"files": []}, {"superseded": {"seq": -1, "rows": {}}}], ids=str)
def test_bytes_that_are_not_a_result_are_refused(wire: object) -> None:
    """Not a mapping, a field missing, a negative seq: each a ValueError or KeyError (the driver's CommitError)."""
    with pytest.raises((ValueError, KeyError)):
        TaskResult.parse(msgpack.packb(wire) if not isinstance(wire, dict) else pack_payload(wire), 0, 0)
