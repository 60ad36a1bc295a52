"""FileIO: every byte dbidx reads or writes for a table goes through one `pyarrow.fs` filesystem.

The filesystem is chosen from the table URI (`/local/path`, `file://`, `s3://`, `gs://`, `hdfs://`, ...) or injected
(any `pyarrow.fs.FileSystem`, e.g. a `SubTreeFileSystem` or an in-memory one in tests). A FileIO is picklable, so a
Spark task can receive it and open the same table on an executor.

Two write primitives carry the table's atomicity:
- `write_atomic`: readers see the old state or the whole new file, never a prefix (temp file + rename on local and
  HDFS; object stores publish a PUT atomically anyway).
- `create_exclusive`: publish a file only if nothing exists at that path. The commit timeline relies on it to give
  completions a gap-free total order. Local filesystems do it with `link(2)`, which fails if the target exists;
  S3, GCS and Azure with a conditional PUT (`If-None-Match: *`) through obstore (`object_store.py`), since
  `pyarrow.fs` has none; any other filesystem with a user-supplied commit lock (`commit_lock.py`). Without any of
  the three the timeline refuses to run beside a second writer (docs/FORMAT.md, "Atomicity per store").
"""

from __future__ import annotations

import errno

import os
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import pyarrow as pa
import pyarrow.fs as pafs
import xxhash

from dbidx.storage.column_names import ColumnNames
from dbidx.errors import CorruptFileError, DbidxError, InvalidInputError
from dbidx.storage.commit_lock import CommitLock
from dbidx.storage.layout import validate_table_path
from dbidx.storage.object_store import (
    CONDITIONAL_PUT_SCHEMES,
    ConditionalPut,
    endpoint_url,
    normalize_options,
    pyarrow_filesystem,
)

# What decoding a damaged Parquet file can raise (footer statistics that are not UTF-8 surface as UnicodeError):
# callers turn it into a CorruptFileError naming the file.
DECODE_ERRORS = (pa.ArrowException, OSError, ValueError, UnicodeError, IndexError)
CHECKSUM_PREFIX = "xxh64:"
READ_CHUNK = 4 << 20  # bytes per read of a file whose size is not known in advance

# Serializes the check-then-write of a commit lock among the threads of one process (the lock itself serializes
# processes).
_THREAD_LOCK = threading.Lock()
EXCLUSIVE_LINK = "link(2)"
EXCLUSIVE_CONDITIONAL_PUT = "conditional put"
EXCLUSIVE_LOCK = "commit lock"
EXCLUSIVE_NONE = "none"


@dataclass(frozen=True)
class FileEntry:
    """One listed file: table-relative path, size, modification time (ms since the epoch; None if unknown)."""

    path: str
    size: int
    mtime_ms: int | None


@dataclass
class FileIO:
    """A `pyarrow.fs` filesystem plus the table's root path inside it, and how it creates a file exactly once."""

    fs: pafs.FileSystem
    root: str
    _local_root: str | None = field(default=None, repr=False)
    conditional_put: ConditionalPut | None = field(default=None, repr=False)
    commit_lock: CommitLock | None = field(default=None, repr=False)
    endpoint: str = ""  # the object-store endpoint the options name ("" = the default one): part of the location
    uri: str = ""  # the URI the table was opened with, scheme included (what Table.open takes back)
    # The storage options, canonical names (delta-rs/object_store accept them too), for delta-rs calls on the table.
    storage_options: dict[str, str] = field(default_factory=dict, repr=False)
    # The physical names of the data files' columns under Delta column mapping (storage/column_names.py), set by the
    # table from its data view; None: the files name their columns as the table does.
    column_names: ColumnNames | None = field(default=None, repr=False)

    @classmethod
    def from_uri(
        cls,
        uri: str,
        fs: pafs.FileSystem | None = None,
        storage_options: Mapping[str, Any] | None = None,
        commit_lock: CommitLock | None = None,
    ) -> "FileIO":
        """Resolve a table URI (or a path inside an injected filesystem) to a FileIO.

        storage_options (endpoint, region, credentials, allow_http, ...) configure both pyarrow and, on S3, GCS and
        Azure, the conditional-put client; commit_lock is for filesystems that have neither primitive.
        """
        if not uri:
            raise InvalidInputError("table URI is empty; pass a local path or a URI such as s3://bucket/table")
        if commit_lock is not None and not isinstance(commit_lock, CommitLock):
            raise InvalidInputError(f"commit_lock must be a context manager (e.g. FileCommitLock), got {commit_lock!r}")
        options = normalize_options(storage_options)
        if fs is not None:
            return cls(fs=fs, root=uri.rstrip("/") or "/", commit_lock=commit_lock)
        if "://" not in uri:
            uri = os.path.abspath(os.path.expanduser(uri))
        try:
            resolved, path = pyarrow_filesystem(uri, options)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as exc:
            raise InvalidInputError(f"cannot open table URI {uri!r}: {exc}") from exc
        scheme = uri.split("://", 1)[0].lower() if "://" in uri else ""
        root = path.rstrip("/") or "/"
        conditional = (
            ConditionalPut(scheme, root, options) if scheme in CONDITIONAL_PUT_SCHEMES and commit_lock is None else None
        )
        full = f"{scheme}://{root}" if scheme and scheme != "file" else root
        endpoint = endpoint_url(options) or ""
        return cls(
            fs=resolved,
            root=root,
            conditional_put=conditional,
            commit_lock=commit_lock,
            endpoint=endpoint,
            uri=full,
            storage_options=options | ({"endpoint": endpoint} if endpoint else {}),
        )

    @property
    def exclusive_create(self) -> str:
        """How this table creates a file exactly once: link(2), conditional put, commit lock, or none (unsafe
        with a second writer: the timeline then refuses to run beside one)."""
        if self._local_root is not None:
            return EXCLUSIVE_LINK
        if self.commit_lock is not None:
            return EXCLUSIVE_LOCK
        if self.conditional_put is not None:
            return EXCLUSIVE_CONDITIONAL_PUT
        return EXCLUSIVE_NONE

    def check_not_a_file(self) -> None:
        """A table is a directory: a regular file at the root is a clear error, not an OS error later."""
        if self.fs.get_file_info(self.root).type == pafs.FileType.File:
            raise InvalidInputError(f"{self.root} is a file; a dbidx table is a directory (pass the table's root)")

    def __post_init__(self) -> None:
        self._local_root = _local_path_of(self.fs, self.root)
        self._real_root: str | None = None  # the local root with symlinks resolved, once

    def __getstate__(self) -> dict[str, Any]:
        return {
            "fs": self.fs,
            "root": self.root,
            "conditional_put": self.conditional_put,
            "commit_lock": self.commit_lock,
            "endpoint": self.endpoint,
            "uri": self.uri,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.fs = state["fs"]
        self.root = state["root"]
        self.conditional_put = state["conditional_put"]
        self.commit_lock = state["commit_lock"]
        self.endpoint = state["endpoint"]
        self.uri = state["uri"]
        self.__post_init__()

    @property
    def is_local(self) -> bool:
        """True when the table lives on a local filesystem (atomic rename and link are available)."""
        return self._local_root is not None

    def path(self, rel: str) -> str:
        """The filesystem path of a table-relative path."""
        return f"{self.root}/{rel}" if rel else self.root

    # ---- reads -------------------------------------------------------------------------------------------
    def exists(self, rel: str) -> bool:
        """Whether a file or directory exists at the table-relative path."""
        return self.fs.get_file_info(self.path(rel)).type != pafs.FileType.NotFound

    def read_bytes(self, rel: str) -> bytes:
        """The whole content of a file (guarded: inside the table); a missing file is a CorruptFileError naming it."""
        return self._read_whole(rel, lambda stream: stream.read())

    def read_buffer(self, rel: str) -> pa.Buffer:
        """The whole content of a file, as `read_bytes`, in memory Arrow owns: for bytes a Parquet reader decodes."""
        return self._read_whole(rel, lambda stream: read_to_end(stream, READ_CHUNK))

    def _read_whole(self, rel: str, read: Callable[[pa.NativeFile], Any]) -> Any:
        """`read` over a stream of the file (guarded), its failures as CorruptFileErrors naming the file."""
        try:
            with self.fs.open_input_stream(self.path(self.guard(rel))) as stream:
                return read(stream)
        except FileNotFoundError as exc:
            raise CorruptFileError(f"file {self.path(rel)} is missing") from exc
        except OSError as exc:
            raise CorruptFileError(f"cannot read {self.path(rel)}: {exc}") from exc

    def read_verified(self, rel: str, size: int, checksum: str, what: str = "file") -> pa.Buffer:
        """The whole content of a file whose size and checksum a completion record holds; any difference (a
        flipped byte, a truncation, a missing file) is a CorruptFileError naming the file. Nothing read from the
        table is trusted before this check. The path must resolve inside the table (`guard`)."""
        where = self.path(self.guard(rel))
        try:
            with self.fs.open_input_stream(where) as stream:
                data = read_to_end(stream, size + 1)  # one read of the whole file, one more that finds its end
        except FileNotFoundError as exc:
            raise CorruptFileError(f"{what} {where} is missing (listed by a completed commit)") from exc
        except OSError as exc:
            raise CorruptFileError(f"cannot read {what} {where}: {exc}") from exc
        if data.size != size:
            raise CorruptFileError(
                f"{what} {where} has {data.size} bytes but its commit recorded {size} (truncated or overwritten)"
            )
        actual = file_checksum(data)
        if actual != checksum:
            raise CorruptFileError(
                f"{what} {where} fails its checksum ({actual}, commit recorded {checksum}): the file is damaged"
            )
        return data

    def size(self, rel: str) -> int:
        """Size in bytes of a file (0 if missing)."""
        info = self.fs.get_file_info(self.path(rel))
        return info.size or 0 if info.type == pafs.FileType.File else 0

    def sizes(self, rels: list[str]) -> dict[str, int]:
        """Sizes of many files in one `get_file_info` call (one stat per path locally, one HEAD request per path on
        an object store: the call batches the API, not the requests); missing files are absent from the result."""
        if not rels:
            return {}
        infos = self.fs.get_file_info([self.path(rel) for rel in rels])
        return {rel: info.size for rel, info in zip(rels, infos) if info.type == pafs.FileType.File}

    def list_names(self, rel_dir: str) -> list[str]:
        """Sorted base names of the files directly inside a table-relative directory ([] if it does not exist)."""
        selector = pafs.FileSelector(self.path(rel_dir), allow_not_found=True, recursive=False)
        return sorted(info.base_name for info in self.fs.get_file_info(selector) if info.type == pafs.FileType.File)

    def list_dirs(self, rel_dir: str) -> list[str]:
        """Sorted base names of the directories directly inside a table-relative directory."""
        selector = pafs.FileSelector(self.path(rel_dir), allow_not_found=True, recursive=False)
        return sorted(
            info.base_name for info in self.fs.get_file_info(selector) if info.type == pafs.FileType.Directory
        )

    def list_files_recursive(self, rel_dir: str) -> list[tuple[str, int]]:
        """(table-relative path, size) of every file under a directory, sorted by path."""
        return [(e.path, e.size) for e in self.list_entries(rel_dir, recursive=True)]

    def list_entries(self, rel_dir: str, recursive: bool = False) -> list["FileEntry"]:
        """Every file in (or under, `recursive`) a table-relative directory with its size and modification time,
        from one listing, sorted by path ([] if the directory does not exist). A store that reports no time gives
        None: callers that delete by age must then keep the file."""
        selector = pafs.FileSelector(self.path(rel_dir), allow_not_found=True, recursive=recursive)
        prefix = self.root.rstrip("/") + "/"
        out = []
        for info in self.fs.get_file_info(selector):
            if info.type != pafs.FileType.File:
                continue
            rel = info.path[len(prefix) :] if info.path.startswith(prefix) else info.path
            mtime = info.mtime_ns
            out.append(FileEntry(rel, info.size or 0, None if mtime is None else mtime // 1_000_000))
        return sorted(out, key=lambda e: e.path)

    def entries(self, rels: list[str]) -> dict[str, "FileEntry"]:
        """Size and modification time of given files in one `get_file_info` call (a stat or HEAD per path, no
        listing); missing files are absent from the result."""
        infos = self.fs.get_file_info([self.path(rel) for rel in rels]) if rels else []
        return {
            rel: FileEntry(rel, info.size or 0, None if info.mtime_ns is None else info.mtime_ns // 1_000_000)
            for rel, info in zip(rels, infos)
            if info.type == pafs.FileType.File
        }

    # ---- writes ------------------------------------------------------------------------------------------
    def makedirs(self, rel_dir: str) -> None:
        """Create a directory and its parents (no-op on object stores without directories)."""
        self.fs.create_dir(self.path(rel_dir), recursive=True)

    def write_atomic(self, rel: str, data: bytes | pa.Buffer) -> None:
        """Write a whole file so that readers see either nothing/the old file or all of the new one (and a crash
        never leaves a prefix under the final name). Guarded: the path resolves inside the table."""
        self.guard(rel, "write")
        parent = rel.rsplit("/", 1)[0] if "/" in rel else ""
        self.makedirs(parent)
        if not self.is_local and self.fs.type_name != "hdfs":
            with self.fs.open_output_stream(self.path(rel)) as out:  # a PUT is atomic on object stores
                out.write(data)
            return
        tmp = f"{parent}/.tmp-{uuid.uuid4().hex}" if parent else f".tmp-{uuid.uuid4().hex}"
        with self.fs.open_output_stream(self.path(tmp)) as out:
            out.write(data)
        self.fs.move(self.path(tmp), self.path(rel))

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Publish a complete file only if the path is free; False if something already exists there (guarded)."""
        self.guard(rel, "write")
        parent = rel.rsplit("/", 1)[0] if "/" in rel else ""
        self.makedirs(parent)
        if self._local_root is not None:
            # 1. Write the content to a private temp file and flush it to disk.
            target = os.path.join(self._local_root, rel)
            tmp = os.path.join(os.path.dirname(target), f".tmp-{uuid.uuid4().hex}")
            with open(tmp, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            # 2. link(2) publishes it atomically and fails if the target exists: first writer wins.
            try:
                os.link(tmp, target)
                return True
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
        if self.commit_lock is not None:
            with _THREAD_LOCK, self.commit_lock:
                return self._check_then_write(rel, data)
        if self.conditional_put is not None:
            return self.conditional_put.create(rel, data)
        # No primitive: check-then-write, which is safe only without a second writer; the timeline makes sure of that
        # (every writer leaves a presence file when it claims an instant and refuses to run beside another one).
        return self._check_then_write(rel, data)

    def _check_then_write(self, rel: str, data: bytes) -> bool:
        if self.exists(rel):
            return False
        with self.fs.open_output_stream(self.path(rel)) as out:
            out.write(data)
        return True

    def guard(self, rel: str, action: str = "touch") -> str:
        """The one path guard for reads, writes and deletes: `rel` must be a table-relative path that stays inside
        the table, also after resolving symlinks on a local filesystem; else a CorruptFileError naming it (a path
        read from metadata or a marker is untrusted, and a directory on the way may be a symlink out of the table).
        `action` ("touch", "write") only words the message."""
        try:
            validate_table_path(rel)
        except DbidxError as exc:
            raise CorruptFileError(f"refusing to {action} {rel!r} under {self.root}: {exc}") from exc
        if self._local_root is not None:
            root = self._real_root or os.path.realpath(self._local_root)
            self._real_root = root
            target = os.path.realpath(os.path.join(self._local_root, rel))
            if os.path.commonpath([root, target]) != root:
                raise CorruptFileError(
                    f"refusing to {action} {rel!r}: it resolves to {target}, outside the table "
                    f"{root} (a directory on the way is a symlink out of the table): replace the "
                    "symlink by a real directory inside the table (move the files it points to "
                    "there)"
                )
        return rel

    def delete(self, rel: str) -> bool:
        """Delete a file inside the table (guarded); False if it was already gone."""
        self.guard(rel)
        try:
            self.fs.delete_file(self.path(rel))
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            text = str(exc).lower()
            # A name too long for the filesystem names a file that cannot exist (a write refused it): nothing to
            # delete, and a rollback or sweep naming it must not fail for ever.
            if (
                "not found" in text
                or "no such file" in text
                or "name too long" in text
                or getattr(exc, "errno", None) == errno.ENAMETOOLONG
            ):
                return False
            raise

    def delete_dir(self, rel_dir: str) -> None:
        """Delete a directory tree inside the table (guarded) if it exists."""
        self.guard(rel_dir)
        if self.exists(rel_dir):
            self.fs.delete_dir(self.path(rel_dir))

    def open_input_file(self, rel: str) -> pa.NativeFile:
        """A random-access handle for Parquet reads (guarded: inside the table); missing files are a CorruptFileError
        naming the path."""
        try:
            return self.fs.open_input_file(self.path(self.guard(rel)))
        except FileNotFoundError as exc:
            raise CorruptFileError(f"index file {self.path(rel)} is missing") from exc

    def open_output_stream(self, rel: str) -> pa.NativeFile:
        """A sequential output stream (callers that need atomicity write to a temp name and `move`); guarded."""
        self.guard(rel, "write")
        parent = rel.rsplit("/", 1)[0] if "/" in rel else ""
        self.makedirs(parent)
        return self.fs.open_output_stream(self.path(rel))


def _local_path_of(fs: pafs.FileSystem, root: str) -> str | None:
    """The OS path of `root` when `fs` is (a sub-tree of) the local filesystem, else None."""
    if isinstance(fs, pafs.LocalFileSystem):
        return root
    if isinstance(fs, pafs.SubTreeFileSystem) and isinstance(fs.base_fs, pafs.LocalFileSystem):
        return os.path.join(fs.base_path, root.lstrip("/"))
    return None


def file_checksum(data: bytes | pa.Buffer) -> str:
    """The checksum a completion record stores for a file: XXH64 (seed 0) of all its bytes, as `xxh64:<16 hex>`.

    Why whole-file XXH64: it costs ~0.2 ms per MB (Parquet decoding of the same bytes costs ~250 ms per MB of keys),
    and unlike Parquet page checksums it also covers the footer, whose row-group statistics drive lookups.
    """
    return CHECKSUM_PREFIX + xxhash.xxh64(data).hexdigest()


def read_to_end(stream: pa.NativeFile, first: int) -> pa.Buffer:
    """Everything left in `stream`, in buffers Arrow allocates (one read of `first` bytes, then chunks to the end).

    Why not `stream.read_buffer()`: on a stream whose size is unknown it wraps a Python `bytes`. A Parquet reader
    then decodes on Arrow's own threads, and one of them may drop its last reference to those bytes after the
    read returned. If the interpreter is exiting by then, that thread must take the GIL, cannot, and the process
    aborts ("terminate called without an active exception", ~1 in 100 short scripts). Memory Arrow owns is freed
    without the GIL.
    """
    chunks = []
    size = first
    while True:
        chunk = stream.read_buffer(size)  # with a size: Arrow's ReadBuffer, Arrow-allocated
        if chunk.size == 0:
            break
        chunks.append(chunk)
        # A short read is almost always the end: probe it with one byte, not a READ_CHUNK buffer (every verified
        # read asks for one byte more than its file holds, so its end is found here).
        size = READ_CHUNK if chunk.size == size else 1
    if len(chunks) == 1:
        return chunks[0]
    sink = pa.BufferOutputStream()
    for chunk in chunks:
        sink.write(chunk)
    return sink.getvalue()
