"""Compaction and cleaning of RLI files.

Compaction merges a (partition, shard)'s base and deltas into one new base without tombstones, published as one
instant that names the files it replaces: readers switch from "old files" to "new base" in a single step, so a
snapshot before, during and after compaction gives the same answer. Replaced files stay on disk (incremental reads
across the compaction still work) until `clean` removes them; a clean is itself a completion record, so a reader
that needs a removed file gets HistoryCompactedError instead of a silently short answer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from numbers import Integral
from typing import Iterable

from dbidx.errors import ConflictError, CorruptFileError, InvalidInputError
from dbidx.mdt import rli_files
from dbidx.progress import Progress, Steps
from dbidx.table import layout
from dbidx.table.records import ACTION_CLEAN, ACTION_COMPACTION, CompletedInstant, FileRecord
from dbidx.table.state import TableState


@dataclass(frozen=True)
class CompactionResult:
    """What a compaction did (None record when there was nothing to compact)."""

    record: CompletedInstant | None
    groups: int
    files_replaced: int
    entries_written: int


def compact(
    table: TableState,
    partitions: Iterable[str] | None = None,
    min_files: int = 2,
    progress: Progress | None = None,
) -> CompactionResult:
    """Merge every (partition, shard) with at least `min_files` live files into a new base file; `progress` hears
    of each group written (rows: entries read)."""
    view = table.refresh()
    wanted = None if partitions is None else {layout.validate_partition(p) for p in partitions}
    # 1. Choose the groups worth compacting, from the view as of now.
    todo: dict[tuple[str | None, int], list[FileRecord]] = {}
    for partition, shard in view.groups():
        if wanted is not None and partition is not None and partition not in wanted:
            continue
        files = view.files(partition, shard)
        if len(files) >= max(min_files, 1) and (len(files) > 1 or files[0].tombstones or files[0].kind != "base"):
            todo[(partition, shard)] = files
    if not todo:
        return CompactionResult(None, 0, 0, 0)
    writer = table.timeline.start(ACTION_COMPACTION)
    bases: list[FileRecord] = []
    replaced = [f.path for files in todo.values() for f in files]
    steps = Steps(progress, len(todo))
    try:
        # 2. Declare, then write one base per group: the newest entry per key, tombstones dropped.
        paths = {g: layout.base_file(g[0], g[1], writer.instant) for g in todo}
        table.timeline.mark_inflight(writer, paths.values())
        for g, files in todo.items():
            merged = rli_files.resolve_latest([rli_files.read_rli_file(table.io, f) for f in files], table.schema)
            steps.step(f"{g[0] or '(global)'} shard {g[1]}", sum(f.rows for f in files))
            if merged.num_rows == 0:
                continue
            bases.append(rli_files.write_rli_file(table.io, paths[g], merged, table.props.row_group_size, g[0], g[1],
                                                  "base"))

        def check(news: list[CompletedInstant]) -> None:
            # Only another compaction of the same files conflicts; commits that landed meanwhile stay as deltas.
            mine = set(replaced)
            for rec in news:
                if rec.action == ACTION_COMPACTION and mine.intersection(rec.replaced):
                    raise ConflictError(
                        f"compaction {writer.instant} overlaps compaction {rec.instant} (seq {rec.seq}) on the same "
                        "files; nothing was published, run it again"
                    )

        def build(seq: int) -> CompletedInstant:
            return CompletedInstant(seq=seq, instant=writer.instant, action=ACTION_COMPACTION,
                                    table_id=table.props.table_id,
                                    completed_at_ms=int(time.time() * 1000), start_seq=writer.start_seq,
                                    files=tuple(bases), replaced=tuple(replaced))

        # 3. Publish: the bases replace the old files in one step.
        record = table.timeline.publish(writer, build, check)
    except BaseException as exc:
        if getattr(exc, "published", None) is None:  # published, then another engine took its Delta version
            table.timeline.rollback(writer.instant)
        raise
    return CompactionResult(record, len(todo), len(replaced), sum(b.rows for b in bases))


def clean(table: TableState, retain_completions: int = 10, delete_migrated: bool = False) -> CompletedInstant | None:
    """Delete index files replaced by compactions, data files replaced by data compactions, and DV files no live
    deletion vector points into any more, at least `retain_completions` completions ago (a whole number >= 0, else
    InvalidInputError). Source files build-index listed stay unless delete_migrated=True.

    Incremental reads reaching back further than that get HistoryCompactedError (a cache then reloads the
    partition); snapshots of older instants likewise. Returns the clean's completion record, or None.
    """
    # A negative count would have cleaned as 0 does (everything replaced, however recent), and a float or a string
    # would fail (or round) somewhere below: refused before anything is read or deleted.
    if isinstance(retain_completions, bool) or not isinstance(retain_completions, Integral) or retain_completions < 0:
        raise InvalidInputError(f"clean of {table.uri}: retain_completions must be a whole number >= 0 (completions "
                                f"whose replaced files are kept), got {retain_completions!r}")
    if not isinstance(delete_migrated, bool):
        raise InvalidInputError(f"clean of {table.uri}: delete_migrated must be True or False, got "
                                f"{delete_migrated!r}")
    view = table.refresh()
    horizon = table.timeline.latest_seq - int(retain_completions)
    doomed = [path for path, _ in view.replaced_files(horizon)]
    outside = [path for path in doomed if not path.startswith(layout.RLI_DIR + "/")]
    if outside:
        raise CorruptFileError(f"compaction records of {table.uri} replace files outside {layout.RLI_DIR}, e.g. "
                               f"{outside[0]!r}; refusing to clean")
    data = table.data_view()
    doomed += data.replaced(horizon, migrated=delete_migrated) + data.unreferenced_dv_files(horizon)
    if not doomed:
        return None
    writer = table.timeline.start(ACTION_CLEAN)

    def build(seq: int) -> CompletedInstant:
        return CompletedInstant(seq=seq, instant=writer.instant, action=ACTION_CLEAN, table_id=table.props.table_id,
                                completed_at_ms=int(time.time() * 1000), start_seq=writer.start_seq,
                                deleted=tuple(doomed))

    # 1. Publish first: from now on readers know these files are gone on purpose. The claim stays until step 2 is
    #    done: a clean killed in between leaves it, and the next sweep (any upsert, clean, compaction, `dbidx
    #    repair`) deletes what the record lists that is still there (table/leftovers.py).
    record = table.timeline.publish(writer, build, keep_claim=True)
    # 2. Then delete them, then the claim.
    try:
        for path in doomed:
            table.io.delete(path)
    except BaseException:
        table.timeline.stop_heartbeat(writer.instant)  # settled; its claim stays for the sweep to finish the work
        raise
    table.timeline.delete_claim_files(writer.instant)
    return record
