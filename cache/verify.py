"""verify: compare every ready partition of a cache with the index snapshot at the seq it claims to reflect."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dbidx.cache.catchup import check_table
from dbidx.cache.codec import global_location
from dbidx.cache.record_cache import RecordIndexCache
from dbidx.errors import HistoryCompactedError
from dbidx.index.rli_files import FILE_GROUP, KEY, PARTITION
from dbidx.table.facade import Table

MAX_EXAMPLES = 5


@dataclass
class PartitionDiff:
    """Differences between one cache partition and the index."""

    partition: str
    synced_seq: int
    cache_entries: int
    index_entries: int
    missing: int = 0  # in the index, not in the cache
    extra: int = 0  # in the cache, not in the index
    wrong_location: int = 0
    examples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No difference at all."""
        return self.missing == self.extra == self.wrong_location == 0


@dataclass
class VerifyResult:
    """The outcome of verify(): per-partition diffs and an overall verdict."""

    watermark: int
    partitions: list[PartitionDiff]

    @property
    def ok(self) -> bool:
        """Every partition matches."""
        return all(p.ok for p in self.partitions)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {
            "ok": self.ok,
            "watermark": self.watermark,
            "partitions": [
                {**vars(p), "ok": p.ok, "mdt_entries": p.index_entries}  # 0.1's name, for 0.2 only
                for p in self.partitions
            ],
        }


def verify(cache: RecordIndexCache, table: Table) -> VerifyResult:
    """Read each ready partition fully and diff it with the index snapshot of the cache's shard at its synced seq.

    A cache synced to a seq whose index files a clean has removed since cannot be compared: HistoryCompactedError,
    saying to sync the cache first (`dbidx.cache.catchup.sync(cache, table)` or `dbidx cache sync`).
    """
    try:
        return _verify(cache, table)
    except HistoryCompactedError as exc:
        raise HistoryCompactedError(
            f"{exc}. The cache {cache.path} is behind a clean of the index, so its state at its synced seq cannot "
            "be rebuilt to compare with: sync it first (dbidx.cache.catchup.sync(cache, table), or `dbidx cache sync "
            f"{table.uri} --cache-dir <dir>`), then verify"
        ) from exc


def _verify(cache: RecordIndexCache, table: Table) -> VerifyResult:
    check_table(cache, table)
    shard = cache.shard
    diffs = []
    for partition, state in sorted(cache.partitions().items()):
        # 1. The truth at the seq the partition says it reflects.
        if cache.global_mode:
            snap = table.snapshot(None, shard=shard, as_of=state.synced_seq)
            truth = {
                k: global_location(p, fg)
                for k, p, fg in zip(
                    snap.column(KEY).to_pylist(),
                    snap.column(PARTITION).to_pylist(),
                    snap.column(FILE_GROUP).to_pylist(),
                )
            }
        else:
            snap = table.snapshot(partition, shard=shard, as_of=state.synced_seq)
            truth = dict(zip(snap.column(KEY).to_pylist(), snap.column(FILE_GROUP).to_pylist()))
        # 2. The cache's committed content, compared entry by entry.
        diff = PartitionDiff(partition, state.synced_seq, 0, len(truth))
        seen = set()
        for key, location in cache.items(partition):
            diff.cache_entries += 1
            seen.add(key)
            expected = truth.get(key)
            if expected is None:
                diff.extra += 1
                _example(diff, f"extra key {key!r} -> {location!r}")
            elif expected != location:
                diff.wrong_location += 1
                _example(diff, f"key {key!r}: cache {location!r}, index {expected!r}")
        for key in truth.keys() - seen:
            diff.missing += 1
            _example(diff, f"missing key {key!r} -> {truth[key]!r}")
        diffs.append(diff)
    return VerifyResult(cache.watermark, diffs)


def _example(diff: PartitionDiff, text: str) -> None:
    if len(diff.examples) < MAX_EXAMPLES:
        diff.examples.append(text)
