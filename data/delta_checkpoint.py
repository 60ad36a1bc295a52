"""Delta checkpoints of a dbidx table: delta-rs writes them (Delta's own Parquet format), then dbidx drops the
tombstones no reader or vacuum can use, strips the inline deletion vectors off the tombstones it keeps, and
compresses the file.

Why: a dbidx upsert changes a file's deletion vector with a remove of (path, old vector) and an add of (path, new
vector), as the protocol asks. The remove is a tombstone that delta-rs keeps in every checkpoint for
`delta.deletedFileRetentionDuration` (a week by default). At a million keys and a batch a minute that is hundreds
of tombstones per version, millions per week, all in each checkpoint, written uncompressed every
`delta.checkpointInterval` versions. Yet such a tombstone names a path that is live again in the same checkpoint
(a vacuum keeps it whatever the tombstone says) and a vector stored inline (no file to protect): dropping it
changes nothing any reader or vacuum does. Every other tombstone stays (a file a compaction or another engine
removed; a vector in a file of its own).

The tombstones that stay are kept whole but for an inline vector: delta-rs copies each remove's `deletionVector` into
the checkpoint, and a data compaction's remove carries the replaced file's whole vector (the protocol asks that of a
commit, where a reader pairs the remove with the add it cancels by path and vector). In a checkpoint a tombstone is
only ever read by VACUUM (PROTOCOL.md, "Checkpoint Schema": a checkpoint's `remove` is path, deletionTimestamp and
dataChange), which goes by the path and, for a vector in a file of its own, that file; an inline vector names no
file, and no add of the same path is left in the checkpoint to pair it with. Measured (issue 44: 2-minute
retention, one upsert a second and a half with services on): those vectors were 85% of a checkpoint's bytes, and the
checkpoints 42% of the log kept. A vector in a file (`u`, `p`) stays on its tombstone: VACUUM keeps that file for it.

A checkpoint is published once, with its final bytes, and never rewritten (issue 63: delta-rs and polars read a
checkpoint by byte ranges, opening it by name for each, so a file replaced under a load fails it). delta-rs writes
its checkpoint into a private copy of the log's tail (data/delta_scratch.py); dbidx slims it there, reads the slim
file back and checks it (same schema, the same adds, metaData and protocol, the kept tombstones the same but for
inline vectors of paths not added back), and puts it under `<version>.checkpoint.parquet` if absent
(`create_exclusive`, as a Delta version is put). A checkpoint of that version already there (another engine's,
another dbidx process's) is left as it is. Then `_last_checkpoint` moves forward to it, never back (replaced
atomically, as Delta does; read back as untrusted).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dbidx.data.delta_log import DELTA_LOG_DIR, read_checkpoint_pointer
from dbidx.data.delta_scratch import checkpoint_file, copy_tail, log_tail, scratch_checkpoint
from dbidx.errors import CorruptFileError
from dbidx.storage.fileio import DECODE_ERRORS, FileIO

COMPRESSION = "snappy"  # every Delta reader reads it (delta-rs writes its checkpoints uncompressed)


@dataclass(frozen=True)
class CheckpointWritten:
    """A Delta checkpoint dbidx wrote: its version, and what slimming it saved."""

    version: int
    tombstones_dropped: int
    bytes_before: int
    bytes_after: int
    vectors_stripped: int = 0  # inline vectors taken off the tombstones kept
    published: bool = True  # False: a checkpoint of that version was there already, and was left as it is


def write_delta_checkpoint(io: FileIO) -> CheckpointWritten | None:
    """A Delta checkpoint of the latest version (delta-rs), slimmed and published once (module docstring); None for
    a table on an injected filesystem (no URI: it gets no Delta checkpoints)."""
    if not io.is_local and "://" not in io.uri:
        return None
    # 1. The log's tail: the newest checkpoint and the JSON after it. The latest version has one already: no work.
    tail = log_tail(io)
    version = tail.version
    if tail.checkpoint == version or io.exists(checkpoint_file(version)):  # (the pointer may lag a writer's)
        return _found(io, version)
    # 2. delta-rs writes its checkpoint into a local copy of that tail; nothing in the table's log changes.
    with tempfile.TemporaryDirectory(prefix="dbidx-delta-checkpoint-") as scratch:
        copy_tail(io, tail, scratch)
        raw, pointer = scratch_checkpoint(scratch, version)
    # 3. Slimmed in memory, read back and checked against delta-rs's; delta-rs's own if slimming saves nothing.
    written, data, rows, problem = _slimmed(raw, version, io.path(checkpoint_file(version)))
    # 4. Published if absent, then the pointer moved forward to it.
    if io.create_exclusive(checkpoint_file(version), data.to_pybytes()):
        pointer["size"], pointer["sizeInBytes"] = rows, data.size
        _move_pointer(io, pointer)
    else:
        written = _found(io, version)
    if problem is not None:  # a slimming that went wrong is a bug to hear of, whichever checkpoint readers got
        raise problem
    return written


def _slimmed(
    raw: pa.Buffer, version: int, where: str
) -> tuple[CheckpointWritten, pa.Buffer, int, CorruptFileError | None]:
    """What to publish of delta-rs's checkpoint `raw`: (the report, its bytes, its rows, the check's complaint). A
    slim file that fails its check is not published: delta-rs's own is (Delta's format, complete), and the
    complaint is raised once it is."""
    try:
        fat = pq.read_table(pa.BufferReader(raw))
    except DECODE_ERRORS as exc:
        raise CorruptFileError(
            f"the Delta checkpoint delta-rs wrote for {where} is unreadable: {exc}; nothing was published"
        ) from exc
    if "add" not in fat.column_names or "remove" not in fat.column_names:
        raise CorruptFileError(
            f"the Delta checkpoint delta-rs wrote for {where} has no add or remove column; nothing was published"
        )
    unchanged = CheckpointWritten(version, 0, raw.size, raw.size)
    # The tombstones of paths added back in the same checkpoint, with an inline (or no) vector, and all but the
    # newest of each other path; of those kept, the inline vectors.
    useless = _useless_tombstones(fat.column("add"), fat.column("remove"))
    dropped = int(useless.sum())
    kept = fat.filter(pa.array(~useless)) if dropped else fat
    slim, stripped = _strip_inline_vectors(kept)
    if not dropped and not stripped:
        return unchanged, raw, fat.num_rows, None
    sink = pa.BufferOutputStream()
    pq.write_table(slim, sink, compression=COMPRESSION, write_statistics=False)
    data = sink.getvalue()
    if data.size >= raw.size:  # a small log: Parquet's own overhead outweighs the rows dropped
        return unchanged, raw, fat.num_rows, None
    try:
        _check_same_state(fat, kept, pq.read_table(pa.BufferReader(data)), dropped, stripped, where)
    except CorruptFileError as exc:
        return unchanged, raw, fat.num_rows, exc
    return CheckpointWritten(version, dropped, raw.size, data.size, stripped), data, slim.num_rows, None


def _found(io: FileIO, version: int) -> CheckpointWritten:
    """A classic checkpoint of `version` is there already (another writer's): left as it is; the pointer moves
    forward to it with its size and rows (its footer read back), in case its writer died before moving it."""
    name = checkpoint_file(version)
    size = io.size(name)
    if not size:  # a multi-part checkpoint of that version: its writer's pointer names its parts
        return CheckpointWritten(version, 0, 0, 0, published=False)
    try:
        with io.open_input_file(name) as f:
            rows = pq.ParquetFile(f).metadata.num_rows
    except DECODE_ERRORS as exc:
        raise CorruptFileError(
            f"Delta checkpoint {io.path(name)}, which another writer published, is unreadable: {exc}; dbidx leaves "
            "it as it is (delete it if no Delta reader can load the table)"
        ) from exc
    _move_pointer(io, {"version": version, "size": rows, "sizeInBytes": size})
    return CheckpointWritten(version, 0, size, size, published=False)


def _move_pointer(io: FileIO, pointer: dict[str, Any]) -> None:
    """`_last_checkpoint` replaced by `pointer` if it names an older version (or is missing or damaged: a hint Delta
    readers do without); a newer one is left (another writer's later checkpoint)."""
    name = f"{DELTA_LOG_DIR}/_last_checkpoint"
    try:
        current = read_checkpoint_pointer(io)["version"] if io.exists(name) else -1
    except CorruptFileError:
        current = -1
    if current < pointer["version"]:
        io.write_atomic(name, json.dumps(pointer, separators=(",", ":")).encode())


def _useless_tombstones(add: pa.ChunkedArray, remove: pa.ChunkedArray) -> np.ndarray:
    """Per checkpoint row, whether it is a tombstone with an inline (or no) vector that is either of a path live
    again or not the newest tombstone of its path (a vacuum goes by a path's last removal)."""
    rows = len(remove)
    is_remove = pc.is_valid(remove).to_numpy(zero_copy_only=False)
    vector = pc.struct_field(remove, "deletionVector")
    inline = pc.fill_null(
        pc.or_kleene(pc.is_null(vector), pc.equal(pc.struct_field(vector, "storageType"), "i")), True
    ).to_numpy(zero_copy_only=False)
    candidates = np.flatnonzero(is_remove & inline)
    out = np.zeros(rows, dtype=bool)
    if not len(candidates):
        return out
    paths = pc.take(pc.struct_field(remove, "path"), pa.array(candidates)).combine_chunks()
    live = pc.drop_null(pc.struct_field(add, "path")).combine_chunks()
    out[candidates[pc.is_in(paths, value_set=live).to_numpy(zero_copy_only=False)]] = True
    # Of the others, all but the newest per path (ties: the later row).
    stamps = pc.take(pc.struct_field(remove, "deletionTimestamp"), pa.array(candidates)).combine_chunks()
    stamps = pc.fill_null(stamps, -1).to_numpy(zero_copy_only=False)
    codes = pc.dictionary_encode(paths).indices.to_numpy(zero_copy_only=False)
    order = np.lexsort((-np.arange(len(candidates)), -stamps, codes))
    newest = np.ones(len(order), dtype=bool)
    newest[1:] = codes[order][1:] != codes[order][:-1]
    out[candidates[order[~newest]]] = True
    return out


def _inline_vectors(remove: pa.ChunkedArray | pa.StructArray) -> pa.Array:
    """Per checkpoint row, whether it is a tombstone carrying an inline vector (storageType "i")."""
    vector = pc.struct_field(remove, "deletionVector")
    return pc.fill_null(
        pc.and_kleene(pc.is_valid(remove), pc.equal(pc.struct_field(vector, "storageType"), "i")), False
    )


def _strip_inline_vectors(table: pa.Table) -> tuple[pa.Table, int]:
    """The checkpoint with the inline vectors of its tombstones set to null (module docstring), and how many. The
    column's type stays as delta-rs wrote it; a vector in a file of its own stays."""
    at = table.column_names.index("remove")
    remove = table.column(at).combine_chunks()
    if not isinstance(remove, pa.StructArray) or remove.type.get_field_index("deletionVector") < 0:
        return table, 0
    inline = _inline_vectors(remove)
    stripped = int(pc.sum(inline).as_py() or 0)
    if not stripped:
        return table, 0
    vector = remove.field("deletionVector")
    # The vector's own fields are kept as they are under a null parent (some are non-nullable: a null struct over
    # them is what Parquet stores for "no vector").
    bare = pa.StructArray.from_arrays(
        [vector.field(i) for i in range(vector.type.num_fields)],
        fields=list(vector.type),
        mask=pc.or_(pc.is_null(vector), inline),
    )
    fields = [bare if f.name == "deletionVector" else remove.field(i) for i, f in enumerate(remove.type)]
    out = pa.StructArray.from_arrays(fields, fields=list(remove.type), mask=pc.is_null(remove))
    return table.set_column(at, table.schema.field(at), out), stripped


# What a tombstone is to VACUUM, and must survive slimming unchanged.
_TOMBSTONE_FIELDS = ("path", "deletionTimestamp", "dataChange", "size", "partitionValues", "extendedFileMetadata")


def _check_same_state(fat: pa.Table, kept: pa.Table, slim: pa.Table, dropped: int, stripped: int, where: str) -> None:
    """The slim checkpoint holds the fat one's schema and every row but the dropped tombstones (`kept`), the same
    but for the stripped inline vectors, which only tombstones of paths not added back lose."""
    problems = []
    if slim.schema != fat.schema:
        problems.append("its schema differs")
    if slim.num_rows != fat.num_rows - dropped or kept.num_rows != slim.num_rows:
        problems.append(f"it has {slim.num_rows} rows, not {fat.num_rows - dropped}")
    for column in ("add", "metaData", "protocol", "txn", "domainMetadata"):
        if (
            column in fat.column_names
            and pc.sum(pc.is_valid(fat.column(column))).as_py() != pc.sum(pc.is_valid(slim.column(column))).as_py()
        ):
            problems.append(f"its {column} actions differ")
    if not problems:
        for column in slim.column_names:
            if column != "remove" and not slim.column(column).equals(kept.column(column)):
                problems.append(f"its {column} column differs")
        before, after = kept.column("remove"), slim.column("remove")
        remove_type = fat.schema.field("remove").type
        for name in _TOMBSTONE_FIELDS:
            if remove_type.get_field_index(name) >= 0 and not pc.struct_field(before, name).equals(
                pc.struct_field(after, name)
            ):
                problems.append(f"its tombstones' {name} differ")
        if not pc.is_valid(after).equals(pc.is_valid(before)):
            problems.append("its tombstones differ")
        if remove_type.get_field_index("deletionVector") >= 0:
            had = pc.is_valid(pc.struct_field(before, "deletionVector"))
            has = pc.is_valid(pc.struct_field(after, "deletionVector"))
            lost = pc.and_(had, pc.invert(has))
            if pc.sum(lost).as_py() != stripped or not pc.all(pc.or_(pc.invert(lost), _inline_vectors(before))).as_py():
                problems.append("vectors other than the tombstones' inline ones were stripped")
            kept_vectors = pc.filter(pc.struct_field(before, "deletionVector"), has)
            if not kept_vectors.equals(pc.filter(pc.struct_field(after, "deletionVector"), has)):
                problems.append("the vectors kept differ")
            live = pc.drop_null(pc.struct_field(slim.column("add"), "path"))
            bare = pc.filter(pc.struct_field(after, "path"), lost)
            if pc.any(pc.is_in(bare, value_set=live.combine_chunks())).as_py():
                problems.append("a tombstone of a path added back lost its vector")
    if problems:
        raise CorruptFileError(
            f"slimming Delta checkpoint {where} went wrong ({'; '.join(problems)}); the slim file is not "
            "published (the one delta-rs wrote is, unless a checkpoint of that version was there)"
        )
