"""The bytes of one Delta version of a dbidx table: the actions of completion S, derived from record S and the data
view right before it (a pure function of both: the same inputs, the same bytes). Apart from data/delta_log.py, which
says why the Delta log is derived and holds the log on storage and the writer that puts these versions: this module
is the format, that one the I/O.

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

from dbidx.data.column_mapping import column_names_of
from dbidx.data.deletion_vectors import inline_form
from dbidx.data.schema import recorded_schema
from dbidx.errors import CorruptFileError
from dbidx.storage.data_view import (
    SCHEMA_STRING_EXTRA,
    DEFAULT_CONFIGURATION,
    DELTA_ADOPTED_EXTRA,
    DELTA_CONFIGURATION_EXTRA,
    DataView,
    DvRef,
)
from dbidx.storage.commit_stamps import next_stamp, valid_stamp
from dbidx.storage.layout import layout_partition_columns
from dbidx.storage.row_ids import domain_action, row_fields
from dbidx.storage.records import (
    ACTION_ABSORB,
    ACTION_BUILD_INDEX,
    ACTION_COMMIT,
    ACTION_DATA_COMPACTION,
    ACTION_PROPERTIES,
    ACTION_UPGRADE,
    CompletedInstant,
    DataFileRecord,
)

ENGINE = "dbidx"
PROTOCOL = {
    "minReaderVersion": 3,
    "minWriterVersion": 7,
    "readerFeatures": ["deletionVectors"],
    "writerFeatures": ["deletionVectors"],
}
# A commit of no rows that gives vectors the table's form, inline or in files (table/vector_storage.py): its removes
# and adds change no row (dataChange false), and its history entry says so.
VECTORS_MOVED_EXTRA = "vectors_moved"
_OPERATIONS = {
    ACTION_COMMIT: "MERGE",
    ACTION_BUILD_INDEX: "CONVERT",
    ACTION_DATA_COMPACTION: "OPTIMIZE",
    ACTION_UPGRADE: "CONVERT",
    ACTION_PROPERTIES: "SET TBLPROPERTIES",
}
# Partition column types whose partitionValues text every reader parses back to the same value.
_PARTITION_TYPES = (
    pa.types.is_string,
    pa.types.is_large_string,
    pa.types.is_integer,
    pa.types.is_date32,
    pa.types.is_boolean,
)


def encode(actions: Iterable[dict[str, Any]]) -> bytes:
    """A version's bytes: one compact JSON action per line (deterministic: the same actions, the same bytes)."""
    return b"".join(json.dumps(a, sort_keys=True, separators=(",", ":")).encode("utf-8") + b"\n" for a in actions)


def initial_version(table_id: str, created_at_ms: int) -> bytes:
    """Version 0, written when the table is created: the protocol (deletion vectors) and an empty schema (the
    first write's version carries the real one)."""
    return encode(
        [
            _commit_info(created_at_ms, "CREATE TABLE", None),
            {"protocol": PROTOCOL},
            _metadata(table_id, created_at_ms, {"type": "struct", "fields": []}, [], DEFAULT_CONFIGURATION),
        ]
    )


@dataclass(frozen=True)
class TableShape:
    """What every version's metadata and partition values depend on: id, creation time, columns, partitioning."""

    table_id: str
    created_at_ms: int
    upgraded_at_seq: int = 0  # `dbidx upgrade` from format 3: earlier completions add no rows to the Delta log


def version_for(
    shape: TableShape,
    record: CompletedInstant,
    view: DataView,
    body: Callable[[DvRef], bytes],
) -> bytes:
    """Delta version `record.seq`: the record's effect on the rows, given the data view right before it; `body`
    gives a vector's bytes (verified), which the version carries inline if the vector's record has no descriptor.
    On a table with in-commit timestamps on, the version is stamped from the view's previous stamp
    (storage/commit_stamps.py): the same log, the same bytes."""
    if record.action == ACTION_ABSORB:
        version = record.extra.get("absorbed", {}).get("version")
        raise CorruptFileError(
            f"completion {record.seq} ({record.instant}) absorbed another engine's Delta version "
            f"{version!r}, which is missing from the log: it cannot be derived (restore "
            "`_delta_log/` from a backup)"
        )
    moving = VECTORS_MOVED_EXTRA in record.extra
    operation = "REORG" if moving else _OPERATIONS.get(record.action, "VACUUM")
    stamp = next_stamp(record.completed_at_ms, view.previous_stamp(record)) if view.stamps(record) else None
    actions: list[dict[str, Any]] = [_commit_info(record.completed_at_ms, operation, record, stamp)]
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
    vectors = {dv.path: dv for dv in record.deletion_vectors}
    touched = set(vectors) | set(record.replaced if record.action == ACTION_DATA_COMPACTION else ())
    # 0. Files whose vector the log lags behind (rows of a stale rewrite dbidx masked when it absorbed it: table/
    #    absorb.py) get the view's vector first, unless this completion removes them or gives them one itself.
    key = _key(record, view, after_schema)
    actions += _log_catch_up(view, touched, partition_columns, record.completed_at_ms, body, key)
    if record.action == ACTION_PROPERTIES:
        # The table properties change: the metaData as it stands, with the record's whole new configuration.
        configuration = record.extra.get(DELTA_CONFIGURATION_EXTRA)
        if not isinstance(configuration, dict):
            raise CorruptFileError(
                f"completion {record.seq} ({record.instant}) changes the table properties but records no configuration"
            )
        metadata = _current_metadata(shape, view, after_schema, partition_columns, configuration, record)
        return encode(_physical(actions, view) + [metadata])
    if after_schema is not None and (view.schema is None or "schema" in record.extra):
        actions.insert(1, _current_metadata(shape, view, after_schema, partition_columns, None, record))
    dv_files = {f.path: f for f in record.dv_files}
    ms = record.completed_at_ms
    # 1. Data compaction: the replaced files leave (each with the vector it had), the bases enter unchanged rows.
    for path in record.replaced if record.action == ACTION_DATA_COMPACTION else ():
        gone = view.get(path)
        if gone is None:
            raise CorruptFileError(
                f"completion {record.seq} ({record.instant}) replaces {path!r}, which is not a "
                "live data file right before it"
            )
        actions.append(_remove(gone.record, _logged(view, path, body), partition_columns, ms, data_change=False))
    new_paths = {f.path for f in record.data_files}
    # 2. Files that were live before and got a new vector: remove with the old vector, add with the new one.
    for path in sorted(set(vectors) - new_paths):
        old = view.get(path)
        if old is None:
            raise CorruptFileError(
                f"completion {record.seq} ({record.instant}) gives {path!r} a deletion vector, "
                "but it is not a live data file right before it"
            )
        new = DvRef(vectors[path], dv_files[vectors[path].dv_file])
        rows_changed = not moving
        actions.append(_remove(old.record, _logged(view, path, body), partition_columns, ms, data_change=rows_changed))
        actions.append(_add(old.record, _inline(new, body), partition_columns, ms, data_change=rows_changed, key=key))
    # 3. New files (a commit's, or a compaction's bases), each with its own vector if it has one, and fresh row ids
    #    on a table that tracks rows (storage/row_ids.py: the same values the data view records for them).
    change = record.action != ACTION_DATA_COMPACTION
    files, high_water_mark = view.row_ids_for(record)
    for f in files:
        ref = DvRef(vectors[f.path], dv_files[vectors[f.path].dv_file]) if f.path in vectors else None
        actions.append(_add(f, _inline(ref, body), partition_columns, ms, data_change=change, key=key))
    if view.tracks_rows():
        if high_water_mark > view.row_id_high_water_mark:
            actions.append(domain_action(high_water_mark))
        # Rows updated (a new vector on a live file) or copied (a compaction) get fresh ids: not preserved.
        copied = record.action == ACTION_DATA_COMPACTION or (not moving and bool(set(vectors) - new_paths))
        actions[0]["commitInfo"]["tags"] = {"delta.rowTracking.preserved": "false" if copied else "true"}
    return encode(_physical(actions, view))


def _physical(actions: list[dict[str, Any]], view: DataView) -> list[dict[str, Any]]:
    """Under column mapping by name (data/column_mapping.py), the partition values and statistics of the adds and
    removes keyed by the columns' physical names, as the protocol asks; the actions as they are otherwise."""
    names = column_names_of(view)
    if names is None:
        return actions
    out = []
    for action in actions:
        kind = "add" if "add" in action else "remove" if "remove" in action else None
        if kind is None:
            out.append(action)
            continue
        body = dict(action[kind])
        body["partitionValues"] = {names.physical(k): v for k, v in body["partitionValues"].items()}
        if "stats" in body:
            stats = json.loads(body["stats"])
            for part in ("minValues", "maxValues", "nullCount"):
                if part in stats:
                    stats[part] = {names.physical(k): v for k, v in stats[part].items()}
            body["stats"] = json.dumps(stats, sort_keys=True, separators=(",", ":"))
        out.append({kind: body})
    return out


def _logged(view: DataView, path: str, body: Callable[[DvRef], bytes]) -> dict[str, Any] | None:
    """The vector the Delta log has for live file `path` (what a `remove` of it must carry to cancel its `add`)."""
    behind, descriptor = view.log_vector(path)
    return (dict(descriptor) if descriptor is not None else None) if behind else _inline(view.vector_of(path), body)


def _log_catch_up(
    view: DataView, touched: set[str], columns: list[str], ms: int, body: Callable[[DvRef], bytes], key: str | None
) -> list[dict[str, Any]]:
    """remove + add of each live file whose vector the log lags behind (and this completion leaves alone): the add
    carries the view's vector. dataChange true: rows a Delta reader read (a stale rewrite's copies) leave."""
    out: list[dict[str, Any]] = []
    for path in view.log_behind():
        live = view.get(path)
        if path in touched or live is None:
            continue
        out.append(_remove(live.record, _logged(view, path, body), columns, ms, data_change=True))
        out.append(_add(live.record, _inline(view.vector_of(path), body), columns, ms, data_change=True, key=key))
    return out


def _upgrade_actions(
    shape: TableShape, record: CompletedInstant, view: DataView, body: Callable[[DvRef], bytes]
) -> list[dict[str, Any]]:
    """The upgrade's version: the schema and every live data file, each with the vector the upgrade gave it."""
    schema = _schema_after(record, view)
    columns = _partition_columns(record, view, schema)
    out: list[dict[str, Any]] = []
    if schema is not None:
        out.append(_current_metadata(shape, view, schema, columns, None, record))
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
    return {
        "minReaderVersion": 3,
        "minWriterVersion": 7,
        "readerFeatures": sorted(readers),
        "writerFeatures": sorted(writers),
    }


def commit_stamp(first_line: bytes) -> int | None:
    """The inCommitTimestamp of a version, from its first line (where the protocol puts commitInfo when in-commit
    timestamps are on); None when it has none. Read back as untrusted: a stamp that is not an integer is no stamp."""
    try:
        value = json.loads(first_line)["commitInfo"]["inCommitTimestamp"]
    except (ValueError, KeyError, TypeError):
        return None
    return valid_stamp(value)


def _commit_info(ms: int, operation: str, record: CompletedInstant | None, stamp: int | None = None) -> dict[str, Any]:
    info: dict[str, Any] = {"timestamp": ms, "operation": operation, "engineInfo": ENGINE, "isBlindAppend": False}
    if stamp is not None:  # Delta Spark's commits say the same time in both fields
        info["timestamp"] = info["inCommitTimestamp"] = stamp
    if record is not None:
        info["dbidx"] = {"seq": record.seq, "instant": record.instant, "action": record.action}
    return {"commitInfo": info}


def _current_metadata(
    shape: TableShape,
    view: DataView,
    schema: pa.Schema | None,
    partition_columns: list[str],
    configuration: dict[str, str] | None,
    record: CompletedInstant,
) -> dict[str, Any]:
    """The metaData action for the view's table with `schema` and `configuration` (None: the one in force). An
    adopted table keeps its id, creation time and other fields; the configuration is the recorded one once a
    change was recorded (before that, the adopted table's own: the same bytes older dbidx versions derived). The
    columns keep what the schemaString in force says of them (`_kept_fields`): the view's, else the record's own
    copy (a table adopted before dbidx recorded it: its first metaData-writing completion carries it)."""
    delta_schema = _delta_schema(schema) if schema is not None else {"type": "struct", "fields": []}
    in_force = view.delta_schema_string.value if view.delta_schema_string is not None else None
    in_force = in_force if in_force is not None else record.extra.get(SCHEMA_STRING_EXTRA)
    if isinstance(in_force, str):
        delta_schema = _kept_fields(delta_schema, in_force)
    if configuration is None and view.delta_configuration is not None:
        configuration = view.configuration()
    if view.delta_adopted is not None:
        meta = dict(view.delta_adopted.value["metaData"])
        meta["schemaString"] = json.dumps(delta_schema, sort_keys=True, separators=(",", ":"))
        if configuration is not None:
            meta["configuration"] = dict(configuration)
        return {"metaData": meta}
    return _metadata(
        shape.table_id,
        shape.created_at_ms,
        delta_schema,
        partition_columns,
        DEFAULT_CONFIGURATION if configuration is None else configuration,
    )


def _kept_fields(derived: dict[str, Any], in_force: str) -> dict[str, Any]:
    """The derived schema with each column the schemaString in force has taken from it as written (its NOT NULL,
    comment and other metadata: a writer keeps what it does not change); dbidx's new columns as derived. Why not
    the derived form alone: it knows Arrow's types and nothing else, and would drop a NOT NULL constraint (after
    which Delta Spark accepts nulls there) or a column's comment with every dbidx metaData."""
    try:
        fields = json.loads(in_force).get("fields")
    except (ValueError, AttributeError):
        fields = None
    if not isinstance(fields, list):
        return derived
    written = {f.get("name"): f for f in fields if isinstance(f, dict) and isinstance(f.get("name"), str)}
    return dict(derived, fields=[written.get(f.get("name"), f) for f in derived["fields"]])


def _metadata(
    table_id: str,
    created_at_ms: int,
    schema: dict[str, Any],
    partition_columns: list[str],
    configuration: dict[str, str],
) -> dict:
    uid = f"{table_id[:8]}-{table_id[8:12]}-{table_id[12:16]}-{table_id[16:20]}-{table_id[20:32]}"
    return {
        "metaData": {
            "id": uid,
            "format": {"provider": "parquet", "options": {}},
            "schemaString": json.dumps(schema, sort_keys=True, separators=(",", ":")),
            "partitionColumns": partition_columns,
            "createdTime": created_at_ms,
            "configuration": dict(configuration),
        }
    }


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
    return (
        key if pa.types.is_string(schema.field(key).type) or pa.types.is_large_string(schema.field(key).type) else None
    )


def _partition_columns(record: CompletedInstant, view: DataView, schema: pa.Schema | None) -> list[str]:
    """Hive partition columns (`dt=2025-01-15` paths) whose values readers can parse back; else none (an
    unpartitioned Delta table whose files hold the column, as an upsert writes them)."""
    columns = layout_partition_columns(_layout(record, view))
    if schema is None or not all(
        c in schema.names and any(t(schema.field(c).type) for t in _PARTITION_TYPES) for c in columns
    ):
        return []
    return columns


def view_partition_columns(view: DataView) -> list[str]:
    """The Delta partition columns of the table as it stands in `view` (what its newest metaData says)."""
    value = view.layout.value if view.layout is not None else None
    columns = layout_partition_columns(value if isinstance(value, dict) else None)
    schema = recorded_schema(view.schema)
    if schema is None or not all(
        c in schema.names and any(t(schema.field(c).type) for t in _PARTITION_TYPES) for c in columns
    ):
        return []
    return columns


def _partition_values(partition: str, columns: list[str]) -> dict[str, str]:
    """A file's partitionValues: one `<name>=<value>` segment per column. Kept exactly as earlier versions derived
    them (a version derived again must hold the same bytes); values holding a '/' are refused before they are written
    (tagger, delta_adopt), so the reader's layout.hive_values gives the same values."""
    values = dict(seg.split("=", 1) for seg in partition.split("/") if "=" in seg) if partition else {}
    return {c: values[c] for c in columns if c in values}


def _inline(ref: DvRef | None, body: Callable[[DvRef], bytes]) -> dict[str, Any] | None:
    """A vector as the Delta log has it: the descriptor its record carries (a pointer into dbidx's DV file on a
    table that logs its vectors in files, data/deletion_vectors.vectors_in_files; an adopted or absorbed vector's
    own), else inline (a later remove must repeat the form its add had)."""
    if ref is None:
        return None
    if ref.vector.delta is not None:  # the log has this exact descriptor already
        return dict(ref.vector.delta)
    data = body(ref)
    return {
        "storageType": "i",
        "pathOrInlineDv": inline_form(data),
        "sizeInBytes": len(data),
        "cardinality": ref.vector.cardinality,
    }


def delta_path(path: str) -> str:
    """A table-relative path as a Delta `path` (a relative URI: characters outside the unreserved set escaped): the
    spelling of every data file whose record names none (`DataFileRecord.delta_path`). Files written since
    2026-11-26 whose path holds a character delta-rs keeps as it is record delta-rs's spelling instead
    (data/files.py `delta_spelling`)."""
    return quote(path, safe="/=-_.~")


def _add(
    f: DataFileRecord, dv: dict[str, Any] | None, columns: list[str], ms: int, data_change: bool, key: str | None
) -> dict[str, Any]:
    stats: dict[str, Any] = {"numRecords": f.rows}
    if key is not None and key not in columns and f.min_key is not None:
        stats.update(minValues={key: f.min_key}, maxValues={key: f.max_key}, nullCount={key: 0})
    add: dict[str, Any] = {
        "path": f.delta_path or delta_path(f.path),
        "partitionValues": _partition_values(f.partition, columns),
        "size": f.size,
        "modificationTime": ms,
        "dataChange": data_change,
        "stats": json.dumps(stats, sort_keys=True, separators=(",", ":")),
    }
    if dv is not None:
        add["deletionVector"] = dv
    add.update(row_fields(f))
    return {"add": add}


def _remove(
    f: DataFileRecord, dv: dict[str, Any] | None, columns: list[str], ms: int, data_change: bool
) -> dict[str, Any]:
    remove: dict[str, Any] = {
        "path": f.delta_path or delta_path(f.path),
        "deletionTimestamp": ms,
        "dataChange": data_change,
        "extendedFileMetadata": True,
        "partitionValues": _partition_values(f.partition, columns),
        "size": f.size,
    }
    if dv is not None:
        remove["deletionVector"] = dv
    remove.update(row_fields(f))
    return {"remove": remove}
