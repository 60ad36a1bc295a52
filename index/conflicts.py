"""Optimistic concurrency on keys: does a commit that completed meanwhile touch a key this instant relied on?

An instant records, per index group (partition and shard; in global mode the shard), the keys it *touched*: every
key it inserted, deleted or moved, and for an upsert also every key it only tagged (an update writes no index entry
but relies on the key still living where the index said; a delete of a missing key relies on it still being
absent). At publish time, every commit or build_index that completed after the instant's tags were computed and
wrote index entries (inserts, tombstones, moves) in the same group is compared key by key with the touched set.
Any common key is a ConflictError: the instant publishes nothing and its batch must be re-tagged. Which pairs
conflict, and why, is the table in docs/DESIGN.md section 3.

Only groups with overlapping key ranges are read, one at a time, so the publisher's memory is bounded by one
group's keys, not by the batch.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dbidx.arrays import one_chunk
from dbidx.errors import ConflictError, CorruptFileError, DbidxError
from dbidx.index import rli_files
from dbidx.storage import layout
from dbidx.storage.fileio import DECODE_ERRORS, FileIO, file_checksum
from dbidx.storage.records import ENTRY_ACTIONS, CompletedInstant, FileRecord

GroupKey = tuple[str | None, int]
# The partition column of a task's touched-keys file that spans several partitions. Not "partition": a global-mode
# delta file, which serves as its group's touched file when it holds every touched key, has a column of that name.
TOUCHED_PARTITION = "touched_partition"


@dataclass(frozen=True)
class TouchedKeys:
    """The keys an instant touched in one index group, where to find them, and since when they must hold.

    `since_seq`: the completion seq the keys were tagged against; commits at or before it were already seen.
    `path`/`size`/`checksum`: a sorted Parquet file with a `key` column (an upsert task's touched file, or its delta
    file when every touched key has an entry); `keys`: the sorted keys in memory instead (the library writer).
    """

    partition: str | None
    shard: int
    min_key: str
    max_key: str
    since_seq: int
    path: str | None = None
    size: int = 0
    checksum: str = ""
    keys: pa.Array | None = None

    def to_dict(self) -> dict:
        """Plain form for task results (keys in memory are never shipped)."""
        return {
            "partition": self.partition,
            "shard": self.shard,
            "min_key": self.min_key,
            "max_key": self.max_key,
            "since_seq": self.since_seq,
            "path": self.path,
            "size": self.size,
            "checksum": self.checksum,
        }

    @classmethod
    def parse(cls, data: dict, since_min: int, since_max: int) -> "TouchedKeys":
        """Rebuild a task's report strictly: typed fields, a path inside the table, a seq that exists."""
        try:
            t = cls(**data)
            ok = (
                isinstance(t.shard, int)
                and isinstance(t.min_key, str)
                and isinstance(t.max_key, str)
                and t.min_key <= t.max_key
                and isinstance(t.since_seq, int)
                and since_min <= t.since_seq <= since_max
                and (t.partition is None or isinstance(t.partition, str))
                and isinstance(t.path, str)
                and isinstance(t.size, int)
                and isinstance(t.checksum, str)
            )
            if ok:
                layout.validate_table_path(t.path)
        except (TypeError, DbidxError) as exc:
            raise ValueError(f"touched-keys record {data!r} is not valid: {exc}") from exc
        if not ok:
            raise ValueError(f"touched-keys record {data!r} is not valid")
        return t

    def load(self, io: FileIO) -> pa.Array:
        """The touched keys (read and verified from the file if they are not in memory)."""
        if self.keys is not None:
            return self.keys
        assert self.path is not None
        data = io.read_verified(self.path, self.size, self.checksum, "touched-keys file")
        try:
            parquet = pq.ParquetFile(pa.BufferReader(data))
            if TOUCHED_PARTITION not in parquet.schema_arrow.names:  # the group's delta file
                return one_chunk(parquet.read(columns=[rli_files.KEY]).column(rli_files.KEY))
            table = parquet.read(columns=[TOUCHED_PARTITION, rli_files.KEY])  # a task's touched-keys file
            column = table.column(TOUCHED_PARTITION)
            mine = pc.is_null(column) if self.partition is None else pc.equal(column, self.partition)
            keys = one_chunk(table.filter(mine).column(rli_files.KEY))
        except DECODE_ERRORS as exc:
            raise CorruptFileError(f"touched-keys file {io.path(self.path)} is unreadable: {exc}") from exc
        # This group's rows must be there and span the range its record states: none would hide every conflict.
        if not len(keys) or keys[0].as_py() != self.min_key or keys[-1].as_py() != self.max_key:
            raise CorruptFileError(
                f"touched-keys file {io.path(self.path)} does not hold the keys its record states "
                f"for partition {self.partition!r} ({len(keys)} found, range {self.min_key!r} to "
                f"{self.max_key!r} expected)"
            )
        return keys


def write_touched_groups(
    io: FileIO, rel: str, groups: list[tuple[str | None, pa.Array]], shard: int, since_seq: int
) -> list[TouchedKeys]:
    """Write the keys a task tagged in the groups of one shard (each group's keys sorted, distinct, non-empty;
    partition None in global mode) as one file of (partition, key) rows: one write per task, not one per partition.
    Each group's record names the file and its own key range; `TouchedKeys.load` reads back that group's rows."""
    table = pa.table(
        {
            TOUCHED_PARTITION: pa.concat_arrays([pa.repeat(pa.scalar(p, pa.string()), len(k)) for p, k in groups]),
            rli_files.KEY: pa.concat_arrays([k.cast(pa.string()) for _, k in groups]),
        }
    )
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd", use_dictionary=[TOUCHED_PARTITION])
    data = sink.getvalue()
    io.write_atomic(rel, data)
    checksum = file_checksum(data)
    return [TouchedKeys(p, shard, k[0].as_py(), k[-1].as_py(), since_seq, rel, data.size, checksum) for p, k in groups]


def check_conflicts(
    io: FileIO,
    instant: str,
    news: list[CompletedInstant],
    touched: dict[GroupKey, TouchedKeys],
    cleaned: Callable[[str], bool] = lambda path: False,
) -> None:
    """Raise ConflictError if a commit in `news` wrote index entries for a key this instant touched.

    Groups are checked one at a time (their touched keys are dropped before the next group is read), so memory is
    bounded by one group, not by the batch. `cleaned(path)` says whether a clean removed a file since: then the
    keys it held cannot be compared, and the instant conservatively conflicts.
    """
    # 1. Which of the new commits' files can overlap which of our groups (key ranges only, nothing read yet).
    candidates: dict[GroupKey, list[tuple[CompletedInstant, FileRecord]]] = defaultdict(list)
    for rec in news:
        if rec.action not in ENTRY_ACTIONS:
            continue  # compaction, clean and rollback change no live entry
        for f in rec.files:
            mine = touched.get((f.partition, f.shard))
            if mine is None or rec.seq <= mine.since_seq or f.min_key is None or f.max_key is None:
                continue
            if mine.max_key < f.min_key or mine.min_key > f.max_key:
                continue
            candidates[(f.partition, f.shard)].append((rec, f))
    # 2. Per group: our keys against each overlapping file's keys.
    for group, items in candidates.items():
        keys = touched[group].load(io)
        for rec, f in items:
            where = "the global index" if f.partition is None else f"partition {f.partition!r}"
            if cleaned(f.path):
                raise ConflictError(
                    f"instant {instant} cannot be checked against instant {rec.instant} (seq {rec.seq}): its index "
                    f"file for {where}, shard {f.shard} was compacted and cleaned while this instant ran. Nothing "
                    "was published; re-tag the batch against the new index and retry."
                )
            theirs = rli_files.read_rli_file(io, f, columns=[rli_files.KEY]).column(rli_files.KEY)
            clash = keys.filter(pc.is_in(keys, value_set=theirs))
            if len(clash):
                sample = ", ".join(repr(k) for k in clash.slice(0, 5).to_pylist())
                raise ConflictError(
                    f"instant {instant} conflicts with instant {rec.instant} (completed at seq {rec.seq} while this "
                    f"one ran): it inserted, deleted or moved {len(clash)} key(s) this instant also wrote or tagged, "
                    f"in {where}, shard {f.shard}, e.g. {sample}. Nothing was published; re-tag the batch against "
                    "the new index and retry."
                )
        del keys


def touched_in_memory(sorted_keys_by_group: dict[GroupKey, pa.Array], since_seq: int) -> dict[GroupKey, TouchedKeys]:
    """TouchedKeys for keys held in memory (each array sorted, non-empty)."""
    return {
        g: TouchedKeys(g[0], g[1], k[0].as_py(), k[-1].as_py(), since_seq, keys=k)
        for g, k in sorted_keys_by_group.items()
        if len(k)
    }
