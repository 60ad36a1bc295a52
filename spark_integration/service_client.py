"""A task's side of the cache service (shard_service.py): find or start the service of its shard, send it the rows,
and hand back its result, or None when the task must do the work itself.

When the task does the work itself (None): the rows span several shards (an in-process call, a DataFrame not
shuffled by shard), the user's runtime directory is unusable, or no service answered within the start timeout (a
warning says why). Then the task opens the cache as it always did; if a service still holds the directory, the
open asks it to let go. Once a service has accepted a request, the attempt's work is its: a service that dies before
answering fails the attempt with CacheServiceError (Spark runs it again) rather than the task writing the same
files a second time beside a half-done first.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn, Sequence

import numpy as np
import pyarrow as pa

from dbidx.cache import service_link
from dbidx.cache.record_cache import RecordIndexCache
from dbidx.errors import CacheServiceError, ConfigError
from dbidx.spark_integration.tagger import TAG_FIELDS, TagOptions
from dbidx.spark_integration.task_result import TaskResult
from dbidx.table.facade import Table

log = logging.getLogger(__name__)
START_TIMEOUT_S = 30.0  # a fresh interpreter importing dbidx, pyarrow and rocksdict: ~1 s here; a loaded node more
_POLL_S = 0.01
_RESPAWN_S = 2.0  # how long to wait for a started service's socket before starting another (the first may have lost
# its instance lock to one that was exiting)


def upsert_in_service(
    batches: Sequence[pa.RecordBatch], table: Table, options: TagOptions, instant: str, attempt: int
) -> TaskResult | None:
    """The attempt's result as the shard's service computed it; None when the task must do the work itself."""
    started = time.perf_counter()
    answer = _request("upsert", {"instant": instant, "attempt": attempt}, batches, table, options)
    if answer is None:
        return None
    served = TaskResult.parse(answer.to_pybytes(), 0, 2**62)  # checked strictly again by the driver
    for metrics in served.metrics[:1]:
        metrics.service_seconds = time.perf_counter() - started
    return served


def tag_in_service(batches: Sequence[pa.RecordBatch], table: Table, options: TagOptions) -> pa.Table | None:
    """The rows with their tag columns as the shard's service tagged them, in input order; None when the task must
    tag them itself. Why: a `tag` task that opens the shard's cache itself pays the open (every SST file of the cache)
    and a cold block cache in each task; the service holds both warm across tasks."""
    # 1. The service's answer: an Arrow stream of the tagged rows.
    answer = _request("tag", {}, batches, table, options)
    if answer is None:
        return None
    try:
        tagged = pa.ipc.open_stream(answer).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise CacheServiceError(
            f"the cache service answered a tag request with an unreadable Arrow stream: {exc}"
        ) from exc
    # 2. Read back, the answer is checked: every row, and the input's columns then the tag columns.
    rows, names = sum(b.num_rows for b in batches), batches[0].schema.names + [f.name for f in TAG_FIELDS]
    if tagged.num_rows != rows or tagged.column_names != names:
        raise CacheServiceError(
            f"the cache service answered a tag request of {rows} rows with columns {names} with {tagged.num_rows} "
            f"rows with columns {tagged.column_names}"
        )
    return tagged


def _request(
    op: str, fields: dict, batches: Sequence[pa.RecordBatch], table: Table, options: TagOptions
) -> pa.Buffer | None:
    """Send the rows to their shard's service as one `op` request and return its answer's body; None when the task
    must do the work itself (rows of several shards, no usable runtime directory, no service within the start
    timeout). A failure the service reports is raised here, as is a service lost after it accepted the request."""
    # 1. One shard, or the task does it itself (the service holds one directory).
    shard = _only_shard(batches, table, options)
    if shard is None:
        return None
    cache_dir = RecordIndexCache.for_table(table, shard, options.cache).path
    try:
        path = service_link.socket_for(cache_dir)
    except ConfigError as exc:
        log.warning("dbidx opens the cache of shard %d itself: %s", shard, exc)
        return None
    # 2. The request, built once: a service that closed as we connected (idle exit) is retried with a new one.
    header = {"op": op, **fields, "table": pickle.dumps(table), "options": pickle.dumps(options)}
    body = service_link.arrow_stream(batches[0].schema, batches)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        conn = _connect_or_start(path, cache_dir, options.cache.service_idle_s, deadline)
        if conn is None:
            break
        with conn:
            try:
                service_link.send(conn, header, body)
                accepted, _ = service_link.receive(conn, f"the cache service of {cache_dir}")
            except (OSError, CacheServiceError):
                continue  # not accepted: the service was exiting; nothing of this request was done
            if not accepted.get("accepted"):
                _raise(accepted, cache_dir)
            # 3. Accepted: from here the work is the service's; losing it fails the attempt (Spark runs it again).
            try:
                reply, answer = service_link.receive(
                    conn, f"the cache service of {cache_dir} (pid file {path.with_suffix('.pid')})"
                )
            except OSError as exc:
                raise CacheServiceError(f"the cache service of {cache_dir} failed mid-request: {exc}") from exc
        _log_again(reply.get("logs"), path)
        if not reply.get("ok"):
            _raise(reply, cache_dir)
        return answer
    log.warning(
        "dbidx opens the cache of shard %d itself: its cache service did not answer on %s within %g s (see %s)",
        shard,
        path,
        START_TIMEOUT_S,
        path.with_suffix(".log"),
    )
    return None


def _only_shard(batches: Sequence[pa.RecordBatch], table: Table, options: TagOptions) -> int | None:
    """The one shard every row's key falls in (what a Spark task of a shuffled upsert holds), else None."""
    if not batches:
        return None
    found = np.unique(table.shard_of(options.keys_of(pa.Table.from_batches(batches))))
    return int(found[0]) if len(found) == 1 else None


def _connect_or_start(path: Path, cache_dir: Path, idle_s: float, deadline: float) -> socket.socket | None:
    """A connection to the directory's service, starting one if none listens; None past the deadline."""
    started_at = None
    while time.monotonic() < deadline:
        conn = service_link.connect(path)
        if conn is not None:
            return conn
        if started_at is None or time.monotonic() - started_at > _RESPAWN_S:
            start_service(path, cache_dir, idle_s)
            started_at = time.monotonic()
        time.sleep(_POLL_S)
    return None


def start_service(path: Path, cache_dir: Path, idle_s: float, ahead: dict | None = None) -> None:
    """Start a detached service for `cache_dir` on `path` with this interpreter and import path (one instance per
    directory wins its pid file's lock; a second start just exits). `ahead`: a catch-up request it starts with
    (prestart's), left for it as a 0600 file in the runtime directory."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # Spark's pyFiles zips are on sys.path only
    command = [
        sys.executable,
        "-m",
        "dbidx.spark_integration.shard_service",
        "--cache-dir",
        str(cache_dir),
        "--socket",
        str(path),
        "--idle-s",
        repr(float(idle_s)),
    ]
    if ahead is not None:
        ahead_path = service_link.ahead_request_path(path, os.getpid(), threading.get_ident())
        fd = os.open(str(ahead_path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            pickle.dump(ahead, out)
        command += ["--ahead", str(ahead_path)]
    _rotate_log(path.with_suffix(".log"))
    log_fd = os.open(str(path.with_suffix(".log")), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=log_fd,
            env=env,
            close_fds=True,
            start_new_session=True,  # not in the task's process group: Spark ending the worker does not end it
            cwd=str(path.parent),
        )
    finally:
        os.close(log_fd)
    threading.Thread(target=proc.wait, name="dbidx-service-reaper", daemon=True).start()  # no zombie left


def _log_again(records: object, path: Path) -> None:
    """Log here, in the task, the warnings the service logged while it did this task's work."""
    if not isinstance(records, list):
        return
    for record in records[:100]:
        if isinstance(record, list) and len(record) == 3 and isinstance(record[1], int):
            name, level, message = record
            logging.getLogger(str(name)).log(level, "%s [in the cache service on %s]", message, path.name)


LOG_KEEP_BYTES = 1 << 20


def _rotate_log(path: Path) -> None:
    """Keep a service's log bounded across its restarts: past LOG_KEEP_BYTES it becomes `<name>.log.1` (the one
    before is dropped) before the next service starts writing."""
    try:
        if path.stat().st_size > LOG_KEEP_BYTES:
            os.replace(path, path.with_suffix(".log.1"))
    except OSError:
        pass


LOAD_COMMIT_WAIT_S = 120.0  # how long a service started by a bulk load's task waits for the load's commit


def prestart(table: Table, shard: int, options: TagOptions) -> None:
    """Start the shard's service if none runs, without waiting for it, and ask it to open the cache and catch up
    (installing what the load staged) once the load's commit lands: what a bulk load's task does at its end, so the
    first batch after the load finds the service up (its start is ~1 s of imports) and the cache open and warm.
    Never fails the task."""
    try:
        cache_dir = RecordIndexCache.for_table(table, shard, options.cache).path
        path = service_link.socket_for(cache_dir)
        ahead = {
            "op": "ahead",
            "table": pickle.dumps(table),
            "options": pickle.dumps(options),
            "shard": shard,
            "seq": options.bulk_seq,
            "wait_s": LOAD_COMMIT_WAIT_S,
        }
        conn = service_link.connect(path, timeout_s=0.5)
        if conn is not None:
            with conn:
                service_link.send(conn, ahead)
            return
        start_service(path, cache_dir, options.cache.service_idle_s, ahead)
    except (ConfigError, OSError) as exc:
        log.warning("dbidx did not start the cache service of shard %d: %s", shard, exc)


def _raise(reply: dict, cache_dir: Path) -> NoReturn:
    """Raise the failure a service sent back: the exception itself if it came pickled, else a CacheServiceError."""
    pickled = reply.get("error")
    if isinstance(pickled, bytes):
        try:
            exc = pickle.loads(pickled)
        except Exception:  # noqa: BLE001 - an exception class this process cannot build: its text is raised below
            exc = None
        if isinstance(exc, BaseException):
            raise exc
    raise CacheServiceError(
        f"the cache service of {cache_dir} failed: {reply.get('type')}: {reply.get('message')}\n"
        f"{reply.get('traceback', '')}"
    )
