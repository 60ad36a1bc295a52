"""Key files of data files the table no longer has: deleted by the executor's next upsert task, not kept until the
key-file budget or the reaper's TTL.

Why: the executor-local cache directory of a table (`<base>/<table dir>/`) holds the shard caches (RocksDB) and the
key files of the table's data files (`keys/`, data/key_files.py: about 43 bytes per row of the data file). The
RocksDB caches stay proportional to the keys (a location is a file group, which a data compaction keeps), but a key
file outlived its data file: a data compaction rewrites a partition's small files into a base every few batches,
and the key files of the files it replaced stayed until the directory reached `key.files.mb` (4,096 MB) or 65,536
files, or nobody used them for the reaper's TTL (72 h). Measured with benchmarks/soak_bench.py, services on
(100 k keys, 100 batches of 2 k rows, 2 shards): `keys/` grew from 4.4 to 67 MiB, 6,122 files for 265 live data
files, while the shard caches went from 2.1 to 2.7 MiB (proportional to the keys); at 1 M keys the directory reached
1.9 GiB after 300 batches. With this sweep: `keys/` stays between 5.0 and 9.0 MiB (469 files at batch 100: the live
files' and those the last compaction replaced, until the next batch's sweep). With services off nothing dies and
nothing changes: `keys/` holds the index of every row of the live data files, which grow with every batch until a
data compaction rewrites them.

What is dead. A key file is named by its data file's checksum and rows (the same content, whatever its path). It is
dead when no live data file of the sweep's view has its name and nothing can make one live again: files a data
compaction or another engine removed (they never come back; an identical file added back later only costs a
rebuild of its index), and files of an attempt that lost or of an instant rolled back. It is kept while its data
file may still become live:
  - a file of an instant that has not settled at the sweep's view: the batch a sibling task of the same upsert is
    writing in another worker right now, another writer's. Writing tasks announce the key files they are about to
    save (`announce`): one marker per task attempt in `<table dir>/keys.pending/`, naming the instant and each new
    data file's path and key-file name. A sweep keeps the names of markers whose instant has not settled at its view
    (completed at a later seq counts as not settled), and deletes the markers of settled ones;
  - a key file modified after the sweeping task read its view (less MTIME_SLACK_S): saved or used by a task whose
    view is newer, where its file may be live. Both clocks are this machine's.

When. A full sweep lists the directory (a stat per file) and names the view's live files: O(files), measured at
18 k files at 0.1 to 0.5 s on a 2-core machine loaded 4x over (services off at 1 M keys after 300 batches; with
services on a few hundred files, milliseconds). So it runs only when something can have died: this process has not swept
the directory yet, the completions since its last sweep removed data files (`replaced`: a data compaction, another
engine's version), or a settled marker names a file that is not live (a rolled-back instant, a losing attempt).
Otherwise a sweep is the markers' listing (a few files) and a look at the completions since the last sweep, which the
task's timeline holds in memory.

A sweep never fails an upsert: key files are never needed (a missing one is rebuilt from its data file), so what goes
wrong while sweeping is a warning. Only names data/key_files.py writes are deleted, never through a symbolic link.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from dbidx.data.key_files import FINISHED, finished_files
from dbidx.storage.layout import is_instant
from dbidx.storage.records import ACTION_ABSORB, ACTION_DATA_COMPACTION, ACTION_ROLLBACK

REMOVING = (ACTION_DATA_COMPACTION, ACTION_ABSORB)  # the completions that take data files out of the live set

PENDING_DIR = "keys.pending"  # beside `keys/` in a table's cache directory
FORMAT = 1
MARKER = re.compile(r"(\d{17})~(\d{1,20})\.json")
TMP = re.compile(r"\.tmp-[0-9a-f]{32}")
TMP_AGE_S = 3600.0  # a marker being written by a task that died goes after this long
MTIME_SLACK_S = 2.0  # file systems with coarse timestamps: "modified after the view" is judged with this margin
_SWEPT: dict[str, int] = {}  # per process: key-file directory -> view seq up to which its removals were swept
_SWEPT_LOCK = threading.Lock()
log = logging.getLogger(__name__)


def pending_dir(key_files_root: str | Path) -> Path:
    """Where the writing tasks' markers of a key-file directory live (`<table dir>/keys.pending`)."""
    return Path(key_files_root).parent / PENDING_DIR


def announce(
    key_files_root: str | Path, instant: str, attempt: int | str, files: Iterable[tuple[str, str]]
) -> Path | None:
    """Record that a task attempt of `instant` is about to save the key files `files` ((data file path, key-file
    name) pairs): written whole under a temporary name, then renamed; None when there is nothing to announce. Raises
    OSError when it cannot: the caller then saves no key file (one a sweep could not tell from a dead one)."""
    if not is_instant(instant) or not str(attempt).isdigit():
        raise ValueError(f"instant {instant!r} / attempt {attempt!r} cannot name a key-file marker")
    pairs = [[str(path), str(name)] for path, name in files]
    for _path, name in pairs:
        if not FINISHED.fullmatch(name):
            raise ValueError(f"{name!r} is not a key file's name")
    if not pairs:
        return None
    root = pending_dir(key_files_root)
    if root.is_symlink():
        raise OSError(f"{root} is a symbolic link; key-file markers are only kept in a real directory")
    root.mkdir(mode=0o700, exist_ok=True)
    final = root / f"{instant}~{attempt}.json"
    tmp = root / f".tmp-{uuid.uuid4().hex}"
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
            json.dump({"format": FORMAT, "instant": instant, "files": pairs}, out)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


@dataclass
class Marker:
    """One writing task attempt's announced key files."""

    path: Path
    instant: str
    files: list[tuple[str, str]]  # (data file path, key-file name)


@dataclass
class SweepResult:
    """What one sweep did."""

    full: bool = False  # the directory was listed against the live files
    deleted: list[str] = field(default_factory=list)  # key files deleted (names)
    deleted_bytes: int = 0
    kept_recent: int = 0  # dead by the view, kept because modified after it was read
    kept_pending: int = 0  # not live, announced by an instant that has not settled
    markers_removed: int = 0


def sweep(disk: Any, table: Any, view_read_s: float) -> SweepResult:
    """Delete the key files (in `disk`, a data/key_files.KeyFiles) of data files `table`'s view no longer has, and
    the markers of settled instants (see the module docstring). `table`: the task's Table, pinned (its data view is
    read as it is, not refreshed); `view_read_s`: when the task read that view (time.time(), this machine's clock)."""
    root = Path(disk.root)
    result = SweepResult()
    markers = _read_markers(pending_dir(root))
    # 1. Under the view's lock: its seq, which markers settled, whether anything can have died, the live names.
    with table.held_data_view() as view:
        seq = view.applied_seq
        settled, unsettled, dead_marker = [], [], False
        for marker in markers:
            record = table.timeline.record_of(marker.instant)
            if record is None or (record.action != ACTION_ROLLBACK and record.seq > seq):
                unsettled.append(marker)
                continue
            settled.append(marker)
            dead_marker = (
                dead_marker
                or record.action == ACTION_ROLLBACK
                or not all(view.is_live(path) for path, _name in marker.files)
            )
        with _SWEPT_LOCK:
            swept = _SWEPT.get(str(root))
        full = (
            dead_marker
            or swept is None
            or swept < table.timeline.base_seq
            or any(
                rec.action in REMOVING and rec.replaced
                for rec in table.timeline.completed(after_seq=swept, upto_seq=seq)
            )
        )
        live = {key_file_name(f.record) for f in view.live()} if full else set()
    # 2. The directory against the live names, announced names and recent changes.
    if full:
        result.full = True
        announced = {name for m in unsettled for _path, name in m.files}
        cutoff = view_read_s - MTIME_SLACK_S
        for mtime, size, path in finished_files(root):
            name = os.path.basename(path)
            if name in live:
                continue
            if name in announced:
                result.kept_pending += 1
            elif mtime >= cutoff:
                result.kept_recent += 1
            elif _unlink(Path(path)):
                result.deleted.append(name)
                result.deleted_bytes += size
    # 3. Settled markers go (their files are live, or were just deleted); the directory is swept up to `seq` unless
    #    something was kept only for being recent (the next task's newer view decides it).
    for marker in settled:
        if _unlink(marker.path):
            result.markers_removed += 1
    if not result.kept_recent:
        with _SWEPT_LOCK:
            _SWEPT[str(root)] = max(seq, _SWEPT.get(str(root), 0))
    return result


def key_file_name(record: Any) -> str:
    """The name data/key_files.KeyFiles.path_of gives a data file's key file (its checksum's hex digits and its
    row count), without a Path per file: a full sweep names every live file (~1 us a file here, ~11 us through
    path_of). A name path_of would refuse never matches a file on disk, so it needs no check here."""
    return f"{record.checksum.rsplit(':', 1)[-1]}-{record.rows}.keys"


def _read_markers(root: Path) -> list[Marker]:
    """The markers of a directory, each parsed strictly; one that does not parse is deleted with a warning (it
    protects nothing then: at worst a pending file's key index is rebuilt), a temporary one left for TMP_AGE_S."""
    if root.is_symlink() or not root.is_dir():
        return []
    markers = []
    now = time.time()
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return []
    for entry in entries:
        path = Path(entry.path)
        if TMP.fullmatch(entry.name):
            try:
                if now - entry.stat(follow_symlinks=False).st_mtime > TMP_AGE_S:
                    _unlink(path)
            except OSError:
                pass
            continue
        match = MARKER.fullmatch(entry.name)
        if match is None or not entry.is_file(follow_symlinks=False):
            continue  # never delete what we cannot recognise
        try:
            data = json.loads(path.read_text())
            files = [(str(p), str(n)) for p, n in data["files"]]
            if (
                data["format"] != FORMAT
                or data["instant"] != match.group(1)
                or not all(isinstance(p, str) and FINISHED.fullmatch(n) for p, n in data["files"])
            ):
                raise ValueError("format, instant or a key-file name does not match")
        except FileNotFoundError:
            continue  # settled and deleted by another process's sweep meanwhile
        except (OSError, ValueError, TypeError, KeyError) as exc:
            log.warning("dbidx deleted the unreadable key-file marker %s (%s)", path, exc)
            _unlink(path)
            continue
        markers.append(Marker(path, match.group(1), files))
    return markers


def sweep_stale_markers(key_files_root: str | Path, cutoff_s: float) -> list[str]:
    """Delete markers (and temporary ones) not changed since `cutoff_s`, then the directory if that emptied it: the
    cache reaper's part (a writer whose instant never settles, an executor whose tables moved on)."""
    root = pending_dir(key_files_root)
    removed: list[str] = []
    if root.is_symlink() or not root.is_dir():
        return removed
    try:
        with os.scandir(root) as entries:
            for entry in entries:
                if not (MARKER.fullmatch(entry.name) or TMP.fullmatch(entry.name)):
                    continue
                try:
                    if entry.stat(follow_symlinks=False).st_mtime < cutoff_s and _unlink(Path(entry.path)):
                        removed.append(entry.path)
                except OSError:
                    continue
        root.rmdir()  # only succeeds when empty
    except OSError:
        pass
    return removed


def _unlink(path: Path) -> bool:
    """Delete one file; False when it was gone already or cannot be deleted (said in a warning)."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("dbidx could not delete %s: %s", path, exc)
        return False


def forget_swept() -> None:
    """Forget which directories this process swept (tests: a new process)."""
    with _SWEPT_LOCK:
        _SWEPT.clear()
