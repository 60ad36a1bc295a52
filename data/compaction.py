"""Data compaction: rewrite a file group's files into one base file holding only its live rows.

Why: every upsert adds a file per file group it touches and never removes a superseded or deleted row, so data on
disk and the files a read must open grow with every batch. A data compaction merges each chosen file group
exactly as a reader would (data/reads.py) and publishes, as one `data_compaction` instant, the new bases and
the files they replace.

Concurrent upserts never conflict with it: the compaction reads a snapshot (its start seq) and replaces only files
of that snapshot, so a file an upsert committed meanwhile stays. Rows of a replaced file that such an upsert
superseded (its deletion vector grew after the snapshot) are carried over: the compaction knows which base row each
replaced row became and publishes them as the base's deletion vector. An upsert publishing after the compaction
computes its vectors against the base. Only another data compaction of the same files conflicts. Replaced files stay on
disk until a `clean` at least `retain_completions` completions later deletes them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyroaring import BitMap

from dbidx.data.deletion_vectors import positions_bitmap, vectors_in_files
from dbidx.data.files import DELETED_COLUMN, INSTANT_COLUMN, data_file_path, write_data_file
from dbidx.data.reads import ReadUnit, plan_read, read_unit
from dbidx.data.superseded import load_vector, write_vectors
from dbidx.errors import CommitError, ConflictError, CorruptFileError, InvalidInputError
from dbidx.progress import Progress, Steps
from dbidx.runner import IN_PROCESS, WorkRunner, attempt_of, check_written, pack, results_of, unpack
from dbidx.storage import layout, markers
from dbidx.storage.data_view import DvRef
from dbidx.storage.fileio import FileIO
from dbidx.storage.instant_life import InstantLife
from dbidx.storage.records import ACTION_ABSORB, ACTION_DATA_COMPACTION, CompletedInstant, DataFileRecord, record_dict
from dbidx.storage.state import TableState


@dataclass(frozen=True)
class DataCompactionResult:
    """What a data compaction did (record None when no file group needed it)."""

    record: CompletedInstant | None
    file_groups: int
    files_replaced: int
    rows_written: int
    bytes_before: int
    bytes_after: int


DEFAULT_DELETED_SHARE = 0.2
DEFAULT_TARGET_FILE_BYTES = 64 << 20


def compact_data(
    table: TableState,
    partitions: Iterable[str] | None = None,
    min_files: int = 2,
    deleted_share: float | None = DEFAULT_DELETED_SHARE,
    target_file_bytes: int | None = DEFAULT_TARGET_FILE_BYTES,
    progress: Progress | None = None,
    runner: WorkRunner | None = None,
    base_share: float | None = None,
) -> DataCompactionResult:
    """Rewrite, per file group, its small files (under `target_file_bytes`; None: every file counts as small) when
    there are at least `min_files` of them, and every file whose deletion vector hides at least `deleted_share` of
    its rows (None: never for that reason), into one base of their live rows.

    Why the size rule: files that reached the target are not rewritten again only because small ones joined them
    (Delta's OPTIMIZE bin-packs small files the same way). Why the share rule: a file that upserts keep superseding
    grows no new files, but every reader still reads its dead rows and applies its vector (Delta's REORG ... PURGE).
    `progress` hears of each file group rewritten (rows: rows read). `runner` (dbidx.runner; default: here, one
    file group after another) runs the rewrites, e.g. as a Spark job.

    base_share (None: every chosen file is rewritten, one file per group results): a group's largest small file
    stays as it is while the other files chosen hold less than this share of its bytes; they are merged into one
    file beside it. Why: a group that keeps growing (today's partition, a hot key range) would otherwise have its
    whole base rewritten every `min_files` batches, so the cost of each compaction follows the group's size, not
    the new data; leaving it alone until the rest reaches the share bounds the rewrite per new byte (size-tiered, as
    LSM stores and RocksDB's universal compaction do), at the price of one more file per group for readers.
    """
    if deleted_share is not None and not 0.0 < deleted_share <= 1.0:
        raise InvalidInputError(f"deleted_share must be in (0, 1], got {deleted_share!r}")
    if base_share is not None and (
        isinstance(base_share, bool) or not isinstance(base_share, (int, float)) or not 0.0 < base_share <= 1e6
    ):
        raise InvalidInputError(f"base_share must be a number in (0, 1000000] or None, got {base_share!r}")
    if target_file_bytes is not None and (
        isinstance(target_file_bytes, bool) or not isinstance(target_file_bytes, int) or target_file_bytes < 1
    ):
        raise InvalidInputError(f"target_file_bytes must be a positive number of bytes, got {target_file_bytes!r}")
    # 1. The snapshot: the files of each group worth rewriting as of now.
    plan = plan_read(table, partitions)
    chosen = (_to_rewrite(u, max(min_files, 1), deleted_share, target_file_bytes, base_share) for u in plan.units)
    todo = [u for u in chosen if plan.key is not None and u is not None]
    if not todo:
        return DataCompactionResult(None, 0, 0, 0, 0, 0)
    schema = pa.schema(list(plan.schema) + [pa.field(INSTANT_COLUMN, pa.string())])
    replaced = [f.path for u in todo for f in u.files]
    in_files = vectors_in_files(table.data_view().configuration())  # how the bases' vectors are logged
    seen = {f.path: v for u in todo for f, v in zip(u.files, u.vectors)}  # each file's vector in the snapshot
    bases: list[DataFileRecord] = []
    moved: dict[str, tuple[str, np.ndarray]] = {}  # replaced file -> (its base, base row of each of its rows or -1)
    later: dict[str, DvRef] = {}  # replaced file -> the newest vector a commit published after the snapshot

    def check(news: list[CompletedInstant]) -> None:
        mine = set(replaced)
        for rec in news:
            if rec.action == ACTION_DATA_COMPACTION and mine.intersection(rec.replaced):
                raise ConflictError(
                    f"data compaction {writer.instant} overlaps data compaction {rec.instant} "
                    f"(seq {rec.seq}) on the same files; nothing was published, run it again"
                )
            if rec.action == ACTION_ABSORB and mine.intersection(rec.replaced):
                raise ConflictError(
                    f"data compaction {writer.instant} rewrote files another engine's Delta version "
                    f"{rec.extra.get('absorbed', {}).get('version')} removed meanwhile (absorbed at "
                    f"seq {rec.seq}); nothing was published, run it again"
                )
            dv_files = {f.path: f for f in rec.dv_files}
            for dv in rec.deletion_vectors:
                if dv.path in mine:
                    later[dv.path] = DvRef(dv, dv_files[dv.dv_file])

    # The instant ends published or rolled back, its unlisted files (a first try's base, later tries') deleted
    # (storage/instant_life.py).
    with InstantLife(table.timeline, ACTION_DATA_COMPACTION) as writer:
        # 1b. A compaction that published between the snapshot and this instant's start counts too.
        check(table.timeline.completed(after_seq=plan.seq, upto_seq=writer.start_seq))
        # 2. Declare the bases (a rollback finds them after a crash), then write each: live rows only, each row
        #    keeping the instant that wrote it; one piece of work per file group, run by `runner` (here, or as a
        #    Spark job), each result checked before anything is published.
        paths = {
            (u.partition, u.file_group): data_file_path(u.partition, u.file_group, writer.instant, 0) for u in todo
        }
        writer.declare(paths.values())
        steps = Steps(progress, len(todo))
        work = partial(rewrite_file_group, table.io, writer.instant, plan.key or "", schema)
        what = f"data compaction {writer.instant}"
        run = (runner or IN_PROCESS).run(work, todo, f"{what}: rewrite file groups", [u.bytes for u in todo])
        with results_of(run) as results:
            for unit, payload in zip(todo, results):
                base = _parsed_rewrite(payload, unit, writer.instant, moved, what)
                steps.step(f"{unit.partition or '(root)'} {unit.file_group}", sum(f.rows for f in unit.files))
                if base is not None:
                    bases.append(base)
        check_written(table.io, what, [(b.path, b.size) for b in bases])

        def build(seq: int) -> CompletedInstant:
            dv_files, vectors = _rebased_vectors(table, writer.instant, seen, later, moved, in_files)
            return writer.completion(
                seq,
                table.props.table_id,
                data_files=tuple(bases),
                replaced=tuple(replaced),
                dv_files=dv_files,
                deletion_vectors=vectors,
            )

        # 3. Publish: readers switch from the old files to the bases in one step.
        record = writer.publish(build, check)
    return DataCompactionResult(
        record,
        len(todo),
        len(replaced),
        sum(b.rows for b in bases),
        sum(u.bytes for u in todo),
        sum(b.size for b in bases),
    )


def _to_rewrite(
    unit: ReadUnit,
    min_files: int,
    deleted_share: float | None,
    target_file_bytes: int | None,
    base_share: float | None = None,
) -> ReadUnit | None:
    """The part of a file group to rewrite (None: nothing): the files whose vector hides at least `deleted_share` of
    their rows, and the small ones if at least `min_files` files are to be rewritten at all, less the largest small
    one while the others hold under `base_share` of its bytes (compact_data says why)."""
    vectors = unit.vectors or (None,) * len(unit.files)
    share = 2.0 if deleted_share is None else deleted_share
    heavy = {
        i
        for i, (f, v) in enumerate(zip(unit.files, vectors))
        if v is not None and f.rows and v.vector.cardinality / f.rows >= share
    }
    small = {i for i, f in enumerate(unit.files) if target_file_bytes is None or f.size < target_file_bytes}
    picked = sorted(heavy | small) if len(heavy | small) >= min_files else sorted(heavy)
    if base_share is not None and len(picked) >= min_files:
        # The largest file not rewritten for its deletes stays while the rest is small beside it, as long as the
        # rest is still worth merging: two files or more, or one rewritten for its deletes.
        largest = max((i for i in picked if i not in heavy), key=lambda i: unit.files[i].size, default=None)
        rest = [i for i in picked if i != largest]
        if (
            largest is not None
            and sum(unit.files[i].size for i in rest) < base_share * unit.files[largest].size
            and (len(rest) >= 2 or heavy.intersection(rest))
        ):
            picked = rest
    if not picked:
        return None
    return replace(
        unit,
        files=tuple(unit.files[i] for i in picked),
        seqs=tuple(unit.seqs[i] for i in picked),
        instants=tuple(unit.instants[i] for i in picked),
        vectors=tuple(vectors[i] for i in picked),
    )


def rewrite_file_group(io: FileIO, instant: str, key: str, schema: pa.Schema, unit: ReadUnit, attempt: int) -> bytes:
    """One file group's live rows as a base data file (a runner's piece of work: it may run in a Spark task); the
    result says, per replaced file, which base row each of its rows became (-1: not table data), so rows a
    concurrent commit supersedes later can be deleted in the base too. A try after the first writes under its own
    name, announced by a marker first (runner.py)."""
    rel = layout.validate_table_path(data_file_path(unit.partition, unit.file_group, instant, attempt))
    if attempt:
        markers.announce(io, instant, rel)
    origins: list[tuple[DataFileRecord, np.ndarray]] = []
    live = read_unit(io, unit, key, schema, origins=origins)
    if live.num_rows == 0:
        return pack({"attempt": attempt, "base": None, "moved": []})
    live = live.append_column(DELETED_COLUMN, pa.array([False] * live.num_rows))
    order = pc.sort_indices(live, [(key, "ascending")]).to_numpy()  # sorted by key: tighter row-group statistics
    live = live.take(pa.array(order))
    base_row = np.empty(len(order), dtype=np.int64)
    base_row[order] = np.arange(len(order))  # live row i went to base row base_row[i]
    moved, start = [], 0
    for record, kept in origins:
        rows = np.full(record.rows, -1, dtype="<i8")
        rows[kept] = base_row[start : start + len(kept)]
        moved.append([record.path, rows.tobytes()])
        start += len(kept)
    base = write_data_file(io, rel, live, unit.partition, unit.file_group, key)
    return pack({"attempt": attempt, "base": record_dict(base), "moved": moved})


def _parsed_rewrite(
    payload: bytes, unit: ReadUnit, instant: str, moved: dict[str, tuple[str, np.ndarray]], what: str
) -> DataFileRecord | None:
    """A file group's rewrite result, checked strictly (CommitError: nothing is published on a result that does not
    fit its file group): the base must be the group's, written under this instant's name for the attempt, and each
    replaced file's row map must cover its rows and send every base row exactly once. `moved` gets the maps."""
    where = f"{what}, file group {unit.partition or '(root)'} {unit.file_group}"
    result = unpack(payload, where, {"attempt", "base", "moved"})
    try:
        attempt = attempt_of(result)
        if result["base"] is None:
            if result["moved"]:
                raise ValueError("row maps without a base")
            return None
        base = DataFileRecord.parse(result["base"], "base")
        if (base.path, base.partition, base.file_group) != (
            data_file_path(unit.partition, unit.file_group, instant, attempt),
            unit.partition,
            unit.file_group,
        ):
            raise ValueError(f"base {base.path!r} is not this file group's file of attempt {attempt}")
        rows_of = {f.path: f.rows for f in unit.files}
        maps: dict[str, np.ndarray] = {}
        for entry in result["moved"]:
            path, raw = entry
            if path not in rows_of or path in maps or not isinstance(raw, bytes) or len(raw) != 8 * rows_of[path]:
                raise ValueError(f"row map of {str(path)[:200]!r} does not fit a replaced file of the group")
            maps[path] = np.frombuffer(raw, dtype="<i8")
        if set(maps) != set(rows_of):
            raise ValueError(f"row maps for {len(maps)} of the {len(rows_of)} replaced files")
        sent = np.concatenate(list(maps.values()))
        sent = sent[sent >= 0]
        if len(sent) != base.rows or (sent >= base.rows).any() or not _each_once(sent, base.rows):
            raise ValueError(f"row maps send {len(sent)} rows to a base of {base.rows}, not each base row once")
    except (ValueError, TypeError, KeyError) as exc:
        raise CommitError(f"{where}: a malformed rewrite result ({exc}); nothing was published") from exc
    for path, rows in maps.items():
        moved[path] = (base.path, rows)
    return base


def _each_once(sent: np.ndarray, rows: int) -> bool:
    """Whether `sent` (as many rows as the base has, each in [0, rows)) names every base row, hence each once: one
    pass over a flag per row (np.unique hashed or sorted every row: 0.18 s per 535,000 rows in a compaction)."""
    seen = np.zeros(rows, dtype=bool)
    seen[sent] = True
    return bool(seen.all())


def _rebased_vectors(
    table: TableState,
    instant: str,
    seen: dict[str, DvRef | None],
    later: dict[str, DvRef],
    moved: dict[str, tuple[str, np.ndarray]],
    in_files: bool,
) -> tuple[tuple, tuple]:
    """Rows of replaced files that commits superseded after the snapshot, as vectors of the bases that hold them:
    the compaction then publishes without conflicting with those commits, and no version of a record is live
    twice."""
    vectors: dict[str, BitMap] = {}
    for path, ref in sorted(later.items()):
        base, rows = moved[path]
        now = load_vector(table.io, ref, len(rows))
        before = seen.get(path)
        fresh = now - load_vector(table.io, before, len(rows)) if before is not None else now
        positions = rows[np.asarray(fresh.to_array(), dtype=np.int64)]
        if (positions < 0).any():
            raise CorruptFileError(
                f"data compaction {instant}: a commit deleted rows of {path} that were not table "
                "data in the snapshot it compacted; nothing was published"
            )
        vectors[base] = vectors.get(base, BitMap()) | positions_bitmap(positions)
    return write_vectors(table.io, instant, vectors, in_files)
