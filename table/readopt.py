"""Re-adopting a table's Delta log as it is now: the remedy when other engines' versions cannot be absorbed.

Absorbing refuses what would break the upsert contract (docs/FORMAT.md section 12c): a key live twice, a changed
partitioning, a dropped column. Once the user has put the Delta table into a form dbidx can index (deleted the
repeated rows with their engine, say), or wants the new partitioning, the index is rebuilt from the current
snapshot: the old index folder is moved aside (`.dbidx-replaced-<UTC time>/`, hidden, so a Delta VACUUM leaves it),
all but its DV files (`.dbidx/dv/`, which the Delta log's vectors point into), and a new one adopts the table
exactly as `dbidx build-index` adopts any Delta table. What is kept: every data file, its DV files, the Delta log
and its history (Delta readers' time travel), the shard count and index mode. What goes: dbidx's own time travel
before the re-adoption, and every executor cache of the old index (they are keyed by the table id, which is new: the
reaper deletes them).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from dbidx.data.delta_log import listed_versions
from dbidx.errors import InvalidInputError
from dbidx.table.build_index import BuildIndexResult, build_index
from dbidx.table.facade import Table
from dbidx.progress import Progress
from dbidx.storage import layout


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
    # 2. Move it aside, all but the DV files: the Delta log's vectors point into `.dbidx/dv/` (data/
    #    deletion_vectors.file_descriptor), so they stay where every Delta reader finds them, at every instant.
    root = old.io.path("")
    moved = f"{layout.META_DIR}-replaced-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    meta, aside = os.path.join(root, layout.META_DIR), os.path.join(root, moved)
    kept = layout.DV_DIR.rsplit("/", 1)[-1]
    os.mkdir(aside)
    for name in sorted(os.listdir(meta)):
        if name != kept:
            os.rename(os.path.join(meta, name), os.path.join(aside, name))
    # 3. A new index adopting the current snapshot; on failure the new index goes and the old one comes back.
    try:
        table = Table.create(uri, num_shards=shards, global_index=global_mode, storage_options=storage_options)
        result = build_index(table, key_column, partition_columns, progress=progress)
    except BaseException:
        _put_back(meta, aside, kept)
        raise
    return ReadoptResult(table, result, moved)


def _put_back(meta: str, aside: str, kept: str) -> None:
    """Undo a failed re-adoption: the new index's files go and the old index's come back beside the DV files that
    stayed. DV files the failed adoption wrote stay too (a few vectors' bytes; a leftover never loses data, while
    telling them from the old index's would read the old timeline)."""
    for name in os.listdir(meta):
        path = os.path.join(meta, name)
        if name != kept:
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
    for name in os.listdir(aside):
        os.rename(os.path.join(aside, name), os.path.join(meta, name))
    os.rmdir(aside)
