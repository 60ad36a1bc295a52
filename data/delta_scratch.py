"""A private copy of the tail of a table's Delta log, for delta-rs to write a Delta checkpoint into
(data/delta_checkpoint.py publishes it).

Why a copy: delta-rs's `create_checkpoint()` writes `<version>.checkpoint.parquet` and `_last_checkpoint` into the
log of the table it opened, at once, over whatever is there. A checkpoint dbidx publishes must appear once, with
its final (slim) bytes, and never change: delta-rs and polars read a checkpoint by byte ranges, opening the file by
name again for each, so a file replaced between two of those reads fails the load ("Requested range was invalid",
"Unexpected Encoding", issue 63). Here delta-rs opens a local temporary table that holds the newest checkpoint
(classic, multi-part, or a V2 one with its sidecar files) and the JSON versions after it, read through the table's
FileIO (any store), and writes its checkpoint there; nothing under the table's `_delta_log/` is written by delta-rs.
Copying costs a read of the files delta-rs reads anyway to load the table; the JSON versions are immutable
(put-if-absent), and so is every checkpoint dbidx publishes, so the copy is the log as it is. Of a table with the
feature `v2Checkpoint`, delta-rs (1.6.6) loads a copy starting from a UUID-named checkpoint (JSON or Parquet, with
sidecars) and writes a classic-named checkpoint that follows the V2 spec (a checkpointMetadata row, every add and
remove inline, no sidecars), which the protocol allows beside a V1 one and every reader of such a table reads
(Delta Spark 4.4, deltalake, DuckDB; measured 2026-12: tests/spark_integration/test_delta_spark_v2_checkpoint.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from dbidx.data.delta_checkpoint_files import (
    Checkpoint,
    Sidecar,
    listed_checkpoints,
    pointer_checkpoint,
    sidecar_bytes,
    sidecars_of,
)
from dbidx.data.delta_log import DELTA_LOG_DIR, listed_versions, read_checkpoint_pointer, version_file
from dbidx.errors import CorruptFileError, DeltaFeatureError
from dbidx.storage.fileio import FileIO

POINTER = f"{DELTA_LOG_DIR}/_last_checkpoint"

# Versions probed one by one after `_last_checkpoint`'s before the log is listed instead (a listing costs a request
# per thousand files on an object store; a long log holds a month of versions).
PROBE_LIMIT = 200


def checkpoint_file(version: int) -> str:
    """`_delta_log/<version:020d>.checkpoint.parquet`: a classic (single-file) checkpoint."""
    return f"{DELTA_LOG_DIR}/{version:020d}.checkpoint.parquet"


@dataclass(frozen=True)
class LogTail:
    """What a Delta reader needs to load the latest version: the checkpoint it starts from and the JSON after it."""

    version: int  # the latest version in the log
    checkpoint: int  # the checkpoint's version (-1: none, the log from version 0)
    names: tuple[str, ...]  # the files under `_delta_log/` to copy: the checkpoint's, its sidecars, the JSON versions
    sidecars: tuple[Sidecar, ...] = ()  # a V2 checkpoint's sidecar files (among `names`), checked as they are copied


def log_tail(io: FileIO) -> LogTail:
    """The log's tail, found without listing the log when `_last_checkpoint` names a checkpoint (classic,
    multi-part, or UUID-named by its `v2Checkpoint.path`) whose files are there, with JSON versions after it (the
    usual case: a checkpoint is due because versions were written since the last one); else from one listing (no
    checkpoint yet, a stale pointer, or a long run of versions)."""
    try:
        named = pointer_checkpoint(read_checkpoint_pointer(io)) if io.exists(POINTER) else None
    except CorruptFileError:
        named = None  # a damaged pointer is only a hint lost: the listing decides
    if named is not None and all(io.exists(f"{DELTA_LOG_DIR}/{n}") for n in named.names):
        newer: list[int] = []
        while len(newer) < PROBE_LIMIT and io.exists(version_file(named.version + len(newer) + 1)):
            newer.append(named.version + len(newer) + 1)
        if newer and len(newer) < PROBE_LIMIT:
            return _tail(io, named, newer[-1])
    return _listed_tail(io)


def _tail(io: FileIO, checkpoint: Checkpoint | None, latest: int) -> LogTail:
    """The tail from `checkpoint` (None: from version 0) up to `latest`; a V2 checkpoint's sidecars read off it."""
    base = checkpoint.version if checkpoint is not None else -1
    own = list(checkpoint.names) if checkpoint is not None else []
    sidecars = sidecars_of(io, checkpoint) if checkpoint is not None else ()
    own += [s.path.split("/", 1)[1] for s in sidecars]
    return LogTail(latest, base, tuple(own + [f"{v:020d}.json" for v in range(base + 1, latest + 1)]), sidecars)


def _listed_tail(io: FileIO) -> LogTail:
    """The tail from one listing: the newest complete checkpoint whose every later JSON version is there."""
    names = io.list_names(DELTA_LOG_DIR)
    versions = set(listed_versions(io, names))
    checkpoints = listed_checkpoints(names)
    if not versions and not checkpoints:
        raise CorruptFileError(f"the Delta log {io.path(DELTA_LOG_DIR)} holds no version: nothing to checkpoint")
    latest = max(versions | set(checkpoints))
    for base in [*sorted(checkpoints, reverse=True), -1]:
        if base > latest or not all(v in versions for v in range(base + 1, latest + 1)):
            continue
        return _tail(io, checkpoints[base][0] if base >= 0 else None, latest)
    newest = max(checkpoints, default=-1)
    gone = [v for v in range(newest + 1, latest + 1) if v not in versions]
    raise CorruptFileError(
        f"the Delta log {io.path(DELTA_LOG_DIR)} misses version(s) {gone[:5]} after its newest checkpoint "
        f"({newest}): no Delta reader can load version {latest}, so dbidx writes no checkpoint of it"
    )


def copy_tail(io: FileIO, tail: LogTail, scratch: str) -> None:
    """The tail's files, read through the table's FileIO (checked: inside the table; a V2 checkpoint's sidecars of
    the size it names, Parquet), into `<scratch>/_delta_log/`: a local Delta table delta-rs can open. No
    `_last_checkpoint`: delta-rs lists the copy (it is short)."""
    log = os.path.join(scratch, DELTA_LOG_DIR)
    os.makedirs(log, exist_ok=True)
    sidecars = {s.path: s for s in tail.sidecars}
    for name in tail.names:
        rel = f"{DELTA_LOG_DIR}/{name}"
        if rel in sidecars:
            data = sidecar_bytes(io, sidecars[rel], io.path(f"{DELTA_LOG_DIR}/{tail.names[0]}"))
            os.makedirs(os.path.dirname(os.path.join(log, name)), exist_ok=True)
        else:
            data = io.read_buffer(rel)  # a file gone meanwhile: CorruptFileError naming it
        with open(os.path.join(log, name), "wb") as out:
            out.write(data)


def scratch_checkpoint(scratch: str, version: int) -> tuple[pa.Buffer, dict[str, Any]]:
    """delta-rs's checkpoint of `version` of the scratch table: its bytes and its `_last_checkpoint` object (the
    template of the table's pointer)."""
    from deltalake import DeltaTable

    DeltaTable(scratch, version=version).create_checkpoint()
    log = os.path.join(scratch, DELTA_LOG_DIR)
    path = os.path.join(log, f"{version:020d}.checkpoint.parquet")
    if not os.path.isfile(path):
        written = sorted(n for n in os.listdir(log) if n.startswith(f"{version:020d}.checkpoint"))
        raise DeltaFeatureError(
            f"delta-rs wrote no classic checkpoint of version {version} (it wrote {written}) in the scratch copy "
            f"{log} of the table's log: dbidx publishes classic checkpoints only; nothing was published"
        )
    with pa.OSFile(path) as f:
        data = f.read_buffer()  # Arrow-owned memory (fileio.read_to_end says why not a Python bytes)
    with open(os.path.join(log, "_last_checkpoint"), "rb") as f:
        raw = f.read()
    try:
        pointer = json.loads(raw)
        ok = isinstance(pointer, dict) and pointer.get("version") == version
    except ValueError:
        ok = False
    if not ok:
        raise CorruptFileError(
            f"delta-rs's _last_checkpoint in the scratch copy {log} does not name version {version}: {raw[:200]!r}"
        )
    return data, pointer
