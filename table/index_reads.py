"""The Table's reads of its record-level index: snapshots, incremental changes (what a cache catches up
from), their plan, and point lookups. A mixin of `table.facade.Table`, kept apart so the facade stays small."""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbidx.errors import (
    InvalidInputError,
)
from dbidx.index import rli_files
from dbidx.index.point_lookup import lookup
from dbidx.storage import layout
from dbidx.storage.records import FileRecord


class IndexReads:
    """Table methods that read the index: snapshot, incremental, incremental_plan, history_before, lookup."""

    def snapshot(self, partition: str | None, shard: int | None = None, as_of: int | str | None = None) -> pa.Table:
        """Live entries of a partition (or, in global mode with partition None, the whole index) at an instant.

        `as_of` is a completed instant id or a completion seq: the table as it was right after that completion.
        """
        shards = self._shards(shard)
        if partition is not None:
            layout.validate_partition(partition)
        elif not self.global_index:
            raise InvalidInputError("snapshot of a partitioned index needs a partition path")
        # 1. The seq and every shard's file list from one state of the view: another thread's refresh moves the
        #    timeline first and then folds the records in, so a seq read outside the lock can be ahead of the view
        #    (a compaction half folded: replaced files gone, its base not there yet).
        with self._view_lock:
            upto = self.seq_at(as_of)
            listed = [self._view.files(None if self.global_index else partition, s, upto) for s in shards]
        # 2. The files are read without the lock (slow; the view is not needed for them).
        pieces = []
        for files in listed:
            merged = rli_files.resolve_latest([self.read_index_file(f) for f in files], self.schema)
            if self.global_index and partition is not None:
                merged = merged.filter(pc.equal(merged.column(rli_files.PARTITION), partition))
            pieces.append(merged)
        return pa.concat_tables(pieces) if pieces else self.schema.empty_table()

    def incremental(
        self,
        start_exclusive: int | str | None,
        end_inclusive: int | str | None = None,
        partitions: Iterable[str] | None = None,
        shard: int | None = None,
    ) -> pa.Table:
        """Entries (inserts and tombstones) committed in (start, end], in commit order, with `partition` and `seq`.

        What a cache applies to catch up. Raises HistoryCompactedError if cleaning removed a needed file.
        """
        wanted = None if partitions is None else {layout.validate_partition(p) for p in partitions}
        return self.read_incremental(self.incremental_files(start_exclusive, end_inclusive, wanted, shard), wanted)

    def incremental_files(
        self,
        start_exclusive: int | str | None,
        end_inclusive: int | str | None = None,
        partitions: Iterable[str] | None = None,
        shard: int | None = None,
    ) -> list[tuple[int, FileRecord]]:
        """The (seq, record) of each delta file `incremental` reads, in commit order (a global file holds every
        partition: it is listed whatever `partitions` says)."""
        wanted = None if partitions is None else set(partitions)
        shards = set(self._shards(shard))
        # The seqs and the listing under the view lock: another thread's refresh folds records into the same view
        # in place (a listing beside it fails with "dictionary changed size during iteration"), and a seq read
        # outside the lock can be ahead of the records folded so far (the newest files would be missing).
        with self._view_lock:
            start = self.seq_at(start_exclusive) if start_exclusive is not None else 0
            end = self.seq_at(end_inclusive)
            between = self._view.delta_files_between(start, end)
        return [
            (seq, record)
            for seq, record in between
            if record.shard in shards and (wanted is None or record.partition is None or record.partition in wanted)
        ]

    def read_incremental(
        self, files: list[tuple[int, FileRecord]], partitions: Iterable[str] | None = None
    ) -> pa.Table:
        """Read listed delta files (verified) into one table with `partition` and `seq`, a global file's rows cut to
        `partitions`. Needs no refresh: a reader thread can run it beside its caller (cache catch-up does)."""
        wanted = None if partitions is None else sorted(set(partitions))
        pieces = []
        for seq, record in files:
            table = self.read_index_file(record)
            if record.partition is not None:
                table = table.add_column(
                    1, rli_files.PARTITION, pa.repeat(pa.scalar(record.partition, pa.string()), table.num_rows)
                )
            elif wanted is not None:
                table = table.filter(pc.is_in(table.column(rli_files.PARTITION), pa.array(wanted, pa.string())))
            pieces.append(table.append_column("seq", pa.array(np.full(table.num_rows, seq, dtype=np.int64))))
        if not pieces:
            return rli_files.GLOBAL_SCHEMA.append(pa.field("seq", pa.int64())).empty_table()
        return pa.concat_tables(pieces)

    def incremental_plan(
        self, start_exclusive: int, end_inclusive: int, shard: int | None = None
    ) -> dict[str | None, tuple[int, bool]]:
        """Per partition (None in global mode): (entries committed in (start, end], whether cleaning removed
        some of that history). Lets a cache decide, per partition and before reading, to catch up or reload."""
        shards = set(self._shards(shard))
        plan: dict[str | None, tuple[int, bool]] = {}
        with self._view_lock:  # the view as one refresh left it (see incremental_files); no file is read here
            self.refresh()
            stale = self.history_before(start_exclusive)
            for _seq, record in self._view.delta_files_between(start_exclusive, end_inclusive, strict=False):
                if record.shard in shards:
                    rows, cleaned = plan.get(record.partition, (0, False))
                    plan[record.partition] = (
                        rows + record.rows,
                        cleaned or stale or self._view.is_cleaned(record.path),
                    )
        return plan

    def history_before(self, seq: int) -> bool:
        """True if history after `seq` is incomplete in this reader (as of its last refresh): it opened from a
        checkpoint that left out files replaced and cleaned after seq. Every partition behind it must reload
        (incremental_plan says so for the partitions it lists; a caller asks this for the others). The floor only
        comes from the checkpoint a reader starts from, so no refresh is needed to answer."""
        with self._view_lock:  # the first refresh may swap in the view a checkpoint holds
            return seq < self._view.history_floor

    def lookup(
        self,
        keys: Sequence[str] | pa.Array,
        partition: str | None = None,
        mode: str = "auto",
        seek_threshold: float = rli_files.DEFAULT_SEEK_THRESHOLD,
        plan: dict[str, int] | None = None,
    ) -> pa.Table:
        """Live entries for the given keys (absent keys are simply not in the result): index/point_lookup.py.

        Partitioned mode needs the partition; global mode searches the whole index. `mode` is "seek" (read only
        the row groups whose key range contains a lookup key), "scan" (read whole files) or "auto" (seek unless
        more than `seek_threshold` of a file's row groups are touched). `plan`, if given, counts files per method.
        """
        return lookup(self, keys, partition, mode, seek_threshold, plan)
