"""Absorbing another engine's Delta version into the index (docs/FORMAT.md section 12c).

A Delta table is shared: other pipelines append to it, a nightly job OPTIMIZEs it, a retention job VACUUMs it, a
GDPR job deletes rows. Each of their commits is one Delta version, and dbidx gives it one completion record of its
own (action `absorb`, at the seq whose Delta version it is), so the index describes exactly the rows every Delta
reader reads. The record is computed from the version's actions alone, reading the key column of the files it
touched and nothing else:

- keys of the rows that left (removed files, rows a new deletion vector deletes) and came (added files minus their
  vectors), per partition (table-wide in global mode);
- a key that left and came back is re-pointed to its new file group (a data-neutral rewrite: OPTIMIZE, Z-order; or
  the copy-on-write of a delete, update or merge); a key that only left is tombstoned; a key that only came is new,
  and must not be live elsewhere: a blind append of an existing key is refused by name (ForeignDuplicateError);
- the files it removed leave the data view (kept on storage: that engine's VACUUM deletes them), the files it added
  enter it, each its own file group (its name without `.parquet`), with its vector copied into a DV file of dbidx's
  whose record keeps the log's descriptor (a later dbidx `remove` repeats it exactly).

Caches catch up from the record's index files exactly as from a dbidx commit; an upsert that touched a re-pointed
key meanwhile conflicts (index/conflicts.py), since its rows were written against the old location.

This module holds the run, its files and its record; the index entries of the keys that moved are
table/absorb_entries.py's, the checks of what a version may change table/absorb_checks.py's.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyroaring import BitMap

from dbidx.arrays import one_chunk
from dbidx.data.delta_actions import (
    FileAction,
    VersionActions,
    expired_version,
    from_checkpoint,
    read_descriptor,
    read_version,
)
from dbidx.data.deletion_vectors import vectors_in_files
from dbidx.data.delta_derive import delta_path, view_partition_columns
from dbidx.data.delta_log import last_checkpoint_version, version_file
from dbidx.data.source_files import read_source
from dbidx.data.superseded import load_vector, read_key_column, write_vectors
from dbidx.errors import CorruptFileError, DbidxError, DeltaFeatureError, ForeignDuplicateError
from dbidx.index import rli_files
from dbidx.table.absorb_checks import (
    _check_metadata,
    _partition_of,
    check_run_features,
    row_tracking_extras,
    stamp_extras,
)
from dbidx.table.absorb_entries import _entries, _Rows
from dbidx.table.absorb_stale import STALE_EXTRA, StaleRewrite, split_at_stale, stale_copies
from dbidx.table.writer import EntryBuffer
from dbidx.storage import layout, markers
from dbidx.storage.data_view import DataView
from dbidx.storage.log_vectors import LOG_VECTORS_EXTRA
from dbidx.storage.records import ACTION_ABSORB, CompletedInstant, DataFileRecord
from dbidx.storage.row_ids import ROW_IDS_EXTRA
from dbidx.storage.state import TableState
from dbidx.storage.timeline_writes import StartedInstant

ABSORBED_EXTRA = "absorbed"  # the record's extra: {"version", "operation", "engine"} of the version it absorbs


def absorb_run(table: TableState, run: list[VersionActions], seq: int, published: int = 0) -> list[CompletedInstant]:
    """Absorb the consecutive Delta versions `run` (none of them dbidx's): one record per version, where all but the
    last change nothing (they say which run they belong to) and the last carries the run's net effect on the files
    and the index. Why net: a file another engine added and removed again inside the run (an append, then an
    OPTIMIZE and a VACUUM) may be gone from storage, and only its net effect, nothing, is needed. The records of
    run[:published] are published already (a run another process started); `seq` is the seq of run[published],
    and the data view must stand right before it. Returns the records this call published (all the run's rest, or
    none if another process published `seq` first: nothing of this call then stays on storage)."""
    view = table.data_view()
    if view.applied_seq != seq - 1 or published >= len(run):
        return []
    # 1. What the versions may not do to a table dbidx indexes: checked before anything is claimed or written. A
    #    stale rewrite (table/absorb_stale.py) is absorbed alone, after the versions before it.
    head, stale = split_at_stale({f.record.path for f in view.live()}, run)
    if published == 0:
        run = head
    elif len(head) != len(run):  # a run another absorber started keeps its bounds (its starter split it so)
        raise CorruptFileError(
            f"{_where(run)} were being absorbed as one run, but version {run[len(head)].version} in it is a stale "
            "rewrite, which is absorbed alone (an absorber older than this dbidx started the run): re-adopt the "
            "table: `dbidx build-index URI --key COLUMN --readopt`"
        )
    first, last = run[0], run[-1]
    where = _where(run)
    key = _key_column(view)
    columns = view_partition_columns(view)
    bounds = [first.version, last.version]
    extra: dict[str, Any] = {ABSORBED_EXTRA: _about(last, bounds)}
    for actions in run:
        _check_metadata(view, actions, columns, key, extra, where)
    check_run_features(view, run)
    extra.update(row_tracking_extras(run))
    extra.update(stamp_extras(table.io, view, run, extra))
    removed, added = _net(view, run, where, set(stale.removes))
    # 2. One claimed instant per record still to publish; the net record's files written under the last one.
    claims = [table.timeline.start(ACTION_ABSORB, hooks=False) for _ in run[published:]]
    written: list[str] = []
    done: list[CompletedInstant] = []
    try:
        net_seq = seq + len(claims) - 1
        record = _build(table, view, where, net_seq, claims[-1], key, columns, removed, added, extra, written, stale)
        # 3. The pass-through records of the run's earlier versions, then the net record.
        for i, (actions, claim) in enumerate(zip(run[published:-1], claims)):
            passing = CompletedInstant(
                seq=seq + i,
                instant=claim.instant,
                action=ACTION_ABSORB,
                completed_at_ms=int(time.time() * 1000),
                start_seq=seq + i - 1,
                table_id=table.props.table_id,
                extra={ABSORBED_EXTRA: _about(actions, bounds)},
            )
            if not table.timeline.publish_exact(claim, passing):
                break
            done.append(passing)
        else:
            if table.timeline.publish_exact(claims[-1], record):
                markers.discard_unlisted(table.io, claims[-1].instant, keep={f.path for f in record.dv_files})
                done.append(record)
    except ForeignDuplicateError:
        # Lookups read the index as of the latest completion: if another process published this run's first
        # record meanwhile, the keys it added are live already and the "duplicates" are this run's own.
        table.timeline.refresh()
        if table.timeline.latest_seq < seq:
            raise
    finally:
        # 4. Whatever did not publish goes: its index and DV files, markers and claims (no record to roll back).
        #    Whether the net record published is asked of the timeline: an interrupt in its publish's housekeeping
        #    (after the record is on storage) must not take its files.
        if len(done) < len(claims):
            table.timeline.refresh()
            if table.timeline.record_of(claims[-1].instant) is None:
                _discard(table, [c.instant for c in claims[len(done) :]], written)
    return done


def collect_run(table: TableState, version: int, staged: Callable[[VersionActions], bool]) -> list[VersionActions]:
    """The run of other engines' versions from `version` on: every version on storage up to the first one a dbidx
    writer staged a record for (`staged`). Versions a Delta log cleanup expired (at or below `_last_checkpoint`)
    count as present: up to the checkpoint, the run is read from its snapshot."""
    io = table.io
    floor = last_checkpoint_version(io)
    run: list[VersionActions] = []
    nxt = version
    if version <= floor:
        run = [expired_version(v) for v in range(version, floor)] + [from_checkpoint(io, floor, _known(table))]
        nxt = floor + 1
    while io.exists(version_file(nxt)):
        actions = read_version(io, nxt)
        if run and staged(actions):
            break
        run.append(actions)
        nxt += 1
    return run


def reread_run(table: TableState, first: int, last: int) -> list[VersionActions]:
    """Exactly the run [first, last] another absorber started (its records before the net one are published)."""
    io = table.io
    floor = last_checkpoint_version(io)
    if first > floor:
        return [read_version(io, v) for v in range(first, last + 1)]
    if floor > last:
        raise CorruptFileError(
            f"Delta versions {first}-{last} of {io.path('_delta_log')} were being absorbed when a "
            f"log cleanup expired them (a checkpoint at version {floor} is past them): the run "
            "cannot be finished. Re-adopt the table: `dbidx build-index URI --key COLUMN "
            "--readopt`"
        )
    return (
        [expired_version(v) for v in range(first, floor)]
        + [from_checkpoint(io, floor, _known(table))]
        + [read_version(io, v) for v in range(floor + 1, last + 1)]
    )


def _known(table: TableState) -> dict[str, tuple[int, int | None, int | None]]:
    """The index's live data files with the rows their vectors delete and their row ids (what a checkpoint is
    compared with: a file whose ids changed, Delta Spark's row-tracking backfill, is changed as a new vector is)."""
    view = table.data_view()
    out = {}
    for live in view.live():
        ref = view.vector_of(live.record.path)
        f = live.record
        out[f.path] = (0 if ref is None else ref.vector.cardinality, f.base_row_id, f.row_commit_version)
    return out


def run_in_progress(record: CompletedInstant | None) -> tuple[int, int] | None:
    """The (first, last) Delta versions of the run an absorb record belongs to, when its net record (at the run's
    last version) is not published yet: the next absorber finishes exactly that run."""
    if record is None or record.action != ACTION_ABSORB:
        return None
    about = record.extra.get(ABSORBED_EXTRA)
    run = about.get("run") if isinstance(about, dict) else None
    if not (isinstance(run, list) and len(run) == 2 and all(isinstance(v, int) for v in run)):
        return None
    return (run[0], run[1]) if about.get("version") != run[1] else None


def _about(actions: VersionActions, bounds: list[int]) -> dict[str, Any]:
    return {
        "version": actions.version,
        "operation": str(actions.commit_info.get("operation", "")),
        "engine": str(actions.commit_info.get("engineInfo", "")),
        "run": list(bounds),
    }


def _where(run: list[VersionActions]) -> str:
    if len(run) == 1:
        return f"Delta version {run[0].version} ({run[0].writer})"
    writers = sorted({a.writer for a in run})
    shown = ", ".join(writers[:4]) + (", ..." if len(writers) > 4 else "")
    return f"Delta versions {run[0].version}-{run[-1].version} ({shown})"


def _net(
    view: DataView, run: list[VersionActions], where: str, stale: set[str]
) -> tuple[set[str], dict[str, FileAction]]:
    """The run's net effect on the files: (known files that left or whose vector changed, files live at its end
    that were added in it, with their last `add`). A file added and removed within the run is in neither. The
    `stale` removes (of files no longer live: table/absorb_stale.py) change nothing, for Delta readers too."""
    spelled = {f.record.path: f.record.delta_path or delta_path(f.record.path) for f in view.live()}
    known = set(spelled)
    present: dict[str, FileAction | None] = {p: None for p in known}
    for actions in run:
        for a in actions.removes:
            if a.path in stale:  # (not live before the run: split_at_stale found it so)
                continue
            if a.path not in present:
                raise CorruptFileError(
                    f"Delta version {actions.version} ({actions.writer}) removes {a.raw_path!r}, "
                    "which is not a live file at that version: the index and the log disagree"
                )
            if present[a.path] is None and a.raw_path != spelled[a.path] and not actions.synthetic:
                # Delta readers match a remove to its add by the path string: this one misses, they keep the file.
                raise DeltaFeatureError(
                    f"Delta version {actions.version} ({actions.writer}) removes {a.raw_path!r}, but the file was "
                    f"added as {spelled[a.path]!r}: Delta readers keep it live while the remove says it is gone, so "
                    "dbidx cannot describe what they read. Restore the version before with that engine and rewrite "
                    "the file's rows with dbidx (or re-adopt the table once its log is consistent)"
                )
            present.pop(a.path)
        adds: set[str] = set()
        for a in actions.adds:
            if a.path in adds:
                raise CorruptFileError(f"Delta version {actions.version} ({actions.writer}) adds {a.raw_path!r} twice")
            adds.add(a.path)
            present[a.path] = a
    removed = {p for p in known if p not in present or present[p] is not None}
    added = {p: a for p, a in present.items() if a is not None}
    return removed, added


def _discard(table: TableState, instants: list[str], written: list[str]) -> None:
    """Claims of an absorb that did not publish: their files, markers and claim files go (they never had a record
    to roll back)."""
    for rel in written:
        table.io.delete(rel)
    for instant in instants:
        markers.discard_unlisted(table.io, instant, keep=())
        table.io.delete(layout.inflight_file(instant))
        table.io.delete(layout.requested_file(instant))
        table.timeline.stop_heartbeat(instant)


def _build(
    table: TableState,
    view: DataView,
    where: str,
    seq: int,
    started: StartedInstant,
    key: str | None,
    columns: list[str],
    removed: set[str],
    added: dict[str, FileAction],
    extra: dict[str, Any],
    written: list[str],
    stale: StaleRewrite,
) -> CompletedInstant:
    """The absorb record: data files in and out, vectors, and the index entries of every key that moved (of a stale
    rewrite: its new files' copies of rows placed elsewhere masked, table/absorb_stale.py)."""
    instant = started.instant
    gone = sorted(removed - set(added))
    fresh = sorted(set(added) - removed)
    changed = sorted(removed & set(added))
    if (gone or fresh or changed) and key is None:
        raise DeltaFeatureError(
            f"{where} changes data files, but the table has no recorded key column yet; "
            "write it with dbidx first (build-index or an upsert)"
        )
    left, came = _Rows(), _Rows()
    vectors: dict[str, BitMap] = {}
    descriptors: dict[str, dict[str, Any] | None] = {}
    # 2. Files that left: every row still live in them leaves (read from the file; from the index if a VACUUM
    #    deleted it before dbidx absorbed its removal).
    by_group: dict[tuple[str, str], list[str]] = {}
    live_files = {f.record.path: f.record for f in view.live()}  # gone and changed files are live (_net)
    for path in gone:
        by_group.setdefault((live_files[path].partition, live_files[path].file_group), []).append(path)
    for (partition, group), paths in sorted(by_group.items()):
        if all(table.io.exists(p) for p in paths):
            for path in paths:
                record = live_files[path]
                keys = read_key_column(table.io, record, key or "")
                left.add(_minus(keys, _vector(table, view, path, record.rows)), partition, group, path)
        else:
            left.add(_keys_only_in(table, view, partition, group, set(paths), key or ""), partition, group, paths[0])
    # 3. Files whose vector changed: the rows it newly deletes leave.
    #    A file whose log vector lags the index's (rows of a stale rewrite masked, table/absorb_stale.py) is
    #    compared with the log's vector (what the engine saw), and keeps the masked rows on top of the new one.
    logged: dict[str, dict[str, Any] | None] = {}
    renumbered: dict[str, list[int | None]] = {}
    for path in changed:
        record = live_files[path]
        ids = [added[path].base_row_id, added[path].row_commit_version]
        if ids != [record.base_row_id, record.row_commit_version]:  # (Delta Spark's row-tracking backfill)
            renumbered[path] = ids
        mine = _vector(table, view, path, record.rows)
        behind, log_dv = view.log_vector(path)
        old = mine if not behind else _descriptor_vector(table, log_dv, record.rows, f"{where}, file {path!r}")
        new = _descriptor_vector(table, added[path].dv, record.rows, f"{where}, file {path!r}")
        if not old.issubset(new):
            raise DeltaFeatureError(
                f"{where} brings back deleted rows of {path!r} (its new deletion vector lacks "
                "rows the old one had, as a RESTORE does): dbidx cannot tell which version of those records is "
                "live. Re-adopt the table as it is now: `dbidx build-index URI --key COLUMN --readopt`"
            )
        keys = read_key_column(table.io, record, key or "")
        positions = np.asarray((new - mine).to_array(), dtype=np.int64)
        left.add(keys.take(pa.array(positions)), record.partition, record.file_group, path)
        if not mine.issubset(new):  # still masking rows the log shows
            logged[path] = None if added[path].dv is None else dict(added[path].dv)
            vectors[path], descriptors[path] = new | mine, None
        elif added[path].dv is not None:
            vectors[path], descriptors[path] = new, dict(added[path].dv)
    # 4. Files that came: their rows minus their own vector (and, of a stale rewrite, minus the rows it copied
    #    from files that were no longer live: masked in the index now, in the log by dbidx's next version).
    data_files = []
    left_rows = left.table()  # (complete: only `came` grows below)
    for path in fresh:
        action = added[path]
        partition = _partition_of(action, columns, where, table.io.column_names)
        record, keys = _read_new_file(table, path, partition, action, key or "", where)
        record = replace(record, base_row_id=action.base_row_id, row_commit_version=action.row_commit_version)
        data_files.append(record)
        deleted = BitMap()
        if action.dv is not None:
            deleted = read_descriptor(table.io, action.dv, record.rows, f"{where}, file {path!r}")
            vectors[path], descriptors[path] = deleted, dict(action.dv)
        if stale:
            masked = stale_copies(left_rows, keys, partition, deleted, table.global_index, stale, path)
            if masked:
                logged[path] = None if action.dv is None else dict(action.dv)
                deleted = deleted | masked
                vectors[path], descriptors[path] = deleted, None
        came.add(_minus(keys, deleted), partition, record.file_group, path)
    if stale:
        extra[STALE_EXTRA] = stale.about()
    if renumbered:
        extra[ROW_IDS_EXTRA] = renumbered
    if logged:
        extra[LOG_VECTORS_EXTRA] = logged
    # 5. The index entries, per scope (a partition, or the whole table in global mode).
    buffer = EntryBuffer(table, instant)
    _entries(table, buffer, left_rows, came.table(), came, where)
    groups = buffer.sorted_groups()
    paths = [layout.delta_file(g[0], g[1], instant) for g in groups]
    table.timeline.mark_inflight(started, paths)
    written += paths
    files = buffer.write(table.io, groups)
    dv_files, dv_records = write_vectors(table.io, instant, vectors, vectors_in_files(view.configuration()))
    return CompletedInstant(
        seq=seq,
        instant=instant,
        action=ACTION_ABSORB,
        completed_at_ms=int(time.time() * 1000),
        start_seq=seq - 1,
        table_id=table.props.table_id,
        files=tuple(files),
        data_files=tuple(data_files),
        replaced=tuple(gone),
        dv_files=dv_files,
        deletion_vectors=tuple(replace(v, delta=descriptors[v.path] or v.delta) for v in dv_records),
        partitions=buffer.changes(),
        extra=extra,
    )


def _keys_only_in(table: TableState, view: DataView, partition: str, group: str, paths: set[str], key: str) -> pa.Array:
    """The live keys of a file group's files `paths` without reading them (a VACUUM deleted them): the group's keys
    in the index, minus the live keys of its other files."""
    scope = None if table.global_index else partition
    entries = table.snapshot(scope, as_of=view.applied_seq)  # the index right before the run
    mine = pc.equal(entries.column(rli_files.FILE_GROUP), group)
    if table.global_index:
        mine = pc.and_(mine, pc.equal(entries.column(rli_files.PARTITION), partition))
    keys = one_chunk(entries.filter(mine).column(rli_files.KEY))
    for live in view.live():
        f = live.record
        if f.partition == partition and f.file_group == group and f.path not in paths:
            others = _minus(read_key_column(table.io, f, key), _vector(table, view, f.path, f.rows))
            keys = keys.filter(pc.invert(pc.is_in(keys, value_set=others)))
    return keys


def _descriptor_vector(table: TableState, descriptor: dict[str, Any] | None, rows: int, where: str) -> BitMap:
    return BitMap() if descriptor is None else read_descriptor(table.io, descriptor, rows, where)


def _minus(keys: pa.Array, deleted: BitMap) -> pa.Array:
    if not len(deleted):
        return keys
    keep = np.ones(len(keys), dtype=bool)
    keep[np.asarray(deleted.to_array(), dtype=np.int64)] = False
    return keys.filter(pa.array(keep))


def _vector(table: TableState, view: DataView, path: str, rows: int) -> BitMap:
    ref = view.vector_of(path)
    return BitMap() if ref is None else load_vector(table.io, ref, rows)


def _key_column(view: DataView) -> str | None:
    value = view.layout.value if view.layout is not None else None
    key = value.get("key") if isinstance(value, dict) else None
    return key if isinstance(key, str) else None


def _read_new_file(
    table: TableState, path: str, partition: str, action: FileAction, key: str, where: str
) -> tuple[DataFileRecord, pa.Array]:
    """A file another engine added, read as build-index reads a migrated file (data/source_files.py: its bytes
    checksummed, its key column checked), its size checked against the `add`."""
    try:
        source = read_source(table.io, path, partition, key)
    except DbidxError as exc:
        raise type(exc)(f"{where} adds {path!r}: {exc}") from exc
    if source.record.size != action.size:
        raise CorruptFileError(
            f"{where} adds {table.io.path(path)} of {action.size} bytes; the file has {source.record.size}"
        )
    spelled = None if action.raw_path == delta_path(path) else action.raw_path
    return replace(source.record, delta_path=spelled), source.keys
