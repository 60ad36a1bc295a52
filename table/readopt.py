"""Re-adopting a table's Delta log as it is now: the remedy when other engines' versions cannot be absorbed.

Absorbing refuses what would break the upsert contract (docs/FORMAT.md section 12c): a key live twice, a changed
partitioning, a dropped column. Once the user has put the Delta table into a form dbidx can index (deleted the
repeated rows with their engine, say), or wants the new partitioning, the index is rebuilt from the current
snapshot: the old index folder is moved aside (`.dbidx-replaced-<UTC time>/`, hidden, so a Delta VACUUM leaves it),
and a new one adopts the table exactly as `dbidx build-index` adopts any Delta table. What is kept: every data
file, the Delta log and its history (Delta readers' time travel), the shard count and index mode. What goes:
dbidx's own time travel before the re-adoption, and every executor cache of the old index (they are keyed by the
table id, which is new: the reaper deletes them).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from dbidx.data.delta_log import listed_versions
from dbidx.errors import InvalidInputError
from dbidx.table.build_index import BuildIndexResult, build_index
from dbidx.table.facade import Table
from dbidx.progress import Progress
from dbidx.storage import layout
from dbidx.storage.fileio import FileIO


@dataclass(frozen=True)
class ReadoptResult:
    """The new index's build, and where the old index folder went."""

    table: Table
    build: BuildIndexResult
    moved_to: str


def readopt(
    uri: str,
    key_column: str,
    partition_columns: Sequence[str] | None = None,
    num_shards: int | None = None,
    global_index: bool | None = None,
    storage_options: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
) -> ReadoptResult:
    """Rebuild the index of the dbidx table at `uri` from its Delta table as it is now (shards and index mode of
    the old index unless given). Stop the table's dbidx writers first: a pending instant refuses. On any failure
    the old index is put back and nothing else has changed."""
    # 1. The old index: there, local (adoption reads local tables), no dbidx writer running.
    old = Table.open(uri, storage_options=storage_options)
    if not old.io.is_local:
        raise InvalidInputError(f"re-adopting {old.uri}: adopting a Delta table works on local tables only for now")
    if not listed_versions(old.io):
        raise InvalidInputError(f"{old.uri} has no Delta log to re-adopt")
    pending = old.timeline.pending()
    if pending:
        raise InvalidInputError(
            f"{old.uri} has pending instant(s) {pending[:5]}: stop the table's dbidx writers "
            "(or roll back the dead ones: `dbidx rollback URI --all-pending`) before re-adopting"
        )
    shards = old.num_shards if num_shards is None else num_shards
    global_mode = old.global_index if global_index is None else global_index
    # 2. Move it aside (one rename: the table has no index for that instant, and no dbidx writer may run).
    root = old.io.path("")
    moved = f"{layout.META_DIR}-replaced-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    os.rename(os.path.join(root, layout.META_DIR), os.path.join(root, moved))
    # 3. A new index adopting the current snapshot; on failure the new folder goes and the old one comes back.
    try:
        table = Table.create(uri, num_shards=shards, global_index=global_mode, storage_options=storage_options)
        result = build_index(table, key_column, partition_columns, progress=progress)
    except BaseException:
        io = FileIO.from_uri(uri, None, storage_options)
        if io.exists(layout.META_DIR):
            io.delete_dir(layout.META_DIR)
        os.rename(os.path.join(root, moved), os.path.join(root, layout.META_DIR))
        raise
    return ReadoptResult(table, result, moved)
