"""The Delta checkpoints in a table's log, read back as untrusted input: their names (classic, multi-part and the
UUID-named ones of the V2 spec), which are complete, and what one holds, its sidecar files included.

Why one reader for every place dbidx starts from a checkpoint (adoption, absorbing versions a log cleanup expired,
the log tail delta-rs checkpoints from, the log cleanup): with the table feature `v2Checkpoint` (Delta Spark's
`delta.checkpointPolicy = v2`) a checkpoint may be `<v>.checkpoint.<uuid>.json` or `.parquet` whose add and remove
actions sit in `_delta_log/_sidecars/*.parquet`, named by its `sidecar` actions, and a classic-named checkpoint may
follow the V2 spec too (delta-rs writes one so for such a table). All of them must agree on what a checkpoint holds
and when one is damaged: a V2 checkpoint without exactly one checkpointMetadata action of its own version, a
sidecar that is missing, of another size than its action says, or not Parquet, a V1 checkpoint naming sidecars, is
a CorruptFileError naming the file. A damaged checkpoint read as one with fewer files would be wrong rows.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterable
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq

from dbidx.data.delta_log import DELTA_LOG_DIR, path_in_table
from dbidx.errors import CorruptFileError
from dbidx.storage.fileio import DECODE_ERRORS, FileIO

SIDECAR_DIR = f"{DELTA_LOG_DIR}/_sidecars"
CLASSIC, UUID_NAMED, MULTI_PART = "classic", "uuid", "multi-part"
_UUID = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
_NAME = re.compile(
    rf"^(\d{{20}})\.checkpoint(?:\.parquet|\.(\d{{10}})\.(\d{{10}})\.parquet|\.({_UUID})\.(?:json|parquet))$"
)
_PREFERENCE = {CLASSIC: 0, UUID_NAMED: 1, MULTI_PART: 2}  # one file, and read without sidecars, first
_REMEDY = (
    "restore it from a backup, or delete the damaged checkpoint if the log still holds the JSON versions it sums up "
    "(and `_last_checkpoint` if it names it), so that readers replay those"
)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint of one version that is complete by its names: its files under `_delta_log/` (a multi-part
    one's parts in order)."""

    version: int
    kind: str  # CLASSIC, UUID_NAMED or MULTI_PART
    names: tuple[str, ...]


@dataclass(frozen=True)
class Sidecar:
    """A sidecar file a V2 checkpoint names: its table-relative path and the size its `sidecar` action gives."""

    path: str
    size: int


@dataclass(frozen=True)
class CheckpointContent:
    """What a checkpoint holds for a reader that replays the log from it (tombstones are VACUUM's, not read)."""

    version: int
    where: str  # its (first) file, for messages
    adds: list[dict[str, Any]]
    metadata: dict[str, Any]
    protocol: dict[str, Any]
    sidecars: tuple[Sidecar, ...]


def parse_name(name: str) -> tuple[int, str, int, int] | None:
    """A checkpoint's file name as (version, kind, part, parts); None for any other name."""
    m = _NAME.match(name)
    if m is None:
        return None
    if m.group(2):
        return int(m.group(1)), MULTI_PART, int(m.group(2)), int(m.group(3))
    return int(m.group(1)), UUID_NAMED if m.group(4) else CLASSIC, 1, 1


def listed_checkpoints(names: Iterable[str]) -> dict[int, list[Checkpoint]]:
    """The checkpoints of a listing of `_delta_log/` that are complete by their names, by version, the preferred
    first: classic, UUID-named, multi-part (only with every part: readers must ignore a partly written one)."""
    out: dict[int, list[Checkpoint]] = {}
    parts: dict[tuple[int, int], dict[int, str]] = {}
    for name in names:
        parsed = parse_name(name)
        if parsed is None:
            continue
        version, kind, part, total = parsed
        if kind == MULTI_PART:
            parts.setdefault((version, total), {})[part] = name
        else:
            out.setdefault(version, []).append(Checkpoint(version, kind, (name,)))
    for (version, total), got in parts.items():
        if set(got) == set(range(1, total + 1)):
            out.setdefault(version, []).append(Checkpoint(version, MULTI_PART, tuple(got[p] for p in sorted(got))))
    return {v: sorted(cps, key=lambda c: (_PREFERENCE[c.kind], c.names)) for v, cps in out.items()}


def newest_checkpoint(names: Iterable[str], at_most: int) -> Checkpoint | None:
    """The newest checkpoint at or below version `at_most` of a listing (the preferred one of its version)."""
    found = {v: cps for v, cps in listed_checkpoints(names).items() if v <= at_most}
    return found[max(found)][0] if found else None


def pointer_checkpoint(pointer: dict[str, Any]) -> Checkpoint:
    """The checkpoint `_last_checkpoint` names (a hint: the caller checks its files are there): a UUID-named one
    when its `v2Checkpoint.path` is one of its version, the parts when it has `parts`, else the classic file."""
    version = int(pointer["version"])
    v2 = pointer.get("v2Checkpoint")
    path = v2.get("path") if isinstance(v2, dict) else None
    if isinstance(path, str) and (parsed := parse_name(path)) is not None and parsed[:2] == (version, UUID_NAMED):
        return Checkpoint(version, UUID_NAMED, (path,))
    parts = pointer.get("parts")
    if isinstance(parts, int) and not isinstance(parts, bool) and 1 < parts < 100_000:
        names = tuple(f"{version:020d}.checkpoint.{p:010d}.{parts:010d}.parquet" for p in range(1, parts + 1))
        return Checkpoint(version, MULTI_PART, names)
    return Checkpoint(version, CLASSIC, (f"{version:020d}.checkpoint.parquet",))


def read_checkpoint(io: FileIO, checkpoint: Checkpoint) -> CheckpointContent:
    """Every live `add` (from its sidecars for a V2 checkpoint that has them), the metaData and the protocol of a
    checkpoint, checked (module docstring)."""
    actions = _actions(io, checkpoint, ("add", "remove", "metaData", "protocol", "checkpointMetadata", "sidecar"))
    where = io.path(f"{DELTA_LOG_DIR}/{checkpoint.names[0]}")
    sidecars = _sidecars(io, checkpoint, actions, where)
    if sidecars and (actions.get("add") or actions.get("remove")):
        raise CorruptFileError(
            f"Delta checkpoint {where} holds add or remove actions and names sidecar files too (the V2 spec allows "
            f"one or the other): it is damaged; {_REMEDY}"
        )
    adds = list(actions.get("add", []))
    for sidecar in sidecars:
        table = _decoded(sidecar_bytes(io, sidecar, where), io.path(sidecar.path), ("add",))
        adds.extend(_column_actions(table, "add", io.path(sidecar.path)))
    _check_add_count(actions, len(adds), where)
    one: dict[str, dict[str, Any]] = {}
    for kind in ("metaData", "protocol"):
        found = actions.get(kind, [])
        if len(found) != 1:
            raise CorruptFileError(
                f"Delta checkpoint {where} holds {len(found)} {kind} actions, not one: it is damaged; {_REMEDY}"
            )
        one[kind] = found[0]
    return CheckpointContent(checkpoint.version, where, adds, one["metaData"], one["protocol"], sidecars)


def sidecars_of(io: FileIO, checkpoint: Checkpoint) -> tuple[Sidecar, ...]:
    """The sidecar files a checkpoint names (none for a V1 one), its spec checked: what a copy of the log's tail
    must carry with it, and what the log cleanup must keep. Reads the checkpoint's own file(s), not the sidecars."""
    actions = _actions(io, checkpoint, ("checkpointMetadata", "sidecar"))
    return _sidecars(io, checkpoint, actions, io.path(f"{DELTA_LOG_DIR}/{checkpoint.names[0]}"))


def sidecar_bytes(io: FileIO, sidecar: Sidecar, where: str) -> pa.Buffer:
    """A sidecar's bytes, checked: there, of the size the checkpoint's action gives, with a readable Parquet footer."""
    named = io.path(sidecar.path)
    try:
        data = io.read_buffer(sidecar.path)
    except CorruptFileError as exc:
        raise CorruptFileError(
            f"the sidecar file {named} of Delta checkpoint {where} cannot be read ({exc}): the checkpoint is damaged; "
            f"{_REMEDY}"
        ) from exc
    if data.size != sidecar.size:
        raise CorruptFileError(
            f"the sidecar file {named} of Delta checkpoint {where} is {data.size} bytes, the checkpoint says "
            f"{sidecar.size} (truncated or replaced): the checkpoint is damaged; {_REMEDY}"
        )
    try:
        pq.ParquetFile(pa.BufferReader(data)).metadata
    except DECODE_ERRORS as exc:
        raise CorruptFileError(f"the sidecar file {named} of Delta checkpoint {where} is not Parquet: {exc}") from exc
    return data


def action_from_row(value: Any, arrow_type: pa.DataType, where: str) -> Any:
    """A checkpoint's action row as the JSON action: Parquet maps (partitionValues, tags, configuration, format
    options) come back from Arrow as lists of (key, value) pairs and become objects again; struct fields that are
    null are left out, as JSON leaves out a field it does not have (at every level: a vector's absent offset)."""
    if value is None:
        return None
    if pa.types.is_map(arrow_type):
        try:
            return {k: action_from_row(v, arrow_type.item_type, where) for k, v in value}
        except (TypeError, ValueError) as exc:
            raise CorruptFileError(
                f"Delta checkpoint {where} holds a map that is not key/value pairs: {value!r:.100}"
            ) from exc
    if pa.types.is_struct(arrow_type):
        fields = {f.name: f.type for f in arrow_type}
        return {k: action_from_row(v, fields[k], where) for k, v in value.items() if v is not None}
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        return [action_from_row(v, arrow_type.value_type, where) for v in value]
    return value


def checkpoint_actions(io: FileIO, checkpoint: Checkpoint, kinds: tuple[str, ...]) -> dict[str, list[dict[str, Any]]]:
    """The checkpoint's own (non-sidecar) actions of `kinds`, by kind: e.g. its domainMetadata (data/delta_domains)."""
    return _actions(io, checkpoint, kinds)


def _actions(io: FileIO, checkpoint: Checkpoint, kinds: tuple[str, ...]) -> dict[str, list[dict[str, Any]]]:
    """The checkpoint's own actions of `kinds`, by kind (a JSON checkpoint's lines; a Parquet one's columns)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for name in checkpoint.names:
        rel = f"{DELTA_LOG_DIR}/{name}"
        where = io.path(rel)
        if name.endswith(".json"):
            for kind, body in _json_actions(io.read_buffer(rel).to_pybytes(), where):
                if kind in kinds:
                    out.setdefault(kind, []).append(body)
            continue
        try:
            with io.open_input_file(rel) as f:  # the footer and the columns of `kinds` only
                table = _decoded(f, where, kinds)
        except OSError as exc:
            raise CorruptFileError(f"Delta checkpoint {where} is unreadable: {exc}; {_REMEDY}") from exc
        for kind in kinds:
            out.setdefault(kind, []).extend(_column_actions(table, kind, where))
    return out


def _json_actions(raw: bytes, where: str) -> list[tuple[str, dict[str, Any]]]:
    try:
        lines = [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]
    except (UnicodeError, ValueError) as exc:
        raise CorruptFileError(f"Delta checkpoint {where} is not JSON lines ({exc}): it is damaged; {_REMEDY}") from exc
    out = []
    for i, line in enumerate(lines):
        if not isinstance(line, dict) or len(line) != 1 or not isinstance(next(iter(line.values())), dict):
            raise CorruptFileError(f"line {i + 1} of Delta checkpoint {where} is not one action: {line!r:.200}")
        ((kind, body),) = line.items()
        out.append((kind, body))
    return out


def _decoded(data: pa.Buffer | pa.NativeFile, where: str, kinds: tuple[str, ...]) -> pa.Table:
    """The columns of `kinds` a Parquet checkpoint or sidecar has (a missing column holds no action)."""
    try:
        file = pq.ParquetFile(pa.BufferReader(data) if isinstance(data, pa.Buffer) else data)
        return file.read(columns=[k for k in kinds if k in file.schema_arrow.names])
    except DECODE_ERRORS as exc:
        raise CorruptFileError(f"Delta checkpoint file {where} is unreadable: {exc}; {_REMEDY}") from exc


def _column_actions(table: pa.Table, kind: str, where: str) -> list[dict[str, Any]]:
    if kind not in table.column_names:
        return []
    arrow_type = table.schema.field(kind).type
    return [action_from_row(row, arrow_type, where) for row in table.column(kind).to_pylist() if row is not None]


def _sidecars(
    io: FileIO, checkpoint: Checkpoint, actions: dict[str, list[dict[str, Any]]], where: str
) -> tuple[Sidecar, ...]:
    """The checkpoint's spec checked (V2: exactly one checkpointMetadata of its version; sidecars only in V2; V2
    never multi-part), and its sidecars."""
    metas, named = actions.get("checkpointMetadata", []), actions.get("sidecar", [])
    damaged = f"Delta checkpoint {where}"
    if checkpoint.kind == UUID_NAMED and not metas:
        raise CorruptFileError(
            f"{damaged} is UUID-named, so it follows the V2 spec, but holds no checkpointMetadata action: it is "
            f"damaged; {_REMEDY}"
        )
    if checkpoint.kind == MULTI_PART and (metas or named):
        raise CorruptFileError(f"{damaged} is a multi-part checkpoint (V1 spec only) with V2 actions: {_REMEDY}")
    if len(metas) > 1:
        raise CorruptFileError(f"{damaged} holds {len(metas)} checkpointMetadata actions, not one; {_REMEDY}")
    if metas:
        version = metas[0].get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version != checkpoint.version:
            raise CorruptFileError(
                f"{damaged}: its checkpointMetadata names version {version!r:.50}, not {checkpoint.version}: it is "
                f"damaged; {_REMEDY}"
            )
    elif named:
        raise CorruptFileError(f"{damaged} names sidecar files without a checkpointMetadata action; {_REMEDY}")
    out = []
    for action in named:
        size = action.get("sizeInBytes")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise CorruptFileError(f"{damaged} names a sidecar without a valid sizeInBytes: {action!r:.200}")
        out.append(Sidecar(_sidecar_path(io, action.get("path"), damaged), size))
    return tuple(out)


def _sidecar_path(io: FileIO, raw: Any, damaged: str) -> str:
    """A sidecar action's `path` as a table-relative path: a file name in `_delta_log/_sidecars/` (the only place
    the protocol allows), or a URI of a file there."""
    plain = unquote(raw) if isinstance(raw, str) else ""
    if plain and "/" not in plain and plain not in (".", ".."):
        return f"{SIDECAR_DIR}/{plain}"
    rel = path_in_table(io.path("").rstrip("/"), raw) if plain else None
    if rel is None or rel.rsplit("/", 1)[0] != SIDECAR_DIR or rel.rsplit("/", 1)[-1] in ("", ".", ".."):
        raise CorruptFileError(f"{damaged} names the sidecar {raw!r:.200}, which is not a file of {SIDECAR_DIR}/")
    return rel


def _check_add_count(actions: dict[str, list[dict[str, Any]]], adds: int, where: str) -> None:
    """A V2 checkpoint's `numOfAddFiles` tag, when it has one, must count the adds read (a sidecar replaced by
    another readable one would otherwise read as fewer or other files)."""
    metas = actions.get("checkpointMetadata") or [{}]
    tags = metas[0].get("tags")
    said = tags.get("numOfAddFiles") if isinstance(tags, dict) else None
    if isinstance(said, str) and said.isdigit() and int(said) != adds:
        raise CorruptFileError(
            f"Delta checkpoint {where} says it holds {said} add actions (numOfAddFiles) but {adds} were read from it "
            f"and its sidecars: it is damaged; {_REMEDY}"
        )
