"""How a process reaches the cache service that holds a shard's cache directory open (cache.service): where its
socket lives, the framing of a message, and the one request every other opener of the directory may send (release).

Why a service at all: a Spark task used to open its shard's RocksDB, catch up and close it again, and Spark hands a
shard's next task to whichever Python worker is free, so a task often started on a cold block cache and key memory.
A service process per (node, shard) keeps the directory open across tasks (docs/DESIGN.md section 2); the tasks send
it their rows (an upsert's or a `tag` job's). Every other opener (`dbidx cache verify`, a fallback task) still takes
the directory's flock first; when a service holds it, the opener asks the service to let go (`request_release`) and
waits as usual.

The sockets live in a private runtime directory (0700, owned by the user: `$XDG_RUNTIME_DIR/dbidx`, else
`<tmp>/dbidx-<uid>`), named by a hash of the cache directory's real path: a cache path of any length gets a socket
path under the 107-byte limit. A socket is 0600, and a service answers only peers of its own uid (SO_PEERCRED).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import struct
import tempfile
from pathlib import Path
from typing import Any, Iterable

import msgpack
import pyarrow as pa

from dbidx.cache.base_dir import check_private_dir, make_private_dirs
from dbidx.errors import CacheServiceError, ConfigError

_PREFIX = struct.Struct("!IQ")  # header length, body length
MAX_HEADER = 64 << 20  # a header holds the pickled table and options: never near this
MAX_BODY = 1 << 40
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with its terminating NUL (Linux)
# Cache directories this process serves itself: asking ourselves to release one would wait on our own accept loop.
SERVING: set[str] = set()


def _runtime_path(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    xdg = env.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "dbidx" if xdg and Path(xdg).is_dir() else Path(tempfile.gettempdir()) / f"dbidx-{os.geteuid()}"


def runtime_dir(environ: dict[str, str] | None = None) -> Path:
    """The user's private directory for service sockets, pid files and logs (created 0700, checked to be ours)."""
    base = _runtime_path(environ)
    try:
        make_private_dirs(base)
    except OSError as exc:
        raise ConfigError(f"the cache service directory {base} cannot be created: {exc.strerror or exc}") from exc
    check_private_dir(base)  # another user's (or a group-writable) directory could swap our sockets
    if base.is_symlink() or not base.is_dir():
        raise ConfigError(f"the cache service directory {base} is not a directory")
    return base


def socket_for(cache_dir: Path, environ: dict[str, str] | None = None) -> Path:
    """The socket of the service holding `cache_dir` (whether or not one runs); ConfigError when the runtime
    directory is unusable or too deep for a socket path."""
    digest = hashlib.sha256(os.path.realpath(cache_dir).encode()).hexdigest()[:24]
    path = runtime_dir(environ) / f"shard-{digest}.sock"
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ConfigError(
            f"the cache service socket {path} is longer than the {MAX_SOCKET_PATH} bytes a Unix socket path may "
            "have: set XDG_RUNTIME_DIR (or TMPDIR) to a shorter directory"
        )
    return path


def ahead_request_path(socket_path: Path, pid: int, thread: int) -> Path:
    """Where a starting task leaves the catch-up request of the service it starts on `socket_path` (one name per
    task thread: two tasks starting one service at once do not overwrite each other's)."""
    return socket_path.with_name(f"{socket_path.stem}-{pid}-{thread}.ahead")


def ahead_request_paths(socket_path: Path) -> list[Path]:
    """Every catch-up request file left for the services of `socket_path` (as ahead_request_path names them)."""
    return list(socket_path.parent.glob(f"{socket_path.stem}-*.ahead"))


def peer_uid(conn: socket.socket) -> int | None:
    """The uid of the process at the other end of a Unix socket (None where the OS does not say)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    creds = conn.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def arrow_stream(schema: pa.Schema, batches: Iterable[pa.RecordBatch]) -> pa.Buffer:
    """Rows as a message body: one Arrow IPC stream (what a task sends, and a tag request's answer)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return sink.getvalue()


def send(conn: socket.socket, header: dict[str, Any], body: pa.Buffer | bytes = b"") -> None:
    """One message: a msgpack header and an opaque body (an Arrow IPC stream, a task result)."""
    head = msgpack.packb(header, use_bin_type=True)
    conn.sendall(_PREFIX.pack(len(head), len(body)) + head)
    if len(body):
        conn.sendall(memoryview(body))


def receive(conn: socket.socket, where: str) -> tuple[dict[str, Any], pa.Buffer]:
    """One message (header, body); CacheServiceError when the other end went away or sent something malformed.

    The body lands in memory Arrow allocated, so Arrow's threads may free it without the GIL (storage/fileio.py says
    why that matters at interpreter exit)."""
    head_len, body_len = _PREFIX.unpack(_exactly(conn, _PREFIX.size, where))
    if head_len > MAX_HEADER or body_len > MAX_BODY:
        raise CacheServiceError(f"{where}: a message of {head_len} + {body_len} bytes is not one dbidx sends")
    try:
        header = msgpack.unpackb(_exactly(conn, head_len, where), raw=False)
    except (ValueError, msgpack.ExtraData) as exc:
        raise CacheServiceError(f"{where}: an unreadable message header ({exc})") from exc
    if not isinstance(header, dict):
        raise CacheServiceError(f"{where}: a message header that is not a map")
    body = pa.allocate_buffer(body_len)
    view, got = memoryview(body), 0
    while got < body_len:
        n = conn.recv_into(view[got:], min(body_len - got, 1 << 22))
        if n == 0:
            raise CacheServiceError(f"{where}: the connection closed after {got} of {body_len} body bytes")
        got += n
    return header, body


def _exactly(conn: socket.socket, size: int, where: str) -> bytes:
    chunks, got = [], 0
    while got < size:
        chunk = conn.recv(size - got)
        if not chunk:
            raise CacheServiceError(f"{where}: the connection closed after {got} of {size} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def connect(path: Path, timeout_s: float | None = 2.0) -> socket.socket | None:
    """A connection to the service at `path`, or None when none listens there (no socket, or a stale one)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(timeout_s)
    try:
        conn.connect(str(path))
    except OSError:  # no socket file, a stale one (refused), or one we may not use
        conn.close()
        return None
    conn.settimeout(None)
    return conn


def request_release(cache_dir: Path) -> bool:
    """Ask the service holding `cache_dir` (if any) to close it once its current request ends; True if one was asked.

    Never waits for the answer: the caller goes on waiting for the directory's flock, as with any other holder."""
    return _tell(cache_dir, "release")


def request_stop(cache_dir: Path) -> bool:
    """Ask the service of `cache_dir` (if any) to close the cache and exit once its current request ends (a tool or
    a benchmark done with a table); True if one was asked."""
    return _tell(cache_dir, "stop")


def running_services(timeout_s: float = 2.0) -> list[dict[str, Any]]:
    """The user's cache services on this machine: pid, cache directory, requests served, idle exit, socket; a service
    busy with a request for longer than timeout_s is listed as busy (pid and directory unknown)."""
    if not _runtime_path().is_dir():
        return []  # no service ever started here (listing one must not create the directory)
    found = []
    for sock in sorted(runtime_dir().glob("shard-*.sock")):
        conn = connect(sock, timeout_s=1.0)
        if conn is None:
            continue  # stale: its service was killed (a new one replaces it at the next request)
        with contextlib.closing(conn):
            conn.settimeout(timeout_s)
            try:
                send(conn, {"op": "ping"})
                reply, _ = receive(conn, f"the cache service on {sock}")
            except (OSError, CacheServiceError):
                reply = {"busy": True}
        found.append(
            {
                "pid": reply.get("pid"),
                "cache_dir": reply.get("dir"),
                "requests": reply.get("requests"),
                "idle_exit_s": reply.get("idle_s"),
                "busy": bool(reply.get("busy")),
                "socket": str(sock),
            }
        )
    return found


def _tell(cache_dir: Path, op: str) -> bool:
    if os.path.realpath(cache_dir) in SERVING or not _runtime_path().is_dir():
        return False  # ourselves, or no service ever started here (a busy lock must not create the directory)
    try:
        path = socket_for(cache_dir)
    except ConfigError:
        return False  # no usable runtime directory: then no service can have started either
    conn = connect(path, timeout_s=1.0)
    if conn is None:
        return False
    with contextlib.closing(conn):
        try:
            send(conn, {"op": op, "dir": os.path.realpath(cache_dir)})
        except OSError:
            return False
    return True
