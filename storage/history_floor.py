"""The retention floor: the durable, checkable statement that completion records 1..F were expired on purpose.

Why a file of its own: archive retention (storage/archive_retention.py) deletes archive bundles whose records are all
older than the table's `delta.logRetentionDuration`. Without a record of that, a reader asking for those records
(`dbidx commits`, time travel, `verify`'s replay) would find a gap and rightly call the table corrupt. The floor
file says "records up to seq F are gone, by retention" and carries the folded table state at F (the same views a
checkpoint holds), so that time travel to a kept seq and `verify` fold from F instead of from seq 1.

Layout: `timeline/floor/<F:012d>.floor`, created exclusively and never changed; the largest F present is the floor
(a newer floor is written before the older one is deleted, so a listing never shows none while one is due).
Encoding: the checkpoint encoding (zstd, canonical JSON, XXH64 checksum, format, table id; docs/FORMAT.md 7a).
Older dbidx never lists this folder: reading below the floor, it reports the gap (CorruptFileError) - loud.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dbidx.errors import CorruptFileError, HistoryCompactedError
from dbidx.storage import checkpoint
from dbidx.storage.fileio import FileIO
from dbidx.storage.records import FieldError, parse_instant, parse_int, parse_str

FLOOR_DIR, floor_file, floor_seqs = checkpoint.FLOOR_DIR, checkpoint.floor_file, checkpoint.floor_seqs
SETTING = "delta.logRetentionDuration"  # what a refused read names as the reason
_LOOKS = 3  # listings before a floor that vanished between listing and reading is damage


@dataclass(frozen=True)
class HistoryFloor:
    """Records 1..seq were expired by retention; `index` / `data` are the views folded up to seq."""

    seq: int
    max_instant: str  # the largest instant id among the expired records ("" if none)
    expired_at_ms: int
    retention_ms: int
    newest_expired_ms: int  # the newest completed_at_ms among the expired records
    index: dict[str, Any]
    data: dict[str, Any]
    where: str

    def refusal(self, what: str) -> HistoryCompactedError:
        """The loud answer to anything that needs an expired record: what, why, which setting, what is kept."""
        return HistoryCompactedError(
            f"{what} needs completion records up to seq {self.seq}, which archive retention expired on purpose "
            f"({SETTING} = {self.retention_ms} ms; floor {self.where}); the history kept starts at seq "
            f"{self.seq + 1}. A cache reloads instead; time travel and history reach back to seq {self.seq} at most"
        )


def write_floor(io: FileIO, table_id: str, floor: HistoryFloor) -> bool:
    """Create the floor file of floor.seq exclusively; False if it exists (another expirer wrote the same state)."""
    payload = {
        "format": checkpoint.CHECKPOINT_FORMAT,
        "table_id": table_id,
        "seq": floor.seq,
        "max_instant": floor.max_instant,
        "expired_at_ms": floor.expired_at_ms,
        "retention_ms": floor.retention_ms,
        "newest_expired_ms": floor.newest_expired_ms,
        "setting": SETTING,
        "index": floor.index,
        "data": floor.data,
    }
    return io.create_exclusive(floor_file(floor.seq), checkpoint.seal(payload))


def read_floor(io: FileIO, seq: int, table_id: str) -> HistoryFloor:
    """One floor file, checked like a checkpoint (checksum, format, table id, every field's type; seq = name)."""
    rel = floor_file(seq)
    where = io.path(rel)
    fields = {"seq", "max_instant", "expired_at_ms", "retention_ms", "newest_expired_ms", "setting", "index", "data"}
    data = checkpoint.unseal(io.read_bytes(rel), f"history floor {where}", table_id, fields)
    try:
        if parse_int(data["seq"], "seq", 1) != seq:
            raise FieldError(f"it says seq {data['seq']}, its name {seq}")
        max_instant = "" if data["max_instant"] == "" else parse_instant(data["max_instant"], "max_instant")
        if parse_str(data["setting"], "setting") != SETTING:
            raise FieldError(f"setting {data['setting']!r} is not {SETTING!r}")
        for name in ("index", "data"):
            if not isinstance(data[name], dict):
                raise FieldError(f"{name} is not an object")
        return HistoryFloor(
            seq,
            max_instant,
            parse_int(data["expired_at_ms"], "expired_at_ms", 0),
            parse_int(data["retention_ms"], "retention_ms", 0),
            parse_int(data["newest_expired_ms"], "newest_expired_ms", 0),
            data["index"],
            data["data"],
            where,
        )
    except FieldError as exc:
        raise CorruptFileError(f"history floor {where} is not valid: {exc}") from exc


def current_floor(io: FileIO, table_id: str) -> HistoryFloor | None:
    """The floor in force: the largest floor file, read and checked; None if no history was ever expired.

    A floor file deleted between the listing and the read was replaced by a newer one (expiry writes the new floor
    before it deletes the old): look again, a few times, before calling it damage."""
    for _ in range(_LOOKS):
        seqs = floor_seqs(io)
        if not seqs:
            return None
        try:
            return read_floor(io, seqs[-1], table_id)
        except CorruptFileError:
            if io.exists(floor_file(seqs[-1])):
                raise  # there, but damaged
    raise CorruptFileError(f"history floor files under {io.path(FLOOR_DIR)} keep vanishing while read")
