"""The data view: which data files make up the table's current state, and what the writes recorded about it.

Built by replaying completion records in order, like the index's IndexView (file_view.py): commits and build-index
add data files, data compactions swap the files they replace for bases, cleans forget replaced files they deleted.
It also keeps the newest recorded data schema, key/partition layout and bucket spec, so nothing that plans a read
or checks a write has to walk the whole completion log (a checkpoint stores this view; storage/checkpoint.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

from dbidx.errors import CorruptFileError
from dbidx.storage import layout
from dbidx.storage.commit_stamps import STAMP_EXTRA, next_stamp, stamp_of, stamps_on
from dbidx.storage.log_vectors import LOG_VECTORS_EXTRA, parse_log_vectors
from dbidx.storage.row_ids import HIGH_WATER_MARK_EXTRA, PROTOCOL_EXTRA, ROW_IDS_EXTRA, assign, tracks_rows
from dbidx.storage.records import (
    ACTION_ABSORB,
    ACTION_BUILD_INDEX,
    ACTION_CLEAN,
    ACTION_COMMIT,
    ACTION_DATA_COMPACTION,
    ACTION_PROPERTIES,
    DATA_ACTIONS,
    CompletedInstant,
    DataFileRecord,
    DeletionVectorRecord,
    DvFileRecord,
    FieldError,
    parse_instant,
    parse_int,
    parse_items,
    parse_object,
    parse_order,
    parse_path,
    record_dict,
)

LAYOUT_EXTRA = "upsert"  # the completion record's extra that names key and partition columns (and bucket spec)
SCHEMA_EXTRA = "schema"  # the completion record's extra that holds the data schema (data/schema.py)


@dataclass(frozen=True)
class LiveDataFile:
    """A data file of the current state: its record, merge order, the completion that added it, and whether it is a
    user's source file that build-index listed by reference."""

    record: DataFileRecord
    order: tuple[int, int]  # (seq of the newest commit it reflects, 0 for a commit's file / 1 for a base)
    seq: int
    instant: str
    source: bool = False


@dataclass(frozen=True)
class DvRef:
    """A live data file's current deletion vector and the DV file that holds it."""

    vector: DeletionVectorRecord
    file: DvFileRecord


@dataclass(frozen=True)
class Recorded:
    """A value some completion's extra recorded (schema, layout, buckets), with where it came from."""

    value: Any
    seq: int
    instant: str


class DataView:
    """Replays the completion log incrementally; answers live data files, replaced files, schema and layout."""

    def __init__(self) -> None:
        self.applied_seq = 0
        self.writes = 0  # commits and build-indexes so far
        self.last_write: str | None = None  # instant of the newest of them
        self._live: dict[str, LiveDataFile] = {}
        self._replaced: dict[str, tuple[int, bool]] = {}  # path -> (replacing seq, user's source file)
        self._dv: dict[str, DvRef] = {}  # live data file -> its current deletion vector
        self._dv_files: dict[str, int] = {}  # DV file -> seq it was written, or a vector of it last left the state
        self.schema: Recorded | None = None
        self.layout: Recorded | None = None
        self.buckets: Recorded | None = None
        # The Delta table a build-index adopted (FORMAT.md section 12): its version then, metaData and protocol.
        self.delta_adopted: Recorded | None = None
        # The Delta table properties (metaData.configuration) as last changed by a `properties` completion or an
        # absorbed metaData of another engine; None: never changed (`configuration()` gives the one in force).
        self.delta_configuration: Recorded | None = None
        # Delta row tracking (storage/row_ids.py): the protocol another engine's absorbed version set (None: the
        # adopted one, or dbidx's own), and the row-id high-water mark (-1: no row id assigned yet).
        self.delta_protocol: Recorded | None = None
        self.row_id_high_water_mark = -1
        # The inCommitTimestamp of the newest Delta version (storage/commit_stamps.py); None: none seen.
        self.last_stamp: int | None = None
        # The Delta schemaString in force as another engine wrote it (the adopted table's, or its newest absorbed
        # metaData's: SCHEMA_STRING_EXTRA), whose columns' NOT NULL, comments and other metadata dbidx's own metaData
        # keeps (data/delta_derive.py) and whose NOT NULL columns upserts must fill; None: none recorded.
        self.delta_schema_string: Recorded | None = None
        # Live data files whose vector in the Delta log is not the view's (LOG_VECTORS_EXTRA): the log's descriptor.
        self._log_dv: dict[str, dict[str, Any] | None] = {}

    @property
    def delta_offset(self) -> int:
        """Delta version minus completion seq for the completions dbidx writes Delta versions of: 0 for a table
        dbidx created; for an adopted Delta table, the adopting build-index (seq b) is version V + 1."""
        if self.delta_adopted is None:
            return 0
        return self.delta_adopted.value["version"] + 1 - self.delta_adopted.seq

    @property
    def delta_first_seq(self) -> int:
        """The first completion seq that has a Delta version of dbidx's (older ones belong to an adopted history)."""
        return 0 if self.delta_adopted is None else self.delta_adopted.seq

    def apply(
        self, records: list[CompletedInstant], before: Callable[[CompletedInstant, "DataView"], None] | None = None
    ) -> None:
        """Fold newly published completion records (in seq order) into the view; an inconsistent log (a data file
        under the metadata folder, a compaction of a file that is not live) is a CorruptFileError naming it.
        `before(record, view)` sees each record with the view as it stood right before it (the Delta log's
        commit for a record is a function of both: data/delta_derive.py)."""
        for rec in records:
            if rec.seq <= self.applied_seq:
                continue
            if before is not None:
                before(rec, self)
            self._stamp(rec)
            if rec.action != ACTION_ABSORB:
                self._log_dv.clear()  # the Delta version of every dbidx completion brings the log in line
            files = self._with_row_ids(rec)
            if rec.action in DATA_ACTIONS:
                self._add_written(rec, files)
            elif rec.action == ACTION_DATA_COMPACTION:
                self._swap(rec, files)
            elif rec.action == ACTION_ABSORB:
                self._absorb(rec)
            elif rec.action == ACTION_CLEAN:
                for path in rec.deleted:
                    self._replaced.pop(path, None)
                    self._dv_files.pop(path, None)
            self._set_vectors(rec)
            if layout_value := rec.extra.get(LAYOUT_EXTRA):
                self.layout = Recorded(layout_value, rec.seq, rec.instant)
                if rec.action == ACTION_COMMIT and isinstance(layout_value, dict) and layout_value.get("buckets"):
                    self.buckets = Recorded(layout_value["buckets"], rec.seq, rec.instant)
            if SCHEMA_EXTRA in rec.extra:
                self.schema = Recorded(rec.extra[SCHEMA_EXTRA], rec.seq, rec.instant)
            if rec.action in (ACTION_ABSORB, ACTION_PROPERTIES) and DELTA_CONFIGURATION_EXTRA in rec.extra:
                self.delta_configuration = Recorded(
                    check_configuration(rec.extra[DELTA_CONFIGURATION_EXTRA], f"completion {rec.seq} ({rec.instant})"),
                    rec.seq,
                    rec.instant,
                )
            if rec.action == ACTION_BUILD_INDEX and DELTA_ADOPTED_EXTRA in rec.extra:
                self.delta_adopted = Recorded(
                    check_adopted(rec.extra[DELTA_ADOPTED_EXTRA], f"completion {rec.seq} ({rec.instant})"),
                    rec.seq,
                    rec.instant,
                )
                self.row_id_high_water_mark = self.delta_adopted.value.get(ADOPTED_HIGH_WATER_MARK, -1)
                self._cover_row_ids()
            if rec.action == ACTION_ABSORB:
                self._absorb_row_tracking(rec)
            if SCHEMA_STRING_EXTRA in rec.extra:  # (an adoption, an absorb, or dbidx's first metaData since one)
                self.delta_schema_string = Recorded(
                    _text(rec.extra[SCHEMA_STRING_EXTRA], f"completion {rec.seq} ({rec.instant})"), rec.seq, rec.instant
                )
            self.applied_seq = rec.seq

    def previous_stamp(self, rec: CompletedInstant) -> int | None:
        """The stamp of the Delta version before `rec`'s (this view stands right before it): an adoption's is the
        adopted version's, as its record says."""
        if rec.action == ACTION_BUILD_INDEX and STAMP_EXTRA in rec.extra:
            return stamp_of(rec.extra[STAMP_EXTRA], f"completion {rec.seq} ({rec.instant})")
        return self.last_stamp

    def stamps(self, rec: CompletedInstant) -> bool:
        """Whether the Delta version of dbidx's completion `rec` carries an inCommitTimestamp: the properties in
        force right before it (for an adoption, the adopted table's) turn them on."""
        if rec.action == ACTION_BUILD_INDEX and DELTA_ADOPTED_EXTRA in rec.extra:
            adopted = rec.extra[DELTA_ADOPTED_EXTRA]
            meta = adopted.get("metaData") if isinstance(adopted, dict) else None
            return stamps_on((meta or {}).get("configuration") or {}) if isinstance(meta, dict) else False
        return stamps_on(self.configuration())

    def _stamp(self, rec: CompletedInstant) -> None:
        where = f"completion {rec.seq} ({rec.instant})"
        if rec.action == ACTION_ABSORB:
            if STAMP_EXTRA in rec.extra:
                self.last_stamp = stamp_of(rec.extra[STAMP_EXTRA], where)
            return
        if self.stamps(rec):
            self.last_stamp = next_stamp(rec.completed_at_ms, self.previous_stamp(rec))

    def protocol(self) -> dict[str, Any] | None:
        """The Delta protocol in force as far as dbidx records it: another engine's newest absorbed one, else the
        adopted table's; None for a table dbidx created and no engine changed (dbidx's own protocol)."""
        if self.delta_protocol is not None:
            return dict(self.delta_protocol.value)
        return dict(self.delta_adopted.value["protocol"]) if self.delta_adopted is not None else None

    def tracks_rows(self) -> bool:
        """Whether dbidx's next completion assigns row ids (storage/row_ids.py)."""
        return tracks_rows(self.protocol(), self.configuration())

    def row_ids_for(self, rec: CompletedInstant) -> tuple[list[DataFileRecord], int]:
        """The files `rec` adds as this view (right before it) records them: with fresh row ids when it is a dbidx
        write on a table that tracks rows, else as recorded; and the high-water mark after them."""
        adopting = rec.action == ACTION_BUILD_INDEX and DELTA_ADOPTED_EXTRA in rec.extra
        if rec.action in (*DATA_ACTIONS, ACTION_DATA_COMPACTION) and not adopting and self.tracks_rows():
            return assign(rec.data_files, self.row_id_high_water_mark, rec.seq + self.delta_offset)
        return list(rec.data_files), self.row_id_high_water_mark

    def _with_row_ids(self, rec: CompletedInstant) -> list[DataFileRecord]:
        files, self.row_id_high_water_mark = self.row_ids_for(rec)
        return files

    def _absorb_row_tracking(self, rec: CompletedInstant) -> None:
        where = f"completion {rec.seq} ({rec.instant})"
        if PROTOCOL_EXTRA in rec.extra:
            if not _is_protocol(rec.extra[PROTOCOL_EXTRA]):
                raise CorruptFileError(f"{where}: its {PROTOCOL_EXTRA} is not a Delta protocol")
            self.delta_protocol = Recorded(rec.extra[PROTOCOL_EXTRA], rec.seq, rec.instant)
        mark = rec.extra.get(HIGH_WATER_MARK_EXTRA)
        if mark is not None:
            if not isinstance(mark, int) or isinstance(mark, bool) or mark < -1:
                raise CorruptFileError(f"{where}: its {HIGH_WATER_MARK_EXTRA} {mark!r} is not a row id")
            self.row_id_high_water_mark = max(self.row_id_high_water_mark, mark)
        for path, ids in (rec.extra.get(ROW_IDS_EXTRA) or {}).items():
            live = self._live.get(path)
            if live is None or not isinstance(ids, list) or len(ids) != 2:
                raise CorruptFileError(f"{where}: its {ROW_IDS_EXTRA} of {path!r} do not fit a live file")
            if not all(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0) for v in ids):
                raise CorruptFileError(f"{where}: its {ROW_IDS_EXTRA} of {path!r} are not row ids: {ids!r}")
            base, version = ids
            record = replace(live.record, base_row_id=base, row_commit_version=version)
            self._live[path] = replace(live, record=record)
        self._cover_row_ids()

    def _cover_row_ids(self) -> None:
        """The mark covers every row id a live file holds (another engine's domain may lag its adds, or be gone
        with the log's JSON): dbidx's next ids never repeat one. Only on a table that tracks rows: this runs for
        every absorb, and the mark is read only there (a table that turns tracking on does so in an absorb, which
        covers then)."""
        if not self.tracks_rows():
            return
        for live in self._live.values():
            f = live.record
            if f.base_row_id is not None:
                self.row_id_high_water_mark = max(self.row_id_high_water_mark, f.base_row_id + f.rows - 1)

    def _add_written(self, rec: CompletedInstant, files: list[DataFileRecord]) -> None:
        self.writes += 1
        self.last_write = rec.instant
        for f in files:
            _check_outside_meta(f.path, rec)
            self._live[f.path] = LiveDataFile(f, (rec.seq, 0), rec.seq, rec.instant, rec.action == ACTION_BUILD_INDEX)

    def _swap(self, rec: CompletedInstant, files: list[DataFileRecord]) -> None:
        """A data compaction: its bases stand where the newest file they replaced stood, so a file committed while
        it ran (not replaced, seq below the compaction's) stays newer than the base."""
        covered: dict[tuple[str, str], int] = {}
        for path in rec.replaced:
            gone = self._live.pop(path, None)
            if gone is None:  # two compactions of one file never both publish: the log is damaged or crafted
                raise CorruptFileError(
                    f"data compaction {rec.instant} (seq {rec.seq}) replaces {path!r}, which is "
                    "not a live data file at that point of the log"
                )
            self._replaced[path] = (rec.seq, gone.source)
            self._release(self._dv.pop(path, None), rec.seq)
            group = (gone.record.partition, gone.record.file_group)
            covered[group] = max(covered.get(group, 0), gone.order[0])
        for f in files:
            _check_outside_meta(f.path, rec)
            if (f.partition, f.file_group) not in covered:
                raise CorruptFileError(
                    f"data compaction {rec.instant} (seq {rec.seq}) writes a base for file group "
                    f"{f.file_group!r} of {f.partition!r} without replacing any of its files"
                )
            self._live[f.path] = LiveDataFile(f, (covered[(f.partition, f.file_group)], 1), rec.seq, rec.instant)

    def _absorb(self, rec: CompletedInstant) -> None:
        """Another engine's Delta version: the files it removed leave (kept on storage: they are that engine's to
        VACUUM, and its time travel may read them, so they are not `replaced` files a clean would delete), the
        files it added enter as the newest of their groups."""
        if rec.data_files or rec.replaced:
            self.writes += 1
            self.last_write = rec.instant
        for path in rec.replaced:
            gone = self._live.pop(path, None)
            if gone is None:
                raise CorruptFileError(
                    f"completion {rec.seq} ({rec.instant}) absorbs the removal of {path!r}, which "
                    "is not a live data file at that point of the log"
                )
            self._replaced.pop(path, None)
            self._log_dv.pop(path, None)
            self._release(self._dv.pop(path, None), rec.seq)
        for f in rec.data_files:
            _check_outside_meta(f.path, rec)
            if f.path in self._live:
                raise CorruptFileError(
                    f"completion {rec.seq} ({rec.instant}) absorbs {f.path!r} as a new data file, "
                    "but it is live already"
                )
            self._replaced.pop(f.path, None)  # a file an earlier version removed, added back (a RESTORE)
            self._live[f.path] = LiveDataFile(f, (rec.seq, 0), rec.seq, rec.instant)
        logged = rec.extra.get(LOG_VECTORS_EXTRA)
        if logged is not None:
            self._log_dv.update(parse_log_vectors(logged, f"completion {rec.seq} ({rec.instant})"))

    def _set_vectors(self, rec: CompletedInstant) -> None:
        """A completion's deletion vectors replace the earlier ones of their files, which must be live and in a DV
        file the same completion wrote."""
        dv_files = {f.path: f for f in rec.dv_files}
        for f in rec.dv_files:
            self._dv_files[f.path] = rec.seq
        for dv in rec.deletion_vectors:
            live = self._live.get(dv.path)
            if live is None or dv.dv_file not in dv_files or dv.cardinality > live.record.rows:
                raise CorruptFileError(
                    f"completion {rec.seq} ({rec.instant}) gives {dv.path!r} a deletion vector "
                    "that does not fit: the file is not live, the vector's DV file is not one the "
                    "completion wrote, or it deletes more rows than the file has"
                )
            self._release(self._dv.get(dv.path), rec.seq)
            self._dv[dv.path] = DvRef(dv, dv_files[dv.dv_file])

    def _release(self, ref: DvRef | None, seq: int) -> None:
        """A vector left the state at `seq`: its DV file may become unreferenced from then on."""
        if ref is not None and ref.file.path in self._dv_files:
            self._dv_files[ref.file.path] = seq

    # ---- answers -----------------------------------------------------------------------------------------
    def configuration(self) -> dict[str, str]:
        """The Delta table properties in force: the last recorded change, else the adopted table's own, else the
        ones dbidx creates a table with."""
        if self.delta_configuration is not None:
            return dict(self.delta_configuration.value)
        if self.delta_adopted is not None:
            return dict(self.delta_adopted.value["metaData"].get("configuration") or {})
        return dict(DEFAULT_CONFIGURATION)

    def live(self) -> list[LiveDataFile]:
        """Every data file of the current state."""
        return list(self._live.values())

    def get(self, path: str) -> LiveDataFile | None:
        """The live data file at `path`, if it is one."""
        return self._live.get(path)

    def vector_of(self, path: str) -> DvRef | None:
        """The live data file's current deletion vector (None: every row of it is table data)."""
        return self._dv.get(path)

    def live_rows(self) -> int:
        """Rows of the current state: the live files' rows minus their deletion vectors."""
        return sum(f.record.rows for f in self._live.values()) - sum(d.vector.cardinality for d in self._dv.values())

    def log_vector(self, path: str) -> tuple[bool, dict[str, Any] | None]:
        """(True, the Delta log's descriptor) for a live file whose log vector is not the view's (LOG_VECTORS_EXTRA:
        a Delta `remove` of it must repeat the log's), else (False, None)."""
        return (True, self._log_dv[path]) if path in self._log_dv else (False, None)

    def log_behind(self) -> list[str]:
        """Live files whose vector the Delta log does not have yet (the next dbidx version gives it to them)."""
        return sorted(self._log_dv)

    def is_live(self, path: str) -> bool:
        """Whether the path is a data file of the current state."""
        return path in self._live

    def referenced_paths(self) -> set[str]:
        """Files the table still names: live data files, replaced ones no clean has deleted yet, and every DV file
        a live vector points into or no clean has deleted yet."""
        return set(self._live) | set(self._replaced) | set(self._dv_files) | {r.file.path for r in self._dv.values()}

    def unreferenced_dv_files(self, upto_seq: int) -> list[tuple[str, int]]:
        """(path, seq) of the DV files no live vector points into, seq being the completion at or before `upto_seq`
        at which the last vector of it left the state (for `clean`: Delta versions before that one read it)."""
        referenced = {ref.file.path for ref in self._dv.values()}
        return sorted((p, seq) for p, seq in self._dv_files.items() if seq <= upto_seq and p not in referenced)

    def replaced(self, upto_seq: int, migrated: bool = False) -> list[tuple[str, int]]:
        """(path, replacing seq) of data files data compactions at or before `upto_seq` replaced, not cleaned yet
        (for `clean`); the user's source files build-index listed only with `migrated` (the user's decision)."""
        return sorted(
            (p, seq) for p, (seq, source) in self._replaced.items() if seq <= upto_seq and (migrated or not source)
        )

    # ---- checkpoint form ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The view as a checkpoint stores it (deterministic: the same log gives the same dict)."""
        return (
            {
                "applied_seq": self.applied_seq,
                "writes": self.writes,
                "last_write": self.last_write,
                "live": [
                    {
                        "file": record_dict(a.record),
                        "order": list(a.order),
                        "seq": a.seq,
                        "instant": a.instant,
                        "source": a.source,
                    }
                    for a in sorted(self._live.values(), key=lambda a: a.record.path)
                ],
                "replaced": [{"path": p, "seq": s, "source": src} for p, (s, src) in sorted(self._replaced.items())],
                "schema": _recorded_dict(self.schema),
                "layout": _recorded_dict(self.layout),
                "buckets": _recorded_dict(self.buckets),
                "vectors": [
                    {"vector": record_dict(d.vector), "file": asdict(d.file)} for _p, d in sorted(self._dv.items())
                ],
                "dv_files": [{"path": p, "seq": seq} for p, seq in sorted(self._dv_files.items())],
            }
            | ({"delta_adopted": _recorded_dict(self.delta_adopted)} if self.delta_adopted is not None else {})
            | (
                {"delta_configuration": _recorded_dict(self.delta_configuration)}
                if self.delta_configuration is not None
                else {}
            )
            | ({LOG_VECTORS_EXTRA: dict(sorted(self._log_dv.items()))} if self._log_dv else {})
            | ({"delta_protocol": _recorded_dict(self.delta_protocol)} if self.delta_protocol is not None else {})
            | ({HIGH_WATER_MARK_EXTRA: self.row_id_high_water_mark} if self.row_id_high_water_mark >= 0 else {})
            | ({STAMP_EXTRA: self.last_stamp} if self.last_stamp is not None else {})
            | (
                {SCHEMA_STRING_EXTRA: _recorded_dict(self.delta_schema_string)}
                if self.delta_schema_string is not None
                else {}
            )
        )

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "DataView":
        """Rebuild from a checkpoint, checking every field (a checkpoint is read back from storage: untrusted)."""
        try:
            d = parse_object(
                data,
                "data",
                {
                    "applied_seq",
                    "writes",
                    "last_write",
                    "live",
                    "replaced",
                    "schema",
                    "layout",
                    "buckets",
                    "vectors",
                    "dv_files",
                    "delta_adopted",
                    "delta_configuration",
                    LOG_VECTORS_EXTRA,
                    "delta_protocol",
                    HIGH_WATER_MARK_EXTRA,
                    SCHEMA_STRING_EXTRA,
                    STAMP_EXTRA,
                },
                optional={
                    SCHEMA_STRING_EXTRA,
                    STAMP_EXTRA,
                    "delta_adopted",
                    "delta_configuration",
                    LOG_VECTORS_EXTRA,
                    "delta_protocol",
                    HIGH_WATER_MARK_EXTRA,
                },
            )
            view = cls()
            view.applied_seq = parse_int(d["applied_seq"], "data.applied_seq")
            view.writes = parse_int(d["writes"], "data.writes")
            view.last_write = None if d["last_write"] is None else parse_instant(d["last_write"], "data.last_write")
            for i, item in enumerate(parse_items(d["live"], "data.live")):
                e = parse_object(item, f"data.live[{i}]", {"file", "order", "seq", "instant", "source"})
                record = DataFileRecord.parse(e["file"], f"data.live[{i}].file")
                _check_outside_meta(record.path, None)
                order = parse_order(e["order"], f"data.live[{i}].order")
                view._live[record.path] = LiveDataFile(
                    record,
                    order,
                    parse_int(e["seq"], f"data.live[{i}].seq", 1),
                    parse_instant(e["instant"], f"data.live[{i}].instant"),
                    _bool(e["source"], f"data.live[{i}].source"),
                )
            for i, item in enumerate(parse_items(d["replaced"], "data.replaced")):
                e = parse_object(item, f"data.replaced[{i}]", {"path", "seq", "source"})
                path = parse_path(e["path"], f"data.replaced[{i}].path")
                _check_outside_meta(path, None)
                view._replaced[path] = (
                    parse_int(e["seq"], f"data.replaced[{i}].seq", 1),
                    _bool(e["source"], f"data.replaced[{i}].source"),
                )
            for i, item in enumerate(parse_items(d["vectors"], "data.vectors")):
                e = parse_object(item, f"data.vectors[{i}]", {"vector", "file"})
                ref = DvRef(
                    DeletionVectorRecord.parse(e["vector"], f"data.vectors[{i}].vector"),
                    DvFileRecord.parse(e["file"], f"data.vectors[{i}].file"),
                )
                live = view._live.get(ref.vector.path)
                if live is None or ref.vector.dv_file != ref.file.path or ref.vector.cardinality > live.record.rows:
                    raise FieldError(
                        f"data.vectors[{i}] is the vector of {ref.vector.path!r}, which is not a live "
                        "file, or names another DV file, or deletes more rows than the file has"
                    )
                view._dv[ref.vector.path] = ref
            for i, item in enumerate(parse_items(d["dv_files"], "data.dv_files")):
                e = parse_object(item, f"data.dv_files[{i}]", {"path", "seq"})
                path = DvFileRecord.parse(
                    {"path": e["path"], "size": 0, "checksum": "xxh64:" + "0" * 16}, f"data.dv_files[{i}]"
                ).path
                view._dv_files[path] = parse_int(e["seq"], f"data.dv_files[{i}].seq", 1)
            if any(ref.file.path not in view._dv_files for ref in view._dv.values()):
                raise FieldError("a live vector points into a DV file the view does not list")
            view.schema = _recorded(d["schema"], "data.schema")
            view.layout = _recorded(d["layout"], "data.layout")
            view.buckets = _recorded(d["buckets"], "data.buckets")
            view.delta_adopted = _recorded(d.get("delta_adopted"), "data.delta_adopted")
            if view.delta_adopted is not None:
                check_adopted(view.delta_adopted.value, "data.delta_adopted")
            if d.get(LOG_VECTORS_EXTRA) is not None:
                view._log_dv = parse_log_vectors(d[LOG_VECTORS_EXTRA], f"data.{LOG_VECTORS_EXTRA}")
                if not set(view._log_dv) <= set(view._live):
                    raise FieldError(f"data.{LOG_VECTORS_EXTRA} names a file that is not live")
            view.delta_configuration = _recorded(d.get("delta_configuration"), "data.delta_configuration")
            if view.delta_configuration is not None:
                check_configuration(view.delta_configuration.value, "data.delta_configuration")
            view.delta_protocol = _recorded(d.get("delta_protocol"), "data.delta_protocol")
            if view.delta_protocol is not None and not _is_protocol(view.delta_protocol.value):
                raise FieldError("data.delta_protocol is not a Delta protocol")
            view.row_id_high_water_mark = parse_int(d.get(HIGH_WATER_MARK_EXTRA, -1), "data.row_id_high_water_mark", -1)
            if d.get(STAMP_EXTRA) is not None:
                view.last_stamp = stamp_of(d[STAMP_EXTRA], "data")
            view.delta_schema_string = _recorded(d.get(SCHEMA_STRING_EXTRA), f"data.{SCHEMA_STRING_EXTRA}")
            if view.delta_schema_string is not None:
                _text(view.delta_schema_string.value, f"data.{SCHEMA_STRING_EXTRA}")
            return view
        except (FieldError, ValueError, TypeError) as exc:
            raise CorruptFileError(f"checkpoint {where}: its data view is not valid: {exc}") from exc


def _check_outside_meta(path: str, rec: CompletedInstant | None) -> None:
    """A data file never lies under the metadata folder: a record that says so is crafted or damaged (a clean
    would otherwise delete the table's own metadata)."""
    if path.startswith(layout.META_DIR + "/"):
        where = f"completion {rec.seq} ({rec.instant})" if rec is not None else "the checkpoint"
        raise CorruptFileError(f"{where} lists {path!r} as a data file, inside the metadata folder {layout.META_DIR}")


# The Delta schemaString another engine's metaData holds, recorded by the adoption and by each absorbed metaData.
SCHEMA_STRING_EXTRA = "delta_schema_string"


def _is_protocol(value: Any) -> bool:
    """A Delta protocol action's body as far as the view reads it: its feature lists are lists of names."""
    return isinstance(value, dict) and all(
        isinstance(value.get(k, []), list) and all(isinstance(n, str) for n in value.get(k, []))
        for k in ("readerFeatures", "writerFeatures")
    )


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise CorruptFileError(f"{where}: its {SCHEMA_STRING_EXTRA} is not a Delta schemaString: {value!r:.200}")
    return value


DELTA_ADOPTED_EXTRA = "delta_adopted"
# The adopted table's row-id high-water mark (its `delta.rowTracking` domain), when it tracks rows.
ADOPTED_HIGH_WATER_MARK = "rowIdHighWaterMark"
# The completion record's extra holding the whole Delta configuration after it (a `properties` completion, or an
# absorbed version whose metaData changed it).
DELTA_CONFIGURATION_EXTRA = "delta_configuration"
DEFAULT_CONFIGURATION = {"delta.enableDeletionVectors": "true"}


def check_configuration(value: Any, where: str) -> dict[str, str]:
    """A Delta configuration read back from a record or checkpoint: an object of strings to strings (what Delta's
    metaData.configuration is), with deletion vectors on (dbidx writes them)."""
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise CorruptFileError(f"{where}: the Delta configuration must be an object of strings, got {value!r}")
    if value.get("delta.enableDeletionVectors", "true").lower() != "true":
        raise CorruptFileError(f"{where}: the Delta configuration turns deletion vectors off, which dbidx writes")
    return value


def check_adopted(value: Any, where: str) -> dict[str, Any]:
    """What a build-index recorded of the Delta table it adopted: {"version": V, "metaData": {...}, "protocol": {...}}
    (read back from storage: checked before any Delta version number is computed from it)."""
    try:
        d = parse_object(
            value,
            "delta_adopted",
            {"version", "metaData", "protocol", ADOPTED_HIGH_WATER_MARK},
            optional={ADOPTED_HIGH_WATER_MARK},
        )
        parse_int(d["version"], "delta_adopted.version")
        parse_int(d.get(ADOPTED_HIGH_WATER_MARK, -1), f"delta_adopted.{ADOPTED_HIGH_WATER_MARK}", -1)
        parse_object(
            d["protocol"],
            "delta_adopted.protocol",
            {"minReaderVersion", "minWriterVersion", "readerFeatures", "writerFeatures"},
            optional={"readerFeatures", "writerFeatures"},
        )
        meta = d["metaData"]
        if not isinstance(meta, dict) or not isinstance(meta.get("id"), str):
            raise FieldError("delta_adopted.metaData must be a Delta metaData action with an id")
    except (FieldError, ValueError, TypeError) as exc:
        raise CorruptFileError(f"{where}: the adopted Delta table's description is not valid: {exc}") from exc
    return d


def _recorded_dict(recorded: Recorded | None) -> dict[str, Any] | None:
    return None if recorded is None else {"value": recorded.value, "seq": recorded.seq, "instant": recorded.instant}


def _recorded(data: Any, name: str) -> Recorded | None:
    if data is None:
        return None
    d = parse_object(data, name, {"value", "seq", "instant"})
    return Recorded(d["value"], parse_int(d["seq"], f"{name}.seq", 1), parse_instant(d["instant"], f"{name}.instant"))


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise FieldError(f"{name} must be true or false, got {value!r}")
    return value
