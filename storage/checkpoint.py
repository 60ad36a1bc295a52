"""Checkpoints and archive bundles: what keeps opening a table cheap however long its completion log grows.

A checkpoint is the table's folded state at one seq - the index's file view, the data view (live data files,
replaced files awaiting a clean, schema, layout) and partition statistics - so a reader starts from it and reads only
the completions published after it, not every record ever written. An archive bundle holds older completion records
(their exact bytes, each with its own checksum) in one file, so the completion folder stays short; the records stay
readable for whoever asks for history (`dbidx commits`, an old instant's seq, a full verification).

Both are written once (exclusive create) and never changed; both are read back as untrusted input: a checksum over
the canonical JSON, the table id, every field parsed strictly by the view that owns it (file_view.py, data_view.py).
Format: docs/FORMAT.md section 7a.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import xxhash

from dbidx.errors import CorruptFileError
from dbidx.storage import layout
from dbidx.storage.fileio import FileIO
from dbidx.storage.records import CompletedInstant, FieldError, parse_instant, parse_int, parse_object, parse_str

CHECKPOINT_FORMAT = 1
_CHECKPOINT_NAME = re.compile(r"^(\d{12})\.ckpt$")
_ARCHIVE_NAME = re.compile(r"^(\d{12})-(\d{12})\.arch$")
MAX_DECOMPRESSED = 1 << 31  # a crafted file must not make a reader allocate without bound
CODEC = "zstd"


@dataclass(frozen=True)
class Checkpoint:
    """The folded table state at `seq`, as read back (views still in their dict form, parsed by their owners)."""

    seq: int
    max_instant: str  # the largest instant id of the records up to seq (new ids must stay above it)
    index: dict[str, Any]
    data: dict[str, Any]
    where: str


# ---- encoding -----------------------------------------------------------------------------------------------
def _canonical(data: dict[str, Any]) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _compress(data: bytes) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, CODEC) as out:
        out.write(data)
    return sink.getvalue().to_pybytes()


def _decompress(raw: bytes, where: str) -> bytes:
    try:
        data = pa.CompressedInputStream(pa.BufferReader(raw), CODEC).read(MAX_DECOMPRESSED + 1)
    except (OSError, pa.ArrowException) as exc:
        raise CorruptFileError(f"{where} is not a readable {CODEC} stream: {exc}") from exc
    if len(data) > MAX_DECOMPRESSED:
        raise CorruptFileError(f"{where} decompresses to more than {MAX_DECOMPRESSED} bytes; refusing it")
    return data


def seal(payload: dict[str, Any]) -> bytes:
    """Payload + checksum over its canonical form, compressed (also the history floor's encoding)."""
    body = dict(payload, checksum="xxh64:" + xxhash.xxh64(_canonical(payload)).hexdigest())
    return _compress(_canonical(body))


def unseal(raw: bytes, where: str, table_id: str, fields: set[str]) -> dict[str, Any]:
    """Decompress, parse, check the checksum, the format and the table id; returns the payload."""
    try:
        data = json.loads(_decompress(raw, where))
        if not isinstance(data, dict) or "checksum" not in data:
            raise FieldError("it has no checksum")
        stored = data.pop("checksum")
        if stored != "xxh64:" + xxhash.xxh64(_canonical(data)).hexdigest():
            raise FieldError(f"its checksum {stored!r} does not match its content (the file is damaged)")
        data = parse_object(data, "file", fields | {"format", "table_id"})
        if data["format"] != CHECKPOINT_FORMAT:
            raise FieldError(f"format {data['format']!r} is not {CHECKPOINT_FORMAT}")
        if parse_str(data["table_id"], "table_id") != table_id and table_id:
            raise FieldError(f"it belongs to table {data['table_id']!r}, not to {table_id!r}")
        return data
    except (FieldError, ValueError, TypeError, RecursionError) as exc:
        raise CorruptFileError(f"{where} is not valid: {exc}") from exc


# ---- checkpoints ----------------------------------------------------------------------------------------------
def checkpoint_seqs(io: FileIO) -> list[int]:
    """Seqs of the checkpoints present, ascending; an unexpected name is a CorruptFileError (temp files skipped)."""
    return sorted(int(m.group(1)) for m in _names(io, layout.CHECKPOINT_DIR, _CHECKPOINT_NAME))


def write_checkpoint(
    io: FileIO, table_id: str, seq: int, max_instant: str, index: dict[str, Any], data: dict[str, Any]
) -> bool:
    """Create the checkpoint of seq exclusively; False if one exists already (another writer made it)."""
    payload = {
        "format": CHECKPOINT_FORMAT,
        "table_id": table_id,
        "seq": seq,
        "max_instant": max_instant,
        "index": index,
        "data": data,
    }
    return io.create_exclusive(layout.checkpoint_file(seq), seal(payload))


def read_checkpoint(io: FileIO, seq: int, table_id: str) -> Checkpoint:
    """One checkpoint, verified; its seq must match its name."""
    rel = layout.checkpoint_file(seq)
    where = f"checkpoint {io.path(rel)}"
    data = unseal(io.read_bytes(rel), where, table_id, {"seq", "max_instant", "index", "data"})
    try:
        if parse_int(data["seq"], "seq", 1) != seq:
            raise FieldError(f"it says seq {data['seq']}, its name {seq}")
        max_instant = parse_instant(data["max_instant"], "max_instant")
    except FieldError as exc:
        raise CorruptFileError(f"{where} is not valid: {exc}") from exc
    return Checkpoint(seq, max_instant, data["index"], data["data"], where)


def archive_before(io: FileIO, table_id: str, seq: int) -> None:
    """After the checkpoint of seq: bundle the records up to the checkpoint before it (those after that one stay
    files, for readers that started from it), remove them, and remove checkpoints older than that one."""
    older = [s for s in checkpoint_seqs(io) if s < seq]
    if not older:
        return
    upto = older[-1]
    # Records up to the retention floor are expired, bundles and all (storage/archive_retention.py): bundling starts
    # after the newest bundle or the floor, whichever is further.
    first = max([last for _, last in archive_ranges(io)] + floor_seqs(io) + [0]) + 1
    if first <= upto:
        write_archive(io, table_id, first, [io.read_bytes(layout.completed_file(s)) for s in range(first, upto + 1)])
        for s in range(first, upto + 1):
            io.delete(layout.completed_file(s))
    for s in older[:-1]:
        io.delete(layout.checkpoint_file(s))


# ---- the history floor's names (its content: storage/history_floor.py) ---------------------------------------
FLOOR_DIR = f"{layout.TIMELINE_DIR}/floor"
_FLOOR_NAME = re.compile(r"^(\d{12})\.floor$")


def floor_file(seq: int) -> str:
    """Table-relative path of the history floor file of seq (records 1..seq expired by archive retention)."""
    return f"{FLOOR_DIR}/{seq:012d}.floor"


def floor_seqs(io: FileIO) -> list[int]:
    """Seqs of the floor files present, ascending (temp files skipped; any other name is a CorruptFileError)."""
    out = []
    for name in io.list_names(FLOOR_DIR):
        if name.startswith("."):
            continue
        m = _FLOOR_NAME.match(name)
        if m is None or int(m.group(1)) < 1:
            raise CorruptFileError(
                f"unexpected file {io.path(FLOOR_DIR)}/{name} (floor files are named "
                "<12-digit seq>.floor, seq >= 1); it is not dbidx's"
            )
        out.append(int(m.group(1)))
    return sorted(out)


# ---- archive bundles ------------------------------------------------------------------------------------------
def archive_ranges(io: FileIO) -> list[tuple[int, int]]:
    """(first, last) seq of every archive bundle present, ascending."""
    ranges = []
    for m in _names(io, layout.ARCHIVE_DIR, _ARCHIVE_NAME):
        first, last = int(m.group(1)), int(m.group(2))
        if not 1 <= first <= last:
            raise CorruptFileError(f"archive bundle {io.path(layout.ARCHIVE_DIR)}/{m.group(0)} names an empty range")
        ranges.append((first, last))
    return sorted(ranges)


def write_archive(io: FileIO, table_id: str, first: int, raw_records: list[bytes]) -> bool:
    """Bundle the exact bytes of records first..first+n-1; False if that bundle exists already."""
    last = first + len(raw_records) - 1
    payload = {
        "format": CHECKPOINT_FORMAT,
        "table_id": table_id,
        "first": first,
        "last": last,
        "records": [r.decode("utf-8") for r in raw_records],
    }
    return io.create_exclusive(layout.archive_file(first, last), seal(payload))


def read_archive(io: FileIO, first: int, last: int, table_id: str) -> dict[int, bytes]:
    """The record bytes a bundle holds, by seq (each still carries and is checked against its own checksum when
    parsed)."""
    rel = layout.archive_file(first, last)
    where = f"archive bundle {io.path(rel)}"
    data = unseal(io.read_bytes(rel), where, table_id, {"first", "last", "records"})
    records = data["records"]
    if (
        data["first"] != first
        or data["last"] != last
        or not isinstance(records, list)
        or len(records) != last - first + 1
        or not all(isinstance(r, str) for r in records)
    ):
        raise CorruptFileError(f"{where} is not valid: its range or record list does not match its name")
    return {first + i: r.encode("utf-8") for i, r in enumerate(records)}


# ---- the completion log's records, from their files or from bundles -------------------------------------------
def listed_seqs(io: FileIO, names: list[str]) -> set[int]:
    """Seqs of the record files among the names of the completion folder (temp files skipped; any other name is a
    CorruptFileError)."""
    seqs = set()
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        if not name[:-5].isdigit():
            raise CorruptFileError(
                f"unexpected file {io.path(layout.COMPLETED_DIR)}/{name} in the completion log "
                "(names are <seq>.json); remove it"
            )
        seqs.add(int(name[:-5]))
    return seqs


def read_records(
    io: FileIO, table_id: str, seqs: range, listed: set[int], legacy_upto: int = 0
) -> list[CompletedInstant]:
    """Records of consecutive seqs, each from its file if listed, else from the archive bundle that holds it; each
    checked (its own checksum, its seq, its table). Records up to `legacy_upto` are of the table's format-3 past."""
    out: list[CompletedInstant] = []
    bundle: dict[int, bytes] = {}
    bundle_name = ""
    for seq in seqs:
        rel = layout.completed_file(seq)
        where = io.path(rel)  # what errors name: the record's file, or the bundle it was read from
        raw = None
        if seq in listed:
            try:
                raw = io.read_bytes(rel)
            except CorruptFileError:
                if io.exists(rel):
                    raise  # there but unreadable: damage, not archiving
                raw = None  # archived and removed since the listing: the bundle has it
        if raw is None:
            if seq not in bundle:
                bundle, bundle_name = _bundle_holding(io, seq, table_id)
            raw = bundle.get(seq)
            if raw is None:
                raise CorruptFileError(
                    f"completion log gap at {io.path(rel)}: seq {seq} is neither in the "
                    "completion folder nor in an archive bundle"
                )
            where = f"{seq} in archive bundle {bundle_name}"
        record = CompletedInstant.from_json(raw, where, legacy=seq <= legacy_upto)
        if record.seq != seq:
            raise CorruptFileError(
                f"completion log gap or mismatch at {where}: expected seq {seq}, the record says {record.seq}"
            )
        if table_id and record.table_id != table_id:
            raise CorruptFileError(
                f"completion record {where} belongs to table {record.table_id!r}, not to {table_id!r} of "
                f"{io.path(layout.PROPERTIES_FILE)}: the table's metadata is mixed up"
            )
        out.append(record)
    return out


def _bundle_holding(io: FileIO, seq: int, table_id: str) -> tuple[dict[int, bytes], str]:
    """The records of the archive bundle holding seq, with the bundle's path ({} and "" if none holds it)."""
    for first, last in archive_ranges(io):
        if first <= seq <= last:
            return read_archive(io, first, last, table_id), io.path(layout.archive_file(first, last))
    return {}, ""


def _names(io: FileIO, rel_dir: str, pattern: re.Pattern[str]) -> list[re.Match[str]]:
    out = []
    for name in io.list_names(rel_dir):
        if name.startswith("."):
            continue  # temp files of writers
        m = pattern.match(name)
        if m is None:
            raise CorruptFileError(
                f"unexpected file {io.path(rel_dir)}/{name} (expected names like {pattern.pattern}); remove it"
            )
        out.append(m)
    return out
