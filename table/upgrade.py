"""`dbidx upgrade`: a format-3 table (rows merged by key per file group) becomes a format-4 table (a Delta Lake table
whose superseded and delete rows are deletion vectors), in place, without rewriting a data file.

Why this order (docs/FORMAT.md section 14): a format-3 reader reads table.json, the completion log, its checkpoints
and the data files the log lists; a format-4 reader also needs the upgrade's completion record (the vectors). So:
1. the vectors are computed from the data files exactly as a format-3 reader merges them (per file group, the row
   of the latest commit wins, delete rows drop) and written to one DV file, which no format-3 reader looks at;
2. the upgrade's completion record is staged beside table.json (`.dbidx/upgrade-from-3.json`);
3. table.json is replaced by its format-4 form naming that record's seq (one atomic rename: the switch);
4. the staged record is published as that seq, then the Delta log is written and a checkpoint taken.
A crash before step 3 leaves the format-3 table as it was (an unlisted DV file and markers besides, which a new run
replaces); after it, every format-4 open first publishes the staged record (finish_upgrade), so the new reader
always reads the whole table. A format-3 writer that commits while the upgrade runs is caught at step 4: table.json
goes back to format 3, nothing is published, and the upgrade fails (stop the writers and run it again).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import numpy as np
import pyarrow as pa
from pyroaring import BitMap

from dbidx.data.deletion_vectors import positions_bitmap
from dbidx.data.superseded import _read_columns, write_vectors
from dbidx.errors import CorruptFileError, FormatUpgradeError, TableNotFoundError
from dbidx.table.facade import Table
from dbidx.progress import Progress, Steps
from dbidx.storage import layout, markers
from dbidx.storage.checkpoint import checkpoint_seqs
from dbidx.storage.data_view import LAYOUT_EXTRA, DataView, LiveDataFile
from dbidx.storage.fileio import FileIO
from dbidx.storage.format_switch import STAGED_RECORD, UPGRADE_FROM, finish_upgrade, publish, revert
from dbidx.storage.keyhash import HASH_NAME
from dbidx.storage.properties import FORMAT_VERSION, parse_properties, properties_json
from dbidx.storage.records import ACTION_UPGRADE, CompletedInstant
from dbidx.storage.timeline import Timeline

UPGRADE_LOCK = f"{layout.META_DIR}/upgrade.lock"
_ALL_LEGACY = 10**18  # while the table is still format 3, every record is a format-3 record


@dataclass
class UpgradeReport:
    """What `upgrade_table` did (or found done)."""

    uri: str
    status: str  # "upgraded", "finished" (a crashed upgrade's last step), "already" (format 4 already)
    upgraded_at_seq: int = 0
    data_files: int = 0
    files_with_vectors: int = 0
    rows_hidden: int = 0
    live_rows: int = 0
    delta_versions: int = 0
    rolled_back: list[str] = field(default_factory=list)
    seconds: float = 0.0


def upgrade_table(
    uri: str,
    fs: Any = None,
    storage_options: Mapping[str, Any] | None = None,
    rollback_pending: bool = False,
    progress: Progress | None = None,
) -> UpgradeReport:
    """Upgrade the format-3 table at `uri` to format 4 in place (see the module docstring for the steps and their
    crash safety). Pending instants (a running or crashed format-3 writer) refuse the upgrade unless
    `rollback_pending`: they are then rolled back once the table is format 4. Running it on a format-4 table only
    finishes an upgrade a crash cut short. `progress` hears of each file group whose vectors are computed (rows:
    rows read)."""
    started_at = time.perf_counter()
    io = FileIO.from_uri(uri, fs, storage_options)
    io.check_not_a_file()
    if not io.exists(layout.PROPERTIES_FILE):
        raise TableNotFoundError(
            f"no dbidx table at {io.root} ({layout.PROPERTIES_FILE} not found): nothing to upgrade"
        )
    with _UpgradeLock(io):
        report = _upgrade_locked(io, uri, fs, storage_options, rollback_pending, progress)
    report.seconds = time.perf_counter() - started_at
    return report


def _upgrade_locked(
    io: FileIO,
    uri: str,
    fs: Any,
    storage_options: Mapping[str, Any] | None,
    rollback_pending: bool,
    progress: Progress | None = None,
) -> UpgradeReport:
    """upgrade_table's steps, run while this process holds the upgrade lock."""
    original = io.read_bytes(layout.PROPERTIES_FILE)
    props = parse_properties(original, io.path(layout.PROPERTIES_FILE))
    if props.format_version == FORMAT_VERSION:
        # A crash after the switch: publish the staged record (an open may have done it), write the Delta log,
        # roll back what the crashed run was asked to.
        finished = finish_upgrade(io, props)
        report = UpgradeReport(io.root, "already", props.upgraded_at_seq)
        if props.upgraded_at_seq:
            table = Table.open(uri, fs, storage_options)
            _settle(table, report)
            if finished or report.delta_versions:
                report.status = "finished"
            if rollback_pending:
                report.rolled_back = _roll_back(table, table.timeline.pending())
        return report
    if props.format_version != UPGRADE_FROM or props.key_hash != HASH_NAME:
        raise FormatUpgradeError(
            f"the table at {io.root} is in format {props.format_version} / hash "
            f"{props.key_hash}; `dbidx upgrade` converts format {UPGRADE_FROM} tables only"
        )
    # 1. The format-3 log as it stands (its checkpoints hold format-3 views: replay the records instead).
    timeline = Timeline(io, props.table_id)
    timeline.legacy_upto = timeline.first_checkpoint = _ALL_LEGACY
    timeline.refresh()
    _discard_crashed_upgrades(io, timeline)
    pending = timeline.pending()
    if pending and not rollback_pending:
        raise FormatUpgradeError(
            f"the table at {io.root} has pending instants {pending} (a format-3 writer is running, or crashed): stop "
            "its writers; if they are gone, run `dbidx upgrade URI --rollback-pending` (they are rolled back after "
            "the upgrade); nothing was changed"
        )
    view = DataView()
    view.apply(timeline.completed())
    last = timeline.latest_seq
    # 2. The vectors of every file group, in one DV file of the upgrade's own instant.
    started = timeline.start(ACTION_UPGRADE, ignore=pending)
    vectors = table_vectors(io, view, progress)
    dv_files, deletion_vectors = write_vectors(io, started.instant, vectors)
    record = CompletedInstant(
        seq=last + 1,
        instant=started.instant,
        action=ACTION_UPGRADE,
        completed_at_ms=int(time.time() * 1000),
        start_seq=last,
        table_id=props.table_id,
        dv_files=dv_files,
        deletion_vectors=deletion_vectors,
        extra={"upgraded_from": UPGRADE_FROM},
    )
    # 3. Staged record, then the switch: table.json in format 4, naming the record's seq.
    io.write_atomic(STAGED_RECORD, record.to_json())
    io.write_atomic(
        layout.PROPERTIES_FILE,
        properties_json(replace(props, format_version=FORMAT_VERSION, upgraded_at_seq=record.seq)),
    )
    # 4. Publish; a format-3 commit that slipped in first takes the switch back.
    try:
        publish(timeline, started, record)
    except FormatUpgradeError:
        revert(io, original, record)
        raise
    io.delete(STAGED_RECORD)
    report = UpgradeReport(
        io.root, "upgraded", record.seq, len(view.live()), len(vectors), sum(len(v) for v in vectors.values())
    )
    table = Table.open(uri, fs, storage_options)
    _settle(table, report)
    report.rolled_back = _roll_back(table, pending)
    return report


def _roll_back(table: Any, instants: list[str]) -> list[str]:
    """Roll back the given pending instants (format-3 writers that are gone), now that the table is format 4."""
    for instant in instants:
        table.rollback(instant)
    return list(instants)


class _UpgradeLock:
    """`.dbidx/upgrade.lock`, created exclusively: one upgrade of a table at a time (a second one would take the
    first one's pending instant for a crashed run's and discard it). A lock left by a dead process of this host is
    taken over; any other is a FormatUpgradeError naming the file."""

    def __init__(self, io: FileIO) -> None:
        self.io = io
        self.body = json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "started_at_ms": int(time.time() * 1000)}
        ).encode()

    def __enter__(self) -> "_UpgradeLock":
        for _ in range(2):
            if self.io.create_exclusive(UPGRADE_LOCK, self.body):
                return self
            if not self._stale():
                break
            self.io.delete(UPGRADE_LOCK)
        raise FormatUpgradeError(
            f"another `dbidx upgrade` of {self.io.root} is running ({self.io.path(UPGRADE_LOCK)} exists); if it is "
            "not (it ran on another host and died), delete that file and run the upgrade again"
        )

    def _stale(self) -> bool:
        try:
            holder = json.loads(self.io.read_bytes(UPGRADE_LOCK))
            if holder.get("host") != socket.gethostname():
                return False
            os.kill(int(holder["pid"]), 0)
            return False  # that process lives
        except ProcessLookupError:
            return True
        except (ValueError, KeyError, TypeError, PermissionError, CorruptFileError):
            return False

    def __exit__(self, *exc: Any) -> None:
        self.io.delete(UPGRADE_LOCK)


def table_vectors(io: FileIO, view: DataView, progress: Progress | None = None) -> dict[str, BitMap]:
    """Per live data file, the rows a format-3 reader does not return: in each file group (files in commit order)
    every row but the last of its key, and the last one too when it is a delete row."""
    layout_value = view.layout.value if view.layout is not None else None
    if not view.live():
        return {}
    if not isinstance(layout_value, dict) or not isinstance(layout_value.get("key"), str):
        raise CorruptFileError(
            f"the completion log of {io.root} records no key column (its {LAYOUT_EXTRA!r} "
            "extra): the rows of its data files cannot be merged"
        )
    key = layout_value["key"]
    groups: dict[tuple[str, str], list[LiveDataFile]] = {}
    for live in view.live():
        groups.setdefault((live.record.partition, live.record.file_group), []).append(live)
    vectors: dict[str, BitMap] = {}
    steps = Steps(progress, len(groups))
    for (partition, file_group), entries in sorted(groups.items()):
        entries.sort(key=lambda e: e.order)
        # 1. The group's keys and delete flags, rows numbered in commit order.
        columns = [_read_columns(io, e.record, key) for e in entries]
        keys = pa.concat_arrays([k for k, _d in columns]) if columns else pa.array([], pa.string())
        deleted = np.concatenate([d for _k, d in columns])
        # 2. Per key the highest row number is the record's row; a delete row hides it too.
        numbered = pa.table({"k": keys, "n": pa.array(np.arange(len(keys), dtype=np.int64))})
        keep = np.zeros(len(keys), dtype=bool)
        keep[numbered.group_by("k").aggregate([("n", "max")]).column("n_max").to_numpy()] = True
        keep &= ~deleted
        # 3. Split back into each file's rows.
        start = 0
        for entry, (file_keys, _d) in zip(entries, columns):
            hidden = np.flatnonzero(~keep[start : start + len(file_keys)])
            start += len(file_keys)
            if len(hidden):
                vectors[entry.record.path] = positions_bitmap(hidden)
        steps.step(f"{partition or '(root)'} {file_group}", len(keys))
    return vectors


def _discard_crashed_upgrades(io: FileIO, timeline: Timeline) -> None:
    """An upgrade that died before its switch left a pending instant of its own: its DV file (announced) goes with
    its markers, so this run starts over (no format-3 reader ever looked at them)."""
    for instant in timeline.pending():
        try:
            action = json.loads(io.read_bytes(layout.requested_file(instant))).get("action")
        except (ValueError, AttributeError, CorruptFileError):
            continue  # not readable as an upgrade's marker: a writer's pending instant, reported as such
        if action == ACTION_UPGRADE:
            markers.discard_unlisted(io, instant, ())
            io.delete(layout.inflight_file(instant))
            io.delete(layout.requested_file(instant))
            io.delete(layout.heartbeat_file(instant))
    io.delete(STAGED_RECORD)


def _settle(table: Any, report: UpgradeReport) -> None:
    """After the publish: the Delta log (versions 0..seq) and a checkpoint at the upgrade, so no reader needs the
    format-3 checkpoints again."""
    report.delta_versions = table.sync_delta_log()
    if report.delta_versions or not [s for s in checkpoint_seqs(table.io) if s >= table.props.upgraded_at_seq]:
        table.checkpoint()
    report.live_rows = table.data_view().live_rows()
