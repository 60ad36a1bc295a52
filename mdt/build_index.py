"""Migration (F7): build the record-level index of an existing Parquet data set.

The data set is a plain directory of Parquet files, hive-partitioned (`dt=2025-01-15/part-...parquet`) or flat, as
Spark or pyarrow write it. Each data file becomes one file group; its partition path is its directory relative to
the table root. The index is written as one `build_index` instant, so a failed build leaves nothing behind.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dbidx.errors import CorruptFileError, DuplicateKeyError, InvalidInputError, InvalidKeyError
from dbidx.mdt import layout
from dbidx.mdt.table import Table
from dbidx.mdt.timeline import ACTION_BUILD_INDEX, ACTION_COMMIT, CompletedInstant
from dbidx.mdt.writer import CommitWriter, as_key_array

Progress = Callable[[int, int], None]
# dbidx's own data files are `<file group>_<instant>.parquet`; anything else is its own file group (its stem).
_OWN_DATA_FILE = re.compile(r"^(?P<fg>\d{8}-[0-9a-f]+)_\d{17}")


@dataclass(frozen=True)
class BuildIndexResult:
    """Summary of an index build."""

    instant: str
    files: int
    partitions: int
    keys: int
    record: CompletedInstant


def file_group_of(file_name: str) -> str:
    """The file group id a data file belongs to."""
    own = _OWN_DATA_FILE.match(file_name)
    return own.group("fg") if own else file_name.split(".", 1)[0]


def list_data_files(table: Table) -> dict[str, list[str]]:
    """Data files per partition path (relative dirs), skipping hidden/underscore entries and the metadata folder."""
    by_partition: dict[str, list[str]] = {}
    for rel, _size in table.io.list_files_recursive(""):
        parts = rel.split("/")
        if any(p.startswith((".", "_")) for p in parts) or not parts[-1].endswith(".parquet"):
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


def _read_keys(table: Table, rel: str, key_column: str) -> pa.Array:
    """The key column of one data file, validated."""
    try:
        handle = pq.ParquetFile(table.io.open_input_file(rel))
        if key_column not in handle.schema_arrow.names:
            raise InvalidInputError(
                f"data file {table.io.path(rel)} has no column {key_column!r} (columns: {handle.schema_arrow.names})"
            )
        keys = handle.read(columns=[key_column]).column(0)
    except (pa.ArrowException, OSError) as exc:
        raise CorruptFileError(f"data file {table.io.path(rel)} is unreadable: {exc}") from exc
    if not pa.types.is_string(keys.type) and not pa.types.is_large_string(keys.type):
        keys = pc.cast(keys, pa.string())
    try:
        return as_key_array(keys, f"key in {table.io.path(rel)}")
    except InvalidKeyError as exc:
        raise InvalidKeyError(str(exc)) from None


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
    """Index every record key of the Parquet files under the table root, as one `build_index` instant."""
    table.refresh()
    writes = [r for r in table.timeline.completed() if r.action in (ACTION_COMMIT, ACTION_BUILD_INDEX)]
    if writes:
        raise InvalidInputError(
            f"table {table.uri} already has {len(writes)} committed instant(s), the last {writes[-1].instant}; "
            "build-index only initialises an empty index"
        )
    by_partition = list_data_files(table)
    total = sum(len(v) for v in by_partition.values())
    if total == 0:
        raise InvalidInputError(f"no Parquet data files found under {table.uri}")
    done = keys_total = 0
    all_keys: list[pa.Array] = []
    all_ids: list[np.ndarray] = []
    files: list[str] = []
    with CommitWriter(table, ACTION_BUILD_INDEX) as writer:
        for partition in sorted(by_partition):
            # 1. Validate the partition path and read each file's keys; one file = one file group.
            layout.validate_partition(partition)
            if partition_columns:
                _check_partition_columns(partition, partition_columns, table.io.path(by_partition[partition][0]))
            part_keys, part_ids = [], []
            for rel in by_partition[partition]:
                keys = _read_keys(table, rel, key_column)
                files.append(table.io.path(rel))
                part_keys.append(keys)
                part_ids.append(np.full(len(keys), len(files) - 1, dtype=np.int64))
                writer.insert(partition, keys, file_group_of(rel.rsplit("/", 1)[-1]))
                keys_total += len(keys)
                done += 1
                if progress is not None:
                    progress(done, total)
            # 2. Keys must be unique per partition (or table-wide in global mode, checked below).
            if table.global_index:
                all_keys += part_keys
                all_ids += part_ids
            else:
                _reject_duplicates(pa.concat_arrays(part_keys), np.concatenate(part_ids), files,
                                   f"partition {partition!r}")
        if table.global_index:
            _reject_duplicates(pa.concat_arrays(all_keys), np.concatenate(all_ids), files, "the table")
        writer.extra["source_files"] = total
    record = table.timeline.record_of(writer.instant)
    assert record is not None
    return BuildIndexResult(writer.instant, total, len(by_partition), keys_total, record)
