"""A private copy of the tail of a table's Delta log, for delta-rs to write a Delta checkpoint into
(data/delta_checkpoint.py publishes it).

Why a copy: delta-rs's `create_checkpoint()` writes `<version>.checkpoint.parquet` and `_last_checkpoint` into the
log of the table it opened, at once, over whatever is there. A checkpoint dbidx publishes must appear once, with
its final (slim) bytes, and never change: delta-rs and polars read a checkpoint by byte ranges, opening the file by
name again for each, so a file replaced between two of those reads fails the load ("Requested range was invalid",
"Unexpected Encoding", issue 63). Here delta-rs opens a local temporary table that holds the newest classic (or
multi-part) checkpoint and the JSON versions after it, read through the table's FileIO (any store), and writes its
checkpoint there; nothing under the table's `_delta_log/` is written by delta-rs. Copying costs a read of the files
delta-rs reads anyway to load the table; the JSON versions are immutable (put-if-absent), and so is every
checkpoint dbidx publishes, so the copy is the log as it is.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from dbidx.data.delta_log import DELTA_LOG_DIR, checkpoint_pointer, listed_versions, version_file
from dbidx.errors import CorruptFileError, DeltaFeatureError
from dbidx.storage.fileio import FileIO

# Classic (<v>.checkpoint.parquet) and multi-part (<v>.checkpoint.<part>.<parts>.parquet) checkpoints: what
# delta-rs loads a table from. A V2 checkpoint (<v>.checkpoint.<uuid>.*, with sidecar files) is not a starting point.
_CHECKPOINT = re.compile(r"^(\d{20})\.checkpoint(?:\.(\d{10})\.(\d{10}))?\.parquet$")
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
    names: tuple[str, ...]  # the files under `_delta_log/` to copy: the checkpoint's, then the JSON versions


def log_tail(io: FileIO) -> LogTail:
    """The log's tail, found without listing the log when `_last_checkpoint` names a classic checkpoint with JSON
    versions after it (the usual case: a checkpoint is due because versions were written since the last one);
    else from one listing (no checkpoint yet, a stale pointer, a multi-part one, or a long run of versions)."""
    try:
        pointer = checkpoint_pointer(io)
    except CorruptFileError:
        pointer = -1  # a damaged pointer is only a hint lost: the listing decides
    if pointer >= 0 and io.exists(checkpoint_file(pointer)):
        newer: list[int] = []
        while len(newer) < PROBE_LIMIT and io.exists(version_file(pointer + len(newer) + 1)):
            newer.append(pointer + len(newer) + 1)
        if newer and len(newer) < PROBE_LIMIT:
            names = [checkpoint_file(pointer)] + [version_file(v) for v in newer]
            return LogTail(newer[-1], pointer, tuple(n.split("/", 1)[1] for n in names))
    return _listed_tail(io)


def _listed_tail(io: FileIO) -> LogTail:
    """The tail from one listing: the newest complete checkpoint whose every later JSON version is there."""
    names = io.list_names(DELTA_LOG_DIR)
    versions = set(listed_versions(io, names))
    classic: set[int] = set()
    parts: dict[int, dict[int, set[int]]] = {}  # version -> parts -> the part numbers listed
    for name in names:
        m = _CHECKPOINT.match(name)
        if m and m.group(2):
            parts.setdefault(int(m.group(1)), {}).setdefault(int(m.group(3)), set()).add(int(m.group(2)))
        elif m:
            classic.add(int(m.group(1)))
    whole = {v for v, by_total in parts.items() if any(got == set(range(1, t + 1)) for t, got in by_total.items())}
    checkpoints = sorted(classic | whole)
    if not versions and not checkpoints:
        raise CorruptFileError(f"the Delta log {io.path(DELTA_LOG_DIR)} holds no version: nothing to checkpoint")
    latest = max(versions | set(checkpoints))
    for base in [*reversed(checkpoints), -1]:
        if base > latest or not all(v in versions for v in range(base + 1, latest + 1)):
            continue
        if base < 0:
            own: list[str] = []
        elif base in classic:
            own = [f"{base:020d}.checkpoint.parquet"]
        else:
            total = next(t for t, got in parts[base].items() if got == set(range(1, t + 1)))
            own = [f"{base:020d}.checkpoint.{p:010d}.{total:010d}.parquet" for p in range(1, total + 1)]
        return LogTail(latest, base, tuple(own + [f"{v:020d}.json" for v in range(base + 1, latest + 1)]))
    newest = checkpoints[-1] if checkpoints else -1
    gone = [v for v in range(newest + 1, latest + 1) if v not in versions]
    raise CorruptFileError(
        f"the Delta log {io.path(DELTA_LOG_DIR)} misses version(s) {gone[:5]} after its newest checkpoint "
        f"({newest}): no Delta reader can load version {latest}, so dbidx writes no checkpoint of it"
    )


def copy_tail(io: FileIO, tail: LogTail, scratch: str) -> None:
    """The tail's files, read through the table's FileIO (checked: inside the table), into `<scratch>/_delta_log/`:
    a local Delta table delta-rs can open. No `_last_checkpoint`: delta-rs lists the copy (it is short)."""
    log = os.path.join(scratch, DELTA_LOG_DIR)
    os.makedirs(log, exist_ok=True)
    for name in tail.names:
        data = io.read_buffer(f"{DELTA_LOG_DIR}/{name}")  # a file gone meanwhile: CorruptFileError naming it
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
