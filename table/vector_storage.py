"""Bringing every deletion vector of the Delta log into the form the table's `dbidx.deletionVectors.storage` asks
for: inline (the default) or a pointer into a DV file (data/deletion_vectors.vectors_in_files says why each).

A vector keeps the form it was logged in: every later `remove` must repeat its descriptor. So a table whose setting
changed, or one another engine wrote file-backed vectors into (Delta Spark's DELETE, MERGE, UPDATE), holds vectors
of the other form until each file gets a new vector, which for cold partitions is never. `match_vector_storage` does
it at once: one dbidx version (a commit of no rows) that gives every live file whose log vector has the other form
the same vector in a new DV file of dbidx's, as a `remove` (the old descriptor, which cancels the old add) and an
`add` (the new form), both `dataChange: false` since no row changes (operation REORG). Moving to files, a Delta
checkpoint of that version follows: it keeps no inline vector on its tombstones (data/delta_checkpoint.py), so a
Delta Spark VACUUM reading the log from it meets none. `dbidx sync` and `dbidx config URI
dbidx.deletionVectors.storage=...` run it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dbidx.data.delta_checkpoint import write_delta_checkpoint
from dbidx.data.delta_derive import VECTORS_MOVED_EXTRA
from dbidx.data.deletion_vectors import vectors_in_files
from dbidx.data.superseded import load_vector, write_vectors
from dbidx.errors import ConflictError
from dbidx.storage.instant_life import InstantLife
from dbidx.storage.records import ACTION_COMMIT, CompletedInstant


@dataclass(frozen=True)
class VectorsMoved:
    """What `match_vector_storage` did: the form, how many vectors it moved, at which Delta version, the checkpoint."""

    form: str  # "inline" or "file"
    moved: int
    version: int | None  # the Delta version that moved them (None: every vector had the form already)
    checkpoint: int | None  # the Delta checkpoint written at that version (moving to files only)


def logged_form(view: Any, path: str) -> str | None:
    """How the Delta log holds live file `path`'s vector now: "inline", "file", or None (no vector)."""
    behind, logged = view.log_vector(path)
    if behind:  # the log has another engine's vector for it (dbidx's own is logged by the next catch-up)
        descriptor = logged
    else:
        ref = view.vector_of(path)
        if ref is None:
            return None
        descriptor = ref.vector.delta
    if descriptor is None:  # no vector in the log, or dbidx's own logged inline (its record has no descriptor)
        return None if behind else "inline"
    return "inline" if descriptor.get("storageType") == "i" else "file"


def misplaced_vectors(table: Any) -> list[str]:
    """The live data files whose vector the Delta log holds in the other form than the table's setting, sorted."""
    view = table.data_view()
    return _misplaced(view, vectors_in_files(view.configuration()))


def _misplaced(view: Any, in_files: bool) -> list[str]:
    other = "inline" if in_files else "file"
    return sorted(f.record.path for f in view.live() if logged_form(view, f.record.path) == other)


def match_vector_storage(table: Any) -> VectorsMoved:
    """Give every vector of the Delta log the table's form (module docstring). A dbidx or foreign commit landing
    meanwhile makes it a ConflictError with nothing published (run it again); nothing to move: nothing is written."""
    table.sync_delta_log()
    view = table.data_view()
    in_files = vectors_in_files(view.configuration())
    form = "file" if in_files else "inline"
    paths = _misplaced(view, in_files)
    if not paths:
        return VectorsMoved(form, 0, None, None)
    with InstantLife(table.timeline, ACTION_COMMIT) as life:
        dv_bytes: dict[str, bytes] = {}
        vectors = {}
        for path in paths:
            ref, live = view.vector_of(path), view.get(path)
            if ref is not None and live is not None:
                vectors[path] = load_vector(table.io, ref, live.record.rows, dv_bytes)
        dv_files, records = write_vectors(table.io, life.instant, vectors, in_files)
        started = table.timeline.latest_seq

        def check(meanwhile: list[CompletedInstant]) -> None:
            if meanwhile:
                raise ConflictError(
                    f"moving the deletion vectors of {table.uri} {'into files' if in_files else 'inline'}: "
                    f"{len(meanwhile)} completion(s) landed after seq {started} while it ran; nothing was "
                    "published, run it again"
                )

        def build(seq: int) -> CompletedInstant:
            return life.completion(
                seq,
                table.props.table_id,
                dv_files=dv_files,
                deletion_vectors=records,
                extra={VECTORS_MOVED_EXTRA: form},
            )

        life.publish(build, check)
    version = table.delta_version()
    written = write_delta_checkpoint(table.io) if in_files else None
    return VectorsMoved(form, len(records), version, None if written is None else written.version)
