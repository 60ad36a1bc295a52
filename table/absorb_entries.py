"""The index side of an absorb (table/absorb.py): the key rows that left and came with another engine's Delta
versions, and the index entries they make (keys re-pointed to their new file group, tombstoned, or inserted), with
the checks that no key becomes live twice. Apart from the run, its files and its record (table/absorb.py), which
feed these rows in and write what they buffer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbidx.arrays import one_chunk
from dbidx.errors import ForeignDuplicateError
from dbidx.index import rli_files
from dbidx.table.writer import EntryBuffer
from dbidx.storage.state import TableState

_SAMPLE = 10  # keys or files an error names


class _Rows:
    """Key rows of one side of a version (the rows that left, or those that came), with their partition, file
    group and file, gathered file by file and stacked into one table."""

    def __init__(self) -> None:
        self._parts: list[pa.Table] = []
        self._files: list[str] = []

    def add(self, keys: pa.Array, partition: str, group: str, file: str) -> None:
        n = len(keys)
        self._parts.append(
            pa.table(
                {
                    "key": keys,
                    "partition": pa.repeat(pa.scalar(partition, pa.string()), n),
                    "group": pa.repeat(pa.scalar(group, pa.string()), n),
                    "file": pa.array(np.full(n, len(self._files), dtype=np.int64)),
                }
            )
        )
        self._files.append(file)

    def table(self) -> pa.Table:
        if not self._parts:
            return pa.table(
                {
                    "key": pa.array([], pa.string()),
                    "partition": pa.array([], pa.string()),
                    "group": pa.array([], pa.string()),
                    "file": pa.array([], pa.int64()),
                }
            )
        return pa.concat_tables(self._parts)

    def file_name(self, i: int) -> str:
        return self._files[i]


def _entries(
    table: TableState, buffer: EntryBuffer, left: pa.Table, came: pa.Table, came_rows: _Rows, where: str
) -> None:
    """Re-point the keys that left and came, tombstone those that only left, insert those that only came (after
    checking that none of them is live elsewhere)."""
    scopes = (
        [None]
        if table.global_index
        else sorted(set(left.column("partition").to_pylist()) | set(came.column("partition").to_pylist()))
    )
    for scope in scopes:
        old = left if scope is None else left.filter(pc.equal(left.column("partition"), scope))
        new = came if scope is None else came.filter(pc.equal(came.column("partition"), scope))
        _reject_repeats(new, came_rows, where, scope)
        index = pc.index_in(new.column("key"), value_set=old.column("key"))
        moved = pc.is_valid(index)
        stays = pc.invert(pc.is_in(old.column("key"), value_set=new.column("key")))
        repoint, insert = new.filter(moved), new.filter(pc.invert(moved))
        previous = old.take(pc.drop_null(index))
        _reject_live(table, insert, came_rows, where, scope)
        for part in _partitions(repoint):
            rows = repoint.filter(pc.equal(repoint.column("partition"), part))
            buffer.add(part, rows.column("key"), one_chunk(rows.column("group")), deleted=False, live=+1)
        for part in _partitions(previous):
            rows = previous.filter(pc.equal(previous.column("partition"), part))
            buffer.count(part, one_chunk(rows.column("group")), -1)
        tombstones = old.filter(stays)
        for part in _partitions(tombstones):
            rows = tombstones.filter(pc.equal(tombstones.column("partition"), part))
            buffer.add(part, rows.column("key"), one_chunk(rows.column("group")), deleted=True, live=-1)
        for part in _partitions(insert):
            rows = insert.filter(pc.equal(insert.column("partition"), part))
            buffer.add(part, rows.column("key"), one_chunk(rows.column("group")), deleted=False, live=+1)


def _partitions(rows: pa.Table) -> list[str]:
    return sorted(set(rows.column("partition").to_pylist())) if rows.num_rows else []


def _reject_repeats(new: pa.Table, came_rows: _Rows, where: str, scope: str | None) -> None:
    """A key may come once per scope in a version (two live rows of it would be two locations)."""
    counts = pc.value_counts(new.column("key"))
    repeated = counts.field("values").filter(pc.greater(counts.field("counts"), 1))
    if len(repeated):
        _duplicate(where, scope, repeated, new, came_rows, "it adds more than one live row of each")


def _reject_live(table: TableState, insert: pa.Table, came_rows: _Rows, where: str, scope: str | None) -> None:
    """A key that only came must not be live in another file the version left alone (a blind append)."""
    if not insert.num_rows:
        return
    found = table.lookup(one_chunk(insert.column("key")), scope)
    if found.num_rows:
        _duplicate(
            where,
            scope,
            found.column(rli_files.KEY),
            insert,
            came_rows,
            "they are live already in files it did not touch",
        )


def _duplicate(where: str, scope: str | None, keys: Any, rows: pa.Table, came_rows: _Rows, why: str) -> None:
    sample = one_chunk(keys).slice(0, _SAMPLE)
    hit = rows.filter(pc.is_in(rows.column("key"), value_set=sample))
    files = sorted({came_rows.file_name(i) for i in hit.column("file").to_pylist()})[:_SAMPLE]
    scope_text = "the table" if scope is None else f"partition {scope!r}"
    raise ForeignDuplicateError(
        f"{where} makes {len(keys)} key(s) of {scope_text} live twice ({why}), e.g. "
        f"{', '.join(repr(k) for k in sample.to_pylist())}, in {', '.join(files)}. dbidx keeps one location per key "
        "and absorbed nothing of it. Remedy: remove the repeated rows with the engine that wrote them (or restore "
        "the version before), then re-adopt the table as it then is: `dbidx build-index URI --key COLUMN --readopt` "
        "(docs/FORMAT.md section 12c)"
    )
