"""Compaction of RLI files.

Compaction merges a (partition, shard)'s base and deltas into one new base without tombstones, published as one
instant that names the files it replaces: readers switch from "old files" to "new base" in a single step, so a
snapshot before, during and after compaction gives the same answer. Replaced files stay on disk (incremental reads
across the compaction still work) until `clean` removes them (index/clean.py, still importable from here); a clean
is itself a completion record, so a reader that needs a removed file gets HistoryCompactedError instead of a
silently short answer.

Size-tiered (`base_share`, what the table services use): rewriting a group's base costs its whole size, so doing it
whenever a group has `min_files` files makes a long-running table's compaction cost grow with the table. With a
base_share, the base is rewritten only once the files after it hold that share of its entries; until then a
compaction merges the group's newest run of files of similar size into one "merged" file (tombstones kept: the base
below may hold the keys they delete), which stands where the newest file it replaced stood. Each entry is then
rewritten about log2(share x base / delta) times before it reaches the base, and the base once per share of new
bytes: a cost per batch that follows the batch, not the table. A merged file is not a delta: a cache's catch-up,
which replays deltas, never reads it (its entries are older than the deltas it replaced, which the cache saw).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Iterable

import pyarrow as pa

from dbidx.errors import CommitError, ConflictError, InvalidInputError
from dbidx.index import rli_files
from dbidx.index.clean import clean as clean  # re-exported: `clean` lived here before index/clean.py
from dbidx.progress import Progress, Steps
from dbidx.runner import IN_PROCESS, WorkRunner, attempt_of, check_written, pack, results_of, unpack
from dbidx.storage import layout, markers
from dbidx.storage.fileio import FileIO
from dbidx.storage.instant_life import InstantLife
from dbidx.storage.records import ACTION_COMPACTION, CompletedInstant, FileRecord, record_dict
from dbidx.storage.state import TableState


# A newest run of files grows while the next older file holds at most this many times the run's entries: files of
# about the same size merge, a file much larger than everything after it waits (size-tiered, as an LSM's
# universal compaction; with 2, a run of halving sizes merges whole).
RUN_RATIO = 2.0


@dataclass(frozen=True)
class CompactionResult:
    """What a compaction did (None record when there was nothing to compact)."""

    record: CompletedInstant | None
    groups: int
    files_replaced: int
    entries_written: int
    bases: int = 0  # groups merged into a new base (the others into a merged file, base left alone)


@dataclass(frozen=True)
class GroupPlan:
    """One group's files to merge now (oldest first), and whether into a new base or into a merged file."""

    files: tuple[FileRecord, ...]
    into_base: bool


def plan_group(files: list[FileRecord], min_files: int, base_share: float | None) -> GroupPlan | None:
    """What to merge of one group's live files (oldest first, as IndexView.files lists them), or None.

    1. Nothing below `min_files` files, nor a lone base without tombstones (already compact).
    2. Into a new base: every file, when base_share is None, the group has no base, or the files after the base hold
       at least base_share of its entries (read amplification bounded by the share). Entries, not bytes: a merge's
       cost follows them, and a small file's bytes are mostly Parquet's fixed overhead.
    3. Else the newest run: from the newest file back, while the next older file holds at most RUN_RATIO times the
       run's entries; at least two files, so each compaction leaves the group with fewer files.
    """
    if len(files) < max(min_files, 1) or (len(files) == 1 and not files[0].tombstones and files[0].kind == "base"):
        return None
    base = files[0] if files[0].kind == "base" else None
    after = files[1:] if base is not None else files
    if base_share is None or base is None or len(after) < 2 or sum(f.rows for f in after) >= base_share * base.rows:
        return GroupPlan(tuple(files), True)
    run = [after[-1]]
    run_rows = after[-1].rows
    for f in reversed(after[:-1]):
        if len(run) >= 2 and f.rows > RUN_RATIO * run_rows:
            break
        run.append(f)
        run_rows += f.rows
    return GroupPlan(tuple(reversed(run)), False)


def compact(
    table: TableState,
    partitions: Iterable[str] | None = None,
    min_files: int = 2,
    progress: Progress | None = None,
    runner: WorkRunner | None = None,
    base_share: float | None = None,
) -> CompactionResult:
    """Merge every (partition, shard) with at least `min_files` live files into a new base file; `progress` hears
    of each group written (rows: entries read); `runner` (dbidx.runner; default: here, one group after another)
    runs the merges, e.g. as a Spark job. base_share (None: always into a new base): a group's base is rewritten
    only once the files after it hold this share of its entries, before that its newest run of files is merged into
    one merged file (size-tiered; the module docstring says why, `plan_group` how)."""
    if base_share is not None and (
        isinstance(base_share, bool) or not isinstance(base_share, (int, float)) or not 0.0 < base_share <= 1e6
    ):
        raise InvalidInputError(
            f"index compaction of {table.uri}: base_share must be a number in (0, 1000000] or None, got {base_share!r}"
        )
    view = table.refresh()
    wanted = None if partitions is None else {layout.validate_partition(p) for p in partitions}
    # 1. Choose the groups worth compacting and what of each, from the view as of now.
    todo: dict[tuple[str | None, int], GroupPlan] = {}
    for partition, shard in view.groups():
        if wanted is not None and partition is not None and partition not in wanted:
            continue
        plan = plan_group(view.files(partition, shard), min_files, base_share)
        if plan is not None:
            todo[(partition, shard)] = plan
    if not todo:
        return CompactionResult(None, 0, 0, 0)
    bases: list[FileRecord] = []
    replaced = [f.path for plan in todo.values() for f in plan.files]
    steps = Steps(progress, len(todo))
    # The instant ends published or rolled back, its unlisted files (a first try's base, later tries') deleted
    # (storage/instant_life.py).
    with InstantLife(table.timeline, ACTION_COMPACTION) as writer:
        # 2. Declare, then write one file per group: the newest entry per key, tombstones dropped from a base (kept in
        #    a merged file); one piece of work per group, run by `runner` (here, or as a Spark job), each result
        #    checked before anything is published.
        paths = {
            g: layout.rli_file(g[0], g[1], _output_kind(plan.into_base), writer.instant) for g, plan in todo.items()
        }
        writer.declare(paths.values())
        work = partial(merge_group, table.io, writer.instant, table.schema, table.props.row_group_size)
        what = f"compaction {writer.instant}"
        items = [(g[0], g[1], plan.files, plan.into_base) for g, plan in todo.items()]
        run = (runner or IN_PROCESS).run(
            work, items, f"{what}: merge index groups", [sum(f.size for f in item[2]) for item in items]
        )
        with results_of(run) as results:
            for item, payload in zip(items, results):
                base = _parsed_merge(payload, item[0], item[1], item[3], writer.instant, what)
                steps.step(f"{item[0] or '(global)'} shard {item[1]}", sum(f.rows for f in item[2]))
                if base is not None:
                    bases.append(base)
        check_written(table.io, what, [(b.path, b.size) for b in bases])

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
            return writer.completion(
                seq,
                table.props.table_id,
                files=tuple(bases),
                replaced=tuple(replaced),
            )

        # 3. Publish: the bases replace the old files in one step.
        record = writer.publish(build, check)
    return CompactionResult(
        record, len(todo), len(replaced), sum(b.rows for b in bases), sum(1 for plan in todo.values() if plan.into_base)
    )


def _output_kind(into_base: bool) -> str:
    """The kind of file a group's merge writes (FileRecord.kind and its name's prefix, layout.rli_file)."""
    return "base" if into_base else "merged"


def merge_group(
    io: FileIO,
    instant: str,
    schema: pa.Schema,
    row_group_size: int,
    item: tuple[str | None, int, tuple[FileRecord, ...], bool],
    attempt: int,
) -> bytes:
    """One (partition, shard)'s files merged into a base, or into a merged file that keeps tombstones (a runner's
    piece of work: it may run in a Spark task); a try after the first writes under its own name, announced by a
    marker first (dbidx/runner.py)."""
    partition, shard, files, into_base = item
    kind = _output_kind(into_base)
    rel = layout.rli_file(partition, shard, kind, instant, attempt or None)
    if attempt:
        markers.announce(io, instant, rel)
    merged = rli_files.resolve_latest(
        [rli_files.read_rli_file(io, f) for f in files], schema, keep_tombstones=not into_base
    )
    if merged.num_rows == 0:
        return pack({"attempt": attempt, "base": None})
    out = rli_files.write_rli_file(io, rel, merged, row_group_size, partition, shard, kind)
    return pack({"attempt": attempt, "base": record_dict(out)})


def _parsed_merge(
    payload: bytes, partition: str | None, shard: int, into_base: bool, instant: str, what: str
) -> FileRecord | None:
    """A group's merge result, checked strictly: a base (or merged file) of this group, written under this
    instant's name for the attempt (CommitError otherwise: nothing is published)."""
    where = f"{what}, group {partition or '(global)'} shard {shard}"
    result = unpack(payload, where, {"attempt", "base"})
    kind = _output_kind(into_base)
    try:
        attempt = attempt_of(result)
        if result["base"] is None:
            return None
        base = FileRecord.parse(result["base"], "base")
        if (base.path, base.partition, base.shard, base.kind) != (
            layout.rli_file(partition, shard, kind, instant, attempt or None),
            partition,
            shard,
            kind,
        ):
            raise ValueError(f"{kind} file {base.path!r} is not this group's {kind} file of attempt {attempt}")
    except (ValueError, TypeError, KeyError) as exc:
        raise CommitError(f"{where}: a malformed merge result ({exc}); nothing was published") from exc
    return base
