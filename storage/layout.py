"""Where things live inside a table, and which partition paths and keys are acceptable.

Pure functions only: no I/O, so the layout can be unit-tested and documented in docs/FORMAT.md line by line.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from urllib.parse import quote

import xxhash

from dbidx.errors import InvalidInputError, InvalidPartitionError

META_DIR = ".dbidx"
PROPERTIES_FILE = f"{META_DIR}/table.json"
TIMELINE_DIR = f"{META_DIR}/timeline"
COMPLETED_DIR = f"{TIMELINE_DIR}/completed"
RLI_DIR = f"{META_DIR}/rli"
# Deletion-vector files: under the hidden metadata folder, so a Delta VACUUM (which skips hidden paths) never deletes
# them (the Delta log carries the vectors inline; only dbidx reads these files).
DV_DIR = f"{META_DIR}/dv"
GLOBAL_PARTITION_DIR = "_global"

# A directory name stays well under the 255-byte limit of common filesystems.
_MAX_DIR_NAME = 200
_SAFE_CHARS = "=-.,+@"
_INSTANT_RE = re.compile(r"^\d{17}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


MAX_SEGMENT_BYTES = 255  # NAME_MAX of ext4, xfs, btrfs, APFS, NTFS (in UTF-16 units there; bytes are stricter)


def validate_partition(partition: object) -> str:
    """Return the partition path if it is a safe relative path inside the table, else raise naming it.

    Rejected: non-strings, control characters (NUL, newline, tab, CR, ...), absolute paths, backslashes, `.`/`..`
    segments, empty segments and any `.dbidx` segment (the metadata folder's name). The empty string is the single
    partition of a non-partitioned table.
    """
    if not isinstance(partition, str):
        raise InvalidPartitionError(f"partition path must be a string, got {type(partition).__name__}: {partition!r}")
    if partition == "":
        return partition
    control = _CONTROL.search(partition)
    if control:
        raise InvalidPartitionError(
            f"partition path {partition!r} contains the control character "
            f"{control.group(0)!r} at position {control.start()}; partition values must be "
            "printable (a newline or tab would become part of a directory name)"
        )
    if partition.startswith("/") or re.match(r"^[A-Za-z]:", partition):
        raise InvalidPartitionError(f"partition path {partition!r} is absolute; use a path relative to the table")
    if "\\" in partition:
        raise InvalidPartitionError(f"partition path {partition!r} contains a backslash; use '/' between levels")
    segments = partition.split("/")
    for segment in segments:
        if segment in ("", ".", ".."):
            raise InvalidPartitionError(
                f"partition path {partition!r} has an empty, '.' or '..' segment; it must stay inside the table"
            )
        if len(segment.encode("utf-8")) > MAX_SEGMENT_BYTES:
            raise InvalidPartitionError(
                f"partition path segment {segment[:40]!r}... is {len(segment.encode('utf-8'))} bytes long; a "
                f"directory name holds at most {MAX_SEGMENT_BYTES} bytes on common filesystems, so no file could be "
                "written there: shorten or hash the partition value before the upsert"
            )
    if META_DIR in segments:
        raise InvalidPartitionError(
            f"partition path {partition!r} has a {META_DIR!r} segment, the name of the metadata folder"
        )
    return partition


def validate_table_path(rel: object) -> str:
    """Return a table-relative file path read from metadata if it stays inside the table, else raise naming it.

    Rejected: non-strings, empty paths, control characters, absolute paths, drive letters, backslashes and empty,
    `.` or `..` segments. Every path dbidx deletes or reads because a metadata file named it goes through here.
    """
    if not isinstance(rel, str) or not rel:
        raise InvalidInputError(f"file path {rel!r} is not a non-empty string")
    if rel in _VALID_PATHS:  # a pure function of the string: a commit checks the same few hundred paths again
        return rel
    if _CONTROL.search(rel) or "\\" in rel or rel.startswith("/") or re.match(r"^[A-Za-z]:", rel):
        raise InvalidInputError(f"file path {rel!r} is not a relative path inside the table")
    if any(segment in ("", ".", "..") for segment in rel.split("/")):
        raise InvalidInputError(f"file path {rel!r} has an empty, '.' or '..' segment; it must stay inside the table")
    if len(_VALID_PATHS) >= 100_000:
        _VALID_PATHS.clear()
    _VALID_PATHS.add(rel)
    return rel


_VALID_PATHS: set[str] = set()  # paths validate_table_path accepted (bounded: cleared when full)


def validate_instant_file(rel: object, instant: str) -> str:
    """A file an instant may own (and a rollback or cleanup may delete): inside the table, named with the instant's
    id, and either an index file under `.dbidx/rli/` or a data file outside `.dbidx/`. Never the table's metadata."""
    path = validate_table_path(rel)
    name = path.rsplit("/", 1)[-1]
    if (
        name.startswith("deletion_vector_")
        and path in (name, f"{DV_DIR}/{name}")
        and name.replace("-", "")[16:33] == instant
    ):
        return path  # a DV file (Delta names it by a uuid, whose first 17 hex digits are the instant's id)
    if instant not in name or (path.startswith(META_DIR + "/") and not path.startswith(RLI_DIR + "/")):
        raise InvalidInputError(f"file path {path!r} is not a file instant {instant} can have written")
    return path


def is_instant(value: object) -> bool:
    """Whether `value` has an instant id's form (17 digits), without raising."""
    return isinstance(value, str) and bool(_INSTANT_RE.match(value))


def validate_instant(instant: object) -> str:
    """Return an instant id if it has the yyyyMMddHHmmssSSS form, else raise naming it."""
    if not isinstance(instant, str) or not _INSTANT_RE.match(instant):
        raise InvalidInputError(f"instant {instant!r} is not a 17-digit yyyyMMddHHmmssSSS id")
    return instant


def partition_dir_name(partition: str) -> str:
    """The single directory name that holds a partition's RLI files.

    Percent-encoding keeps it one path segment (`/` becomes `%2F`) and readable; names that would be too long are cut
    and suffixed with an xxh64 of the full path so distinct partitions never share a directory. Readers never parse
    this name back: commit records carry the partition string.
    """
    encoded = "p_" + quote(partition, safe=_SAFE_CHARS)
    if len(encoded) <= _MAX_DIR_NAME:
        return encoded
    digest = xxhash.xxh64_hexdigest(partition.encode("utf-8"))
    return f"{encoded[: _MAX_DIR_NAME - 18]}~{digest}"


def rli_dir(partition: str | None, shard: int) -> str:
    """Table-relative directory of one (partition, shard) file group; partition None means the global index."""
    part = GLOBAL_PARTITION_DIR if partition is None else partition_dir_name(partition)
    return f"{RLI_DIR}/{part}/{shard:04d}"


def rli_file(partition: str | None, shard: int, kind: str, instant: str, attempt: int | None = None) -> str:
    """Table-relative path of the RLI file of a kind ("delta", "base", "merged": FileRecord.kind, also the name's
    prefix) an instant writes for one (partition, shard); `attempt` names the Spark task attempt that wrote it
    (None: the first, or a writer in one process; attempts of one task must not overwrite each other's files)."""
    suffix = "" if attempt is None else f"-a{attempt}"
    return f"{rli_dir(partition, shard)}/{kind}-{instant}{suffix}.parquet"


def delta_file(partition: str | None, shard: int, instant: str, attempt: int | None = None) -> str:
    """Table-relative path of the delta file an instant writes for one (partition, shard) (rli_file)."""
    return rli_file(partition, shard, "delta", instant, attempt)


def touched_file(shard: int, instant: str, attempt: int) -> str:
    """Table-relative path of the keys an upsert task tagged in one shard, as (partition, key) rows, kept until the
    instant settles: its publish checks them against commits that completed meanwhile (never part of the index).
    Under `_touched/`, which no partition directory can be (those start `p_`)."""
    return f"{RLI_DIR}/_touched/{shard:04d}/touched-{instant}-a{attempt}.parquet"


def base_file(partition: str | None, shard: int, instant: str, attempt: int | None = None) -> str:
    """Table-relative path of the base file a compaction instant writes for one (partition, shard) (rli_file)."""
    return rli_file(partition, shard, "base", instant, attempt)


def merged_file(partition: str | None, shard: int, instant: str, attempt: int | None = None) -> str:
    """Table-relative path of the merged file a compaction instant writes for one (partition, shard) when it merges
    the group's newest files and leaves its base alone (index/compaction.py; rli_file)."""
    return rli_file(partition, shard, "merged", instant, attempt)


def requested_file(instant: str) -> str:
    """Timeline marker written when an instant starts."""
    return f"{TIMELINE_DIR}/{instant}.requested"


def inflight_file(instant: str) -> str:
    """Timeline marker listing the files an instant is about to write (its rollback plan)."""
    return f"{TIMELINE_DIR}/{instant}.inflight"


LATEST_DIR = f"{TIMELINE_DIR}/latest"
STAGED_DIR = f"{TIMELINE_DIR}/staged"  # records whose Delta version is being put (docs/FORMAT.md section 12)


def staged_file(instant: str) -> str:
    """An instant's completion record, staged before its Delta version is put (the commit point)."""
    return f"{STAGED_DIR}/{instant}.json"


WRITERS_DIR = f"{TIMELINE_DIR}/writers"  # presence files of active writers, only without an exclusive create
HEARTBEAT_DIR = f"{TIMELINE_DIR}/heartbeats"  # one file per running instant, renewed by its writer


def heartbeat_file(instant: str) -> str:
    """The heartbeat of a running instant: its writer rewrites it every few seconds (storage/heartbeat.py)."""
    return f"{HEARTBEAT_DIR}/{instant}.json"


def latest_file(seq: int) -> str:
    """The latest-seq pointer marker for seq (an empty file; the largest one present is the pointer)."""
    return f"{LATEST_DIR}/{seq:012d}"


def completed_file(seq: int) -> str:
    """The completion record with sequence number `seq` (exclusive-create gives completions a total order)."""
    return f"{COMPLETED_DIR}/{seq:012d}.json"


CHECKPOINT_DIR = f"{TIMELINE_DIR}/checkpoints"  # the folded table state at a seq (storage/checkpoint.py)
ARCHIVE_DIR = f"{TIMELINE_DIR}/archive"  # bundles of older completion records


def checkpoint_file(seq: int) -> str:
    """Path of the checkpoint of the state right after completion seq."""
    return f"{CHECKPOINT_DIR}/{seq:012d}.ckpt"


def archive_file(first: int, last: int) -> str:
    """Path of the bundle holding completion records first..last."""
    return f"{ARCHIVE_DIR}/{first:012d}-{last:012d}.arch"


def now_instant() -> int:
    """The current UTC time as a yyyyMMddHHmmssSSS integer (an instant id before formatting)."""
    now = datetime.now(tz=timezone.utc)
    return int(now.strftime("%Y%m%d%H%M%S")) * 1000 + now.microsecond // 1000


# No clock reaches year 9999: an instant id from there on is a typo or a crafted id (issue 29), and allocation (+1 on
# the largest id known) could never get back below it, so such ids are refused, reported and repaired.
FIRST_OUT_OF_RANGE = 9999 * 10**13


def instant_out_of_range(instant: str | int) -> bool:
    """True for an instant id at the end of the 17-digit range (year 9999 or beyond), where no writer's clock is."""
    return int(instant) >= FIRST_OUT_OF_RANGE


def format_instant(value: int) -> str:
    """Instant ids are 17 digits; +1 ms arithmetic on the integer form may produce e.g. ...60 seconds, still ordered."""
    return f"{value:017d}"


# ---- hive partition values ---------------------------------------------------------------------------------
def layout_partition_columns(recorded: dict | None) -> list[str]:
    """The hive partition columns a table's recorded key/partition layout names: build-index's
    `partition_columns`, or an upsert's `partition` column when its paths are `<column>=<value>`."""
    if not recorded:
        return []
    if recorded.get("partition_columns") is not None:
        return list(recorded["partition_columns"])
    if recorded.get("partition") and recorded.get("hive_style", True):
        return [recorded["partition"]]
    return []


def hive_values(partition: str, columns: list[str]) -> dict[str, str]:
    """The values of hive partition columns in a partition path. One column: everything after `<column>=` (an
    upsert's value may itself hold a `/`, making nested directories); several: one `<name>=<value>` segment each."""
    if not partition:
        return {}
    if len(columns) == 1 and partition.startswith(columns[0] + "="):
        return {columns[0]: partition[len(columns[0]) + 1 :]}
    values = dict(seg.split("=", 1) for seg in partition.split("/") if "=" in seg)
    return {c: values[c] for c in columns if c in values}
