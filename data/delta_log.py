"""The table's Delta Lake log: `_delta_log/`, derived from the completion log so that every Delta reader sees exactly
the rows dbidx reads.

Why derived and not a second source of truth: the completion log (`.dbidx/timeline/completed/`) is verified,
checksummed and carries every guarantee of the commit protocol (conflicts, all-or-nothing, rollback). The Delta
commit of completion seq S is a pure function of record S and the data view right before it, and Delta version S
belongs to completion S (version 0 is the table's creation). So a writer publishes its completion first and then
writes the Delta version with a put-if-absent; a crash in between leaves a version missing, never a wrong one, and
the next writer (or `dbidx repair`) writes it. Two processes writing the same version write the same bytes; a
version whose bytes differ from the derivation was written by someone else (another Delta writer) and is refused
loudly (ForeignCommitError) before dbidx writes anything on top of it.

What a version holds (docs/FORMAT.md section 12): commits and build-index `add` their data files (with
`numRecords`, key min/max and the file's own delete rows as its deletion vector); a file that got a new deletion
vector is a `remove` carrying its old vector plus an `add` carrying the union; a data compaction removes the files
it replaced and adds its bases with `dataChange: false`; index compactions, cleans and rollbacks change no row and
write a version with `commitInfo` only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Iterable
from urllib.parse import quote

import pyarrow as pa

from dbidx.data.deletion_vectors import inline_form
from dbidx.data.schema import recorded_schema
from dbidx.data.superseded import load_vector_bytes
from dbidx.errors import CorruptFileError, ForeignCommitError
from dbidx.storage.data_view import (
    DEFAULT_CONFIGURATION, DELTA_ADOPTED_EXTRA, DELTA_CONFIGURATION_EXTRA, DataView, DvRef,
)
from dbidx.storage.fileio import FileIO
from dbidx.storage.layout import layout_partition_columns
from dbidx.storage.records import (
    ACTION_ABSORB, ACTION_BUILD_INDEX, ACTION_COMMIT, ACTION_DATA_COMPACTION, ACTION_PROPERTIES, ACTION_UPGRADE,
    CompletedInstant,
    DataFileRecord,
)

DELTA_LOG_DIR = "_delta_log"
ENGINE = "dbidx"
PROTOCOL = {"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": ["deletionVectors"],
            "writerFeatures": ["deletionVectors"]}
_OPERATIONS = {ACTION_COMMIT: "MERGE", ACTION_BUILD_INDEX: "CONVERT", ACTION_DATA_COMPACTION: "OPTIMIZE",
               ACTION_UPGRADE: "CONVERT", ACTION_PROPERTIES: "SET TBLPROPERTIES"}
# Partition column types whose partitionValues text every reader parses back to the same value.
_PARTITION_TYPES = (pa.types.is_string, pa.types.is_large_string, pa.types.is_integer, pa.types.is_date32,
                    pa.types.is_boolean)


def version_file(version: int) -> str:
    """`_delta_log/<version:020d>.json`."""
    return f"{DELTA_LOG_DIR}/{version:020d}.json"


def encode(actions: Iterable[dict[str, Any]]) -> bytes:
    """A version's bytes: one compact JSON action per line (deterministic: the same actions, the same bytes)."""
    return b"".join(json.dumps(a, sort_keys=True, separators=(",", ":")).encode("utf-8") + b"\n" for a in actions)


def initial_version(table_id: str, created_at_ms: int) -> bytes:
    """Version 0, written when the table is created: the protocol (deletion vectors) and an empty schema (the
    first write's version carries the real one)."""
    return encode([_commit_info(created_at_ms, "CREATE TABLE", None),
                   {"protocol": PROTOCOL},
                   _metadata(table_id, created_at_ms, {"type": "struct", "fields": []}, [], DEFAULT_CONFIGURATION)])


@dataclass(frozen=True)
class TableShape:
    """What every version's metadata and partition values depend on: id, creation time, columns, partitioning."""

    table_id: str
    created_at_ms: int
    upgraded_at_seq: int = 0  # `dbidx upgrade` from format 3: earlier completions add no rows to the Delta log


def version_for(shape: TableShape, record: CompletedInstant, view: DataView,
                body: Callable[[DvRef], bytes]) -> bytes:
    """Delta version `record.seq`: the record's effect on the rows, given the data view right before it; `body`
    gives a vector's bytes (verified), which the version carries inline."""
    if record.action == ACTION_ABSORB:
        version = record.extra.get("absorbed", {}).get("version")
        raise CorruptFileError(f"completion {record.seq} ({record.instant}) absorbed another engine's Delta version "
                               f"{version!r}, which is missing from the log: it cannot be derived (restore "
                               "`_delta_log/` from a backup)")
    actions: list[dict[str, Any]] = [_commit_info(record.completed_at_ms, _OPERATIONS.get(record.action, "VACUUM"),
                                                  record)]
    if record.seq < shape.upgraded_at_seq:
        # A format-3 completion: its files had no vectors yet (rows merged by key), so it adds nothing a Delta
        # reader could read correctly; the upgrade's version adds the whole table at once.
        return encode(actions)
    if record.action == ACTION_UPGRADE:
        return encode(actions + _upgrade_actions(shape, record, view, body))
    if record.action == ACTION_BUILD_INDEX and DELTA_ADOPTED_EXTRA in record.extra:
        # The adoption: the files are in the log already; the protocol gains deletion vectors (kept features stay).
        return encode(actions + [{"protocol": adoption_protocol(record.extra[DELTA_ADOPTED_EXTRA]["protocol"])}])
    after_schema = _schema_after(record, view)
    partition_columns = _partition_columns(record, view, after_schema)
    if record.action == ACTION_PROPERTIES:
        # The table properties change: the metaData as it stands, with the record's whole new configuration.
        configuration = record.extra.get(DELTA_CONFIGURATION_EXTRA)
        if not isinstance(configuration, dict):
            raise CorruptFileError(f"completion {record.seq} ({record.instant}) changes the table properties but "
                                   "records no configuration")
        return encode(actions + [_current_metadata(shape, view, after_schema, partition_columns, configuration)])
    if after_schema is not None and (view.schema is None or "schema" in record.extra):
        actions.append(_current_metadata(shape, view, after_schema, partition_columns, None))
    vectors = {dv.path: dv for dv in record.deletion_vectors}
    dv_files = {f.path: f for f in record.dv_files}
    ms, key = record.completed_at_ms, _key(record, view, after_schema)
    # 1. Data compaction: the replaced files leave (each with the vector it had), the bases enter unchanged rows.
    for path in record.replaced if record.action == ACTION_DATA_COMPACTION else ():
        gone = view.get(path)
        if gone is None:
            raise CorruptFileError(f"completion {record.seq} ({record.instant}) replaces {path!r}, which is not a "
                                   "live data file right before it")
        actions.append(_remove(gone.record, _inline(view.vector_of(path), body), partition_columns, ms,
                               data_change=False))
    new_paths = {f.path for f in record.data_files}
    # 2. Files that were live before and got a new vector: remove with the old vector, add with the new one.
    for path in sorted(set(vectors) - new_paths):
        old = view.get(path)
        if old is None:
            raise CorruptFileError(f"completion {record.seq} ({record.instant}) gives {path!r} a deletion vector, "
                                   "but it is not a live data file right before it")
        new = DvRef(vectors[path], dv_files[vectors[path].dv_file])
        actions.append(_remove(old.record, _inline(view.vector_of(path), body), partition_columns, ms,
                               data_change=True))
        actions.append(_add(old.record, _inline(new, body), partition_columns, ms, data_change=True, key=key))
    # 3. New files (a commit's, or a compaction's bases), each with its own vector if it has one.
    change = record.action != ACTION_DATA_COMPACTION
    for f in record.data_files:
        ref = DvRef(vectors[f.path], dv_files[vectors[f.path].dv_file]) if f.path in vectors else None
        actions.append(_add(f, _inline(ref, body), partition_columns, ms, data_change=change, key=key))
    return encode(actions)


def _upgrade_actions(shape: TableShape, record: CompletedInstant, view: DataView,
                     body: Callable[[DvRef], bytes]) -> list[dict[str, Any]]:
    """The upgrade's version: the schema and every live data file, each with the vector the upgrade gave it."""
    schema = _schema_after(record, view)
    columns = _partition_columns(record, view, schema)
    out: list[dict[str, Any]] = []
    if schema is not None:
        out.append(_current_metadata(shape, view, schema, columns, None))
    vectors = {dv.path: dv for dv in record.deletion_vectors}
    dv_files = {f.path: f for f in record.dv_files}
    key = _key(record, view, schema)
    for live in sorted(view.live(), key=lambda e: e.record.path):
        f = live.record
        ref = DvRef(vectors[f.path], dv_files[vectors[f.path].dv_file]) if f.path in vectors else view.vector_of(f.path)
        out.append(_add(f, _inline(ref, body), columns, record.completed_at_ms, data_change=True, key=key))
    return out


def adoption_protocol(existing: dict[str, Any]) -> dict[str, Any]:
    """The protocol of an adopted table once dbidx writes to it: table features (reader 3 / writer 7) with
    deletionVectors added to what it had; a legacy writer version 2 brings its implied appendOnly and invariants
    (data/delta_adopt.py refused every protocol it cannot keep)."""
    readers = set(existing.get("readerFeatures") or []) | {"deletionVectors"}
    writers = set(existing.get("writerFeatures") or []) | {"deletionVectors"}
    if existing.get("minWriterVersion", 1) >= 2 and "writerFeatures" not in existing:
        writers |= {"appendOnly", "invariants"}
    return {"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": sorted(readers),
            "writerFeatures": sorted(writers)}


def _commit_info(ms: int, operation: str, record: CompletedInstant | None) -> dict[str, Any]:
    info: dict[str, Any] = {"timestamp": ms, "operation": operation, "engineInfo": ENGINE, "isBlindAppend": False}
    if record is not None:
        info["dbidx"] = {"seq": record.seq, "instant": record.instant, "action": record.action}
    return {"commitInfo": info}


def _current_metadata(shape: TableShape, view: DataView, schema: pa.Schema | None, partition_columns: list[str],
                      configuration: dict[str, str] | None) -> dict[str, Any]:
    """The metaData action for the view's table with `schema` and `configuration` (None: the one in force). An
    adopted table keeps its id, creation time and other fields; the configuration is the recorded one once a
    change was recorded (before that, the adopted table's own: the same bytes older dbidx versions derived)."""
    delta_schema = _delta_schema(schema) if schema is not None else {"type": "struct", "fields": []}
    if configuration is None and view.delta_configuration is not None:
        configuration = view.configuration()
    if view.delta_adopted is not None:
        meta = dict(view.delta_adopted.value["metaData"])
        meta["schemaString"] = json.dumps(delta_schema, sort_keys=True, separators=(",", ":"))
        if configuration is not None:
            meta["configuration"] = dict(configuration)
        return {"metaData": meta}
    return _metadata(shape.table_id, shape.created_at_ms, delta_schema, partition_columns,
                     DEFAULT_CONFIGURATION if configuration is None else configuration)


def _metadata(table_id: str, created_at_ms: int, schema: dict[str, Any], partition_columns: list[str],
              configuration: dict[str, str]) -> dict:
    uid = f"{table_id[:8]}-{table_id[8:12]}-{table_id[12:16]}-{table_id[16:20]}-{table_id[20:32]}"
    return {"metaData": {"id": uid, "format": {"provider": "parquet", "options": {}},
                         "schemaString": json.dumps(schema, sort_keys=True, separators=(",", ":")),
                         "partitionColumns": partition_columns, "createdTime": created_at_ms,
                         "configuration": dict(configuration)}}


def _delta_schema(schema: pa.Schema) -> dict[str, Any]:
    """The Delta form of the table's data schema (delta-rs's own conversion: one mapping of types, not ours)."""
    from deltalake import Schema

    return json.loads(Schema.from_arrow(pa.schema([f.with_nullable(True) for f in schema])).to_json())


def _schema_after(record: CompletedInstant, view: DataView) -> pa.Schema | None:
    if "schema" in record.extra:
        from dbidx.data.schema import decode_schema

        return decode_schema(record.extra["schema"], f"completion {record.seq} ({record.instant})")
    return recorded_schema(view.schema)


def _layout(record: CompletedInstant, view: DataView) -> dict[str, Any]:
    value = record.extra.get("upsert") or (view.layout.value if view.layout is not None else None)
    return value if isinstance(value, dict) else {}


def _key(record: CompletedInstant, view: DataView, schema: pa.Schema | None) -> str | None:
    """The key column, when it is a string column (its min/max go into the statistics)."""
    key = _layout(record, view).get("key")
    if not isinstance(key, str) or schema is None or key not in schema.names:
        return None
    return key if pa.types.is_string(schema.field(key).type) or pa.types.is_large_string(schema.field(key).type) \
        else None


def _partition_columns(record: CompletedInstant, view: DataView, schema: pa.Schema | None) -> list[str]:
    """Hive partition columns (`dt=2025-01-15` paths) whose values readers can parse back; else none (an
    unpartitioned Delta table whose files hold the column, as an upsert writes them)."""
    columns = layout_partition_columns(_layout(record, view))
    if schema is None or not all(c in schema.names and any(t(schema.field(c).type) for t in _PARTITION_TYPES)
                                 for c in columns):
        return []
    return columns


def view_partition_columns(view: DataView) -> list[str]:
    """The Delta partition columns of the table as it stands in `view` (what its newest metaData says)."""
    value = view.layout.value if view.layout is not None else None
    columns = layout_partition_columns(value if isinstance(value, dict) else None)
    schema = recorded_schema(view.schema)
    if schema is None or not all(c in schema.names and any(t(schema.field(c).type) for t in _PARTITION_TYPES)
                                 for c in columns):
        return []
    return columns


def _partition_values(partition: str, columns: list[str]) -> dict[str, str]:
    """A file's partitionValues: one `<name>=<value>` segment per column. Kept exactly as earlier versions derived
    them (a version derived again must hold the same bytes); values holding a '/' are refused before they are written
    (tagger, delta_adopt), so the reader's layout.hive_values gives the same values."""
    values = dict(seg.split("=", 1) for seg in partition.split("/") if "=" in seg) if partition else {}
    return {c: values[c] for c in columns if c in values}


def _inline(ref: DvRef | None, body: Callable[[DvRef], bytes]) -> dict[str, Any] | None:
    """A vector as an inline Delta descriptor. Why inline and not a pointer into the DV file: deltalake's
    `DeltaTable.deletion_vectors()` (what polars reads through) stalled for minutes, at random, on tables with a
    few hundred file-backed vectors (seen here with deltalake 1.6.6 at ~770; inline ones took 0.1 s)."""
    if ref is None:
        return None
    if ref.vector.delta is not None:  # adopted with a Delta table: its log has this exact descriptor already
        return dict(ref.vector.delta)
    data = body(ref)
    return {"storageType": "i", "pathOrInlineDv": inline_form(data), "sizeInBytes": len(data),
            "cardinality": ref.vector.cardinality}


def delta_path(path: str) -> str:
    """A table-relative path as a Delta `path` (a relative URI: characters outside the unreserved set escaped): the
    spelling of every data file whose record names none (`DataFileRecord.delta_path`). Files written since
    2026-11-26 whose path holds a character delta-rs keeps as it is record delta-rs's spelling instead
    (data/files.py `delta_spelling`)."""
    return quote(path, safe="/=-_.~")


def _add(f: DataFileRecord, dv: dict[str, Any] | None, columns: list[str], ms: int, data_change: bool,
         key: str | None) -> dict[str, Any]:
    stats: dict[str, Any] = {"numRecords": f.rows}
    if key is not None and key not in columns and f.min_key is not None:
        stats.update(minValues={key: f.min_key}, maxValues={key: f.max_key}, nullCount={key: 0})
    add: dict[str, Any] = {"path": f.delta_path or delta_path(f.path),
                           "partitionValues": _partition_values(f.partition, columns),
                           "size": f.size, "modificationTime": ms, "dataChange": data_change,
                           "stats": json.dumps(stats, sort_keys=True, separators=(",", ":"))}
    if dv is not None:
        add["deletionVector"] = dv
    return {"add": add}


def _remove(f: DataFileRecord, dv: dict[str, Any] | None, columns: list[str], ms: int,
            data_change: bool) -> dict[str, Any]:
    remove: dict[str, Any] = {"path": f.delta_path or delta_path(f.path), "deletionTimestamp": ms,
                              "dataChange": data_change, "extendedFileMetadata": True,
                              "partitionValues": _partition_values(f.partition, columns), "size": f.size}
    if dv is not None:
        remove["deletionVector"] = dv
    return {"remove": remove}


# ---- the log on storage ------------------------------------------------------------------------------------
def listed_versions(io: FileIO, names: list[str] | None = None) -> list[int]:
    """Versions present in `_delta_log/` (commit JSON files; checkpoints and temp files are not versions); `names`:
    the log's listing when the caller has it already."""
    out = []
    for name in io.list_names(DELTA_LOG_DIR) if names is None else names:
        stem = name[:-5] if name.endswith(".json") else ""
        if len(stem) == 20 and stem.isdigit():
            out.append(int(stem))
    return sorted(out)


def stored_versions(io: FileIO) -> tuple[set[int], int]:
    """From one listing of `_delta_log/`: the versions whose JSON is there, and the newest Delta checkpoint's version
    (checkpoint_floor). Every version up to that one counts as stored too (the caller adds the range it needs)."""
    names = io.list_names(DELTA_LOG_DIR)
    return set(listed_versions(io, names)), checkpoint_floor(io, names)


def checkpoint_floor(io: FileIO, names: list[str] | None = None) -> int:
    """The version of the table's newest Delta checkpoint (`_delta_log/_last_checkpoint`), -1 without one. Every
    version up to it is summed up by the checkpoint, so another engine's log cleanup may have deleted their JSON;
    the checkpoint's own Parquet file must then be there (else the log is damaged). `names`: the log's listing."""
    names = io.list_names(DELTA_LOG_DIR) if names is None else names
    if "_last_checkpoint" not in names:
        return -1
    version = _pointer_version(io)
    # classic, multi-part (N.checkpoint.i.n.parquet) or V2 checkpoints
    if not any(n.startswith(f"{version:020d}.checkpoint") or n == f"{version:020d}.json" for n in names):
        raise CorruptFileError(f"{io.path(DELTA_LOG_DIR)}/_last_checkpoint names version {version}, whose "
                               "checkpoint file and JSON are both missing")
    return version


def read_checkpoint_pointer(io: FileIO) -> dict[str, Any]:
    """`_delta_log/_last_checkpoint` as its JSON object, read back: anything but an object naming a version >= 0 is a
    CorruptFileError."""
    raw = io.read_bytes(f"{DELTA_LOG_DIR}/_last_checkpoint")
    try:
        pointer = json.loads(raw)
        version = pointer["version"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptFileError(f"{io.path(DELTA_LOG_DIR)}/_last_checkpoint is not a Delta checkpoint pointer: "
                               f"{raw[:200]!r}") from exc
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise CorruptFileError(f"{io.path(DELTA_LOG_DIR)}/_last_checkpoint names version {version!r}")
    return pointer


def _pointer_version(io: FileIO) -> int:
    """The version `_delta_log/_last_checkpoint` names (read back: anything else is a CorruptFileError)."""
    return read_checkpoint_pointer(io)["version"]


def checkpoint_pointer(io: FileIO) -> int:
    """The version `_last_checkpoint` names, -1 without one: one read, no listing (how far the newest checkpoint
    lags the log, asked after every batch; `checkpoint_floor` also checks the checkpoint is there)."""
    if not io.exists(f"{DELTA_LOG_DIR}/_last_checkpoint"):
        return -1
    return _pointer_version(io)


def last_checkpoint_version(io: FileIO) -> int:
    """The version `_delta_log/_last_checkpoint` names (-1 without one), read without listing the log (what every
    commit and catch-up asks: versions up to it exist for Delta readers even when a log cleanup deleted their JSON,
    so dbidx must neither put one of them nor wait for it)."""
    version = checkpoint_pointer(io)
    if version < 0:
        return -1
    # 1. The usual case in two existence checks: a classic checkpoint file, or the version's JSON still there.
    if io.exists(f"{DELTA_LOG_DIR}/{version:020d}.checkpoint.parquet") or io.exists(version_file(version)):
        return version
    # 2. Otherwise a multi-part or V2 checkpoint, or a damaged log: the listing decides (CorruptFileError). Why not
    #    always list: this runs at every commit, and the log holds a month of versions by default.
    return checkpoint_floor(io)


def put_version(io: FileIO, version: int, data: bytes) -> bool:
    """Create version `version` if absent (True if this call wrote it); an existing version must hold exactly
    these bytes, else another writer committed to the Delta table: ForeignCommitError, nothing written."""
    if io.create_exclusive(version_file(version), data):
        return True
    existing = io.read_bytes(version_file(version))
    if existing != data:
        raise ForeignCommitError(
            f"Delta version {version} of {io.path(DELTA_LOG_DIR)} was not written by dbidx (its content differs "
            "from what dbidx's completion log derives): another engine committed to this table. dbidx refuses to "
            "write on top of it; re-index the table with `dbidx build-index` to adopt its current state")
    return False


def check_no_foreign(present: Iterable[int], latest_seq: int, io: FileIO) -> None:
    """Before a dbidx write: every Delta version above the completion log's latest seq is someone else's."""
    beyond = sorted(v for v in present if v > latest_seq)
    if beyond:
        raise ForeignCommitError(
            f"{io.path(DELTA_LOG_DIR)} has version(s) {beyond[:5]} beyond dbidx's latest completion {latest_seq}: "
            "another engine committed to this Delta table. dbidx refuses to write on top of it; re-index the "
            "table with `dbidx build-index` to adopt its current state")


class DeltaLogWriter:
    """Derives the Delta versions of the completions a writer's table view applies, and writes the missing ones."""

    def __init__(self, shape: TableShape, io: FileIO) -> None:
        self.shape = shape
        self.io = io
        # Derived versions not yet known to be on storage (an error: the version cannot be derived here, because a
        # clean removed a DV file it needs after the version was written; it must then exist).
        self.pending: dict[int, bytes | CorruptFileError] = {}
        self.written_upto = -1  # every version up to this one is known to be on storage
        self.known: set[int] = set()  # versions known on storage above that: put at the commit point, or absorbed

    def mark_written(self, seq: int) -> None:
        """The version of completion `seq` is on storage (this process put it at the commit point)."""
        self.known.add(seq)
        self.pending.pop(seq, None)

    def derive(self, record: CompletedInstant, view: DataView) -> None:
        """DataView.apply's `before` hook: remember the version of a record this writer has not seen written (an
        absorbed record's version is another engine's, on storage by definition)."""
        if record.action == ACTION_ABSORB:
            self.known.add(record.seq)
            return
        if record.seq > self.written_upto and record.seq not in self.known:
            try:
                self.pending[record.seq] = version_for(self.shape, record, view, self.body())
            except CorruptFileError as exc:  # a vector's DV file is gone: fine if the version exists (sync checks)
                self.pending[record.seq] = exc

    def sync(self, io: FileIO, latest_seq: int, records: Any, recheck: Any, offset: int = 0, first_seq: int = 0,
             in_memory: Callable[[int], CompletedInstant | None] = lambda _seq: None) -> int:
        """Write every missing version up to `latest_seq` (put-if-absent, compared if present) and refuse a version
        beyond it that no dbidx completion explains (`recheck()` refreshes the completion log and returns its latest
        seq: a dbidx writer may have published and written meanwhile). The first call of a process lists the log;
        later ones write what they derived and look for the one next version only. `records()` gives the whole
        completion log when a missing version was not derived here (a crash, a new process): the log is then folded
        from its first record. Completion s has Delta version s + offset from s = first_seq on (an adopted Delta
        table: DataView.delta_offset); before it, the versions are the adopted table's own. Returns the number of
        versions this call wrote."""
        # 1. What is on storage: listed once per process, then known from what this process wrote.
        if self.written_upto < 0:
            versions, floor = stored_versions(io)
            # Versions up to a Delta checkpoint may have been expired (Delta's log cleanup): they count as present.
            if first_seq == 0 and not (floor > 0 and 0 not in versions):
                self._check_own_origin(io, versions)
            versions |= set(range(floor + 1))
            present = {v - offset for v in versions if v - offset >= first_seq}
            self._check_newest_own(io, present, latest_seq, in_memory, offset)
        else:
            present = set(range(first_seq, self.written_upto + 1)) | self.known
        # 2. Versions above the latest completion are absorbed (or published from their staged record) by the
        #    table's catch-up before and after this call, never refused here.
        # 3. Versions neither on storage nor derived here are derived from the whole log; then all are written.
        wanted = [v for v in range(first_seq, latest_seq + 1) if v not in present or v in self.pending]
        missing = {v for v in wanted if v not in self.pending}
        if missing:
            self._fold_all(records(), missing)
        written = 0
        for v in wanted:
            data = self.pending.get(v)
            if isinstance(data, CorruptFileError):
                # Written by the process that published it, before a clean removed its DV files: a record is only
                # published once its version exists, so a version this process cannot derive must be there.
                if v in present or io.exists(version_file(v + offset)):
                    continue
                raise CorruptFileError(f"Delta version {v + offset} of {io.path(DELTA_LOG_DIR)} is missing and "
                                       f"cannot be derived again: {data}") from data
            if data is not None:
                written += put_version(io, v + offset, data)
        self.pending = {v: d for v, d in self.pending.items() if v > latest_seq}
        self.written_upto = latest_seq
        self.known = {v for v in self.known if v > latest_seq}
        return written

    def _check_own_origin(self, io: FileIO, versions: set[int]) -> None:
        """A table dbidx created starts its Delta log with its own version 0; any other log is a Delta table that
        must be adopted (build-index) before dbidx writes a version into it."""
        if not versions:
            return
        if 0 in versions and io.read_bytes(version_file(0)) == initial_version(self.shape.table_id,
                                                                              self.shape.created_at_ms):
            return
        raise ForeignCommitError(
            f"{io.path(DELTA_LOG_DIR)} is the log of a Delta table dbidx has not adopted (its first version is not "
            "this dbidx table's): dbidx refuses to write into it. Adopt the table with `dbidx build-index URI "
            "--key COLUMN` (it indexes the table's current files, deletion vectors honoured)")

    def _check_newest_own(self, io: FileIO, present: set[int], latest_seq: int,
                          in_memory: Callable[[int], CompletedInstant | None], offset: int) -> None:
        """The newest version a completion has, when this process did not derive it: its commitInfo must name that
        completion's instant. Another engine that took a version in the instant between dbidx's last check and its
        publish left exactly that version foreign; every later writer refuses here. Skipped when the completion is
        only in the timeline's checkpoint (the publisher, which checked its version, wrote that checkpoint after it)
        or its JSON went with a Delta log cleanup."""
        newest = max((v for v in present if 0 < v <= latest_seq and v not in self.pending), default=None)
        mine = None if newest is None else in_memory(newest)
        if mine is None or mine.action == ACTION_ABSORB or not io.exists(version_file(newest + offset)):
            return
        first_line = io.read_bytes(version_file(newest + offset)).split(b"\n", 1)[0]
        try:
            info = json.loads(first_line)["commitInfo"]["dbidx"]
        except (ValueError, KeyError, TypeError):
            info = None
        if not isinstance(info, dict) or info.get("instant") != mine.instant \
                or info.get("seq") != newest:
            raise ForeignCommitError(
                f"Delta version {newest + offset} of {io.path(DELTA_LOG_DIR)} was not written by dbidx (it does not "
                f"name completion {newest}, the one it belongs to): another engine committed to this table. dbidx "
                "refuses to write on top of it; re-index the table with `dbidx build-index` to adopt its current "
                "state")

    def body(self) -> Callable[[DvRef], bytes]:
        """Vector bytes from their DV files (verified), each file read once per derivation."""
        files: dict[str, bytes] = {}
        return lambda ref: load_vector_bytes(self.io, ref, files)

    def _fold_all(self, records: list[CompletedInstant], missing: set[int]) -> None:
        """Derive the missing versions by replaying the whole completion log into a fresh view."""
        if 0 in missing:
            self.pending[0] = initial_version(self.shape.table_id, self.shape.created_at_ms)
        view, body = DataView(), self.body()

        def keep(rec: CompletedInstant, before: DataView) -> None:
            if rec.seq in missing:
                self.pending[rec.seq] = version_for(self.shape, rec, before, body)

        view.apply(records, before=keep)


def delta_checkpoint(io: FileIO) -> bool:
    """A Delta checkpoint of the latest version (delta-rs writes it: Delta's own Parquet checkpoint format), so a Delta
    reader opens the table from it instead of replaying every version's JSON. Local tables and object stores named
    by URI (delta-rs gets the table's storage options); False for a table on an injected pyarrow filesystem, which
    delta-rs cannot reach."""
    from deltalake import DeltaTable

    if not io.is_local and "://" not in io.uri:
        return False
    DeltaTable(io.path("") if io.is_local else io.uri, storage_options=io.storage_options or None).create_checkpoint()
    return True
