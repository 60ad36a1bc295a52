"""ShardTagger: tag one shard's rows against its open cache (location, insert/update, old location, new bucket).

No pyspark here: the tagger works on Arrow tables, so the same code runs in `mapInArrow`, in `mapPartitions` and in
plain-Python tests. A task creates one tagger per shard it serves and feeds it every Arrow batch of the task; the
tagger remembers the buckets it gave to new keys, so a key repeated across batches of one task gets one location.
Repeats within a batch are collapsed before tagging (latest_per_key, in spark_integration/dedupe.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbidx.arrays import one_chunk
from dbidx.buckets.assigner import BucketSpec, DynamicBucketAssigner
from dbidx.cache.codec import split_global_location
from dbidx.cache.record_cache import GLOBAL_PARTITION, RecordIndexCache
from dbidx.config import CacheConfig
from dbidx.counters import Counters
from dbidx.errors import InvalidInputError, InvalidKeyError, InvalidPartitionError
from dbidx.table.facade import Table
from dbidx.table.writer import as_key_array
from dbidx.spark_integration.grouping import runs
from dbidx.storage.keys import unfit_key_kind, unfit_key_message
from dbidx.storage.layout import validate_partition

TAG_PARTITION = "_dbidx_partition"  # partition path the row is written to (global-mode deletes: where the key lives)
TAG_FILE_GROUP = "_dbidx_file_group"  # file group the row is written to (None: delete of a key not in the index)
TAG_IS_UPDATE = "_dbidx_is_update"  # the key is in the index (update, delete or move)
TAG_OLD_PARTITION = "_dbidx_old_partition"  # where the key lives now (None for new keys)
TAG_OLD_FILE_GROUP = "_dbidx_old_file_group"
TAG_IS_DELETE = "_dbidx_is_delete"  # the row deletes the key
ROW_ID = "_dbidx_row"  # arrival order (monotonically_increasing_id), the tie-breaker of same-key rows
DEFAULT_DELETE_COLUMN = "_dbidx_delete"
TAG_FIELDS = [
    pa.field(TAG_PARTITION, pa.string()),
    pa.field(TAG_FILE_GROUP, pa.string()),
    pa.field(TAG_IS_UPDATE, pa.bool_()),
    pa.field(TAG_OLD_PARTITION, pa.string()),
    pa.field(TAG_OLD_FILE_GROUP, pa.string()),
    pa.field(TAG_IS_DELETE, pa.bool_()),
]
TAG_NAMES = frozenset(f.name for f in TAG_FIELDS)


@dataclass(frozen=True)
class TagOptions:
    """What the rows look like and how new keys are routed; picklable (shipped to every task)."""

    key: str  # no defaults: a guessed column name that happens to exist would silently be the wrong one
    partition: str
    ordering: str | None = None  # same-key rows of a batch: highest value wins (ties: latest arrival)
    delete_column: str | None = DEFAULT_DELETE_COLUMN  # a true value deletes the key; this default is optional
    hive_style: bool = True  # partition path "dt=2025-01-15" (True) or "2025-01-15" (False)
    buckets: BucketSpec = field(default_factory=BucketSpec)
    cache: CacheConfig = field(default_factory=CacheConfig)
    # Set by the driver when no key of the batch can be in the index (an empty table, or partitions the table has
    # never had): the completion seq that was checked at. Tasks then skip the cache (bulk path, ShardTagger.tag_new).
    bulk_seq: int | None = None
    # The hive partition columns the table's layout fixes (an adopted Delta table's, build-index's declared ones;
    # driver.recorded_partition_columns), None where no layout fixes them. Every partition path must be a hive path
    # of exactly these columns (`dt=<v>/region=<v>`; "" for none): checked per distinct path in partitions_of when
    # the paths are the column's values (hive_style=False); with hive_style the driver checks the column's name.
    partition_columns: tuple[str, ...] | None = None

    def check_columns(
        self,
        names: list[str],
        where: str,
        boolean: Mapping[str, bool] | None = None,
        unfit: Mapping[str, tuple[str, str] | None] | None = None,
    ) -> None:
        """Fail early, on the driver, naming the missing column and the ones that exist.

        `boolean` (column -> is its type boolean) checks the delete column: a delete column named explicitly must
        exist (a typo would silently turn every delete into an update and store the flag as data), and whichever
        delete column is present must be boolean. The default `_dbidx_delete` may be absent (no deletes).
        `unfit` (column -> (its type's name, kind) if its type cannot be a key, else None; kinds in
        table.keys.unfit_key_kind) refuses a floating-point key column (1.0 would become the key "1", NaN the key
        "nan"), a boolean one (two records at most) and a list, struct or map one (no exact text form).
        Column names must be unique: a duplicate would make "the key column" ambiguous.
        """
        duplicated = sorted({name for name in names if names.count(name) > 1})
        if duplicated:
            raise InvalidInputError(
                f"{where} has more than one column named {', '.join(map(repr, duplicated))}; "
                "rename or drop the duplicates (a key, partition or data column must be one "
                "column)"
            )
        for role, column in (("key", self.key), ("partition", self.partition), ("ordering", self.ordering)):
            if column is not None and column not in names:
                raise InvalidInputError(f"{where} has no {role} column {column!r}; its columns are {names}")
        bad = unfit.get(self.key) if unfit is not None else None
        if bad is not None:
            raise InvalidKeyError(unfit_key_message(self.key, bad[0], bad[1], where))
        column = self.delete_column
        if column is None:
            return
        if column not in names:
            if column != DEFAULT_DELETE_COLUMN:
                raise InvalidInputError(
                    f"{where} has no delete column {column!r}; its columns are {names} (pass "
                    "delete_column=None for a batch without deletes)"
                )
            return
        if boolean is not None and not boolean.get(column, False):
            raise InvalidInputError(f"delete column {column!r} of {where} must be boolean (true deletes the key)")

    def keys_of(self, batch: pa.Table) -> pa.Array:
        """The record keys as strings (integers, decimals and dates are formatted; floats, booleans, lists,
        structs, maps, binary that is not UTF-8, nulls and empty strings are InvalidKeyErrors)."""
        column = batch.column(self.key)
        what = f"record key (column {self.key!r})"
        kind = unfit_key_kind(column.type)
        if kind is not None:
            raise InvalidKeyError(unfit_key_message(self.key, str(column.type), kind, "the batch"))
        if pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
            return as_key_array(_utf8_keys(column, what), what)
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            column = pc.cast(column, pa.string())
        return as_key_array(column, what)

    def partitions_of(self, batch: pa.Table) -> pa.Array:
        """The partition path of each row, validated once per distinct value."""
        values = self._partition_values(batch)
        if values.null_count:
            row = pc.index(pc.is_null(values), True).as_py()
            raise InvalidPartitionError(f"partition column {self.partition!r} is null at row {row} of the batch")
        self.check_layout_values(values)
        if self.hive_style:
            _refuse_hive_values(values, self.partition)
        paths = pc.binary_join_element_wise(pa.scalar(self.partition + "="), values, "") if self.hive_style else values
        for path in pc.unique(paths).to_pylist():
            validate_partition(path)
        return paths

    def _partition_values(self, batch: pa.Table) -> pa.Array:
        """The partition column as one string array."""
        column = batch.column(self.partition)
        if isinstance(column, pa.ChunkedArray):
            column = one_chunk(column)
        return pc.cast(column, pa.string())

    def check_layout_values(self, batch: pa.Table | pa.Array) -> None:
        """The partition values a table's Delta layout cannot hold: an empty hive value (Delta reads it as null) and,
        without hive_style, a path that is not a hive path of the table's recorded partition columns (with
        hive_style the driver checks the column's name once). Part of partitions_of (the tasks); a caller that holds
        the whole batch on the driver (upsert_arrow) runs it before the instant starts as well, so such a batch
        leaves no completion behind. Nulls are left to partitions_of."""
        values = batch if isinstance(batch, pa.Array) else self._partition_values(batch)
        if self.hive_style:
            _refuse_empty_values(values, self.partition)
        elif self.partition_columns is not None:
            for path in pc.unique(values).to_pylist():
                if path is not None:
                    self._check_recorded_columns(path, values)

    def _check_recorded_columns(self, path: str, paths: pa.Array) -> None:
        """A partition path must name exactly the table's recorded hive partition columns, in order: another path
        would be a partition no earlier file is in (every update of a record there an insert of a second one) and,
        in the Delta log, files whose partitionValues lack the table's partition columns."""
        segments = (
            [segment.split("=", 1) if "=" in segment else [None, ""] for segment in path.split("/")] if path else []
        )
        row = pc.index(pc.equal(paths, pa.scalar(path)), True).as_py()
        if [name for name, _value in segments] == list(self.partition_columns or ()):
            if all(value for _name, value in segments):
                return
            raise InvalidPartitionError(
                f"partition column {self.partition!r} holds the partition path {path!r} "
                f"(row {row} of the batch) with an empty value; Delta readers read an empty "
                "partition value as null"
            )
        expected = "/".join(f"{c}=<value>" for c in self.partition_columns or ()) or '"" (the table is not partitioned)'
        raise InvalidPartitionError(
            f"partition column {self.partition!r} holds the partition path {path!r} (row {row} of the batch, "
            f"hive_style=False), but the table is partitioned by {list(self.partition_columns or ())}: every path "
            f"must be {expected}"
        )

    def deletes_of(self, batch: pa.Table) -> np.ndarray:
        """Whether each row deletes its key (all False when there is no delete column)."""
        if self.delete_column is None or self.delete_column not in batch.column_names:
            return np.zeros(batch.num_rows, dtype=bool)
        column = batch.column(self.delete_column)
        if not pa.types.is_boolean(column.type):
            raise InvalidInputError(f"delete column {self.delete_column!r} must be boolean, got {column.type}")
        return pc.fill_null(column, False).to_numpy(zero_copy_only=False).astype(bool)


def _refuse_empty_values(values: pa.Array, column: str) -> None:
    """An empty value is refused as a null is: its hive path `dt=` is a partition that Delta readers read back as a
    null partition value (Delta writes an empty partition value as null), so dbidx and they would disagree."""
    empty = pc.equal(pc.binary_length(values), 0)
    if pc.any(empty).as_py():
        row = pc.index(empty, True).as_py()
        raise InvalidPartitionError(
            f'partition column {column!r} is empty ("") at row {row} of the batch; Delta '
            'readers read an empty partition value as null (pass hive_style=False with "" '
            "values for a table without partitions)"
        )


def _refuse_hive_values(values: pa.Array, column: str) -> None:
    """Values that are hive paths already (`dt=2025-01-10` in column `dt`) would become `dt=dt=2025-01-10`
    directories and Delta partition values that differ from the column: refused, with the two ways out."""
    prefixed = pc.starts_with(values, f"{column}=")
    if pc.any(prefixed).as_py():
        row = pc.index(prefixed, True).as_py()
        raise InvalidPartitionError(
            f"partition column {column!r} holds hive paths already ({values[row].as_py()!r} at row {row} of the "
            f"batch): dbidx would write {column}={values[row].as_py()}/ directories. Strip the {column + '='!r} "
            "prefix from the column, or pass hive_style=False to use the values as the partition paths"
        )
    slashed = pc.match_substring(values, "/")
    if pc.any(slashed).as_py():
        row = pc.index(slashed, True).as_py()
        raise InvalidPartitionError(
            f"partition column {column!r} holds a '/' ({values[row].as_py()!r} at row {row} of the batch): as a hive "
            f"path it would nest directories, and Delta readers that read partition values from paths (polars) "
            f"would see only its first level. Replace the '/' in the column, or pass hive_style=False to use the "
            "values as (nested) partition paths"
        )


@dataclass
class TagCounts(Counters):
    """What tagging saw in one shard: rows and their kinds."""

    input_rows: int = 0  # rows received, before repeats of a key were collapsed (upsert counts them; tag does not)
    rows: int = 0  # rows tagged: one per record key after repeats were collapsed
    inserts: int = 0
    updates: int = 0
    deletes: int = 0
    deletes_missing: int = 0  # deletes of keys that are not in the index (nothing to do)
    moves: int = 0  # global mode: existing keys that changed partition
    duplicates_dropped: int = 0


class ShardTagger:
    """Tags rows of one shard: index lookups in one batched call per partition, buckets for new keys."""

    def __init__(self, table: Table, shard: int, options: TagOptions) -> None:
        self.table = table
        self.shard = shard
        self.options = options
        self.global_mode = table.global_index
        self.assigner = options.buckets.assigner(table.props.table_id, table.num_shards, shard)
        self.counts = TagCounts()
        self._new: dict[tuple[str, str], str] = {}  # (partition path, key) -> file group given to a new key

    def partitions_needed(self, batch: pa.Table) -> list[str]:
        """Cache partitions a batch looks up (the one global partition in global mode)."""
        if self.global_mode:
            return [GLOBAL_PARTITION]
        return sorted(pc.unique(self.options.partitions_of(batch)).to_pylist())

    def tag(self, cache: RecordIndexCache, batch: pa.Table, last: bool = False) -> pa.Table:
        """The batch with the TAG_FIELDS columns appended; the cache must hold the batch's partitions ready.
        `last`: no later batch is tagged by this tagger (an upsert task tags its rows at once), so the file groups
        given to new keys need not be remembered for one (a dict entry per new key, ~5 ms per 50 k rows)."""
        n = batch.num_rows
        keys = self.options.keys_of(batch)
        parts = self.options.partitions_of(batch)
        deletes = self.options.deletes_of(batch)
        # 1. Where each key lives now: one batched lookup per partition (one in global mode).
        if self.global_mode:
            old_part, old_fg = self._lookup_global(cache, keys)
            exists = np.not_equal(old_fg, None)
            part = np.asarray(parts.to_pylist(), dtype=object)
            # 2. Existing keys keep their file group; a key whose partition changed moves (needs a bucket).
            moved = exists & ~deletes & (old_part != part)
            needs_bucket = (~exists & ~deletes) | moved
            out_part: np.ndarray | pa.Array = np.where(deletes & exists, old_part, part)
            out_fg = np.where(moved, None, old_fg)
            old_parts: np.ndarray | pa.Array = old_part
        else:
            old_fg = self._lookup_partitioned(cache, keys, parts)
            exists = np.not_equal(old_fg, None)
            # 2. A key's partition is part of its identity: every row stays in its own partition (the old one, where
            #    the key exists), existing keys keep their file group. Kept as Arrow: no Python string per row.
            moved = np.zeros(n, dtype=bool)
            needs_bucket = ~exists & ~deletes
            out_part, out_fg = parts, old_fg.copy()
            old_parts = pc.if_else(pa.array(exists), parts, pa.scalar(None, pa.string()))
        # 3. New keys (and moved ones) get a bucket of their target partition.
        if needs_bucket.any():
            rows = np.flatnonzero(needs_bucket)
            targets = part[rows] if self.global_mode else np.asarray(parts.take(pa.array(rows)).to_pylist(), object)
            self._assign(cache, keys, targets, rows, out_fg, remember=not last)
        counts = TagCounts(
            rows=n,
            inserts=int((~exists & ~deletes).sum()),
            updates=int((exists & ~deletes).sum()),
            deletes=int((exists & deletes).sum()),
            deletes_missing=int((~exists & deletes).sum()),
            moves=int(moved.sum()),
        )
        self.counts.add(counts)
        columns = [out_part, out_fg, exists, old_parts, old_fg, deletes]
        for spec, values in zip(TAG_FIELDS, columns):
            array = values.cast(spec.type) if isinstance(values, pa.Array) else pa.array(values, spec.type)
            batch = batch.append_column(spec, array)
        return batch

    def tag_new(self, batch: pa.Table) -> pa.Table:
        """Tag rows whose keys the driver knows are not in the index (TagOptions.bulk_seq): every row inserts a new
        key, a delete row deletes nothing. No cache and no per-row Python objects: the bulk path of a first load.
        Keys must be distinct per record (latest_per_key ran)."""
        n = batch.num_rows
        keys = self.options.keys_of(batch)
        parts = self.options.partitions_of(batch)
        deletes = self.options.deletes_of(batch)
        inserts = np.flatnonzero(~deletes)
        # Insert rows grouped by partition code (one stable sort, not one string comparison per partition). Each row
        # gets the integer code of its file group's name, and the string column is built once from the codes: no
        # per-partition string arrays concatenated and then gathered again (5 M rows: ~250 MB less at the task's
        # peak, and fresh memory is what a bulk task's time goes to).
        encoded = pc.dictionary_encode(parts if len(inserts) == n else parts.take(pa.array(inserts)))
        names: dict[str, int] = {}
        codes = np.full(n, -1, dtype=np.int32)
        for code, positions in runs(encoded.indices.to_numpy(zero_copy_only=False)):
            rows = inserts[positions]
            self._place(encoded.dictionary[code].as_py(), keys, rows, names, codes)
        fg = file_group_column(list(names), codes)
        self.counts.add(TagCounts(rows=n, inserts=len(inserts), deletes_missing=n - len(inserts)))
        nulls = pa.nulls(n, pa.string())
        columns = [parts, fg, pa.array(np.zeros(n, dtype=bool)), nulls, nulls, pa.array(deletes)]
        for spec, array in zip(TAG_FIELDS, columns):
            batch = batch.append_column(spec, array)
        return batch

    def _place(
        self, partition: str, keys: pa.Array, rows: np.ndarray, names: dict[str, int], codes: np.ndarray
    ) -> None:
        """File-group codes of a partition's new keys at `rows` (names: file group -> code, grown here)."""
        if isinstance(self.assigner, DynamicBucketAssigner):  # only the count matters: no copy of the keys
            start = 0
            for name, count in self.assigner.placements(partition, len(rows), {}):
                codes[rows[start : start + count]] = names.setdefault(name, len(names))
                start += count
            return
        chosen = pc.dictionary_encode(self.assigner.assign(partition, keys.take(pa.array(rows)), {}))
        local = np.array([names.setdefault(name, len(names)) for name in chosen.dictionary.to_pylist()], dtype=np.int32)
        codes[rows] = local[chosen.indices.to_numpy(zero_copy_only=False)]

    def _lookup_global(self, cache: RecordIndexCache, keys: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """(old partition, old file group) per row, from the one global partition; None where the key is not in the
        index."""
        n = len(keys)
        old_part = np.full(n, None, dtype=object)
        old_fg = np.full(n, None, dtype=object)
        for i, loc in enumerate(cache.lookup_array(GLOBAL_PARTITION, keys).tolist()):
            if loc is not None:
                old_part[i], old_fg[i] = split_global_location(loc)
        return old_part, old_fg

    def _lookup_partitioned(self, cache: RecordIndexCache, keys: pa.Array, parts: pa.Array) -> np.ndarray:
        """The old file group per row, looked up in the row's own partition; None where the key is not in it."""
        old_fg = np.full(len(keys), None, dtype=object)
        # One pass groups the rows by partition (a comparison of every row per partition was O(rows x partitions)).
        encoded = pc.dictionary_encode(parts)
        names = encoded.dictionary.to_pylist()
        for code, rows in runs(encoded.indices.to_numpy(zero_copy_only=False)):
            old_fg[rows] = cache.lookup_array(names[code], keys.take(pa.array(rows)))
        return old_fg

    def _assign(
        self,
        cache: RecordIndexCache,
        keys: pa.Array,
        sub_parts: np.ndarray,
        rows: np.ndarray,
        out_fg: np.ndarray,
        remember: bool = True,
    ) -> None:
        """Give each new (or moving) key at `rows` a file group in its target partition (`sub_parts`: one per row
        of `rows`); repeats reuse the first one (and, when `remember`, a later batch's repeats of these keys too)."""
        sub_keys = keys.take(pa.array(rows))
        # 1. Keys this tagger already placed (an earlier Arrow batch of the task) keep that file group.
        if self._new:
            prior = np.empty(len(rows), dtype=object)
            prior[:] = [self._new.get(pk) for pk in zip(sub_parts.tolist(), sub_keys.to_pylist())]
            hit = np.not_equal(prior, None)
            if hit.any():
                out_fg[rows[hit]] = prior[hit]
                rows, sub_parts = rows[~hit], sub_parts[~hit]
                sub_keys = sub_keys.filter(pa.array(~hit))
        # 2. Per partition, one bucket per distinct key (first occurrence order): repeats share a file group.
        for partition in dict.fromkeys(sub_parts.tolist()):
            mask = sub_parts == partition
            encoded = pc.dictionary_encode(sub_keys.filter(pa.array(mask)))
            distinct = encoded.dictionary
            fgs = self.assigner.assign(partition, distinct, lambda p=partition: self._fills(cache, p)).to_numpy(
                zero_copy_only=False
            )
            out_fg[rows[mask]] = fgs[encoded.indices.to_numpy(zero_copy_only=False)]
            if remember:
                self._new.update(zip(((partition, k) for k in distinct.to_pylist()), fgs.tolist()))

    def _fills(self, cache: RecordIndexCache, partition: str) -> dict[str, int]:
        """Live keys per file group of a partition (this shard's slice), as the cache holds them after catch-up."""
        if not self.global_mode:
            return cache.fills(partition)
        prefix = partition + "\x00"
        return {loc[len(prefix) :]: n for loc, n in cache.fills(GLOBAL_PARTITION).items() if loc.startswith(prefix)}


def file_group_column(names: list[str], codes: np.ndarray, limit: int = 2**31 - 1) -> pa.Array:
    """Per row, the name its code points to (null where the code is -1), as one string column. Names whose bytes
    would pass `limit` (what 32-bit string offsets hold; every later step of a task works on string columns) are an
    InvalidInputError that says what to change, before anything is written."""
    used = np.bincount(codes[codes >= 0], minlength=len(names))
    width = np.array([len(name.encode("utf-8")) for name in names], dtype=np.int64)
    total = int(used @ width)
    if total > limit:
        raise InvalidInputError(
            f"one task's {int(used.sum()):,} new rows name their file groups in {total:,} bytes, past the {limit:,} "
            "one Arrow string column holds: spread the load over more key shards (num_shards) or load it in parts"
        )
    return pa.array(names, pa.string()).take(pa.array(codes, mask=codes < 0))


def _utf8_keys(column: pa.Array | pa.ChunkedArray, what: str) -> pa.Array:
    """A binary key column as text; a value that is not valid UTF-8 is an InvalidKeyError naming its row."""
    try:
        return pc.cast(column, pa.string())
    except pa.ArrowInvalid:
        for row, value in enumerate(column.to_pylist()):
            try:
                value is None or value.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidKeyError(
                    f"{what} at row {row} ({value[:40]!r}) is not valid UTF-8 text: {exc.reason}; "
                    "binary keys must hold UTF-8 text"
                ) from exc
        raise
