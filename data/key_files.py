"""The key index of data files on the executor's local disk: what a worker process that did not write a file
reads instead of decoding, hashing and sorting its key column again.

Why: the rows an upsert supersedes are found through each older data file's key index (data/key_columns.py), kept in
the memory of the worker process that built it. Spark gives a shard's next task to any worker, so the first batch
after a load often ran on a worker that had never seen the shard's files: at 10 M keys it decoded, hashed and sorted
5 M keys per shard (~0.9 s of CPU per task, 1.7 s with both tasks on two cores) before it could write. The index is
a pure function of the file's bytes, so it is written once, next to the shard caches, by whoever builds it, and every
worker process of the executor maps it (Arrow IPC, uncompressed: no decoding) instead of rebuilding it.

A key file is a cache and never needed: it is named by the data file's checksum and row count (the same content,
whichever table or path holds it), checked before use (magic, its own XXH64, the data file it claims to index, the
hash it was built with, a full Arrow validation, each row once, sort order, a random sample of its hashes recomputed;
`_decode` says what is left unchecked), and one that fails any check is deleted with a warning and rebuilt from the
data file; nothing a key file holds can fail a batch. Every file is kept, a batch's small ones too: its next batch
may run on another worker, and mapping a key file costs ~0.2 ms against 1-2 ms to decode even a tiny data file.
The directory is bounded: past `max_bytes` or MAX_FILES files (plus what each writing process saved since its last
trim, 1/64 of either), the least recently used go (a use touches a file's mtime, a worker's memory hit too, at most
once a minute per process), and the cache reaper removes a table's key files unused for its TTL (cache/reaper.py),
and each upsert task deletes the key files of data files the table no longer has (cache/key_file_sweep.py: a data
compaction's replaced files). The directory is private (0700) like the caches; a save never re-creates a table
directory the reaper removed, nor writes through a symbolic link.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import struct
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa
import xxhash

from dbidx.data.key_columns import FileKeys
from dbidx.storage.keyhash import HASH_NAME, spark_hash  # what sorted_hashes hold; any other is refused
from dbidx.storage.records import DataFileRecord

TRIM_EVERY = 64  # trim after saving 1/64 of the byte budget, or of MAX_FILES files
MAX_FILES = 65_536
SAMPLE = 256  # (hash, row) pairs recomputed when a key file is read
MAX_QUEUED_BYTES = 256 << 20  # index bytes waiting for the saver thread; past this, saves are skipped
TOUCH_EVERY_S = 60.0  # a key file in use is touched (its mtime: the LRU order) at most once a minute per process
MAGIC = b"DBIDXKF1"
KEY_FILES_DIR = "keys"  # beside a table's shard caches: <base>/<table dir>/keys
SUFFIX = ".keys"
FINISHED = re.compile(r"[0-9a-f]{16}-\d{1,10}\.keys")  # a key file
NAME = re.compile(rf"(?:{FINISHED.pattern}|\.tmp-[0-9a-f]{{32}}\.keys)")  # and one being written: all it ever writes
_HEADER = struct.Struct("<8sQ")  # magic, XXH64 of the Arrow IPC payload that follows (16 bytes: keeps 8-byte alignment)
_COLUMNS = ["key", "sorted_hash", "row"]
_SHARED: dict[tuple[str, int], "KeyFiles"] = {}
_SHARED_LOCK = threading.Lock()
_SAVER: tuple[int, ThreadPoolExecutor] | None = None
log = logging.getLogger(__name__)


class KeyFiles:
    """One directory of key files (`<data checksum>-<rows>.keys`), shared by the worker processes of an executor."""

    def __init__(self, root: str | Path, max_bytes: int, background: bool = False) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.background = background
        self._unchecked = (max_bytes, MAX_FILES)  # bytes and files saved since the last trim (the first save trims)
        self._queued = 0  # bytes of indexes handed to the saver thread and not written yet
        self._warned = False  # a skipped save is said once per process
        self._lock = threading.Lock()
        self._touched: dict[tuple[str, int], float] = {}  # (checksum, rows) -> when this process last touched its
        # key file (monotonic)

    @classmethod
    def shared(cls, root: str | Path, max_bytes: int) -> "KeyFiles":
        """One instance per directory and budget in this process, saving in the background (Python workers are
        reused: what it saved since its last trim carries over from task to task)."""
        with _SHARED_LOCK:
            return _SHARED.setdefault((str(root), max_bytes), cls(root, max_bytes, background=True))

    def path_of(self, record: DataFileRecord) -> Path | None:
        """Where a data file's key index is kept (by content: its checksum's hex digits and its row count); None for
        a checksum that cannot name a file (read from a commit, so never trusted to become a path part)."""
        name = f"{record.checksum.rsplit(':', 1)[-1]}-{record.rows}{SUFFIX}"
        return self.root / name if FINISHED.fullmatch(name) else None

    def load(self, record: DataFileRecord) -> FileKeys | None:
        """The file's key index mapped from disk, checked; None when absent or damaged (a damaged one is deleted).
        Never raises: a key file is never needed."""
        path = self.path_of(record)
        if path is None:
            return None
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):  # a link, a FIFO (whose open would block): not ours
                raise OSError(f"{path} is not a regular file")
            with pa.memory_map(str(path)) as mapped:
                data = mapped.read_buffer()
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - unreadable: the data file is read instead
            log.warning("dbidx could not read the key file %s (%s); reading the data file instead", path, exc)
            return None
        try:
            found = _decode(data, record)
        except Exception as exc:  # noqa: BLE001 - whatever the damage, the data file answers instead
            log.warning("dbidx deleted the damaged key file %s (%s); it is rebuilt from the data file", path, exc)
            _unlink(path)
            return None
        self.touch(record)
        return found

    def touch(self, record: DataFileRecord) -> None:
        """Mark a data file's key file used (the budget drops the least recently used first): also when a worker
        found the index in its own memory, so a file every batch needs is never the one trimmed."""
        # One touch per file per TOUCH_EVERY_S is enough for an LRU order and a TTL of hours: a steady stream of
        # batches uses the same few hundred files each time (a syscall each, ~7 ms per task at 2 M keys). Looked up
        # by the data file's identity before any path is built (a Path per file was another ~5 ms per task).
        now, identity = time.monotonic(), (record.checksum, record.rows)
        with self._lock:
            if now - self._touched.get(identity, -TOUCH_EVERY_S) < TOUCH_EVERY_S:
                return
            if len(self._touched) >= 100_000:
                self._touched.clear()
            self._touched[identity] = now
        path = self.path_of(record)
        if path is None:
            return
        try:
            os.utime(path)
        except OSError:
            pass

    def save(self, record: DataFileRecord, keys: FileKeys) -> None:
        """Keep a file's key index (written whole to a temporary name, then renamed), then trim to the budget; on
        the process's saver thread when `background` (a task does not wait: its worker writes while the driver
        commits; `wait_for_saves` drains; past MAX_QUEUED_BYTES waiting, a save is skipped with a warning, once, rather
        than held in memory; one is always admitted, whatever its size). Never raises: a failure costs the next worker
        a rebuild, never the batch."""
        if not self.background:
            self._save_logged(record, keys, 0)
            return
        size = keys.nbytes
        with self._lock:
            if self._queued and self._queued + size > MAX_QUEUED_BYTES:  # one save is always admitted
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "dbidx skips key files while %d MB of indexes wait to be written in %s (the disk is "
                        "slower than the task); their data files are decoded where needed",
                        self._queued >> 20,
                        self.root,
                    )
                return
            self._queued += size
        try:
            _saver().submit(self._save_logged, record, keys, size)
        except RuntimeError:  # the interpreter is shutting down: nothing is saved any more
            with self._lock:
                self._queued -= size

    def _save_logged(self, record: DataFileRecord, keys: FileKeys, queued: int) -> None:
        try:
            self._save_now(record, keys)
        except Exception as exc:  # noqa: BLE001 - nobody waits for a save: said here, or never
            log.warning("dbidx could not keep the key index of %s in %s: %s", record.path, self.root, exc)
        finally:
            with self._lock:
                self._queued -= queued

    def _save_now(self, record: DataFileRecord, keys: FileKeys) -> None:
        path = self.path_of(record)
        if path is None or len(keys.keys) != record.rows or self.max_bytes <= 0:
            return
        if path.exists():
            self.touch(record)
            return
        # 1. The directory, private, but only inside a table directory that still exists (the reaper may have
        #    removed it since the task made it: then nothing is saved, rather than a directory made anew by umask).
        if not self.root.is_dir():
            if not self.root.parent.is_dir():
                return
            self.root.mkdir(mode=0o700, exist_ok=True)
            os.chmod(self.root, 0o700)
        if self.root.is_symlink():
            return
        # 2. Written whole under a temporary name (0600), hashed as it is written (no copy of the payload), renamed.
        tmp = path.with_name(f".tmp-{uuid.uuid4().hex}{SUFFIX}")
        try:
            with os.fdopen(os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), "w+b") as out:
                out.write(bytes(_HEADER.size))
                sink = _HashingSink(out)
                _encode(keys, record, pa.PythonFile(sink, mode="w"))
                out.seek(0)
                out.write(_HEADER.pack(MAGIC, sink.digest.intdigest()))
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        # 3. Trimming lists the directory: done once per 1/TRIM_EVERY of the budget saved, so the directory stays
        #    within its bounds plus that slice per writing process.
        with self._lock:
            saved, files = self._unchecked[0] + sink.size, self._unchecked[1] + 1
            due = saved >= self.max_bytes // TRIM_EVERY or files >= MAX_FILES // TRIM_EVERY
            self._unchecked = (0, 0) if due else (saved, files)
        if due:
            self.trim()

    def trim(self) -> int:
        """Delete the least recently used key files until the directory fits `max_bytes` and MAX_FILES; returns how
        many went."""
        files = finished_files(self.root)
        total = sum(size for _m, size, _p in files)
        removed = 0
        count = len(files)
        for _mtime, size, path in sorted(files):
            if total <= self.max_bytes and count <= MAX_FILES:
                break
            _unlink(Path(path))  # a reader that mapped it keeps its pages
            total -= size
            count -= 1
            removed += 1
        return removed


def finished_files(root: str | Path) -> list[tuple[float, int, str]]:
    """(mtime, size, path) of each finished key file in a directory, skipping what a live executor renames or deletes
    meanwhile (none when the directory cannot be read)."""
    files = []
    try:
        with os.scandir(root) as entries:
            for entry in entries:
                if FINISHED.fullmatch(entry.name):
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    files.append((info.st_mtime, info.st_size, entry.path))
    except OSError:
        return []
    return files


class _HashingSink:
    """A binary file that also hashes what goes through it (Arrow writes the IPC file into it)."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out = out
        self.digest = xxhash.xxh64()
        self.size = 0
        self.closed = False

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.out.write(data)

    def flush(self) -> None:
        self.out.flush()

    def close(self) -> None:
        self.closed = True  # the caller closes the file itself


def wait_for_saves() -> None:
    """Block until every background save this process queued so far is done (tests; a process about to exit)."""
    _saver().submit(lambda: None).result()


def _saver() -> ThreadPoolExecutor:
    """The process's one saver thread (made anew in a forked child: a parent's thread does not survive the fork)."""
    global _SAVER
    with _SHARED_LOCK:
        if _SAVER is None or _SAVER[0] != os.getpid():
            _SAVER = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="dbidx-key-files"))
        return _SAVER[1]


def _encode(keys: FileKeys, record: DataFileRecord, sink: Any) -> None:
    """Write the Arrow IPC file of one key index into `sink`: keys, sorted hashes and their rows, with what they
    index."""
    batch = pa.record_batch([keys.keys, pa.array(keys.sorted_hashes), pa.array(keys.order)], names=_COLUMNS)
    meta = {"data_checksum": record.checksum, "rows": str(record.rows), "hash": HASH_NAME}
    with pa.ipc.new_file(sink, batch.schema.with_metadata(meta)) as writer:
        writer.write_batch(batch)


def _decode(data: pa.Buffer, record: DataFileRecord) -> FileKeys:
    """A key file's index, every check passed (ValueError or ArrowException naming the first that fails).

    The checksum catches damage; the rest is checked as if the bytes were hostile, because a wrong index hides rows
    from the search (a record left twice in the table), finds a wrong one (a record lost) or crashes the reader. Left
    unchecked: a key or hash at a row the random sample skips (the keys are not compared with the data file;
    recomputing them all is the work a key file saves). Writing such a file takes write access to the private cache
    directory, which could as well rewrite the cache's own entries.
    """
    if data.size < _HEADER.size:
        raise ValueError(f"{data.size} bytes, shorter than the header")
    magic, digest = _HEADER.unpack(data.slice(0, _HEADER.size).to_pybytes())
    payload = data.slice(_HEADER.size)
    if magic != MAGIC:
        raise ValueError(f"magic {magic!r} is not {MAGIC!r}")
    if xxhash.xxh64(memoryview(payload)).intdigest() != digest:
        raise ValueError("checksum mismatch")
    reader = pa.ipc.open_file(payload)
    meta = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
    claims = (meta.get("data_checksum"), meta.get("rows"), meta.get("hash"))
    if claims != (record.checksum, str(record.rows), HASH_NAME):
        raise ValueError(f"it indexes {claims}, not {(record.checksum, str(record.rows), HASH_NAME)}")
    if reader.num_record_batches != 1:
        raise ValueError(f"{reader.num_record_batches} record batches, not 1")
    batch = reader.get_batch(0)
    if batch.schema.names != _COLUMNS or batch.num_rows != record.rows:
        raise ValueError(f"columns {batch.schema.names} of {batch.num_rows} rows")
    if batch.schema.types != [pa.string(), pa.uint32(), pa.int32()]:
        raise ValueError(f"column types {batch.schema.types}")
    batch.validate(full=True)  # offsets, UTF-8, buffer sizes: what a reader would otherwise trust blindly
    keys, hashes, rows = batch.column(0), batch.column(1), batch.column(2)
    if keys.null_count or hashes.null_count or rows.null_count:
        raise ValueError("a null in a key file")
    sorted_hashes = hashes.to_numpy(zero_copy_only=True)
    order = rows.to_numpy(zero_copy_only=True)
    # Each row exactly once (a row listed twice stands in for one that would be missed), hashes ascending, and a
    # sample of (hash, row) pairs recomputed.
    if len(order):
        if order.min() < 0 or order.max() >= record.rows:
            raise ValueError("a row number is out of range")
        seen = np.zeros(record.rows, dtype=bool)
        seen[order] = True
        if not seen.all():  # as many rows as the file has, all in range: each once, or one is missing
            raise ValueError("the rows are not each row of the file once")
    if np.any(sorted_hashes[1:] < sorted_hashes[:-1]):
        raise ValueError("hashes out of order")
    sample = np.random.default_rng().choice(len(order), size=min(len(order), SAMPLE), replace=False)  # not foreseeable
    if len(sample) and not np.array_equal(
        spark_hash(keys.take(pa.array(order[sample]))).view(np.uint32), sorted_hashes[sample]
    ):
        raise ValueError("a sampled hash is not its row's key's hash")
    return FileKeys(keys, sorted_hashes, order)


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("dbidx could not delete the key file %s: %s", path, exc)


def sweep_unused(root: str | Path, cutoff_s: float) -> list[str]:
    """Delete key files (and temporary ones a killed writer left) not used since `cutoff_s` (epoch seconds), then
    the directory if that emptied it and it was not changed since either; returns what went. The cache reaper's part
    for key files: an executor's shards move on, and nothing else would ever read them again. Only names this module
    writes are deleted, never through a symbolic link."""
    removed: list[str] = []
    root = Path(root)
    if root.is_symlink() or not root.is_dir():
        return removed
    try:
        with os.scandir(root) as entries:
            for entry in entries:
                if not NAME.fullmatch(entry.name) or not entry.is_file(follow_symlinks=False):
                    continue  # never delete what we cannot recognise
                try:
                    if entry.stat(follow_symlinks=False).st_mtime < cutoff_s:
                        os.unlink(entry.path)
                        removed.append(entry.path)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    log.warning("dbidx could not delete the unused key file %s: %s", entry.path, exc)
        if root.stat().st_mtime < cutoff_s or removed:
            os.rmdir(root)  # only succeeds when empty
    except OSError:
        pass
    return removed
