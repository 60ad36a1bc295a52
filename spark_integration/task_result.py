"""What a shard task sends the driver, typed: built on the executor, packed, and parsed strictly on the driver, all in
this one module, so the two sides cannot drift apart.

The wire form is a msgpack'd dict (one binary cell per task: RESULT_DDL); `to_wire` and `parse` are its only writer and
reader. A result is metadata only: the records of the files the task wrote, its touched-key files, the rows they
supersede, the index changes per partition, the shards' metrics and, under Spark, which attempt of the task it is.
Never a key. Parsing treats it as untrusted input: every record is checked (ValueError, KeyError or TypeError, which
the driver turns into a CommitError and publishes nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import pyarrow as pa
from pyroaring import BitMap

from dbidx.cache.metrics import CacheCounters
from dbidx.counters import gauge
from dbidx.index.conflicts import TouchedKeys
from dbidx.plain import plain
from dbidx.spark_integration.job_report import TASK_KEY, TaskAttempt
from dbidx.spark_integration.tagger import TagCounts
from dbidx.storage import layout
from dbidx.storage.records import DataFileRecord, FileRecord, PartitionChange

RESULT_DDL = "shard int, attempt long, payload binary"


@dataclass
class TaskCounts(TagCounts, CacheCounters):
    """Tagging counts plus the cache counters of the same work (summed per shard, then per commit)."""

    reloads: int = 0
    evictions: int = 0
    cache_rebuilds: int = 0  # damaged caches discarded and rebuilt from the index within the task


@dataclass
class ShardMetrics(TaskCounts):
    """One shard's work in one task (docs/DESIGN.md section 6): tagging counts, cache counters, catch-up and timings."""

    shard: int = gauge()
    open_seconds: float = 0.0
    sync_seconds: float = 0.0  # taken from the cache's counters, as its other counters
    tag_seconds: float = 0.0
    write_seconds: float = 0.0
    stage_seconds: float = 0.0  # a bulk load's staging of its entries for the cache (inside write_seconds)
    staged_entries: int = 0
    # Older data files whose key index the deletion vectors needed, by where it came from (data/key_columns.py):
    # this worker's memory, the executor's key files, or the data file itself (decoded, hashed, sorted).
    keys_from_memory: int = 0
    keys_from_key_files: int = 0
    keys_from_data_files: int = 0
    # 1 when the shard's work ran in its cache service (cache.service), and the seconds the task waited for it
    # (sending the rows, the work, the answer; the start of the service too, the first time).
    served: int = 0
    service_seconds: float = 0.0
    # Catch-up entries the service applied after the previous batch's commit landed, before this task came (off
    # the task's critical path; the task's own catch-up is in catchup_entries).
    ahead_entries: int = 0
    cache_disk_bytes: int = gauge()
    cache_entries: int = gauge()
    tagged_seq: int = gauge()  # the completion seq the shard's rows were tagged against
    partitions: list[str] = field(default_factory=list)


@dataclass
class TaskResult:
    """One task's result: what it wrote and did, as the driver checks and publishes it."""

    superseded_seq: int  # the data view the superseded rows were computed against
    files: list[DataFileRecord] = field(default_factory=list)
    index_files: list[FileRecord] = field(default_factory=list)
    touched: list[TouchedKeys] = field(default_factory=list)
    changes: dict[str, PartitionChange] = field(default_factory=dict)
    superseded: dict[str, BitMap] = field(default_factory=dict)  # data file -> rows the task's files supersede
    metrics: list[ShardMetrics] = field(default_factory=list)
    attempt: TaskAttempt | None = None  # under Spark: which attempt of the task this is, where it ran
    # Parsed results only: each shard's metrics as sent, which the driver completes with Spark's figures for the
    # summary's per-shard part.
    sent_metrics: list[dict[str, Any]] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        """The wire form (plain dicts, lists, numbers, strings and bytes)."""
        wire: dict[str, Any] = {
            "files": [plain(f) for f in self.files],
            "index_files": [plain(f) for f in self.index_files],
            "touched": [t.to_dict() for t in self.touched],
            "superseded": {"seq": self.superseded_seq, "rows": {p: b.serialize() for p, b in self.superseded.items()}},
            "changes": {p: plain(c) for p, c in self.changes.items()},
            "metrics": [m.to_dict() for m in self.metrics],
        }
        if self.attempt is not None:
            wire[TASK_KEY] = plain(self.attempt)
        return wire

    def pack(self) -> bytes:
        """The bytes the driver receives."""
        return pack_payload(self.to_wire())

    @classmethod
    def parse(cls, payload: bytes, since_min: int, since_max: int) -> "TaskResult":
        """A result as received, every record checked; since_min and since_max bound the seqs its touched-key
        reports may name (the instant's start and the latest completion)."""
        sent = unpack_result(payload)
        if not isinstance(sent, dict):
            raise ValueError(f"a task result is a {type(sent).__name__}, not a mapping")
        seq, rows = _superseded(sent["superseded"])
        sent_metrics = sent["metrics"]
        if not isinstance(sent_metrics, list):
            raise ValueError(f"task metrics {sent_metrics!r:.100} are not a list")
        return cls(
            superseded_seq=seq,
            superseded=rows,
            files=[DataFileRecord.parse(f, "data file") for f in sent["files"]],
            index_files=[FileRecord.parse(f, "index file") for f in sent["index_files"]],
            touched=[TouchedKeys.parse(t, since_min, since_max) for t in sent["touched"]],
            changes={p: PartitionChange.parse(c, p) for p, c in sent["changes"].items()},
            # Strict: every number present, >= 0, whole where an int.
            metrics=[ShardMetrics.from_dict(m) for m in sent_metrics],
            sent_metrics=sent_metrics,
            attempt=TaskAttempt.from_dict(sent[TASK_KEY]) if TASK_KEY in sent else None,
        )


def _superseded(sent: Any) -> tuple[int, dict[str, BitMap]]:
    """A task's superseded rows (view seq, data file -> positions), parsed strictly (bad input: ValueError)."""
    seq, rows = sent["seq"], sent["rows"]
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0 or not isinstance(rows, dict):
        raise ValueError(f"superseded rows {sent!r:.100} are not (seq, positions)")
    return seq, {layout.validate_table_path(p): BitMap.deserialize(b) for p, b in rows.items()}


def pack_payload(wire: dict[str, Any]) -> bytes:
    """A result's wire form as bytes (tests craft malformed results with it)."""
    return msgpack.packb(wire, use_bin_type=True)


def unpack_result(payload: bytes) -> Any:
    """Inverse of pack_payload: the wire form, not yet checked (TaskResult.parse checks it)."""
    return msgpack.unpackb(payload, raw=False)


def pack_result(shard: int, attempt: int, result: TaskResult) -> pa.RecordBatch:
    """The one-row Arrow batch a task returns to the driver (RESULT_DDL)."""
    return pa.RecordBatch.from_pydict(
        {
            "shard": pa.array([shard], pa.int32()),
            "attempt": pa.array([attempt]),
            "payload": pa.array([result.pack()], pa.binary()),
        }
    )
