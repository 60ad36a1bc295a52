"""The completion log's record types and their strict parsing.

Everything read back from storage is untrusted input: a completion record is parsed field by field against the
types FORMAT.md section 7 gives, and any difference (a missing field, a string where a number belongs, an unknown
field, a path that leaves the table) is a CorruptFileError naming the file, never a TypeError later on or, worse, a
silently different table.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field, fields, replace
from datetime import datetime, timezone
from typing import AbstractSet, Any, Callable
from urllib.parse import unquote

import xxhash

from dbidx.errors import CorruptFileError, InvalidInputError
from dbidx.plain import plain
from dbidx.storage import layout

ACTION_COMMIT = "commit"
ACTION_COMPACTION = "compaction"
ACTION_CLEAN = "clean"
ACTION_ROLLBACK = "rollback"
ACTION_BUILD_INDEX = "build_index"
ACTION_DATA_COMPACTION = "data_compaction"
ACTION_UPGRADE = "upgrade"  # a format-3 table became format 4: its superseded and delete rows became vectors
# Another engine's Delta version, applied to the index (data/delta_absorb.py): its files, vectors and key entries.
ACTION_ABSORB = "absorb"
# A change of the Delta table properties (metaData.configuration: log and file retention, checkpoint interval):
# table/delta_properties.py. Its Delta version is commitInfo + metaData; it adds no file.
ACTION_PROPERTIES = "properties"
ACTIONS = (
    ACTION_COMMIT,
    ACTION_COMPACTION,
    ACTION_CLEAN,
    ACTION_ROLLBACK,
    ACTION_BUILD_INDEX,
    ACTION_DATA_COMPACTION,
    ACTION_UPGRADE,
    ACTION_ABSORB,
    ACTION_PROPERTIES,
)
# Completions whose index files add live entries (inserts, tombstones, re-pointed keys): what a cache catches up
# from and what an upsert's conflict check reads.
ENTRY_ACTIONS = (ACTION_COMMIT, ACTION_BUILD_INDEX, ACTION_ABSORB)
# Fields format 4 added to records: a record of a format-3 table (before its upgrade) lacks them.
_FORMAT4_DATA_FILE_FIELDS = {"min_key", "max_key", "deletes"}
_FORMAT4_RECORD_FIELDS = {"dv_files", "deletion_vectors"}
DATA_ACTIONS = (ACTION_COMMIT, ACTION_BUILD_INDEX)  # completions that add data files (upserts; migrated files)
FILE_KINDS = ("delta", "base", "merged")
_CHECKSUM_RE = re.compile(r"^xxh64:[0-9a-f]{16}$")
_DV_NAME_RE = re.compile(
    r"^(\.dbidx/dv/)?deletion_vector_[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-"
    r"[0-9a-f]{4}-[0-9a-f]{12}\.bin$"
)


class _Bad(ValueError):
    """A field of a record does not have the type or value the format requires."""


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    """A record class's field names (what its parser accepts), computed once per class: a commit parses its file
    and vector records by the hundred, and `dataclasses.fields` is slow enough to show."""
    return frozenset(f.name for f in fields(cls))


def _int(value: Any, name: str, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise _Bad(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _optional_int(value: Any, name: str) -> int | None:
    return None if value is None else _int(value, name)


_OPTIONAL_DATA_FILE_FIELDS = {"delta_path", "base_row_id", "row_commit_version"}


def _str(value: Any, name: str, nullable: bool = False) -> str | None:
    if value is None and nullable:
        return None
    if not isinstance(value, str):
        raise _Bad(f"{name} must be a string, got {value!r}")
    return value


def _path(value: Any, name: str) -> str:
    try:
        return layout.validate_table_path(value)
    except InvalidInputError as exc:
        raise _Bad(f"{name}: {exc}") from exc


def _checksum(value: Any, name: str) -> str:
    if not isinstance(value, str) or not _CHECKSUM_RE.match(value):
        raise _Bad(f"{name} must look like 'xxh64:<16 hex digits>', got {value!r}")
    return value


def _list(value: Any, name: str, item: Callable[[Any, str], Any]) -> tuple:
    if not isinstance(value, list):
        raise _Bad(f"{name} must be a list, got {type(value).__name__}")
    return tuple(item(v, f"{name}[{i}]") for i, v in enumerate(value))


def _object(
    value: Any, name: str, expected: AbstractSet[str], optional: AbstractSet[str] = frozenset()
) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Bad(f"{name} must be an object, got {type(value).__name__}")
    missing = expected - optional - set(value)
    unknown = set(value) - expected
    if missing or unknown:
        raise _Bad(f"{name} has missing fields {sorted(missing)} / unknown fields {sorted(unknown)}")
    return value


@dataclass(frozen=True)
class FileRecord:
    """One RLI file an instant added: where it is, what it holds, and how to verify it."""

    path: str
    partition: str | None
    shard: int
    kind: str  # "delta", "base", or "merged" (a compaction's merge of a group's newest files, tombstones kept)
    rows: int
    inserts: int
    tombstones: int
    min_key: str | None
    max_key: str | None
    size: int
    checksum: str

    @classmethod
    def parse(cls, data: Any, name: str) -> "FileRecord":
        """Rebuild a record from its JSON form, checking every field."""
        d = _object(data, name, _field_names(cls))
        if d["kind"] not in FILE_KINDS:
            raise _Bad(f"{name}.kind must be one of {FILE_KINDS}, got {d['kind']!r}")
        record = cls(
            path=_path(d["path"], f"{name}.path"),
            partition=_str(d["partition"], f"{name}.partition", True),
            shard=_int(d["shard"], f"{name}.shard"),
            kind=d["kind"],
            rows=_int(d["rows"], f"{name}.rows"),
            inserts=_int(d["inserts"], f"{name}.inserts"),
            tombstones=_int(d["tombstones"], f"{name}.tombstones"),
            min_key=_str(d["min_key"], f"{name}.min_key", True),
            max_key=_str(d["max_key"], f"{name}.max_key", True),
            size=_int(d["size"], f"{name}.size"),
            checksum=_checksum(d["checksum"], f"{name}.checksum"),
        )
        if (
            record.inserts + record.tombstones != record.rows
            or (record.rows > 0) != (record.min_key is not None)
            or (record.min_key is None) != (record.max_key is None)
            or (record.min_key is not None and record.min_key > record.max_key)
        ):
            raise _Bad(f"{name}: rows, inserts, tombstones and key range do not agree")
        return record


@dataclass(frozen=True)
class DataFileRecord:
    """One data file an upsert published: its file group, row count, size, checksum and key range (the key column's
    smallest and largest value when it is a string column: the Delta log's statistics; None otherwise)."""

    path: str
    partition: str
    file_group: str
    rows: int
    size: int
    checksum: str
    min_key: str | None = None
    max_key: str | None = None
    deletes: int = 0  # rows that are delete markers (`_dbidx_deleted`): never table data, in the file's own vector
    # A file of an adopted Delta table whose log spells its path otherwise than dbidx would (FORMAT.md section 12):
    # its `remove` must repeat the exact string. None (and left out of the JSON) for every other file.
    delta_path: str | None = None
    # Delta row tracking (storage/row_ids.py): the file's `baseRowId` and `defaultRowCommitVersion`, as another
    # engine's `add` gave them (absorbed, adopted) or as the data view assigned them to a dbidx file; None (and left
    # out of the JSON) on a table without row tracking.
    base_row_id: int | None = None
    row_commit_version: int | None = None

    @classmethod
    def parse(cls, data: Any, name: str, legacy: bool = False) -> "DataFileRecord":
        """Rebuild a record from its JSON form, checking every field (`legacy`: a format-3 record, which has no key
        range or delete count)."""
        d = _object(
            data,
            name,
            _field_names(cls),
            optional=_OPTIONAL_DATA_FILE_FIELDS | (_FORMAT4_DATA_FILE_FIELDS if legacy else set()),
        )
        if legacy:
            d = {"min_key": None, "max_key": None, "deletes": 0} | d
        record = cls(
            path=_path(d["path"], f"{name}.path"),
            partition=_str(d["partition"], f"{name}.partition"),
            file_group=_str(d["file_group"], f"{name}.file_group"),
            rows=_int(d["rows"], f"{name}.rows"),
            size=_int(d["size"], f"{name}.size"),
            checksum=_checksum(d["checksum"], f"{name}.checksum"),
            min_key=_str(d["min_key"], f"{name}.min_key", True),
            max_key=_str(d["max_key"], f"{name}.max_key", True),
            deletes=_int(d["deletes"], f"{name}.deletes"),
            delta_path=_str(d.get("delta_path"), f"{name}.delta_path", True),
            base_row_id=_optional_int(d.get("base_row_id"), f"{name}.base_row_id"),
            row_commit_version=_optional_int(d.get("row_commit_version"), f"{name}.row_commit_version"),
        )
        if record.delta_path is not None and unquote(record.delta_path) != record.path:
            raise _Bad(f"{name}.delta_path {record.delta_path!r} does not name {record.path!r}")
        if record.deletes > record.rows:
            raise _Bad(f"{name}: more delete rows ({record.deletes}) than rows ({record.rows})")
        if (record.min_key is None) != (record.max_key is None) or (
            record.min_key is not None and record.min_key > record.max_key
        ):
            raise _Bad(f"{name}: min_key and max_key do not form a key range")
        return record


@dataclass(frozen=True)
class DvFileRecord:
    """One deletion-vector file a completion wrote (Delta's `deletion_vector_<uuid>.bin`, under `.dbidx/dv/`; at the
    table root before 2026-11-25): its size and checksum, verified before any vector in it is used."""

    path: str
    size: int
    checksum: str

    @classmethod
    def parse(cls, data: Any, name: str) -> "DvFileRecord":
        """Rebuild a record from its JSON form, checking every field (a `deletion_vector_<uuid>.bin` under
        `.dbidx/dv/` or at the root)."""
        d = _object(data, name, _field_names(cls))
        path = _path(d["path"], f"{name}.path")
        if not _DV_NAME_RE.match(path):
            raise _Bad(
                f"{name}.path must be a deletion_vector_<uuid>.bin file under .dbidx/dv/ or at the table "
                f"root, got {path!r}"
            )
        return cls(
            path=path, size=_int(d["size"], f"{name}.size"), checksum=_checksum(d["checksum"], f"{name}.checksum")
        )


@dataclass(frozen=True)
class DeletionVectorRecord:
    """A data file's deletion vector as of a completion: every row of the file that is not table data (superseded,
    deleted, or a delete row), as one vector in one of the completion's DV files. It replaces the file's earlier one."""

    path: str  # the data file
    dv_file: str  # a DvFileRecord.path of the same completion
    offset: int
    size: int
    cardinality: int
    # A vector adopted with a Delta table: the descriptor its log already has for it (a later `remove` must repeat
    # it exactly, or Delta readers would keep the old file entry). None (left out of the JSON) otherwise.
    delta: dict[str, Any] | None = None

    @classmethod
    def parse(cls, data: Any, name: str) -> "DeletionVectorRecord":
        """Rebuild a record from its JSON form, checking every field."""
        d = _object(data, name, _field_names(cls), optional={"delta"})
        record = cls(
            path=_path(d["path"], f"{name}.path"),
            dv_file=_path(d["dv_file"], f"{name}.dv_file"),
            offset=_int(d["offset"], f"{name}.offset", 1),
            size=_int(d["size"], f"{name}.size", 1),
            cardinality=_int(d["cardinality"], f"{name}.cardinality", 1),
        )
        if d.get("delta") is not None:
            record = replace(record, delta=parse_dv_descriptor(d["delta"], f"{name}.delta", record.cardinality))
        return record


def parse_dv_descriptor(value: Any, name: str, cardinality: int) -> dict[str, Any]:
    """A Delta `deletionVector` descriptor read back (inline or relative-file form; never an absolute path)."""
    d = _object(
        value, name, {"storageType", "pathOrInlineDv", "offset", "sizeInBytes", "cardinality"}, optional={"offset"}
    )
    if d["storageType"] not in ("u", "i"):
        raise _Bad(f"{name}.storageType must be 'u' or 'i', got {d['storageType']!r}")
    _str(d["pathOrInlineDv"], f"{name}.pathOrInlineDv")
    if "offset" in d:
        _int(d["offset"], f"{name}.offset")
    _int(d["sizeInBytes"], f"{name}.sizeInBytes")
    if _int(d["cardinality"], f"{name}.cardinality") != cardinality:
        raise _Bad(f"{name}.cardinality {d['cardinality']} differs from the vector's {cardinality}")
    return dict(d)


def record_dict(record: Any) -> dict[str, Any]:
    """A record's JSON form: asdict without the adoption-only fields that are None (most records never have them,
    so they are not written at all)."""
    data = plain(record)
    for name in _UNSET_OMITTED:
        if name in data and data[name] is None:
            del data[name]
    return data


_UNSET_OMITTED = ("delta_path", "delta", "base_row_id", "row_commit_version")


@dataclass(frozen=True)
class PartitionChange:
    """What an instant changed in one data partition: live key delta and per-file-group fill deltas."""

    live: int = 0
    fills: dict[str, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, data: Any, name: str) -> "PartitionChange":
        """Rebuild from JSON (both fields optional)."""
        d = _object(data, name, {"live", "fills"}, optional={"live", "fills"})
        fills = _object(d.get("fills", {}), f"{name}.fills", set(d.get("fills", {}) or {}))
        for fg, n in fills.items():
            _int(n, f"{name}.fills[{fg!r}]", minimum=-(2**62))
        return cls(live=_int(d.get("live", 0), f"{name}.live", minimum=-(2**62)), fills=dict(fills))


@dataclass(frozen=True)
class CompletedInstant:
    """One entry of the completion log."""

    seq: int
    instant: str
    action: str
    completed_at_ms: int
    start_seq: int
    table_id: str = ""
    files: tuple[FileRecord, ...] = ()
    data_files: tuple[DataFileRecord, ...] = ()
    replaced: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()
    dv_files: tuple[DvFileRecord, ...] = ()
    deletion_vectors: tuple[DeletionVectorRecord, ...] = ()
    rolled_back: str | None = None
    partitions: dict[str, PartitionChange] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        """Serialize for the completion file, with a checksum over the canonical form of every other field (a
        flipped byte in a key range or a path would otherwise still be valid JSON, and silently wrong)."""
        data = plain(self)
        data["data_files"] = [record_dict(f) for f in self.data_files]
        data["deletion_vectors"] = [record_dict(v) for v in self.deletion_vectors]
        data["checksum"] = _record_checksum(data)
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, raw: bytes, where: str, legacy: bool = False) -> "CompletedInstant":
        """Parse a completion file; anything malformed is a CorruptFileError naming the file. `legacy`: a record
        of the table's format-3 past (before `dbidx upgrade`), which lacks the fields format 4 added."""
        try:
            d = json.loads(raw)
            if not isinstance(d, dict) or "checksum" not in d:
                raise _Bad("the record has no checksum")
            stored = d.pop("checksum")
            if stored != _record_checksum(d):
                raise _Bad(f"its checksum {stored!r} does not match its content (the record is damaged)")
            d = _object(
                d,
                "record",
                _field_names(cls),
                optional={"rolled_back", "extra"} | (_FORMAT4_RECORD_FIELDS if legacy else set()),
            )
            if legacy:
                d = {"dv_files": [], "deletion_vectors": []} | d
            if d["action"] not in ACTIONS:
                raise _Bad(f"action must be one of {ACTIONS}, got {d['action']!r}")
            extra = d.get("extra", {})
            if not isinstance(extra, dict):
                raise _Bad("extra must be an object")
            rolled_back = d.get("rolled_back")
            partitions = _object(d["partitions"], "partitions", set(d["partitions"] or {}))
            files = _list(d["files"], "files", FileRecord.parse)
            # A compaction publishes bases and merged files, every other action deltas: a kind out of place would
            # put a file where the merge order or a cache's catch-up (which reads deltas only) does not expect it.
            kinds = ("base", "merged") if d["action"] == ACTION_COMPACTION else ("delta",)
            for i, f in enumerate(files):
                if f.kind not in kinds:
                    raise _Bad(f"files[{i}].kind must be one of {kinds} in a {d['action']} record, got {f.kind!r}")
            return cls(
                seq=_int(d["seq"], "seq", minimum=1),
                instant=_instant(d["instant"], "instant"),
                action=d["action"],
                completed_at_ms=_int(d["completed_at_ms"], "completed_at_ms"),
                start_seq=_int(d["start_seq"], "start_seq"),
                table_id=_str(d["table_id"], "table_id"),
                files=files,
                data_files=_list(d["data_files"], "data_files", lambda v, n: DataFileRecord.parse(v, n, legacy)),
                replaced=_list(d["replaced"], "replaced", _path),
                deleted=_list(d["deleted"], "deleted", _path),
                dv_files=_list(d["dv_files"], "dv_files", DvFileRecord.parse),
                deletion_vectors=_list(d["deletion_vectors"], "deletion_vectors", DeletionVectorRecord.parse),
                rolled_back=None if rolled_back is None else _instant(rolled_back, "rolled_back"),
                partitions={
                    _str(p, "partition"): PartitionChange.parse(c, f"partitions[{p!r}]") for p, c in partitions.items()
                },
                extra=extra,
            )
        except (_Bad, ValueError, TypeError, RecursionError, UnicodeError) as exc:
            raise CorruptFileError(f"completion record {where} is not valid: {exc}") from exc

    @property
    def completed_at(self) -> datetime:
        """Wall-clock completion time (UTC)."""
        return datetime.fromtimestamp(self.completed_at_ms / 1000, tz=timezone.utc)


def _record_checksum(data: dict[str, Any]) -> str:
    """XXH64 of a record's canonical JSON (sorted keys, compact, ASCII), without the checksum field itself."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return "xxh64:" + xxhash.xxh64(canonical).hexdigest()


def _instant(value: Any, name: str) -> str:
    try:
        return layout.validate_instant(value)
    except InvalidInputError as exc:
        raise _Bad(f"{name}: {exc}") from exc


def _items(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise _Bad(f"{name} must be a list, got {type(value).__name__}")
    return value


def _order(value: Any, name: str) -> tuple[int, int]:
    """A merge order as a checkpoint stores it: [seq, 0 for a commit's file / 1 for a base]."""
    if not isinstance(value, list) or len(value) != 2 or value[1] not in (0, 1):
        raise _Bad(f"{name} must be [seq, 0 or 1], got {value!r}")
    return _int(value[0], name), int(value[1])


# The strict field parsers, shared with the other formats read back from storage (checkpoints, storage/checkpoint.py).
FieldError = _Bad
parse_int = _int
parse_str = _str
parse_object = _object
parse_path = _path
parse_instant = _instant
parse_items = _items
parse_order = _order
