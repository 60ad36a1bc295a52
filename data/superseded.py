"""Deletion vectors of a commit: which rows of which data files the commit's new rows supersede or delete.

A record lives in one file group (the index says which), so the rows a commit's new version of a record supersedes
are in the older live files of that same group. The vectors are computed by the committing process against the
table exactly as it stands right before the completion it publishes (inside the publish loop, after the conflict
check): a commit that lands meanwhile, a data compaction that rewrote the group, every earlier vector - all are
in that state, so the union it writes is never stale. Each data file's key column is read once per process and
kept with a hash index (data/key_columns.py), and a writer keeps the keys of the files it writes, so a steady
stream of batches reads few files and probes only the batch's keys, not every older row; a group's older files are
probed at once, through one merged index kept per process and grown batch by batch (data/group_keys.py).

The result is one Delta DV file per commit (data/deletion_vectors.py) and, per data file whose vector changed, its
whole new vector. A new file's own delete rows (deletes, global-mode moves out of the group) are in its vector
from the start, so no Delta reader ever sees them.
"""

from __future__ import annotations

import secrets
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyroaring import BitMap

from dbidx.arrays import one_chunk
from dbidx.data.deletion_vectors import (
    DvFileBuilder,
    VectorSlot,
    dv_file_name,
    file_descriptor,
    vectors_in_files,
    positions_bitmap,
    read_vector,
    vector_body,
)
from dbidx.data.files import DELETED_COLUMN, read_data_file
from dbidx.data.group_keys import GROUPS, FileId
from dbidx.data.key_columns import KEYS, FileKeys, KeySources, KeyStore, Probe
from dbidx.errors import CorruptFileError
from dbidx.storage import layout, markers
from dbidx.storage.data_view import DataView, DvRef
from dbidx.storage.fileio import FileIO, file_checksum
from dbidx.storage.records import DataFileRecord, DeletionVectorRecord, DvFileRecord

_THREADS = 8


def _read_columns(
    io: FileIO, record: DataFileRecord, key: str, with_deleted: bool = True
) -> tuple[pa.Array, np.ndarray]:
    """A data file's keys (as strings) and delete flags (False where the file has none, or when not
    `with_deleted`), verified first."""
    table = read_data_file(io, record, [key, DELETED_COLUMN] if with_deleted else [key])
    if key not in table.column_names:
        raise CorruptFileError(f"data file {io.path(record.path)} has no key column {key!r}")
    keys = one_chunk(pc.cast(table.column(key), pa.string()))
    if DELETED_COLUMN in table.column_names:
        deleted = pc.fill_null(table.column(DELETED_COLUMN), False).to_numpy(zero_copy_only=False)
    else:
        deleted = np.zeros(table.num_rows, dtype=bool)
    return keys, deleted


def load_vector(io: FileIO, ref: DvRef, rows: int, files: dict[str, bytes] | None = None) -> BitMap:
    """A live data file's current vector, read from its DV file (size and checksum verified, then the vector's
    length, CRC-32 and cardinality); `files` caches DV file bytes across calls of one read."""
    return read_vector(_dv_file(io, ref, files), _slot(ref), rows, io.path(ref.file.path))


def load_vector_bytes(io: FileIO, ref: DvRef, files: dict[str, bytes] | None = None) -> bytes:
    """A vector's serialized bytes (checked like load_vector's, but not decoded): what the Delta log inlines."""
    return vector_body(_dv_file(io, ref, files), _slot(ref), io.path(ref.file.path))


def _dv_file(io: FileIO, ref: DvRef, files: dict[str, bytes] | None) -> bytes:
    data = files.get(ref.file.path) if files is not None else None
    if data is None:
        data = io.read_verified(ref.file.path, ref.file.size, ref.file.checksum, "DV file").to_pybytes()
        if files is not None:
            files[ref.file.path] = data
    return data


def _slot(ref: DvRef) -> VectorSlot:
    return VectorSlot(ref.vector.offset, ref.vector.size, ref.vector.cardinality)


def dv_file_for(instant: str) -> str:
    """A fresh DV file path for an instant, under `.dbidx/dv/` (out of a Delta VACUUM's reach): Delta names DV files
    by a uuid; ours starts with the instant's 17 digits (so a rollback may delete it:
    table/layout.validate_instant_file) and ends with 15 random hex digits."""
    return f"{layout.DV_DIR}/{dv_file_name(uuid.UUID(hex=instant + secrets.token_hex(8)[:15]))}"


NewRows = tuple[DataFileRecord, pa.Array, np.ndarray]  # a new data file, its keys (strings) and delete flags


def superseded_rows(
    io: FileIO,
    view: DataView,
    new: Sequence[NewRows],
    key: str,
    disk: KeyStore | None = None,
    sources: KeySources | None = None,
) -> dict[str, BitMap]:
    """Rows that new data files make non-table data, against `view`: each new file's own delete rows, and the rows
    of the touched groups' older live files whose key a new row carries, minus their current vector ("fresh"
    positions, not unions). What a writing task computes for its own files, and the driver when it must.
    `disk`: the executor's key files (data/key_files.py), read before a data file and given what is built;
    `sources` counts where the older files' key indexes came from."""
    # 1. The new files' own delete rows; the new keys per file group. The new files' keys are kept: the next batch
    #    probes them as older files.
    fresh: dict[str, BitMap] = {}
    new_keys: dict[tuple[str, str], list[FileKeys]] = {}
    for f, keys, deleted in new:
        if deleted.any():
            fresh[f.path] = positions_bitmap(np.flatnonzero(deleted))
        new_keys.setdefault((f.partition, f.file_group), []).append(KEYS.put(f, keys, disk))
    # 2. Older live files of the touched groups: each one's key index, held here for step 3 (looked up once, its
    #    key file marked used once): from this process, else the executor's key files or the data file, on a few
    #    threads.
    new_paths = {f.path for f, _k, _d in new}
    older = [
        f.record
        for f in view.live()
        if (f.record.partition, f.record.file_group) in new_keys and f.record.path not in new_paths
    ]
    reader = partial(read_key_column, io, key=key)
    indexes = {r.path: KEYS.find(r) for r in older}
    missing = [r for r in older if indexes[r.path] is None]
    sources = sources if sources is not None else KeySources()
    sources.count("memory", len(older) - len(missing))
    if disk is not None:
        for r in older:
            if indexes[r.path] is not None:
                disk.touch(r)  # used: its key file is not the one a trim drops first
    if missing:
        with ThreadPoolExecutor(max_workers=max(1, min(_THREADS, len(missing)))) as pool:
            indexes.update(
                zip((r.path for r in missing), pool.map(lambda r: KEYS.get(r, reader, disk, sources), missing))
            )
    # 3. In each, the rows whose key a new row of its group carries (one hash index per group over its older files,
    #    kept per process: data/group_keys.py; confirmed by key), minus its vector. Only the groups that have older
    #    files are searched (a load into new partitions has none).
    by_group: dict[tuple[str, str], dict[FileId, FileKeys]] = {}
    for r in older:
        by_group.setdefault((r.partition, r.file_group), {})[(r.path, r.checksum)] = indexes[r.path]
    hits: dict[FileId, np.ndarray] = {}
    for (partition, file_group), files in by_group.items():
        merged = GROUPS.of((io.root, partition, file_group), files)
        hits.update(merged.rows_of(Probe.of_files(new_keys[(partition, file_group)]), files))
    dv_bytes: dict[str, bytes] = {}
    found: list[tuple[DataFileRecord, BitMap, pa.Array]] = []
    for record in older:
        file_keys = indexes[record.path]
        rows = hits.get((record.path, record.checksum))
        if rows is None or not len(rows):
            continue
        hit = positions_bitmap(rows)
        ref = view.vector_of(record.path)
        if ref is not None:
            hit -= load_vector(io, ref, record.rows, dv_bytes)
        if len(hit):
            found.append((record, hit, file_keys.keys.take(pa.array(np.asarray(hit.to_array(), dtype=np.int64)))))
    # 4. A key has at most one live row per group: two would mean the table was already inconsistent.
    _reject_repeats([(r, k) for r, _hit, k in found], io)
    fresh.update({r.path: hit for r, hit, _k in found})
    return fresh


def read_key_column(io: FileIO, record: DataFileRecord, key: str) -> pa.Array:
    """A live file's keys as strings, verified first (its delete flags are in its vector already: not read)."""
    return _read_columns(io, record, key, with_deleted=False)[0]


def read_new_rows(io: FileIO, view: DataView, new_files: Sequence[DataFileRecord], key: str) -> list[NewRows]:
    """The new files that can change a vector (with delete rows, or in a group that has older live files), their
    keys and delete flags read on a few threads (the keys are kept for later batches)."""
    groups_with_files = {(f.record.partition, f.record.file_group) for f in view.live()}
    new_files = [f for f in new_files if f.deletes or (f.partition, f.file_group) in groups_with_files]
    with ThreadPoolExecutor(max_workers=max(1, min(_THREADS, len(new_files)))) as pool:
        columns = list(pool.map(lambda f: _read_columns(io, f, key), new_files))
    return [(f, keys, deleted) for f, (keys, deleted) in zip(new_files, columns)]


def vectors_for_commit(
    io: FileIO,
    view: DataView,
    new_files: Sequence[DataFileRecord],
    key: str,
    instant: str,
    fresh: dict[str, BitMap] | None = None,
) -> tuple[tuple[DvFileRecord, ...], tuple[DeletionVectorRecord, ...]]:
    """The DV file and vectors of a commit adding `new_files`, against `view` (the table right before it): each
    touched file's current vector united with its fresh positions. `fresh`: what the writing tasks computed, when
    the caller checked that nothing committed since changed their groups; else computed here."""
    if fresh is None:
        fresh = superseded_rows(io, view, read_new_rows(io, view, new_files, key), key)
    vectors, dv_bytes = {}, {}
    for path, positions in fresh.items():
        live = view.get(path)
        ref = view.vector_of(path)
        if live is None and path not in {f.path for f in new_files}:
            raise CorruptFileError(f"rows of {path} were found superseded, but it is not a live data file")
        rows = live.record.rows if live is not None else next(f.rows for f in new_files if f.path == path)
        if len(positions) and positions.max() >= rows:
            raise CorruptFileError(
                f"row {positions.max()} of {path} was reported superseded, but the file has "
                f"{rows} rows; nothing was published"
            )
        current = load_vector(io, ref, rows, dv_bytes) if ref is not None else BitMap()
        if positions.issubset(current):
            continue  # nothing new: a vector "changed" to itself would be a remove and an add of one (path, DV)
        vectors[path] = positions | current
    return write_vectors(io, instant, vectors, vectors_in_files(view.configuration()))


def write_vectors(
    io: FileIO, instant: str, vectors: dict[str, BitMap], in_files: bool = False
) -> tuple[tuple[DvFileRecord, ...], tuple[DeletionVectorRecord, ...]]:
    """One DV file holding the given whole vectors (data file -> positions), announced before it is written (a
    rollback of the instant deletes it); nothing when there are none. `in_files`: each record
    carries the Delta descriptor pointing into that file, the form the log then gives the vector (and every later
    remove of it repeats); else none, and the log carries it inline (deletion_vectors.vectors_in_files says when)."""
    if not vectors:
        return (), ()
    builder = DvFileBuilder()
    slots = {path: builder.add(vectors[path]) for path in sorted(vectors)}
    data = builder.to_bytes()
    rel = dv_file_for(instant)
    markers.announce(io, instant, rel)
    io.write_atomic(rel, data)
    dv_file = DvFileRecord(path=rel, size=len(data), checksum=file_checksum(data))
    return (dv_file,), tuple(
        DeletionVectorRecord(
            path=p,
            dv_file=rel,
            offset=s.offset,
            size=s.size,
            cardinality=s.cardinality,
            delta=file_descriptor(rel, s.offset, s.size, s.cardinality) if in_files else None,
        )
        for p, s in slots.items()
    )


def _reject_repeats(found: Iterable[tuple[DataFileRecord, pa.Array]], io: FileIO) -> None:
    """Name a key that has live rows in two places of one file group (never written by dbidx: a damaged table)."""
    by_group: dict[tuple[str, str], list[tuple[DataFileRecord, pa.Array]]] = {}
    for record, keys in found:
        by_group.setdefault((record.partition, record.file_group), []).append((record, keys))
    for (partition, group), items in by_group.items():
        keys = pa.concat_arrays([k for _r, k in items])
        if len(pc.unique(keys)) == len(keys):
            continue
        counts = pc.value_counts(keys)
        repeated = counts.field("values").filter(pc.greater(counts.field("counts"), 1))[0].as_py()
        paths = [io.path(r.path) for r, k in items if pc.any(pc.equal(k, repeated)).as_py()]
        raise CorruptFileError(
            f"key {repeated!r} has more than one live row in file group {group!r} of partition "
            f"{partition!r} ({', '.join(paths)}); the table's data files and deletion vectors "
            "disagree, nothing was published (run `dbidx verify`)"
        )
