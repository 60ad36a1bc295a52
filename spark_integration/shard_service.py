"""The cache service: one process per (node, shard cache directory) that keeps the shard's cache open across tasks
and runs their upsert work in it (cache.service; docs/DESIGN.md section 2).

Why: a task used to open its shard's RocksDB, catch up and close it, in whichever Python worker Spark picked, so a
shard's task often found a cold block cache and no key memory (the older data files' key indexes the deletion
vectors search). The service is the one process on the node that holds the shard: the cache stays open and warm,
the table's timeline is read incrementally, and the key indexes stay in memory. A task sends it its rows and gets
its result back (`service_client.py`); the work is the same `task.upsert_batches`, so every check, marker and
withdrawal of an attempt is unchanged.

Its life: started by the first task that needs it (a detached process of the task's Python, owned by the user,
socket 0600 in the user's 0700 runtime directory, only peers of the same uid answered); one instance per directory
(an flock on its pid file); requests one at a time, in arrival order (a shard's tasks never ran at once anyway: they
shared the directory's flock); between them, once the commit of the batch it served lands, it catches the cache up,
so the next task does not (`_catch_up_ahead`); exits when idle for `service.idle.s`, closing the cache as a task
would. A `tag` task's rows are tagged there too (one request per task, nothing written). Any other opener of the
directory (`dbidx cache verify`, a task that works itself) asks it to release the directory and
waits for the flock as usual; the service reopens the cache at its next request. Killed at any point, it leaves what
a killed task leaves: the flock and RocksDB's LOCK die with it, the cache is consistent at its last flush (catch-up
repairs the rest), and the attempt it was serving fails loudly in its task (CacheServiceError), which Spark retries.

Run as `python -m dbidx.spark_integration.shard_service --cache-dir D --socket S --idle-s N`.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("dbidx.shard_service")
STALL_TIMEOUT_S = 60.0
# After answering an upsert, how long the service watches for a commit to catch up on before the next task comes,
# and how often it looks (one stat of the next completion record's path; on an object store, one HEAD request).
AHEAD_WAIT_S = 10.0
AHEAD_POLL_S = 0.005
AHEAD_POLL_REMOTE_S = 0.05
# A starting service removes its socket's catch-up requests (service_link.ahead_request_paths) older than this: a
# service killed between its start and reading its request (or never started: the interpreter failed) leaves one.
STALE_AHEAD_S = 600.0


@dataclass
class _Ahead:
    """What the service catches up on once the next commit lands: the table and shard it served, the completion seq
    its cache was caught up to, until when it watches, and the file groups the served upsert wrote into (whose data
    compaction it then watches for: service_warm.py)."""

    table: Any
    options: Any
    shard: int
    seq: int
    until: float
    open_cache: bool = False  # open the cache if it is not (after a bulk load: the first batch finds it warm)
    groups: frozenset[tuple[str, str]] = frozenset()  # (partition, file group); none after a bulk load

    @classmethod
    def load(cls, message: dict[str, Any]) -> "_Ahead":
        """A catch-up a bulk load's task asked for (service_client.prestart): open the cache once its commit lands."""
        return cls(
            pickle.loads(message["table"]),
            pickle.loads(message["options"]),
            int(message["shard"]),
            int(message["seq"]),
            time.monotonic() + float(message["wait_s"]),
            open_cache=True,
        )


class ShardService:
    """The accept loop of one shard's service: requests in arrival order, the shard's cache held between them."""

    def __init__(self, cache_dir: Path, socket_path: Path, idle_s: float, ahead: _Ahead | None = None) -> None:
        from dbidx.spark_integration.shard_sessions import HeldCache

        self.cache_dir = Path(os.path.realpath(cache_dir))
        self.socket_path = socket_path
        self.idle_s = idle_s
        self.held = HeldCache(self.cache_dir)
        self.served = 0
        self.stopping = False  # asked to exit (service_link.request_stop) after the current request
        self.ahead = ahead  # a catch-up to run between requests, once its commit lands
        self.warm: Any = None  # service_warm.WarmKeys: a compaction's new files to index between requests

    def serve(self) -> None:
        """Bind, answer until idle for idle_s, then close the cache and remove the socket."""
        from dbidx.cache import service_link

        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket file is created 0600
        try:
            self.socket_path.unlink(missing_ok=True)  # a dead instance's: we hold the instance lock
            listener.bind(str(self.socket_path))
        finally:
            os.umask(old_umask)
        os.chmod(self.socket_path, 0o600)
        listener.listen(64)
        service_link.SERVING.add(str(self.cache_dir))
        log.info(
            "serving %s on %s (pid %d, idle exit after %g s)",
            self.cache_dir,
            self.socket_path,
            os.getpid(),
            self.idle_s,
        )
        last_request = time.monotonic()
        try:
            while True:
                # 1. Wait for a request: until idle for idle_s, or a poll's length while a catch-up is pending.
                idle_left = self.idle_s - (time.monotonic() - last_request)
                watching = self.ahead is not None or self.warm is not None
                listener.settimeout(self._poll_s() if watching else max(0.001, idle_left))
                try:
                    conn, _ = listener.accept()
                except socket.timeout:
                    # 2. No request: catch up if the served batch's commit (or any other) landed, then index the new
                    #    files of a data compaction that lands; exit when idle.
                    if self.ahead is not None:
                        self._catch_up_ahead()
                        continue
                    if self.warm is not None:
                        # Done watching, or idle for idle_s (then the service exits as it would have).
                        if idle_left <= 0 or not self.warm.step(listener, last_request + self.idle_s):
                            self.warm = None
                        continue
                    break
                with conn:
                    self._answer(conn)
                last_request = time.monotonic()
                if self.stopping:
                    break
        finally:
            # Unlink first: a client that finds no socket starts a new service instead of talking to a closing one.
            self.socket_path.unlink(missing_ok=True)
            listener.close()
            self.held.release()
            log.info("exiting after %d requests (%s)", self.served, "asked to" if self.stopping else "idle")

    def _poll_s(self) -> float:
        """How long to wait for a request before looking for the pending catch-up's (or compaction's) commit again."""
        if self.ahead is None:
            return self.warm.poll_s() if self.warm is not None else AHEAD_POLL_S
        return AHEAD_POLL_S if self.ahead.table.io.is_local else AHEAD_POLL_REMOTE_S

    def _catch_up_ahead(self) -> None:
        """Catch the held cache up once a completion past the one it holds exists (the commit of the batch just
        served, normally ~0.1 s after the answer), so the next task skips that step; give up after AHEAD_WAIT_S (a
        failed or abandoned batch). A failure here is only logged: the next task catches up (or reopens) itself."""
        from dbidx.storage import layout

        ahead = self.ahead
        assert ahead is not None
        if time.monotonic() > ahead.until or (self.held.cache is None and not ahead.open_cache):
            self.ahead = None
            return
        try:
            if not ahead.table.io.exists(layout.completed_file(ahead.seq + 1)):
                return
            self.ahead = None
            entries = self.held.catch_up_held(ahead.table, ahead.shard, ahead.options, ahead.open_cache)
            log.debug("caught up %d entries past seq %d ahead of the next task", entries, ahead.seq)
        except Exception as exc:  # noqa: BLE001 - the next task's own catch-up reports a real problem
            self.ahead = None
            log.warning("catching up ahead of the next task failed (the task will): %s", exc)
            return
        if ahead.groups:
            from dbidx.spark_integration.service_warm import WarmKeys

            self.warm = WarmKeys.after(ahead.table, ahead.options, ahead.shard, ahead.seq + 1, ahead.groups)

    def _answer(self, conn: socket.socket) -> None:
        from dbidx.cache import service_link
        from dbidx.errors import CacheServiceError

        # A peer that stalls for this long mid-message (or never reads our answer) is dropped: one stuck client must not
        # wedge the shard's service for every task after it. A socket timeout is per read or write, so a large batch
        # sent steadily never trips it.
        conn.settimeout(STALL_TIMEOUT_S)
        uid = service_link.peer_uid(conn)
        if uid is not None and uid != os.geteuid():
            log.warning("refused a connection from uid %d", uid)
            return
        received = time.perf_counter()
        try:
            header, body = service_link.receive(conn, f"a request to the service of {self.cache_dir}")
        except (CacheServiceError, OSError) as exc:
            log.warning("dropped an unreadable request: %s", exc)
            return
        op = header.get("op")
        if op == "release":  # another opener wants the directory: the service also stops its work between requests
            self.held.release()
            self.warm = None
            return
        if op == "stop":
            self.stopping = True
            return
        if op == "ahead":  # a bulk load's task: open and catch up once the load's commit lands
            try:
                self.ahead = _Ahead.load(header)
            except Exception as exc:  # noqa: BLE001 - a request we cannot use is only logged (nothing waits on it)
                log.warning("dropped an unusable catch-up request: %s", exc)
            return
        if op == "ping":
            self._reply(
                conn,
                {
                    "ok": True,
                    "pid": os.getpid(),
                    "dir": str(self.cache_dir),
                    "requests": self.served,
                    "idle_s": self.idle_s,
                },
            )
            return
        if op not in ("upsert", "tag"):
            self._reply(conn, {"ok": False, "type": "CacheServiceError", "message": f"unknown request {op!r}"})
            return
        self._reply(conn, {"accepted": True})  # from here on the attempt's work is in our hands (no retry)
        started = time.perf_counter()
        what = f"upsert {header.get('instant')} attempt {header.get('attempt')}" if op == "upsert" else "tag"
        with _Forwarded() as forwarded:
            try:
                if op == "upsert":
                    self.ahead = self.warm = None  # this request catches up itself and reads the files it needs
                    wire = self._upsert(header, body)
                else:  # a pending catch-up stays: a tag request commits nothing
                    wire = self._tag(header, body)
            except Exception as exc:  # noqa: BLE001 - every failure goes back to the task, which raises it there
                log.warning("%s failed: %s", what, exc)
                self._reply(conn, {**_error_header(exc), "logs": forwarded.records})
                return
        self.served += 1
        log.debug(  # not INFO: a service that serves for days would grow its log (rotated only at a start) without end
            "%s: received in %.3f s, served in %.3f s", what, started - received, time.perf_counter() - started
        )
        self._reply(conn, {"ok": True, "logs": forwarded.records}, wire)

    def _upsert(self, header: dict[str, Any], body: Any) -> bytes:
        from dbidx.spark_integration import task

        table, options, batches = _unpacked(header, body)
        result = task.upsert_batches(batches, table, options, header["instant"], int(header["attempt"]), held=self.held)
        if len(result.metrics) == 1:  # the commit of this batch will be the next completion to catch up on
            shard = result.metrics[0]
            groups = frozenset((f.partition, f.file_group) for f in result.files)
            until = time.monotonic() + AHEAD_WAIT_S
            self.ahead = _Ahead(table, options, shard.shard, shard.tagged_seq, until, groups=groups)
        return result.pack()

    def _tag(self, header: dict[str, Any], body: Any) -> Any:
        from dbidx.cache import service_link
        from dbidx.spark_integration import task

        table, options, batches = _unpacked(header, body)
        tagged = task.tag_in_held(batches, table, options, self.held)
        return service_link.arrow_stream(tagged.schema, tagged.to_batches())

    @staticmethod
    def _reply(conn: socket.socket, header: dict[str, Any], body: bytes = b"") -> None:
        from dbidx.cache import service_link

        try:
            service_link.send(conn, header, body)
        except OSError as exc:  # the task went away (killed, or its attempt cancelled): its work stays unlisted
            log.warning("could not answer a request: %s", exc)


class _Forwarded(logging.Handler):
    """dbidx's warnings while a request runs, sent back with its answer: the task logs them again, so they land in
    the executor's log beside the task's other lines (not only in the service's own log)."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.records: list[list[Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("dbidx") and record.name != log.name and len(self.records) < 100:
            self.records.append([record.name, record.levelno, record.getMessage()])

    def __enter__(self) -> "_Forwarded":
        logging.getLogger("dbidx").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("dbidx").removeHandler(self)


def _unpacked(header: dict[str, Any], body: Any) -> tuple[Any, Any, list[Any]]:
    """A work request's table, options and rows (service_client._request packs them)."""
    import pyarrow as pa

    table = pickle.loads(header["table"])
    options = pickle.loads(header["options"])
    return table, options, pa.ipc.open_stream(body).read_all().to_batches()


def _error_header(exc: BaseException) -> dict[str, Any]:
    """A failure as the task re-raises it: the exception itself when it pickles, else its type and message."""
    header: dict[str, Any] = {
        "ok": False,
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc))[-20000:],
    }
    try:
        header["error"] = pickle.dumps(exc)
        pickle.loads(header["error"])
    except Exception:  # noqa: BLE001 - an exception that does not pickle goes back as its type and message
        header.pop("error", None)
    return header


def _hold_instance(socket_path: Path) -> int | None:
    """The instance lock of one socket (an flock on `<socket>.pid`, holding our pid): None if another holds it.

    An exiting instance unlinks the pid file before it lets go, so a lock taken on a file that is no longer at the path
    (opened just before that unlink) is worthless: `try_flock` checks the path still names the inode it locked, and
    tries again if not. A lock that fails otherwise (not "held") is logged: this instance does not serve."""
    from dbidx.cache.dir_lock import try_flock
    from dbidx.errors import CacheError

    try:
        fd = try_flock(socket_path.with_suffix(".pid"))
    except CacheError as exc:
        log.warning("cannot take the instance lock: %s", exc)
        return None
    if fd is not None:
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
    return fd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dbidx.spark_integration.shard_service")
    parser.add_argument("--cache-dir", required=True, type=Path)
    parser.add_argument("--socket", required=True, type=Path)
    parser.add_argument("--idle-s", type=float, default=300.0)
    parser.add_argument("--ahead", type=Path, help="a pickled catch-up request to start with (read, then removed)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=log_level(), format="%(asctime)s %(process)d %(levelname)s %(message)s")
    lock = _hold_instance(args.socket)
    if lock is None:
        if args.ahead is not None:
            args.ahead.unlink(missing_ok=True)
        return 0  # another instance serves this directory (two tasks started one at once)
    try:
        sweep_stale_requests(args.socket)
        warm_up()
        ShardService(args.cache_dir, args.socket, args.idle_s, _ahead_from(args.ahead)).serve()
    finally:
        args.socket.with_suffix(".pid").unlink(missing_ok=True)  # before the lock goes (see _hold_instance)
        os.close(lock)
    return 0


LOG_LEVEL_ENV = "DBIDX_SERVICE_LOG_LEVEL"  # DEBUG logs each request's receive and serve time (a service's log grows)


def log_level(environ: dict[str, str] | None = None) -> int:
    """The service log's level: INFO, or what DBIDX_SERVICE_LOG_LEVEL names (DEBUG, INFO, WARNING, ERROR; the task's
    environment reaches the service it starts). An unknown name is logged and INFO kept: a log setting must not stop
    the service every task of the shard relies on."""
    name = (os.environ if environ is None else environ).get(LOG_LEVEL_ENV, "INFO").strip().upper()
    if name in ("DEBUG", "INFO", "WARNING", "ERROR"):
        return int(getattr(logging, name))
    print(f"{LOG_LEVEL_ENV}={name!r} is not DEBUG, INFO, WARNING or ERROR: logging at INFO", file=sys.stderr)
    return logging.INFO


def warm_up() -> None:
    """Pay at start what this process's first request would otherwise pay: pyarrow imports pandas on its first
    conversion of Python objects (an Arrow array of Python values, a compute call with a Python scalar), which took
    0.4-0.8 s of a served first batch (measured: 1.26 s served against 0.78 s of tagging and writing, then ~0 apart in
    later batches). A service a bulk load starts does this long before the first batch."""
    import pyarrow as pa

    pa.array(["warm"])


def sweep_stale_requests(socket_path: Path, older_than_s: float = STALE_AHEAD_S) -> list[Path]:
    """Remove this socket's catch-up request files older than `older_than_s` (left by a service that died before
    reading its own; a fresh one may be a request of a service about to start: kept). Returns what it removed."""
    from dbidx.cache import service_link

    removed: list[Path] = []
    cutoff = time.time() - older_than_s
    try:
        for path in service_link.ahead_request_paths(socket_path):
            try:
                if path.lstat().st_mtime < cutoff:
                    path.unlink()
                    removed.append(path)
            except FileNotFoundError:  # read and removed by its service meanwhile
                continue
    except OSError as exc:  # only tidying: a service that cannot tidy still serves
        log.warning("could not remove stale catch-up requests of %s: %s", socket_path.name, exc)
    if removed:
        log.info("removed %d stale catch-up request(s) of %s", len(removed), socket_path.name)
    return removed


def _ahead_from(path: Path | None) -> _Ahead | None:
    """The catch-up request a starting task left in the runtime directory (removed once read), if any."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return _Ahead.load(pickle.load(f))
    except Exception as exc:  # noqa: BLE001 - only a head start: without it the first task catches up itself
        log.warning("ignored the catch-up request %s: %s", path, exc)
        return None
    finally:
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
