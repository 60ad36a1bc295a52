"""Adopting an existing Delta table (docs/FORMAT.md section 12b): what `build-index` reads of it before indexing.

Why a replay of our own beside delta-rs: delta-rs gives the snapshot's files, schema and each file's deleted rows,
but not the exact `path` string and `deletionVector` descriptor of each file's `add` action, and a later `remove`
must repeat both exactly (Delta identifies a logical file by its path and its vector's id), or every Delta reader
would keep the old entry beside dbidx's new one. So the log's JSON versions (from the newest checkpoint on, a V2
one and its sidecars included) are replayed here for those two facts, and the result is checked against delta-rs's
snapshot file by file (paths, deleted-row counts): a disagreement is an error, never a guess.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyroaring import BitMap

from dbidx.data.column_mapping import mapped_names, mapping_mode
from dbidx.data.deletion_vectors import positions_bitmap, z85_decode
from dbidx.data.delta_actions import row_ids_of
from dbidx.data.delta_checkpoint_files import listed_checkpoints, newest_checkpoint, read_checkpoint
from dbidx.data.delta_features import check_adoptable, check_versions
from dbidx.data.delta_log import DELTA_LOG_DIR, listed_versions, path_in_table, version_file
from dbidx.errors import CorruptFileError, DbidxError, DeltaFeatureError, InvalidInputError
from dbidx.storage import layout
from dbidx.storage.column_names import ColumnNames
from dbidx.storage.fileio import FileIO


@dataclass(frozen=True)
class AdoptedFile:
    """One live file of the snapshot: its table-relative path, the log's spelling of it, its partition as a hive
    path, size, and its deletion vector (descriptor and deleted rows) if it has one."""

    path: str
    raw_path: str
    partition: str
    size: int
    dv: dict[str, Any] | None
    deleted: BitMap | None
    base_row_id: int | None = None  # row tracking: the add's baseRowId and defaultRowCommitVersion
    row_commit_version: int | None = None


@dataclass(frozen=True)
class DeltaSnapshot:
    """The adopted table at one version: protocol, metaData, Arrow schema, partition columns and live files."""

    version: int
    protocol: dict[str, Any]
    metadata: dict[str, Any]
    schema: pa.Schema
    partition_columns: list[str]
    files: list[AdoptedFile]


def is_foreign_delta_table(io: FileIO, own_version_zero: bytes) -> bool:
    """True if the directory holds a Delta log that is not this dbidx table's own (its version 0 differs)."""
    versions = listed_versions(io)
    if not versions:
        return False
    return 0 not in versions or io.read_bytes(version_file(0)) != own_version_zero


def read_snapshot(io: FileIO) -> DeltaSnapshot:
    """The Delta table's latest snapshot, checked: a protocol dbidx can keep, files and vectors inside the table,
    descriptors that match what delta-rs reads. Nothing here writes."""
    from deltalake import DeltaTable
    from deltalake.exceptions import DeltaError

    if not io.is_local:
        raise DeltaFeatureError(
            f"adopting a Delta table on an object store ({io.path('')}) is not supported yet; "
            "adopt a local copy, or write the table with dbidx from the start"
        )
    # 1. delta-rs's snapshot: version, protocol, metaData, schema, files. A log it cannot read (a torn commit) is
    #    named by our own replay of it where it can be, else with delta-rs's words.
    try:
        table = DeltaTable(io.path(""))
        version = table.version()
        raw_protocol = table.protocol()
        schema = pa.schema(table.schema().to_arrow())
        their_paths = pa.table(table.get_add_actions(flatten=True)).column("path").to_pylist()
    except DeltaError as exc:
        _replay(io, _newest_version(io))
        raise CorruptFileError(
            f"the Delta log {io.path(DELTA_LOG_DIR)} is unreadable to delta-rs: {exc}; nothing was written"
        ) from exc
    protocol = _check_protocol(raw_protocol, io)
    # 2. Our replay of the same version: each file's raw path and vector descriptor, and the metaData action; every
    #    vector checked to be inline or inside the table before anything (delta-rs included) opens one.
    live, metadata = _replay(io, version)
    partition_columns = list(metadata.get("partitionColumns") or [])
    # Column mapping by name: the files and the partition values name the columns physically (the check of the
    # features, below, refuses what dbidx cannot map); the table's FileIO reads its files so from here on.
    configuration = dict(metadata.get("configuration") or {})
    if mapping_mode(configuration) == "name" and isinstance(metadata.get("schemaString"), str):
        io.column_names = mapped_names(metadata["schemaString"])
    _check_schema(schema, io)
    check_adoptable(io, version, protocol, metadata)  # every feature dbidx cannot keep, named (data/delta_features.py)
    # 3. Checked against delta-rs: the same files; every vector deletes as many rows as delta-rs says.
    theirs = {_relative(str(p), io): None for p in their_paths}
    ours = {_relative(raw, io): (raw, add) for raw, add in live.items()}
    if set(theirs) != set(ours):
        odd = sorted(set(theirs) ^ set(ours))[:3]
        raise CorruptFileError(
            f"the Delta log of {io.path('')} at version {version} reads differently in delta-rs and "
            f"in dbidx's replay (e.g. {odd}); nothing was written"
        )
    for path, (_raw, add) in sorted(ours.items()):
        if add.get("deletionVector") is not None:
            _check_vector(add["deletionVector"], io, path)
    try:
        deleted = _deleted_rows(table, io) if any(add.get("deletionVector") for add in live.values()) else {}
    except DeltaError as exc:
        raise CorruptFileError(
            f"delta-rs cannot read the deletion vectors of the Delta table {io.path('')} at "
            f"version {version}: {exc}; nothing was written"
        ) from exc
    files = []
    for path, (raw, add) in sorted(ours.items()):
        dv = add.get("deletionVector")
        rows = deleted.get(path)
        if (dv is None) != (rows is None) or (
            dv is not None and rows is not None and dv.get("cardinality") != len(rows)
        ):
            raise CorruptFileError(
                f"the deletion vector of {io.path(path)} in the Delta log ({dv}) does not match "
                f"the {0 if rows is None else len(rows)} deleted rows delta-rs reads; nothing "
                "was written"
            )
        base_row_id, row_version = row_ids_of(add, f"the add of {io.path(path)} in the Delta log")
        partition = _partition_of(add, partition_columns, io.path(path), io.column_names)
        files.append(AdoptedFile(path, raw, partition, int(add["size"]), dv, rows, base_row_id, row_version))
    return DeltaSnapshot(version, protocol, metadata, schema, partition_columns, files)


def _newest_version(io: FileIO) -> int:
    """The newest version the log's listing names (a commit JSON or a checkpoint); -1 for none."""
    names = io.list_names(DELTA_LOG_DIR)
    return max(listed_versions(io, names) + list(listed_checkpoints(names)), default=-1)


_DV_UUID_CHARS = 20  # a 16-byte uuid in Z85


def _check_vector(dv: Any, io: FileIO, path: str) -> None:
    """A deletion vector dbidx can adopt, checked on the log's own descriptor before anything reads it: inline
    (`i`), or a DV file relative to the table (`u`: an optional directory prefix, then the file's uuid in Z85; the
    file is `<prefix>/deletion_vector_<uuid>.bin`) that stays inside the table, symlinks resolved. Why before: a
    descriptor is untrusted input, and one that points out of the table (`..`, an absolute `p` path, a symlink)
    would have delta-rs read, and dbidx then adopt, bytes of a file that is no part of the table."""
    where = f"{io.path(path)} (deletion vector {dv!r:.200})"
    kind = dv.get("storageType") if isinstance(dv, dict) else None
    if kind == "i":
        return
    if kind != "u":
        raise DeltaFeatureError(
            f"{where} is stored at an absolute path or in an unknown way ({kind!r}); dbidx "
            "adopts relative (u) and inline (i) vectors only; nothing was written"
        )
    text = dv.get("pathOrInlineDv")
    if not isinstance(text, str) or len(text) < _DV_UUID_CHARS:
        raise CorruptFileError(f"{where}: a relative vector's pathOrInlineDv must end in a 20-character Z85 uuid")
    prefix, encoded = text[:-_DV_UUID_CHARS], text[-_DV_UUID_CHARS:]
    try:
        file_uuid = uuid.UUID(bytes=z85_decode(encoded))
    except ValueError as exc:
        raise CorruptFileError(f"{where}: {encoded!r} is not a Z85 uuid ({exc})") from exc
    name = f"deletion_vector_{file_uuid}.bin"
    rel = f"{prefix}/{name}" if prefix else name
    try:
        io.guard(rel, "read")
    except DbidxError as exc:
        raise DeltaFeatureError(
            f"{where} names the DV file {rel!r}, which is not inside the table: {exc}; dbidx "
            "adopts vectors stored inside the table only; nothing was written"
        ) from exc


def _check_protocol(p: Any, io: FileIO) -> dict[str, Any]:
    """The protocol as a dict, if its reader and writer versions are ones dbidx can write to (its features are
    checked with the metaData: data/delta_features.py)."""
    reader, writer = int(p.min_reader_version), int(p.min_writer_version)
    readers, writers = list(p.reader_features or []), list(p.writer_features or [])
    out: dict[str, Any] = {"minReaderVersion": reader, "minWriterVersion": writer}
    if reader == 3:
        out["readerFeatures"] = sorted(readers)
    if writer == 7:
        out["writerFeatures"] = sorted(writers)
    check_versions(out, io.path(DELTA_LOG_DIR))
    return out


def _check_schema(schema: pa.Schema, io: FileIO) -> None:
    """No column in dbidx's `_dbidx_` namespace."""
    if any(f.name.startswith("_dbidx_") for f in schema):
        raise DeltaFeatureError(f"{io.path('')}: the table has columns in dbidx's `_dbidx_` namespace")


def _replay(io: FileIO, version: int) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Live `add` actions by raw path, and the metaData action, at `version` (newest checkpoint + JSON versions)."""
    start, live, metadata = _from_checkpoint(io, version)
    for v in range(start + 1, version + 1):
        try:
            lines = io.read_bytes(version_file(v)).decode("utf-8").splitlines()
            actions = [json.loads(line) for line in lines if line.strip()]
            if not all(isinstance(action, dict) for action in actions):
                raise ValueError("a line is not a JSON object")
        except (OSError, UnicodeError, ValueError) as exc:
            raise CorruptFileError(
                f"Delta version {v} ({io.path(version_file(v))}) is unreadable: {exc}; nothing was written"
            ) from exc
        for action in actions:  # removes first: a remove and an add of one path in a version replace its vector
            if isinstance(action.get("remove"), dict):
                live.pop((action["remove"].get("path"), _dv_id(action["remove"].get("deletionVector"))), None)
        for action in actions:
            if isinstance(action.get("add"), dict):
                add = action["add"]
                live[(add.get("path"), _dv_id(add.get("deletionVector")))] = add
            if isinstance(action.get("metaData"), dict):
                metadata = action["metaData"]
    by_path: dict[str, dict[str, Any]] = {}
    for (raw, _dv), add in live.items():
        if not isinstance(raw, str) or raw in by_path:
            raise CorruptFileError(
                f"the Delta log of {io.path('')} lists file {raw!r} twice (or without a path) at version {version}"
            )
        by_path[raw] = add
    if not metadata:
        raise CorruptFileError(f"the Delta log of {io.path('')} has no metaData action up to version {version}")
    return by_path, metadata


def _from_checkpoint(io: FileIO, version: int) -> tuple[int, dict[tuple[Any, str], dict[str, Any]], dict[str, Any]]:
    """The newest complete checkpoint at or below `version` (classic, multi-part, or UUID-named with its sidecars:
    data/delta_checkpoint_files.py): (its version, live adds, metaData); (-1, {}, {}) without one."""
    found = newest_checkpoint(io.list_names(DELTA_LOG_DIR), version)
    if found is None:
        return -1, {}, {}
    content = read_checkpoint(io, found)
    live = {(add.get("path"), _dv_id(add.get("deletionVector"))): add for add in content.adds}
    return found.version, live, content.metadata


def _dv_id(dv: Any) -> str:
    """Delta's unique id of a vector (storage type, path or inline data, offset); "" for none."""
    if not isinstance(dv, dict):
        return ""
    offset = dv.get("offset")
    return f"{dv.get('storageType')}{dv.get('pathOrInlineDv')}" + ("" if offset is None else f"@{offset}")


def _relative(path: str, io: FileIO) -> str:
    """A file's table-relative path (decoded), checked to lie inside the table."""
    root = io.path("").rstrip("/")
    plain = path_in_table(root, path)
    if plain is None:
        raise DeltaFeatureError(
            f"the Delta table at {root} lists {path!r}, a file outside its directory (a shallow clone's log names its "
            "source's files so); dbidx adopts tables whose files lie inside them, and nothing was written. Copy the "
            "rows into a table of their own and adopt that, e.g. with Delta Spark: CREATE TABLE delta.`NEW` USING "
            f"delta PARTITIONED BY (its partition columns) AS SELECT * FROM delta.`{root}`, then "
            "`dbidx build-index NEW --key COLUMN`"
        )
    try:
        return layout.validate_table_path(plain)
    except InvalidInputError as exc:
        raise DeltaFeatureError(f"the Delta table at {root} lists {path!r}: {exc}") from exc


def _deleted_rows(table: Any, io: FileIO) -> dict[str, BitMap]:
    """Each file's deleted rows, as delta-rs reads its deletion vector (a selection vector: True keeps a row)."""
    import numpy as np

    out: dict[str, BitMap] = {}
    for row in pa.table(table.deletion_vectors().read_all()).to_pylist():
        keep = np.asarray(row["selection_vector"], dtype=bool)
        out[_relative(row["filepath"], io)] = positions_bitmap(np.flatnonzero(~keep))
    return out


def _partition_of(add: dict[str, Any], columns: list[str], where: str, io_names: ColumnNames | None = None) -> str:
    """A file's partition as dbidx names partitions: `col=value/...` from its partitionValues."""
    values = add.get("partitionValues") or {}
    if io_names is not None:
        values = {c: values.get(io_names.physical(c)) for c in columns}
    segments = []
    for column in columns:
        value = values.get(column)
        if value is None or value == "":  # Delta reads an empty partition value as null
            raise DeltaFeatureError(
                f"{where} has a null, empty or no value ({value!r}) for partition column "
                f"{column!r}; dbidx names partitions by their values"
            )
        if "/" in str(value):
            raise DeltaFeatureError(
                f"{where} has partition value {value!r} for column {column!r}: dbidx names "
                "partitions by path segments, and a '/' in a value would split it; nothing was "
                "written"
            )
        segments.append(f"{column}={value}")
    partition = "/".join(segments)
    try:
        return layout.validate_partition(partition) if partition else partition
    except InvalidInputError as exc:
        raise DeltaFeatureError(f"{where}: partition {partition!r} cannot be a dbidx partition: {exc}") from exc
