"""Migration (docs/FORMAT.md section 9a, migrated data): build the record-level index of an existing Parquet data set.

The data set is a plain directory of Parquet files, hive-partitioned (`dt=2025-01-15/part-...parquet`) or flat, as
Spark or pyarrow write it. Each data file becomes one file group, named by its whole file name; its partition path
is its directory relative to the table root. The files become the table's first data by reference (not copied):
the `build_index` instant lists each with its size and checksum, and records the data schema (the files' columns
plus hive partition columns, which read as strings) and the key column, so `read_table` returns their rows and
later upserts update and delete them. One instant: a failed build leaves nothing behind.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dbidx.data.delta_actions import read_version
from dbidx.data.delta_adopt import is_foreign_delta_table, read_snapshot
from dbidx.data.delta_domains import (
    CLUSTERING_DOMAIN,
    check_clustering,
    clustering_columns,
    domains_at,
    logical_columns,
)
from dbidx.data.delta_log import DELTA_LOG_DIR, read_stamp, version_file
from dbidx.data.delta_derive import delta_path, initial_version
from dbidx.data.schema import check_distinct_names, encode_schema
from dbidx.data.source_files import PARQUET_SUFFIX, SourceFile, file_group_of, read_source  # noqa: F401

# (file_group_of is imported from here too: its home before data/source_files.py)
from dbidx.data.superseded import write_vectors
from dbidx.errors import (
    ConflictError,
    CorruptFileError,
    DuplicateKeyError,
    ForeignCommitError,
    InvalidInputError,
    SchemaError,
)
from dbidx.table.facade import Table
from dbidx.table.writer import CommitWriter
from dbidx.progress import Progress, Steps
from dbidx.storage import layout
from dbidx.storage.data_view import (
    ADOPTED_HIGH_WATER_MARK,
    DELTA_ADOPTED_EXTRA,
    LAYOUT_EXTRA,
    SCHEMA_STRING_EXTRA,
    SCHEMA_EXTRA,
)
from dbidx.storage.commit_stamps import STAMP_EXTRA, stamps_on
from dbidx.storage.row_ids import ROW_TRACKING_DOMAIN, high_water_mark_of
from dbidx.storage.records import ACTION_BUILD_INDEX, CompletedInstant, DataFileRecord


@dataclass(frozen=True)
class BuildIndexResult:
    """Summary of an index build."""

    instant: str
    files: int
    partitions: int
    keys: int
    record: CompletedInstant


def list_data_files(table: Table) -> dict[str, list[str]]:
    """Data files per partition path (relative dirs), skipping hidden/underscore entries and the metadata folder."""
    by_partition: dict[str, list[str]] = {}
    for rel, _size in table.io.list_files_recursive(""):
        parts = rel.split("/")
        if any(p.startswith((".", "_")) for p in parts) or not parts[-1].endswith(PARQUET_SUFFIX):
            continue
        by_partition.setdefault("/".join(parts[:-1]), []).append(rel)
    return by_partition


def _check_partition_columns(partition: str, columns: Sequence[str], where: str) -> None:
    """Every data directory must be `col1=v1/col2=v2...` for the declared partition columns, in order."""
    segments = partition.split("/") if partition else []
    names = [s.split("=", 1)[0] if "=" in s else None for s in segments]
    if names != list(columns):
        raise InvalidInputError(
            f"data file {where} is under {partition or '(the root)'!r}, which is not a hive path of the partition "
            f"columns {list(columns)} (expected {'/'.join(c + '=...' for c in columns)})"
        )


def _read_source(table: Table, rel: str, partition: str, key_column: str) -> SourceFile:
    """A migrated file, read once (data/source_files.py): its record, keys and schema."""
    return read_source(table.io, rel, partition, key_column)


_ESCAPED = re.compile(r"%[0-9A-Fa-f]{2}")


def _check_source(schema: pa.Schema, partition: str, where: str) -> None:
    """What would make a migrated file's rows read wrong: dbidx's own column names, percent-escaped directories."""
    own = [n for n in schema.names if n.startswith("_dbidx_")]
    if own:
        raise SchemaError(
            f"data file {where} has column(s) {own} in dbidx's own `_dbidx_` namespace; data files "
            "use such names for the writing instant and the delete flag (is this a directory dbidx "
            "wrote? build-index only migrates other data); rename them first"
        )
    if _ESCAPED.search(partition):
        raise InvalidInputError(
            f"data file {where} is under {partition!r}, a percent-escaped directory name (as "
            "Spark and pyarrow write values with special characters): upserts name partitions by "
            "their raw values, so the same record would live in two partitions; rewrite the data "
            "set with values that need no escaping"
        )


def _with_partition_columns(schema: pa.Schema, partition: str) -> pa.Schema:
    """A migrated file's columns plus the hive partition columns only its directory names (read as strings)."""
    names = [seg.split("=", 1)[0] for seg in (partition.split("/") if partition else []) if "=" in seg]
    return pa.schema(list(schema) + [pa.field(n, pa.string()) for n in names if n not in schema.names])


def _unify(schema: pa.Schema | None, incoming: pa.Schema, where: str) -> pa.Schema:
    """The table schema over all migrated files: the union of their columns, each with one type."""
    if schema is None:
        return incoming
    for field_ in incoming:
        if field_.name in schema.names and schema.field(field_.name).type != field_.type:
            raise SchemaError(
                f"data file {where}: column {field_.name!r} is {field_.type}, while earlier files "
                f"have {schema.field(field_.name).type}; the table needs one type per column"
            )
    return pa.schema(list(schema) + [f for f in incoming if f.name not in schema.names])


def _check_column_names(table: Table, by_partition: dict[str, list[str]]) -> None:
    """Before the build's instant starts (a refusal leaves no completion and no Delta version behind): no two
    columns of the data set, hive partition columns included, whose names differ only in case (Delta readers
    resolve names case-insensitively, and the build's Delta version could not be written). Reads each file's
    Parquet footer only; the build reads every file whole afterwards."""
    seen: dict[str, tuple[str, str]] = {}  # lower-cased name -> (the name, the first file that has it)
    for partition, rels in sorted(by_partition.items()):
        for rel in rels:
            where = table.io.path(rel)
            try:
                with table.io.open_input_file(rel) as handle:
                    schema = pq.ParquetFile(handle).schema_arrow
            except (pa.ArrowException, OSError) as exc:
                raise CorruptFileError(f"data file {where} is unreadable: {exc}") from exc
            columns = _with_partition_columns(schema, partition)
            check_distinct_names(columns, f"data file {where}")
            for name in columns.names:
                other, first = seen.setdefault(name.lower(), (name, where))
                if other != name:
                    raise SchemaError(
                        f"data file {where} has column {name!r} and data file {first} has {other!r}: "
                        "names that differ only in case, which Delta readers resolve as one column; "
                        "rename one of them"
                    )


def _reject_duplicates(keys: pa.Array, file_ids: np.ndarray, files: list[str], scope: str) -> None:
    """Name the first key found in two data files (or twice in one)."""
    order = pc.sort_indices(keys)
    sorted_keys = keys.take(order)
    if len(sorted_keys) < 2:
        return
    same = pc.equal(sorted_keys[1:], sorted_keys[:-1])
    if pc.any(same).as_py():
        i = pc.index(same, True).as_py()
        a, b = file_ids[order[i].as_py()], file_ids[order[i + 1].as_py()]
        raise DuplicateKeyError(
            f"key {sorted_keys[i].as_py()!r} occurs twice in {scope}: in {files[a]} and {files[b]}; the index "
            "needs one location per key (deduplicate the data first)"
        )


def build_index(
    table: Table,
    key_column: str,
    partition_columns: Sequence[str] | None = None,
    progress: Progress | None = None,
) -> BuildIndexResult:
    """Index every record key of the Parquet files under the table root, as one `build_index` instant; a Delta
    table there is adopted instead (its current files, deletion vectors honoured: `adopt_delta_table`)."""
    view = table.data_view()
    if view.writes:
        raise InvalidInputError(
            f"table {table.uri} already has {view.writes} committed instant(s), the last "
            f"{view.last_write}: it has an index, and build-index only initialises an index that "
            f"has no commit or build_index yet. {_remedies(table, key_column)}"
        )
    if is_foreign_delta_table(table.io, initial_version(table.props.table_id, table.props.created_at_ms or 0)):
        return adopt_delta_table(table, key_column, partition_columns, progress)
    by_partition = list_data_files(table)
    total = sum(len(v) for v in by_partition.values())
    if total == 0:
        raise InvalidInputError(f"no Parquet data files found under {table.uri}")
    _check_column_names(table, by_partition)
    keys_total = 0
    steps = Steps(progress, total)
    all_keys: list[pa.Array] = []
    all_ids: list[np.ndarray] = []
    files: list[str] = []
    records: list[DataFileRecord] = []
    schema: pa.Schema | None = None
    with _first_index_writer(table, key_column) as writer:
        for partition in sorted(by_partition):
            # 1. Validate the partition path and read each file's keys; one file = one file group.
            layout.validate_partition(partition)
            if partition_columns:
                _check_partition_columns(partition, partition_columns, table.io.path(by_partition[partition][0]))
            part_keys, part_ids = [], []
            for rel in by_partition[partition]:
                source = _read_source(table, rel, partition, key_column)
                _check_source(source.schema, partition, table.io.path(rel))
                keys = source.keys
                files.append(table.io.path(rel))
                part_keys.append(keys)
                part_ids.append(np.full(len(keys), len(files) - 1, dtype=np.int64))
                writer.insert(partition, keys, source.record.file_group)
                records.append(source.record)  # the file itself becomes table data, by reference
                schema = _unify(schema, _with_partition_columns(source.schema, partition), files[-1])
                keys_total += len(keys)
                steps.step(f"{partition or '(root)'} {rel.rsplit('/', 1)[-1]}", len(keys))
            # 2. Keys must be unique per partition (or table-wide in global mode, checked below).
            if table.global_index:
                all_keys += part_keys
                all_ids += part_ids
            else:
                _reject_duplicates(
                    pa.concat_arrays(part_keys), np.concatenate(part_ids), files, f"partition {partition!r}"
                )
        if table.global_index:
            _reject_duplicates(pa.concat_arrays(all_keys), np.concatenate(all_ids), files, "the table")
        # 3. The files are the table's first data (read_table returns them; upserts update their records), with
        #    their schema and the key column recorded as an upsert records them.
        writer.add_written([], records, {}, [])
        writer.extra["source_files"] = total
        writer.extra[LAYOUT_EXTRA] = {"key": key_column, "partition_columns": list(partition_columns or [])}
        if schema is not None:
            writer.extra[SCHEMA_EXTRA] = encode_schema(pa.schema([f.with_nullable(True) for f in schema]))
    record = writer.record
    assert record is not None
    return BuildIndexResult(writer.instant, total, len(by_partition), keys_total, record)


def adopt_delta_table(
    table: Table, key_column: str, partition_columns: Sequence[str] | None = None, progress: Progress | None = None
) -> BuildIndexResult:
    """Index the current files of the Delta table at the table root (rows its deletion vectors delete are not
    indexed, and the vectors become the files' vectors in dbidx), as one `build_index` instant whose Delta version
    is the next one of the adopted log: it adds deletionVectors to the protocol and nothing else. From then on
    every dbidx completion is one Delta version (docs/FORMAT.md section 12b)."""
    # 1. The snapshot, checked (protocol, paths, vectors against delta-rs), and the caller's layout against it.
    snapshot = read_snapshot(table.io)
    if partition_columns and list(partition_columns) != snapshot.partition_columns:
        raise InvalidInputError(
            f"--partition-col {list(partition_columns)} differs from the Delta table's partition "
            f"columns {snapshot.partition_columns}"
        )
    if key_column not in snapshot.schema.names or key_column in snapshot.partition_columns:
        raise InvalidInputError(
            f"the Delta table at {table.uri} has no data column {key_column!r} to use as the "
            f"record key (columns: {snapshot.schema.names})"
        )
    features = snapshot.protocol.get("writerFeatures") or []
    where = f"{table.io.path(DELTA_LOG_DIR)} at version {snapshot.version}"
    origins: dict[str, str] = {}  # each domain's file, to name a damaged one
    domains = domains_at(table.io, snapshot.version, origins) if {"clustering", "rowTracking"} & set(features) else {}
    if "clustering" in features:
        columns = logical_columns(
            clustering_columns(domains, origins.get(CLUSTERING_DOMAIN, where)), table.io.column_names
        )
        check_clustering(columns, key_column, snapshot.schema, where)
    adopted_marks = {}
    if ROW_TRACKING_DOMAIN in domains:
        mark = high_water_mark_of(domains[ROW_TRACKING_DOMAIN], origins.get(ROW_TRACKING_DOMAIN, where))
        adopted_marks[ADOPTED_HIGH_WATER_MARK] = mark
    if not snapshot.files:
        raise InvalidInputError(f"the Delta table at {table.uri} has no data files at version {snapshot.version}")
    records, vectors, descriptors = [], {}, {}
    keys_by_scope: dict[str, tuple[list[pa.Array], list[np.ndarray]]] = {}
    files: list[str] = []
    steps = Steps(progress, len(snapshot.files))
    table.adopting_delta = True  # no Delta version is written before this instant publishes its own

    # At publish, whether or not other completions landed meanwhile (a commit check runs only then): another
    # engine's commit after the snapshot refuses the adoption, nothing published.
    def no_newer(record: CompletedInstant) -> None:
        if record.action == ACTION_BUILD_INDEX:  # not its rollback: that one must publish
            _no_newer_version(table, snapshot.version, record.instant, key_column)

    table.timeline.before_publish.append(no_newer)
    try:
        with _first_index_writer(table, key_column) as writer:
            for f in snapshot.files:
                # 2. Each file's keys (its bytes checksummed, as every data file), minus its deleted rows.
                source = _read_source(table, f.path, f.partition, key_column)
                if source.record.size != f.size:
                    raise CorruptFileError(
                        f"data file {table.io.path(f.path)} has {source.record.size} bytes, its "
                        f"Delta `add` says {f.size}"
                    )
                keys = source.keys
                if f.deleted is not None and len(f.deleted):
                    if f.deleted.max() >= len(keys):
                        raise CorruptFileError(
                            f"the deletion vector of {table.io.path(f.path)} deletes row "
                            f"{f.deleted.max()}, but the file has {len(keys)} rows"
                        )
                    keep = np.ones(len(keys), dtype=bool)
                    keep[np.asarray(f.deleted.to_array(), dtype=np.int64)] = False
                    keys = keys.filter(pa.array(keep))
                    vectors[f.path], descriptors[f.path] = f.deleted, f.dv
                writer.insert(f.partition, keys, source.record.file_group)
                spelled = None if f.raw_path == delta_path(f.path) else f.raw_path
                records.append(
                    replace(
                        source.record,
                        delta_path=spelled,
                        base_row_id=f.base_row_id,
                        row_commit_version=f.row_commit_version,
                    )
                )
                files.append(table.io.path(f.path))
                scope = "" if table.global_index else f.partition
                keys_by_scope.setdefault(scope, ([], []))[0].append(keys)
                keys_by_scope[scope][1].append(np.full(len(keys), len(files) - 1, dtype=np.int64))
                steps.step(f"{f.partition or '(root)'} {f.path.rsplit('/', 1)[-1]}", len(keys))
            # 3. One live row per key (per partition, or table-wide in global mode).
            for scope, (part_keys, part_ids) in sorted(keys_by_scope.items()):
                _reject_duplicates(
                    pa.concat_arrays(part_keys),
                    np.concatenate(part_ids),
                    files,
                    "the table" if table.global_index else f"partition {scope!r}",
                )
            # 4. The files, their vectors (copied into a DV file of dbidx's, each remembering the descriptor the
            #    Delta log has for it), the schema, layout and the adopted table's identity.
            writer.add_written([], records, {}, [])
            dv_files, dv_records = write_vectors(table.io, writer.instant, vectors)
            writer.adopted_vectors = (dv_files, tuple(replace(v, delta=descriptors[v.path]) for v in dv_records))
            writer.extra["source_files"] = len(records)
            writer.extra[LAYOUT_EXTRA] = {"key": key_column, "partition_columns": snapshot.partition_columns}
            writer.extra[SCHEMA_EXTRA] = encode_schema(pa.schema([f.with_nullable(True) for f in snapshot.schema]))
            if isinstance(snapshot.metadata.get("schemaString"), str) and snapshot.metadata["schemaString"]:
                writer.extra[SCHEMA_STRING_EXTRA] = snapshot.metadata["schemaString"]
            stamp = read_stamp(table.io, snapshot.version)  # dbidx's first stamp must exceed it
            if stamp is not None:
                writer.extra[STAMP_EXTRA] = stamp
            elif stamps_on(snapshot.metadata.get("configuration") or {}):
                raise CorruptFileError(
                    f"Delta version {snapshot.version} ({table.io.path(version_file(snapshot.version))}) of a table "
                    "whose commits carry in-commit timestamps has no valid inCommitTimestamp; nothing was written"
                )
            writer.extra[DELTA_ADOPTED_EXTRA] = {
                "version": snapshot.version,
                "metaData": snapshot.metadata,
                "protocol": snapshot.protocol,
            } | adopted_marks
    finally:
        table.adopting_delta = False
        table.timeline.before_publish.remove(no_newer)
    record = writer.record
    assert record is not None
    return BuildIndexResult(
        writer.instant,
        len(records),
        len({f.partition for f in records}),
        sum(len(k) for ks, _i in keys_by_scope.values() for k in ks),
        record,
    )


def _remedies(table: Table, key_column: str) -> str:
    """What to run on a table that has an index already, instead of building one."""
    return (
        f"To bring that index up to the commits other engines made to its Delta table, run `dbidx sync "
        f"{table.uri}`; to rebuild the index from the Delta table as it is now (the old index folder is moved "
        f"aside), run `dbidx build-index {table.uri} --key {key_column} --readopt`"
    )


def _indexed_meanwhile(table: Table, key_column: str, instant: str) -> ConflictError | None:
    """The refusal of a build whose table got an index while it ran (another build-index, an upsert, another
    engine's commit, absorbed), or None if the table still has no write."""
    view = table.data_view()
    if not view.writes:
        return None
    return ConflictError(
        f"build-index instant {instant} of {table.uri} lost the race for the table's first index: "
        f"{view.writes} other instant(s) committed while it ran (the last {view.last_write}), and "
        "build-index only initialises an index that has no commit or build_index yet. Nothing of "
        f"this build was published. {_remedies(table, key_column)}"
    )


@contextmanager
def _first_index_writer(table: Table, key_column: str) -> Iterator[CommitWriter]:
    """The CommitWriter of a build, made to publish only while the table still has no write.

    Why: build-index checks that the table has no write before its instant starts, but an upsert, another
    build-index or another engine's commit (absorbed) can complete between that check and the publish, and both
    would succeed: two first indexes, or a build that never saw the commits beside it. Exactly one may win."""
    writer = CommitWriter(table, ACTION_BUILD_INDEX)
    refused: list[ConflictError] = []

    def still_empty(_news: list[CompletedInstant]) -> None:
        refusal = _indexed_meanwhile(table, key_column, writer.instant)
        if refusal is not None:
            refused.append(refusal)
            raise refusal

    try:
        with writer:
            # 1. Checked again against the table as of the instant's start: what completed between the first check
            #    and the start is in no publish check's news.
            still_empty([])
            # 2. A publish check over what completed since the start: it runs on every pass of the publish loop,
            #    right before the record is created exclusively, so nothing of a losing build is published.
            writer.checks.append(still_empty)
            yield writer
    except ConflictError as exc:
        # 3. A conflict on the build's keys (that check runs before ours) means another writer indexed them
        #    meanwhile: the same refusal, naming the remedies instead of "re-tag the batch and retry" (a
        #    build-index run again is refused anyway).
        refusal = None if any(exc is r for r in refused) else _indexed_meanwhile(table, key_column, writer.instant)
        if refusal is None:
            raise
        raise refusal from exc
    # 4. Committed: what the build wrote and its record does not list (a lost publish pass's DV file) goes.
    writer.finish()


def _no_newer_version(table: Table, version: int, instant: str, key_column: str) -> None:
    """At publish: the adopted version is still the Delta table's latest (else another engine committed after the
    snapshot was read, and indexing it would miss that commit, or another build-index adopted the table first)."""
    # 1. Still the latest: the adoption may take the next version.
    if not table.io.exists(version_file(version + 1)):
        return
    # 2. The next version is another build-index's adoption, whose writer may not have published its record yet
    #    (it puts the version first): published from its staged copy here, as any reader that meets such a version
    #    does. Why: this build is rolled back next, and a rollback during an adoption writes no Delta version, so
    #    it would otherwise take that record's seq (or fail on it) instead of following it.
    try:
        table._staged_of(read_version(table.io, version + 1), table.timeline.latest_seq + 1)
    except CorruptFileError:
        if _indexed_meanwhile(table, key_column, instant) is None:
            raise  # not a staged copy that its writer removed once it had published: real damage
    refusal = _indexed_meanwhile(table, key_column, instant)
    if refusal is not None:
        raise refusal
    # 3. Another engine's commit: the snapshot is out of date.
    raise ForeignCommitError(
        f"another engine committed Delta version {version + 1} to {table.uri} while it was "
        "being adopted; nothing was published: run build-index again"
    )
