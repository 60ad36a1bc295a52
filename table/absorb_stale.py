"""Another engine's stale rewrite (table/absorb.py): a data-neutral Delta version (OPTIMIZE, Z-order: every `add`
and `remove` with dataChange false) whose removes name files that are no longer live, because it planned on a
snapshot from before a rewrite of the same files that committed first - dbidx's own data compaction, or that
engine's own earlier OPTIMIZE. delta-rs 1.6.6 commits such a version: since delta-io/delta-rs#3982 its conflict
checker lets a transaction through whose removes a concurrent commit already removed with dataChange=false (see
docs/DESIGN.md). Delta readers then read the rows of those files twice: once where the first rewrite put them, once
in the stale version's new files.

The resolution, provable from the version alone: a data-neutral version must leave the table's rows as they were.
Each row of its new files is either the copy of a row of a file it validly removed (a live file whose `remove`
Delta readers apply) or the copy of a row the first rewrite already placed elsewhere (or that was deleted since).
The first kind re-points its key as any OPTIMIZE does; the second is masked: dbidx gives the new file a deletion
vector holding those rows, in the absorb record (so the index and dbidx's own reads never see them) and, in the
next Delta version dbidx writes, in the log (data/delta_derive.py `_log_catch_up`: the absorber writes one at once).
A key the valid removes held must come exactly once; any doubt is refused by name (ForeignDuplicateError).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyroaring import BitMap

from dbidx.data.delta_actions import VersionActions
from dbidx.data.deletion_vectors import positions_bitmap
from dbidx.errors import CorruptFileError

STALE_EXTRA = "stale_rewrite"  # the absorb record's extra: the stale removes and the rows masked per new file


@dataclass
class StaleRewrite:
    """The stale removes of the one version of a run that has them (empty: none), and what was masked."""

    removes: list[str] = field(default_factory=list)
    masked: dict[str, int] = field(default_factory=dict)  # new file -> rows masked

    def __bool__(self) -> bool:
        return bool(self.removes)

    def about(self) -> dict[str, Any]:
        """The record's STALE_EXTRA: what a reader of the log (and `dbidx verify`) can check."""
        return {"removes": sorted(self.removes), "masked": dict(sorted(self.masked.items()))}


def split_at_stale(live: set[str], run: list[VersionActions]) -> tuple[list[VersionActions], StaleRewrite]:
    """The part of `run` to absorb now, and its stale removes: the versions before the first one that removes a file
    not live at that point (absorbed first, as a run), or that version alone. A version with stale removes that is
    not data-neutral is a log dbidx cannot describe (CorruptFileError naming it)."""
    present = set(live)
    for i, actions in enumerate(run):
        stale = sorted({a.path for a in actions.removes if a.path not in present})
        if stale and not actions.synthetic:
            if i > 0:
                return run[:i], StaleRewrite()
            if any(a.data_change for a in actions.removes + actions.adds):
                raise CorruptFileError(
                    f"Delta version {actions.version} ({actions.writer}) removes {stale[0]!r}, which is not a live "
                    "file at that version, and changes data (dataChange true): the index and the log disagree. "
                    "A stale data-neutral rewrite (OPTIMIZE) is absorbed; this is not one. Restore the version "
                    "before with that engine, or re-adopt: `dbidx build-index URI --key COLUMN --readopt`"
                )
            return run[:1], StaleRewrite(removes=stale)
        present -= {a.path for a in actions.removes}
        present |= {a.path for a in actions.adds}
    return run, StaleRewrite()


def _scoped(keys: pa.Array | pa.ChunkedArray, partitions: pa.Array | pa.ChunkedArray | None) -> pa.Array:
    """Keys made unique per partition (partitioned index) or table-wide (global index: `partitions` None)."""
    keys = pc.cast(keys, pa.string())
    if partitions is None:
        return keys
    return pc.binary_join_element_wise(pc.cast(partitions, pa.string()), keys, "\x00")


def stale_copies(
    left: pa.Table, keys: pa.Array, partition: str, deleted: BitMap, global_index: bool, stale: StaleRewrite, path: str
) -> BitMap:
    """Rows of new file `path` (its `keys`, the rows its own vector `deleted` hides left out) that copy no row of a
    file the version validly removed (`left`: the rows that left, key and partition): the rows to mask."""
    scope = None if global_index else pa.repeat(pa.scalar(partition, pa.string()), len(keys))
    valid = _scoped(left.column("key"), None if global_index else left.column("partition"))
    copy = pc.fill_null(pc.is_in(_scoped(keys, scope), value_set=valid), False).to_numpy(zero_copy_only=False)
    masked = positions_bitmap(np.flatnonzero(~copy)) - deleted
    if masked:
        stale.masked[path] = len(masked)
    return masked
