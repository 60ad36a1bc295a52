"""Clean: delete the files compactions replaced once no reader the table serves can still need them (`Table.clean`,
`dbidx clean`, and the clean service: table/services.py). What each kind of file waits for, and why:

- Data files a data compaction replaced are read by every Delta reader of an older version: time travel, a long
  query that listed its files before the change, another engine's snapshot. The contract every engine on the table
  relies on for them is the table's Delta property `delta.deletedFileRetentionDuration` (Delta's default: one week;
  data/delta_retention.py): Delta's VACUUM deletes a removed file only once its removal is older than that. The
  clean goes by the same rule: a file goes once the completion that removed it from the Delta log is older than the
  retention (its `completed_at_ms`, which is that version's commit time and its removes' `deletionTimestamp`).
- Deletion-vector files (`.dbidx/dv/`) no live vector points into any more are what dbidx's own reads of those
  older versions read (dbidx's Delta versions carry the vectors inline, so Delta readers take them from the log).
  They go by the same rule, once the completion at which their last vector left the state is older than the
  retention, so time travel reaches as far back in dbidx as in any Delta engine.
- Index files under `.dbidx/rli/` an index compaction replaced are dbidx's own; no Delta reader opens them. Their
  readers are a cache catching up (the deltas after the seq it holds) and an index snapshot as of an old seq, and
  both get HistoryCompactedError once a clean took a file they need (a cache then reloads the partition from a
  snapshot). They go by count: `retain_completions` completions after the compaction that replaced them. Why not the
  week as well: the size-tiered index compaction replaces files many times a day, and each replaced file stays in
  the index view and in every checkpoint until it is cleaned, so a week of them would grow what every open reads,
  for reads that have a loud and correct fallback.
- `retain_completions` holds for data and DV files too: they go once both rules let them ("at least this many
  completions as well"), so the count users set keeps meaning what it meant, a floor.

Files other engines removed (absorbed versions) are never cleaned: they are that engine's to VACUUM (table/absorb.py;
dbidx's `vacuum` takes them by the same property), and the data view does not list them as replaced. The user's
source files build-index listed go only with delete_migrated (and by the same retention).

A clean is itself a completion record, published before anything is deleted: a reader that needs a removed file
then gets HistoryCompactedError instead of a silently short answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from numbers import Integral

from dbidx.data.delta_retention import DEFAULTS, DELETED_FILE_RETENTION, retention_of
from dbidx.errors import ConflictError, CorruptFileError, InvalidInputError
from dbidx.storage import layout
from dbidx.storage.completion_times import completed_at
from dbidx.storage.data_view import DELTA_CONFIGURATION_EXTRA
from dbidx.storage.instant_life import InstantLife
from dbidx.storage.records import ACTION_ABSORB, ACTION_CLEAN, ACTION_PROPERTIES, CompletedInstant
from dbidx.storage.state import TableState
from dbidx.storage.timeline import Timeline


@dataclass(frozen=True)
class CleanPlan:
    """What a clean would delete now, and what the Delta retention keeps a while longer."""

    index_files: tuple[str, ...]  # replaced at least retain_completions completions ago
    data_files: tuple[str, ...]  # data files, then DV files, past both the count and the retention
    retain_completions: int
    retention: str  # delta.deletedFileRetentionDuration as the table has it (Delta's default if unset)
    retention_ms: int
    waiting: int  # data and DV files past the count that the retention still keeps
    next_due_ms: int | None  # when the oldest of those may go (None: none waits)
    seen_seq: int  # the data view's seq the plan was made from

    @property
    def doomed(self) -> tuple[str, ...]:
        """Every file the clean deletes, index files first."""
        return self.index_files + self.data_files

    def nothing_to_do(self) -> str:
        """Why nothing is deleted now (for a plan whose `doomed` is empty): what the count and the retention keep."""
        why = f"nothing to delete: no index file replaced at least {self.retain_completions} completions ago"
        if not self.waiting or self.next_due_ms is None:
            return f"{why}, and no data or deletion-vector file replaced that long ago"
        due = datetime.fromtimestamp(self.next_due_ms / 1000, tz=timezone.utc).isoformat(timespec="seconds")
        return (
            f"{why}; {self.waiting} replaced data and deletion-vector files are kept for {DELETED_FILE_RETENTION} "
            f"({self.retention!r}) after the completion that replaced them, the first until {due}"
        )


def plan_clean(
    table: TableState, retain_completions: int = 10, delete_migrated: bool = False, now_ms: int | None = None
) -> CleanPlan:
    """What `clean` would delete at `now_ms` (default: now), from the views as they are (the module docstring says
    which rule holds for which file). Costs no I/O but the times of the replacements old enough plus one that this
    process has not seen (storage/completion_times.py)."""
    # A negative count would have cleaned as 0 does, and a float or a string would fail (or round) somewhere below:
    # refused before anything is read.
    if isinstance(retain_completions, bool) or not isinstance(retain_completions, Integral) or retain_completions < 0:
        raise InvalidInputError(
            f"clean of {table.uri}: retain_completions must be a whole number >= 0 (completions "
            f"whose replaced files are kept), got {retain_completions!r}"
        )
    if not isinstance(delete_migrated, bool):
        raise InvalidInputError(f"clean of {table.uri}: delete_migrated must be True or False, got {delete_migrated!r}")
    view = table.refresh()
    horizon = table.timeline.latest_seq - int(retain_completions)
    index_files = [path for path, _ in view.replaced_files(horizon)]
    outside = [path for path in index_files if not path.startswith(layout.RLI_DIR + "/")]
    if outside:
        raise CorruptFileError(
            f"compaction records of {table.uri} replace files outside {layout.RLI_DIR}, e.g. "
            f"{outside[0]!r}; refusing to clean"
        )
    data = table.data_view()
    configuration = data.configuration()
    retention_ms = retention_of(configuration).deleted_file_retention_ms
    replaced = data.replaced(horizon, migrated=delete_migrated)
    dv_files = data.unreferenced_dv_files(horizon)
    now_ms = int(time.time() * 1000) if now_ms is None else int(now_ms)
    old_upto, next_due_ms = _old_enough(table.timeline, replaced + dv_files, now_ms - retention_ms, retention_ms)
    data_files = [p for p, seq in replaced if seq <= old_upto] + [p for p, seq in dv_files if seq <= old_upto]
    return CleanPlan(
        tuple(index_files),
        tuple(data_files),
        int(retain_completions),
        configuration.get(DELETED_FILE_RETENTION, DEFAULTS[DELETED_FILE_RETENTION]),
        retention_ms,
        len(replaced) + len(dv_files) - len(data_files),
        next_due_ms,
        data.applied_seq,
    )


def _old_enough(
    timeline: Timeline, candidates: list[tuple[str, int]], cutoff_ms: int, retention_ms: int
) -> tuple[int, int | None]:
    """The largest seq up to which every completion that replaced one of the candidates completed at or before the
    cutoff, and when the first one after it turns old enough (None: none is younger). Oldest first, stopping at the
    first young one: the times of the rest are not needed (a writer's clock a little behind another's keeps a file
    one clean longer, never deletes one early)."""
    upto = 0
    for seq in sorted({seq for _, seq in candidates}):
        ms = completed_at(timeline, seq)
        if ms > cutoff_ms:
            return upto, ms + retention_ms
        upto = seq
    return upto, None


def clean(table: TableState, retain_completions: int = 10, delete_migrated: bool = False) -> CompletedInstant | None:
    """Delete index files compactions replaced at least `retain_completions` completions ago (a whole number >= 0,
    else InvalidInputError), and data and DV files replaced that long ago and longer ago than the table's
    `delta.deletedFileRetentionDuration` (the module docstring says why each). Source files build-index listed stay
    unless delete_migrated=True.

    Incremental reads reaching back further than that get HistoryCompactedError (a cache then reloads the
    partition); snapshots of older instants likewise. Returns the clean's completion record, or None when nothing
    was old enough (`plan_clean(...).nothing_to_do()` says what waits).
    """
    plan = plan_clean(table, retain_completions, delete_migrated)
    doomed = list(plan.doomed)
    if not doomed:
        return None

    def check(news: list[CompletedInstant] | None = None) -> None:
        # A retention made longer since the plan (a properties change, or another engine's, absorbed when this
        # instant started) may keep files the plan chose: nothing is deleted, the next clean plans again. Every
        # completion after the plan's view is looked at, not only `news` (those after the instant's start).
        for rec in table.timeline.completed(after_seq=plan.seen_seq):
            configuration = rec.extra.get(DELTA_CONFIGURATION_EXTRA)
            if rec.action not in (ACTION_PROPERTIES, ACTION_ABSORB) or not isinstance(configuration, dict):
                continue
            if retention_of(configuration).deleted_file_retention_ms > plan.retention_ms:
                raise ConflictError(
                    f"clean {writer.instant} of {table.uri}: {DELETED_FILE_RETENTION} grew in completion {rec.seq} "
                    f"({rec.instant}) after the clean chose its files; nothing was deleted, run it again"
                )

    def build(seq: int) -> CompletedInstant:
        return writer.completion(
            seq,
            table.props.table_id,
            deleted=tuple(doomed),
        )

    # 1. Publish first: from now on readers know these files are gone on purpose. The claim stays until step 2 is
    #    done: a clean killed in between leaves it, and the next sweep (any upsert, clean, compaction, `dbidx
    #    repair`) deletes what the record lists that is still there (storage/leftovers.py). A failure before the
    #    publish rolls the instant back (storage/instant_life.py).
    with InstantLife(table.timeline, ACTION_CLEAN) as writer:
        check()  # what completed between the plan and the start (the publish checks only what came after)
        record = writer.publish(build, check, keep_claim=True)
    # 2. Then delete them, then the claim.
    try:
        for path in doomed:
            table.io.delete(path)
    except BaseException:
        table.timeline.stop_heartbeat(writer.instant)  # settled; its claim stays for the sweep to finish the work
        raise
    table.timeline.delete_claim_files(writer.instant)
    return record
