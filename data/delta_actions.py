"""One Delta version another engine wrote, read back and checked: which files it removed and added, with which
deletion vectors, and what it says about the table (metaData, protocol, commitInfo).

Why a reader of our own and not delta-rs: absorbing a version (table/absorb.py) needs each action exactly as the log
spells it (a later `remove` must repeat a path and vector descriptor byte for byte), and needs it for one version at
a time, not a whole snapshot. Everything here is untrusted input: a line that is not JSON, a path or a vector that
lies outside the table, a size that is not a number, is a typed error naming the version file, raised before any
file it names is opened.
"""

from __future__ import annotations

import json
import posixpath
import uuid
from dataclasses import dataclass, field
from typing import Any

from pyroaring import BitMap

from dbidx.data.deletion_vectors import DV_PREFIX, decode_vector, vector_body, VectorSlot, z85_decode
from dbidx.data.delta_checkpoint_files import checkpoint_actions, listed_checkpoints, read_checkpoint
from dbidx.data.delta_log import DELTA_LOG_DIR, path_in_table, version_file
from dbidx.errors import CorruptFileError, DeltaFeatureError, InvalidInputError
from dbidx.storage import layout
from dbidx.storage.fileio import FileIO


@dataclass(frozen=True)
class FileAction:
    """An `add` or `remove` of one data file: its table-relative path, the log's spelling of it, its partition
    values, size, deletion vector descriptor and dataChange flag."""

    path: str
    raw_path: str
    values: dict[str, str | None]
    size: int | None
    dv: dict[str, Any] | None
    data_change: bool
    base_row_id: int | None = None  # row tracking (storage/row_ids.py), as the action gives them
    row_commit_version: int | None = None


@dataclass(frozen=True)
class VersionActions:
    """What one Delta version holds, by kind of action."""

    version: int
    commit_info: dict[str, Any] = field(default_factory=dict)
    adds: tuple[FileAction, ...] = ()
    removes: tuple[FileAction, ...] = ()
    metadata: dict[str, Any] | None = None
    protocol: dict[str, Any] | None = None
    synthetic: bool = False  # made from a checkpoint's snapshot (its removes name files, not log spellings)
    domains: tuple[dict[str, Any], ...] = ()  # its domainMetadata actions, as written

    @property
    def writer(self) -> str:
        """Who wrote it, as its commitInfo says (engine and operation), for error messages."""
        engine = self.commit_info.get("engineInfo") or self.commit_info.get("clientVersion") or "an unknown engine"
        operation = self.commit_info.get("operation") or "an unnamed operation"
        return f"{operation} by {engine}"

    @property
    def dbidx_instant(self) -> str | None:
        """The dbidx instant a version names in its commitInfo (a version dbidx wrote), else None."""
        info = self.commit_info.get("dbidx")
        return info.get("instant") if isinstance(info, dict) and isinstance(info.get("instant"), str) else None


def read_version(io: FileIO, version: int) -> VersionActions:
    """Parse and check Delta version `version` (every path inside the table, every vector relative or inline)."""
    where = io.path(version_file(version))
    try:
        text = io.read_bytes(version_file(version)).decode("utf-8")
        actions = [json.loads(line) for line in text.splitlines() if line.strip()]
    except (UnicodeError, ValueError) as exc:
        raise CorruptFileError(
            f"Delta version {version} ({where}) is not a valid commit (torn or damaged: {exc}); "
            "restore it from a backup or remove the engine's failed commit"
        ) from exc
    out: dict[str, Any] = {"adds": [], "removes": [], "domains": []}
    for i, action in enumerate(actions):
        if not isinstance(action, dict) or len(action) != 1:
            raise CorruptFileError(
                f"line {i + 1} of Delta version {version} ({where}) is not one action: {action!r:.200}"
            )
        ((kind, body),) = action.items()
        if kind in ("add", "remove"):
            out[kind + "s"].append(_file_action(io, body, kind, f"line {i + 1} of {where}"))
        elif kind in ("commitInfo", "metaData", "protocol"):
            if not isinstance(body, dict):
                raise CorruptFileError(f"the {kind} action on line {i + 1} of {where} is not an object")
            out[{"commitInfo": "commit_info", "metaData": "metadata", "protocol": "protocol"}[kind]] = body
        elif kind == "domainMetadata":
            out["domains"].append(body)  # checked where one is used (data/delta_domains.py)
        # txn, cdc (change data files, never table data) and unknown actions change no row
    return VersionActions(
        version,
        out.get("commit_info", {}),
        tuple(out["adds"]),
        tuple(out["removes"]),
        out.get("metadata"),
        out.get("protocol"),
        domains=tuple(out["domains"]),
    )


def _file_action(io: FileIO, body: Any, kind: str, where: str) -> FileAction:
    if not isinstance(body, dict) or not isinstance(body.get("path"), str):
        raise CorruptFileError(f"the {kind} action at {where} has no path")
    raw = body["path"]
    path = table_relative(io, raw, where)
    size = body.get("size")
    if kind == "add" and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        raise CorruptFileError(f"the add of {raw!r} at {where} has no valid size ({size!r})")
    values = body.get("partitionValues") or {}
    if not isinstance(values, dict) or not all(isinstance(v, (str, type(None))) for v in values.values()):
        raise CorruptFileError(f"the {kind} of {raw!r} at {where} has invalid partitionValues {values!r:.200}")
    dv = body.get("deletionVector")
    if dv is not None:
        check_descriptor(io, dv, f"the {kind} of {raw!r} at {where}")
    base_row_id, row_commit_version = row_ids_of(body, f"the {kind} of {raw!r} at {where}")
    return FileAction(
        path,
        raw,
        dict(values),
        size if isinstance(size, int) else None,
        dv,
        bool(body.get("dataChange", True)),
        base_row_id,
        row_commit_version,
    )


def row_ids_of(body: dict[str, Any], what: str) -> tuple[int | None, int | None]:
    """An add's or remove's `baseRowId` and `defaultRowCommitVersion` (row tracking), each absent or a non-negative
    integer: read back as untrusted, anything else is a CorruptFileError naming `what`."""
    out = []
    for name in ("baseRowId", "defaultRowCommitVersion"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise CorruptFileError(f"{what} has an invalid {name} ({value!r})")
        out.append(value)
    return out[0], out[1]


def expired_version(version: int) -> VersionActions:
    """A version a Delta log cleanup deleted (below a checkpoint): its effect is in the checkpoint's snapshot."""
    return VersionActions(version, {"operation": "(expired from the log)", "engineInfo": ""})


def from_checkpoint(io: FileIO, version: int, known: dict[str, tuple[int, int | None, int | None]]) -> VersionActions:
    """Delta version `version`, a checkpoint's, as the actions that turn the data files `known` (path -> rows its
    deletion vector deletes, baseRowId, defaultRowCommitVersion) into the checkpoint's snapshot, its domains with
    it: what absorbing uses when a log cleanup deleted the JSON of versions the index has not absorbed (the
    snapshot is all that is left of them). Any checkpoint of the version will do (classic, multi-part, or V2 with
    its sidecars: data/delta_checkpoint_files.py); its protocol comes along, so the features it lists are checked as
    a JSON version's would be."""
    found = listed_checkpoints(io.list_names(DELTA_LOG_DIR)).get(version)
    if not found:
        raise CorruptFileError(
            f"{io.path(DELTA_LOG_DIR)}: _last_checkpoint names version {version}, whose checkpoint is not complete "
            "or missing, and the versions before it are expired: the Delta log is damaged"
        )
    content = read_checkpoint(io, found[0])
    adds: dict[str, FileAction] = {}
    for add in content.adds:
        action = _file_action(io, add, "add", content.where)
        adds[action.path] = action
    changed = {
        p
        for p, a in adds.items()
        if p in known and ((a.dv or {}).get("cardinality", 0), a.base_row_id, a.row_commit_version) != known[p]
    }
    removes = [FileAction(p, p, {}, None, None, True) for p in sorted(known) if p not in adds or p in changed]
    fresh = [a for p, a in sorted(adds.items()) if p not in known or p in changed]
    info = {"operation": "CHECKPOINT (the versions before it expired from the log)", "engineInfo": ""}
    domains = checkpoint_actions(io, found[0], ("domainMetadata",)).get("domainMetadata", [])
    return VersionActions(
        version,
        info,
        tuple(fresh),
        tuple(removes),
        content.metadata or None,
        content.protocol,
        synthetic=True,
        domains=tuple(domains),
    )


def table_relative(io: FileIO, raw: str, where: str) -> str:
    """A Delta `path` (a relative URI, or an absolute one inside the table) as a checked table-relative path."""
    root = io.path("").rstrip("/")
    plain = path_in_table(root, raw)
    if plain is None:
        raise DeltaFeatureError(
            f"{where} names {raw!r}, a file outside the table at {root} (a shallow clone's log names its source's "
            "files so): dbidx indexes tables whose files lie inside them. Rewrite the table's rows into files of its "
            "own with that engine (Delta Spark: INSERT OVERWRITE delta.`URI` SELECT * FROM delta.`URI`), then "
            "re-adopt it: `dbidx build-index URI --key COLUMN --readopt`"
        )
    try:
        rel = layout.validate_table_path(plain)
    except InvalidInputError as exc:
        raise DeltaFeatureError(f"{where} names {raw!r}: {exc}") from exc
    if rel.split("/", 1)[0] in (layout.META_DIR, "_delta_log"):
        raise CorruptFileError(f"{where} names {raw!r}, inside the table's metadata, as a data file")
    return rel


def dv_file_path(dv: dict[str, Any], where: str) -> str:
    """The table-relative file of a `u` (relative) vector: `<prefix>/deletion_vector_<uuid>.bin`, where the
    descriptor's `pathOrInlineDv` is the prefix followed by the uuid's 20 Z85 characters. Checked to stay inside
    the table (a prefix of `../` is refused before anything opens it)."""
    text = dv.get("pathOrInlineDv")
    if not isinstance(text, str) or len(text) < 20:
        raise CorruptFileError(f"{where}: deletion vector path {text!r} is not a prefix and a Z85 uuid")
    try:
        file_uuid = uuid.UUID(bytes=z85_decode(text[-20:]))
    except ValueError as exc:
        raise CorruptFileError(f"{where}: deletion vector path {text!r} does not end in a Z85 uuid") from exc
    prefix = text[:-20]
    rel = posixpath.normpath(posixpath.join(prefix, f"{DV_PREFIX}{file_uuid}.bin"))
    try:
        return layout.validate_table_path(rel)
    except InvalidInputError as exc:
        raise DeltaFeatureError(
            f"{where}: its deletion vector file {rel!r} lies outside the table ({exc}); nothing was read"
        ) from exc


def check_descriptor(io: FileIO, dv: Any, where: str) -> None:
    """A vector descriptor dbidx can read: inline (`i`) or relative (`u`, inside the table), never absolute (`p`)."""
    if not isinstance(dv, dict):
        raise CorruptFileError(f"{where}: its deletionVector is not an object")
    kind = dv.get("storageType")
    if kind == "p":
        raise DeltaFeatureError(
            f"{where}: its deletion vector is stored at an absolute path "
            f"({dv.get('pathOrInlineDv')!r:.200}); dbidx reads relative and inline vectors only"
        )
    if kind not in ("i", "u"):
        raise CorruptFileError(f"{where}: deletion vector storage type {kind!r} is not one Delta defines")
    for name in ("sizeInBytes", "cardinality"):
        value = dv.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CorruptFileError(f"{where}: deletion vector {name} {value!r} is not a count")
    if kind == "u":
        dv_file_path(dv, where)


def read_descriptor(io: FileIO, dv: dict[str, Any], rows: int, where: str) -> BitMap:
    """The rows a descriptor deletes (checked: its size, CRC-32 for a file, cardinality and every position < rows)."""
    check_descriptor(io, dv, where)
    size, cardinality = dv["sizeInBytes"], dv["cardinality"]
    if dv["storageType"] == "i":
        try:
            body = z85_decode(dv["pathOrInlineDv"])[:size]
        except (ValueError, TypeError) as exc:
            raise CorruptFileError(f"{where}: its inline deletion vector is not Z85: {exc}") from exc
        if len(body) != size:
            raise CorruptFileError(f"{where}: its inline deletion vector has fewer than {size} bytes")
    else:
        rel = dv_file_path(dv, where)
        offset = dv.get("offset", 1)
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise CorruptFileError(f"{where}: deletion vector offset {offset!r} is not a number")
        body = vector_body(io.read_bytes(rel), VectorSlot(offset, size, cardinality), io.path(rel))
    positions = decode_vector(body, where)
    if len(positions) != cardinality:
        raise CorruptFileError(
            f"{where}: its deletion vector holds {len(positions)} rows, its descriptor says {cardinality}"
        )
    if len(positions) and positions.max() >= rows:
        raise CorruptFileError(f"{where}: its deletion vector deletes row {positions.max()} of a file of {rows} rows")
    return positions


def dv_id(dv: dict[str, Any] | None) -> str:
    """Delta's unique id of a vector (storage type, path or inline data, offset); "" for none."""
    if not isinstance(dv, dict):
        return ""
    offset = dv.get("offset")
    return f"{dv.get('storageType')}{dv.get('pathOrInlineDv')}" + ("" if offset is None else f"@{offset}")
