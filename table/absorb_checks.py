"""What another engine's Delta version may change in a table dbidx indexes (table/absorb.py): a protocol or metaData
change dbidx can keep (checked before the absorb claims anything; new columns are recorded as the table's data
schema), and the partition values of the files it adds, which must name a dbidx partition. Kept apart from the
absorb's run, files and record, which work on what passed these checks.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pyarrow as pa

from dbidx.data.delta_actions import FileAction, VersionActions
from dbidx.data.schema import recorded_schema
from dbidx.errors import CorruptFileError, DeltaFeatureError, InvalidInputError
from dbidx.storage import layout
from dbidx.storage.column_names import ColumnNames
from dbidx.storage.data_view import DELTA_CONFIGURATION_EXTRA, SCHEMA_STRING_EXTRA, DataView, check_configuration


def _check_metadata(
    view: DataView, actions: VersionActions, columns: list[str], key: str | None, extra: dict[str, Any], where: str
) -> None:
    """A metaData change dbidx can keep (the same partition columns, the key column, every column with its type,
    deletion vectors on); new columns are recorded as the table's data schema. The protocol's features are checked
    on the whole run (`check_run_features`)."""
    meta = actions.metadata
    if meta is None:
        return
    if list(meta.get("partitionColumns") or []) != columns:
        raise DeltaFeatureError(
            f"{where} changes the partition columns from {columns} to "
            f"{meta.get('partitionColumns')}: every key's partition would change. Re-adopt the "
            "table as it is now: `dbidx build-index URI --key COLUMN --readopt`"
        )
    configuration = meta.get("configuration") or {}
    if str(configuration.get("delta.enableDeletionVectors", "true")).lower() != "true":
        raise DeltaFeatureError(
            f"{where} turns deletion vectors off (delta.enableDeletionVectors), which every "
            "dbidx upsert writes: set it back to true before dbidx writes again"
        )
    # 1. The table properties: recorded when they change (the run's newest wins), so that dbidx's own later
    #    metaData (a schema change, a properties change) carries them on instead of the ones it started with.
    configuration = check_configuration(configuration, where)
    if configuration != extra.get(DELTA_CONFIGURATION_EXTRA, view.configuration()):
        extra[DELTA_CONFIGURATION_EXTRA] = configuration
    if isinstance(meta.get("schemaString"), str) and meta["schemaString"]:
        extra[SCHEMA_STRING_EXTRA] = meta["schemaString"]  # its columns' NOT NULL and metadata stay (delta_derive)
    schema = _arrow_schema(meta, where)
    if schema is None:
        return
    if key is not None and key not in schema.names:
        raise DeltaFeatureError(f"{where} drops the key column {key!r}")
    from dbidx.data.schema import decode_schema, encode_schema, recorded_schema

    # (an earlier version of the same run may have added columns already)
    old = decode_schema(extra["schema"], where) if "schema" in extra else recorded_schema(view.schema)
    names = set(old.names) if old is not None else set()
    if old is not None and not set(n for n in names if n not in columns).issubset(schema.names):
        raise DeltaFeatureError(
            f"{where} drops column(s) {sorted(names - set(schema.names))}: dbidx's files and "
            "schema keep every column; re-adopt the table to take the new schema"
        )
    if old is not None:
        _check_types(old, str(meta["schemaString"]), key, where)
    new_fields = [f.with_nullable(True) for f in schema if f.name not in names]
    if new_fields:
        base = list(old) if old is not None else []
        extra["schema"] = encode_schema(pa.schema(base + new_fields))


def check_run_features(view: DataView, run: list[VersionActions]) -> None:
    """Every feature in use at the end of the run is one dbidx keeps when it writes (data/delta_features.py), else
    the first one is refused by name with the version that turned it on. Why the run's end: dbidx writes after the
    run, so a feature another engine turned on and off again inside it (Delta Spark's DROP FEATURE, the remedy the
    refusal names) is no obstacle, and `dbidx sync` after the remedy absorbs the whole run."""
    from dbidx.data.delta_features import LogState, check_versions, problems, refusal, since, writer_of

    protocol: dict[str, Any] = {}
    configuration, schema = view.configuration(), ""
    states = [LogState(run[0].version - 1, "", problems(protocol, configuration, schema))]
    for actions in run:
        where = f"Delta version {actions.version} ({actions.writer})"
        if actions.protocol is not None:
            protocol = actions.protocol
            check_versions(protocol, where)
        if actions.metadata is not None:
            configuration = dict(actions.metadata.get("configuration") or {})
            schema = str(actions.metadata.get("schemaString") or "")
        in_use = problems(protocol, configuration, schema)
        states.append(LogState(actions.version, writer_of(actions.commit_info), in_use))
    found = states[-1].in_use
    if not found:
        _check_run_clustering(view, run)
        return
    name = sorted(found)[0]
    state = since(states)[name]
    turned_on = (
        f"before Delta version {run[0].version} (absorbed already)"
        if state.version < run[0].version
        else f"by Delta version {state.version} ({state.writer})"
    )
    last = run[-1]
    where = f"Delta version {last.version}" if len(run) == 1 else f"Delta versions {run[0].version}-{last.version}"
    raise refusal(
        name,
        found[name],
        where,
        turned_on,
        "`dbidx sync URI` absorbs the versions (a feature turned off again by the newest of them is no obstacle); "
        "or re-adopt the table as it is then: `dbidx build-index URI --key COLUMN --readopt`",
    )


def stamp_extras(io: Any, view: DataView, run: list[VersionActions], extra: dict[str, Any]) -> dict[str, Any]:
    """The inCommitTimestamp of the run's newest version, which dbidx's next stamp must exceed (storage/
    commit_stamps.py): from its commitInfo, or from its JSON when the run ends at a checkpoint whose versions
    expired. On a table that stamps its commits, a newest version without a valid stamp is damage, named."""
    from dbidx.data.delta_log import read_stamp, version_file
    from dbidx.storage.commit_stamps import STAMP_EXTRA, stamps_on, valid_stamp

    last = run[-1]
    value = last.commit_info.get("inCommitTimestamp")
    stamp = valid_stamp(value)
    if stamp is None and last.synthetic:
        stamp = read_stamp(io, last.version)
    if stamp is not None:
        return {STAMP_EXTRA: stamp}
    if stamps_on(extra.get(DELTA_CONFIGURATION_EXTRA, view.configuration())):
        raise CorruptFileError(
            f"Delta version {last.version} ({io.path(version_file(last.version))}) of a table whose commits carry "
            "in-commit timestamps has no valid inCommitTimestamp: the log is damaged; restore the version from a "
            "backup"
        )
    return {}


def row_tracking_extras(run: list[VersionActions]) -> dict[str, Any]:
    """What the absorb record keeps of the run for row tracking (storage/row_ids.py): the protocol its newest
    protocol action set, and the row-id high-water mark its newest `delta.rowTracking` domain action left."""
    from dbidx.data.delta_log import version_file
    from dbidx.storage.row_ids import HIGH_WATER_MARK_EXTRA, PROTOCOL_EXTRA, ROW_TRACKING_DOMAIN, high_water_mark_of

    out: dict[str, Any] = {}
    for actions in run:
        if actions.protocol is not None:
            out[PROTOCOL_EXTRA] = actions.protocol
        for body in actions.domains:
            if isinstance(body, dict) and body.get("domain") == ROW_TRACKING_DOMAIN and body.get("removed") is not True:
                where = f"Delta version {actions.version} ({actions.writer}, {version_file(actions.version)})"
                out[HIGH_WATER_MARK_EXTRA] = high_water_mark_of(body.get("configuration"), where)
    return out


def _check_run_clustering(view: DataView, run: list[VersionActions]) -> None:
    """A run that clusters the table anew (a `delta.clustering` domain action, Delta Spark's CLUSTER BY) must
    cluster it by nothing dbidx cannot keep (data/delta_domains.py); the clustering at adoption was checked then."""
    from dbidx.data.delta_domains import CLUSTERING_DOMAIN, apply_domain, check_clustering, clustering_columns

    domains: dict[str, str] = {}
    last = None
    for actions in run:
        for body in actions.domains:
            if isinstance(body, dict) and body.get("domain") == CLUSTERING_DOMAIN:
                apply_domain(domains, body, f"Delta version {actions.version}")
                last = actions
    if last is None:
        return
    where = f"Delta version {last.version} ({last.writer})"
    layout = view.layout.value if view.layout is not None else None
    key = layout.get("key") if isinstance(layout, dict) else None
    from dbidx.data.column_mapping import column_names_of
    from dbidx.data.delta_domains import logical_columns

    columns = logical_columns(clustering_columns(domains, where), column_names_of(view))
    check_clustering(columns, key, recorded_schema(view.schema), where)


def _check_types(old: pa.Schema, schema_string: str, key: str | None, where: str) -> None:
    """No column changes its type (in Delta's terms, data/delta_types.py: large_string is string, nullability is no
    type). Why refused, not recorded: the index, dbidx's recorded schema and its next upsert's input all keep the old
    type, and a dbidx file of it in a column the log gives the new type breaks every Delta reader's read of the
    table. A widening Delta allows (`typeWidening`: integer to long, float to double) is refused as well for now."""
    from dbidx.data.delta_types import type_changes

    changes = type_changes(old, schema_string)
    if not changes:
        return
    listed = ", ".join(f"{name!r} from {was} to {now}" for name, was, now in changes[:10])
    more = f" (and {len(changes) - 10} more)" if len(changes) > 10 else ""
    raise DeltaFeatureError(
        f"{where} changes the type of column(s) {listed}{more}: dbidx's recorded schema, its files and its next "
        "write keep the old type, which Delta readers would then read as the new one. Every type change is refused "
        "for now, widenings included (integer to long, which Delta's `typeWidening` feature allows). Re-adopt the "
        f"table as it is now (`dbidx build-index URI --key {key or 'COLUMN'} --readopt`), then write the new type"
    )


def _arrow_schema(meta: dict[str, Any], where: str) -> pa.Schema | None:
    text = meta.get("schemaString")
    if not isinstance(text, str):
        return None
    from deltalake import Schema

    try:
        return pa.schema(Schema.from_json(text).to_arrow())
    except Exception as exc:
        raise CorruptFileError(f"{where} has a schema dbidx cannot read: {exc}") from exc


def _partition_of(action: FileAction, columns: list[str], where: str, names: ColumnNames | None = None) -> str:
    """A new file's dbidx partition from its partitionValues (`col=value`, one segment per column; keyed by physical
    name under column mapping, `names`)."""
    if names is not None:
        logical = {names.physical(c): c for c in columns}
        action = replace(action, values={logical.get(k, k): v for k, v in action.values.items()})
    extra = sorted(set(action.values) - set(columns))
    if extra:
        raise DeltaFeatureError(
            f"{where} adds {action.raw_path!r} with partition values for {extra}, which are not "
            f"the table's partition columns {columns}: the table's partitioning changed"
        )
    segments = []
    for column in columns:
        value = action.values.get(column)
        if value is None or value == "":
            raise DeltaFeatureError(
                f"{where} adds {action.raw_path!r} with a null or empty value of partition "
                f"column {column!r}; dbidx names partitions by their values"
            )
        if len(columns) > 1 and "/" in value:
            raise DeltaFeatureError(
                f"{where} adds {action.raw_path!r} with partition value {value!r}, whose '/' "
                "would split a partition path"
            )
        segments.append(f"{column}={value}")
    try:
        return layout.validate_partition("/".join(segments))
    except InvalidInputError as exc:
        raise DeltaFeatureError(f"{where} adds {action.raw_path!r} in a partition dbidx cannot name: {exc}") from exc
