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
hash it was built with, lengths, sort order, a sample of its hashes recomputed), and one that fails any check is
deleted with a warning and rebuilt from the data file. Every file is kept, a batch's small ones too: its next batch
may run on another worker, and mapping a key file costs ~0.2 ms against 1-2 ms to decode even a tiny data file.
The directory is bounded: past `max_bytes` or MAX_FILES files, the least recently used go (a use touches a file's
mtime), and the cache reaper removes a table's key files unused for its TTL (cache/reaper.py).
"""
from __future__ import annotations

import logging
import os
import struct
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import xxhash

from dbidx.data.key_columns import HASH_NAME, FileKeys
from dbidx.table.keyhash import spark_hash
from dbidx.table.records import DataFileRecord

TRIM_EVERY = 64  # trim after saving 1/64 of the byte budget, or of MAX_FILES files
MAX_FILES = 65_536
SAMPLE = 256  # (hash, row) pairs recomputed when a key file is read
MAGIC = b"DBIDXKF1"
KEY_FILES_DIR = "keys"  # beside a table's shard caches: <base>/<table dir>/keys
SUFFIX = ".keys"
_HEADER = struct.Struct("<8sQ")  # magic, XXH64 of the Arrow IPC payload that follows (16 bytes: keeps 8-byte alignment)
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
        self._lock = threading.Lock()

    @classmethod
    def shared(cls, root: str | Path, max_bytes: int) -> "KeyFiles":
        """One instance per directory and budget in this process, saving in the background (Python workers are
        reused: what it saved since its last trim carries over from task to task)."""
        with _SHARED_LOCK:
            return _SHARED.setdefault((str(root), max_bytes), cls(root, max_bytes, background=True))

    def path_of(self, record: DataFileRecord) -> Path | None:
        """Where a data file's key index is kept (by content: its checksum's hex digits and its row count); None for
        a checksum that cannot name a file (read from a commit, so never trusted to become a path part)."""
        digest = record.checksum.rsplit(":", 1)[-1]
        if not (digest.isascii() and digest.isalnum()) or not 0 <= record.rows < 2**31:
            return None
        return self.root / f"{digest}-{record.rows}{SUFFIX}"

    def load(self, record: DataFileRecord) -> FileKeys | None:
        """The file's key index mapped from disk, checked; None when absent or damaged (a damaged one is deleted)."""
        path = self.path_of(record)
        if path is None:
            return None
        try:
            with pa.memory_map(str(path)) as mapped:
                data = mapped.read_buffer()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("dbidx could not read the key file %s (%s); reading the data file instead", path, exc)
            return None
        try:
            found = _decode(data, record)
        except (ValueError, pa.ArrowException) as exc:
            log.warning("dbidx deleted the damaged key file %s (%s); it is rebuilt from the data file", path, exc)
            path.unlink(missing_ok=True)
            return None
        _touch(path)
        return found

    def save(self, record: DataFileRecord, keys: FileKeys) -> None:
        """Keep a file's key index (written whole to a temporary name, then renamed), then trim to the budget; on
        the process's saver thread when `background` (a task does not wait: its worker writes while the driver
        commits; `wait_for_saves` drains). Best effort: a failure costs the next worker a rebuild, never the batch."""
        if self.background:
            _saver().submit(self._save_logged, record, keys)
        else:
            self._save_now(record, keys)

    def _save_logged(self, record: DataFileRecord, keys: FileKeys) -> None:
        try:
            self._save_now(record, keys)
        except Exception as exc:  # noqa: BLE001 - nobody waits for a background save: said here, or never
            log.warning("dbidx could not keep the key index of %s in %s: %s", record.path, self.root, exc)

    def _save_now(self, record: DataFileRecord, keys: FileKeys) -> None:
        path = self.path_of(record)
        if path is None or len(keys.keys) != record.rows or self.max_bytes <= 0:
            return
        if path.exists():
            _touch(path)
            return
        tmp = path.with_name(f".tmp-{uuid.uuid4().hex}{SUFFIX}")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            payload = _encode(keys, record)
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
                out.write(_HEADER.pack(MAGIC, xxhash.xxh64(payload).intdigest()))
                out.write(payload)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("dbidx could not keep the key index of %s in %s: %s", record.path, self.root, exc)
            tmp.unlink(missing_ok=True)
            return
        # Trimming lists the directory: done once per 1/TRIM_EVERY of the budget saved, so the directory stays
        # within its bounds plus that slice per writing process.
        with self._lock:
            saved, files = self._unchecked[0] + _HEADER.size + payload.size, self._unchecked[1] + 1
            due = saved >= self.max_bytes // TRIM_EVERY or files >= MAX_FILES // TRIM_EVERY
            self._unchecked = (0, 0) if due else (saved, files)
        if due:
            self.trim()

    def trim(self) -> int:
        """Delete the least recently used key files until the directory fits `max_bytes` and MAX_FILES; returns how
        many went."""
        files = []
        try:
            with os.scandir(self.root) as entries:
                for entry in entries:
                    if entry.name.endswith(SUFFIX) and not entry.name.startswith(".tmp-"):
                        try:
                            info = entry.stat()
                        except FileNotFoundError:
                            continue
                        files.append((info.st_mtime, info.st_size, entry.path))
        except FileNotFoundError:
            return 0
        total = sum(size for _m, size, _p in files)
        removed = 0
        count = len(files)
        for _mtime, size, path in sorted(files):
            if total <= self.max_bytes and count <= MAX_FILES:
                break
            Path(path).unlink(missing_ok=True)  # a reader that mapped it keeps its pages
            total -= size
            count -= 1
            removed += 1
        return removed


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


def _encode(keys: FileKeys, record: DataFileRecord) -> pa.Buffer:
    """The Arrow IPC file of one key index: keys, sorted hashes and their rows, with what they index."""
    batch = pa.record_batch([keys.keys, pa.array(keys.sorted_hashes), pa.array(keys.order)],
                            names=["key", "sorted_hash", "row"])
    meta = {"data_checksum": record.checksum, "rows": str(record.rows), "hash": HASH_NAME}
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, batch.schema.with_metadata(meta)) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


def _decode(data: pa.Buffer, record: DataFileRecord) -> FileKeys:
    """A key file's index, every check passed (ValueError or ArrowException naming the first that fails)."""
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
    if batch.schema.names != ["key", "sorted_hash", "row"] or batch.num_rows != record.rows:
        raise ValueError(f"columns {batch.schema.names} of {batch.num_rows} rows")
    keys, hashes, rows = batch.column(0), batch.column(1), batch.column(2)
    if not (pa.types.is_string(keys.type) or pa.types.is_large_string(keys.type)) or keys.null_count:
        raise ValueError(f"key column of type {keys.type} with {keys.null_count} nulls")
    if hashes.type != pa.uint32() or rows.type != pa.int32() or hashes.null_count or rows.null_count:
        raise ValueError(f"hash and row columns of types {hashes.type}, {rows.type}")
    sorted_hashes = hashes.to_numpy(zero_copy_only=True)
    order = rows.to_numpy(zero_copy_only=True)
    # Wrong rows would mark the wrong records deleted: the rows must be in range and the hashes sorted.
    if len(order) and (order.min() < 0 or order.max() >= record.rows):
        raise ValueError("a row number is out of range")
    if np.any(sorted_hashes[1:] < sorted_hashes[:-1]):
        raise ValueError("hashes out of order")
    # A sample of the pairs recomputed: hashes that belong to other rows would hide rows from the search.
    sample = np.linspace(0, len(order) - 1, num=min(len(order), SAMPLE), dtype=np.int64)
    if len(sample) and not np.array_equal(spark_hash(keys.take(pa.array(order[sample]))).view(np.uint32),
                                          sorted_hashes[sample]):
        raise ValueError("a sampled hash is not its row's key's hash")
    return FileKeys(keys, sorted_hashes, order)


def _touch(path: Path) -> None:
    """Mark a key file used (the budget drops the least recently used first)."""
    try:
        os.utime(path)
    except OSError:
        pass


def sweep_unused(root: str | Path, cutoff_s: float) -> list[str]:
    """Delete key files (and temporary ones a killed writer left) not used since `cutoff_s` (epoch seconds), then
    the directory if that emptied it; returns what went. The cache reaper's part for key files: an executor's
    shards move on, and nothing else would ever read them again."""
    removed: list[str] = []
    try:
        with os.scandir(root) as entries:
            for entry in entries:
                if not entry.name.endswith(SUFFIX) or not entry.is_file(follow_symlinks=False):
                    continue  # never delete what we cannot recognise
                try:
                    if entry.stat(follow_symlinks=False).st_mtime < cutoff_s:
                        os.unlink(entry.path)
                        removed.append(entry.path)
                except FileNotFoundError:
                    continue
    except (FileNotFoundError, NotADirectoryError):
        return removed
    try:
        os.rmdir(root)  # only succeeds when empty
    except OSError:
        pass
    return removed
