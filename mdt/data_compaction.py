"""Data compaction: rewrite a file group's files into one base file holding only its live rows.

Why: every upsert adds a file per file group it touches and never removes a superseded or deleted row, so data on
disk and the files a read must open grow with every batch. A data compaction merges each chosen file group
exactly as a reader would (mdt/data_reader.py) and publishes, as one `data_compaction` instant, the new bases and
the files they replace.

Concurrent upserts never conflict with it: the compaction reads a snapshot (its start seq), replaces only files
of that snapshot, and its base stands where the newest file it replaced stood - a file an upsert committed while
the compaction ran is not replaced and stays newer than the base, so readers merge it on top. Only another data
compaction of the same files conflicts (the later one publishes nothing). Replaced files stay on disk until a
`clean` at least `retain_completions` completions later deletes them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

import pyarrow as pa
import pyarrow.compute as pc

from dbidx.errors import ConflictError
from dbidx.mdt import layout
from dbidx.mdt.data_reader import (
    DELETED_COLUMN, INSTANT_COLUMN, ReadUnit, data_file_path, plan_read, read_unit, write_data_file,
)
from dbidx.mdt.records import ACTION_DATA_COMPACTION, CompletedInstant, DataFileRecord
from dbidx.mdt.table import Table


@dataclass(frozen=True)
class DataCompactionResult:
    """What a data compaction did (record None when no file group needed it)."""

    record: CompletedInstant | None
    file_groups: int
    files_replaced: int
    rows_written: int
    bytes_before: int
    bytes_after: int


def compact_data(table: Table, partitions: Iterable[str] | None = None, min_files: int = 2) -> DataCompactionResult:
    """Rewrite every file group with at least `min_files` live data files into one base of its live rows."""
    # 1. The snapshot: file groups worth compacting as of now.
    plan = plan_read(table, partitions)
    todo = [u for u in plan.units if len(u.files) >= max(min_files, 1) and plan.key is not None]
    if not todo:
        return DataCompactionResult(None, 0, 0, 0, 0, 0)
    schema = pa.schema(list(plan.schema) + [pa.field(INSTANT_COLUMN, pa.string())])
    writer = table.timeline.start(ACTION_DATA_COMPACTION)
    replaced = [f.path for u in todo for f in u.files]
    bases: list[DataFileRecord] = []

    def check(news: list[CompletedInstant]) -> None:
        mine = set(replaced)
        for rec in news:
            if rec.action == ACTION_DATA_COMPACTION and mine.intersection(rec.replaced):
                raise ConflictError(f"data compaction {writer.instant} overlaps data compaction {rec.instant} "
                                    f"(seq {rec.seq}) on the same files; nothing was published, run it again")

    try:
        # 1b. A compaction that published between the snapshot and this instant's start counts too.
        check(table.timeline.completed(after_seq=plan.seq, upto_seq=writer.start_seq))
        # 2. Declare the bases (a rollback finds them after a crash), then write each: live rows only, each row
        #    keeping the instant that wrote it.
        paths = {(u.partition, u.file_group): data_file_path(u.partition, u.file_group, writer.instant, 0)
                 for u in todo}
        table.timeline.mark_inflight(writer, paths.values())
        for unit in todo:
            base = _write_base(table, unit, plan.key or "", schema, paths[(unit.partition, unit.file_group)])
            if base is not None:
                bases.append(base)

        def build(seq: int) -> CompletedInstant:
            return CompletedInstant(seq=seq, instant=writer.instant, action=ACTION_DATA_COMPACTION,
                                    table_id=table.props.table_id, completed_at_ms=int(time.time() * 1000),
                                    start_seq=writer.start_seq, data_files=tuple(bases), replaced=tuple(replaced))

        # 3. Publish: readers switch from the old files to the bases in one step.
        record = table.timeline.publish(writer, build, check)
    except BaseException:
        table.timeline.rollback(writer.instant)
        raise
    return DataCompactionResult(record, len(todo), len(replaced), sum(b.rows for b in bases),
                                sum(u.bytes for u in todo), sum(b.size for b in bases))


def _write_base(table: Table, unit: ReadUnit, key: str, schema: pa.Schema, rel: str) -> DataFileRecord | None:
    """One file group's live rows as a base data file (None when every record of the group was deleted)."""
    live = read_unit(table.io, unit, key, schema)
    if live.num_rows == 0:
        return None
    live = live.append_column(DELETED_COLUMN, pa.array([False] * live.num_rows))
    live = live.take(pc.sort_indices(live, [(key, "ascending")]))  # sorted by key: tighter statistics per row group
    return write_data_file(table.io, layout.validate_table_path(rel), live, unit.partition, unit.file_group)
