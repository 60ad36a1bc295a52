"""A commit by another writer that lands while a compaction runs, right after the compaction planned its work."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from dbidx.table.facade import Table


@contextmanager
def commit_after_planning(table: Table, write: Callable[[object], None]) -> Iterator[None]:
    """Within the block, the table's first refresh (what a compaction plans from) is followed by a commit of
    another opener of the same table, made by `write(writer)`: the compaction then publishes over it."""
    original_refresh = table.refresh
    done = []

    def refresh_then_commit(**kwargs):
        result = original_refresh(**kwargs)
        if not done:
            done.append(True)
            with Table.open(table.uri).new_commit() as w:
                write(w)
        return result

    table.refresh = refresh_then_commit
    try:
        yield
    finally:
        table.refresh = original_refresh
    assert done, "the table was never refreshed: no commit landed"
