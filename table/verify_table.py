"""Check every file of a table's latest snapshot against its completion record: size and checksum.

What `dbidx verify URI` runs. Unlike a read, which stops at the first damaged file, it looks at every live
index file (the files the latest snapshot of each (partition, shard) merges) and every data file a completed
upsert listed, and reports each problem, so an operator sees the whole extent of the damage at once. The timeline
itself is parsed on the way (a damaged or missing completion record raises CorruptFileError), and the newest
checkpoint is compared with a replay of every record up to it (archived ones included), or, once archive retention
expired the oldest records, with a replay from the retention floor's saved state (storage/archive_retention.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from dbidx.data.delta_actions import table_relative
from dbidx.data.delta_log import DELTA_LOG_DIR, stored_versions
from dbidx.data.delta_types import type_changes
from dbidx.data.schema import recorded_schema
from dbidx.data.superseded import load_vector
from dbidx.errors import CorruptFileError, DbidxError, HistoryCompactedError, ReadOnlyTableError
from dbidx.index import rli_files
from dbidx.table.facade import Table
from dbidx.progress import Progress, Steps
from dbidx.storage import instant_range, layout
from dbidx.storage.archive_retention import views_at
from dbidx.storage.history_floor import FLOOR_DIR
from dbidx.storage.checkpoint import checkpoint_seqs, read_checkpoint
from dbidx.storage.data_view import DataView
from dbidx.storage.records import FileRecord


@dataclass
class TableCheck:
    """Outcome of verifying a table's files."""

    seq: int
    index_files: int = 0
    data_files: int = 0
    deletion_vectors: int = 0
    checkpoint_seq: int | None = None  # the checkpoint compared with a replay of the log, if any
    history_floor: int = 0  # records up to here were expired by archive retention: the replay starts there
    not_checked: list[str] = field(default_factory=list)  # what the expired history no longer lets verify check
    bytes_checked: int = 0
    damaged: list[dict[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every file matched its record."""
        return not self.damaged

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        out: dict[str, Any] = {
            "seq": self.seq,
            "index_files": self.index_files,
            "data_files": self.data_files,
            "deletion_vectors": self.deletion_vectors,
            "checkpoint_seq": self.checkpoint_seq,
            "bytes_checked": self.bytes_checked,
            "damaged": self.damaged,
            "ok": self.ok,
        }
        if self.history_floor:  # only a table whose history retention expired (docs/CLI.md lists the others)
            out |= {"history_floor": self.history_floor, "not_checked": self.not_checked}
        return out


def verify_table(table: Table, progress: Progress | None = None) -> TableCheck:
    """Verify size and checksum of every live index file and every published data file of the latest snapshot (the
    latest Delta version: other engines' versions are absorbed first; one that cannot be is reported as damage)."""
    unabsorbed = None
    try:
        table.follow_delta_log()
    except ReadOnlyTableError:
        raise  # not damage: this reader may not absorb what other engines wrote (it names `dbidx sync`)
    except DbidxError as exc:
        unabsorbed = {"path": "_delta_log", "problem": f"{type(exc).__name__}: {exc}"}
    view = table.refresh()
    check = TableCheck(seq=table.timeline.latest_seq)
    if unabsorbed is not None:
        check.damaged.append(unabsorbed)
    index_records = []
    for partition, shard in view.groups():
        try:
            index_records += view.files(partition, shard)
        except HistoryCompactedError as exc:  # a live file was cleaned: that is damage too
            check.damaged.append({"path": f"{partition}/{shard}", "problem": str(exc)})
    data_records = [f.record for f in table.data_view().live()]
    steps = Steps(progress, len(index_records) + len(data_records))
    for record in index_records + data_records:
        try:
            if isinstance(record, FileRecord):
                rli_files.open_rli_file(table.io, record)  # also checks rows and schema
                check.index_files += 1
            else:
                table.io.read_verified(record.path, record.size, record.checksum, "data file")
                check.data_files += 1
            check.bytes_checked += record.size
        except CorruptFileError as exc:
            check.damaged.append({"path": record.path, "problem": str(exc)})
        steps.step(record.path)
    _check_vectors(table, check)
    _compare_with_delta(table, check)
    _compare_checkpoint(table, check)
    # Instant ids at the end of the range stop every writer (storage/instant_range.py): each source is reported.
    try:
        found = instant_range.sources(table.io, table.timeline)
    except CorruptFileError as exc:  # the kept history does not read back (a damaged floor, a gap above it)
        found = (
            []
            if any(str(exc) == d["problem"] for d in check.damaged)
            else [{"path": table.io.path(layout.TIMELINE_DIR), "problem": str(exc)}]
        )
    check.damaged += [{"path": s["path"], "problem": s["problem"]} for s in found]
    return check


def _check_vectors(table: Table, check: TableCheck) -> None:
    """Every live file's deletion vector reads back whole (DV file size and checksum, the vector's CRC-32,
    cardinality and positions), and the Delta log has a version for every completion (`dbidx repair` writes missing
    ones)."""
    view = table.data_view()
    dv_files: dict[str, bytes] = {}  # DV file bytes, read once per file across the vectors it holds
    for live in view.live():
        ref = view.vector_of(live.record.path)
        if ref is None:
            continue
        try:
            load_vector(table.io, ref, live.record.rows, dv_files)
            check.deletion_vectors += 1
        except CorruptFileError as exc:
            check.damaged.append({"path": ref.file.path, "problem": str(exc)})
    data = table.data_view()
    first, offset = data.delta_first_seq, data.delta_offset  # an adopted Delta table's own versions come first
    wanted = set(range(first + offset, table.timeline.latest_seq + offset + 1))
    # Versions a Delta checkpoint sums up may have been expired by a log cleanup.
    listed, floor = stored_versions(table.io)
    missing = sorted(v for v in wanted - listed if v > floor)
    if missing:
        check.damaged.append(
            {
                "path": table.io.path(DELTA_LOG_DIR),
                "problem": f"Delta version(s) {missing[:10]} "
                "are missing (a crash between a commit and its Delta version); `dbidx repair URI` "
                "writes them",
            }
        )


def _compare_with_delta(table: Table, check: TableCheck) -> None:
    """The index against the log: delta-rs's snapshot of the latest Delta version lists exactly the index's live data
    files, each with the size the index recorded (local tables and object stores named by URI)."""
    from deltalake import DeltaTable

    view = table.data_view()
    if view.schema is None or check.damaged or not (table.io.is_local or "://" in table.io.uri):
        return  # nothing written yet, or damage already reported (a missing version makes delta-rs disagree too)
    where = table.io.path(DELTA_LOG_DIR)
    try:
        snapshot = DeltaTable(
            table.io.path("") if table.io.is_local else table.io.uri, storage_options=table.io.storage_options or None
        )
        adds = pa.table(snapshot.get_add_actions(flatten=True))
        theirs = {
            table_relative(table.io, str(p), where): int(s)
            for p, s in zip(adds.column("path").to_pylist(), adds.column("size_bytes").to_pylist())
        }
    except DbidxError as exc:
        check.damaged.append({"path": where, "problem": f"the Delta log lists a file dbidx cannot index: {exc}"})
        return
    except Exception as exc:  # noqa: BLE001 - delta-rs raises its own types for a log it cannot read
        check.damaged.append({"path": where, "problem": f"delta-rs cannot read the Delta log: {exc}"})
        return
    if snapshot.version() != table.delta_version():
        check.damaged.append(
            {
                "path": where,
                "problem": f"the Delta log is at version {snapshot.version()}, the "
                f"index at {table.delta_version()} (a writer committed meanwhile? verify again)",
            }
        )
        return
    _compare_schemas(view, snapshot.schema().to_json(), where, check)
    ours = {f.record.path: f.record.size for f in view.live()}
    for path in sorted(set(theirs) ^ set(ours))[:10]:
        side = (
            "the Delta log lists it, the index does not"
            if path in theirs
            else "the index lists it, the Delta log does not"
        )
        check.damaged.append({"path": path, "problem": f"{side}: Delta readers and dbidx read different tables"})
    for path in sorted(p for p in set(theirs) & set(ours) if theirs[p] != ours[p])[:10]:
        check.damaged.append(
            {"path": path, "problem": f"the Delta log says {theirs[path]} bytes, the index {ours[path]}"}
        )


def _compare_schemas(view: DataView, schema_string: str, where: str, check: TableCheck) -> None:
    """Every column has the same type (in Delta's terms, data/delta_types.py) in dbidx's recorded schema as in the
    log's newest metaData. Why: dbidx writes its files in the recorded types, and Delta readers read every file as
    the log's; a table an older dbidx absorbed another engine's type change into silently is reported here."""
    recorded = recorded_schema(view.schema)
    if recorded is None:
        return
    layout_ = view.layout.value if view.layout is not None else None
    key = layout_.get("key") if isinstance(layout_, dict) else None
    for column, ours, theirs in type_changes(recorded, schema_string)[:10]:
        check.damaged.append(
            {
                "path": where,
                "problem": f"column {column!r} is {theirs} in the Delta log's schema but {ours} in dbidx's "
                "recorded schema, which dbidx writes its files in: Delta readers fail on such a file. Re-adopt the "
                f"table to take the log's schema (`dbidx build-index URI --key {key or 'COLUMN'} --readopt`); a "
                f"data file already written with {ours} values stays unreadable to them until it is rewritten",
            }
        )


def _compare_checkpoint(table: Table, check: TableCheck) -> None:
    """The newest checkpoint must hold exactly what replaying records 1..its seq gives: a checkpoint whose
    checksum is intact but whose content another writer got wrong (or crafted) is reported, not trusted. Once
    archive retention expired records 1..F, the replay starts from the floor's saved state at F: the floor file is
    checked (checksum, table id, fields, its views' seq), and what it sums up can no longer be (reported in
    `not_checked`)."""
    seqs = [s for s in checkpoint_seqs(table.io) if s >= table.timeline.first_checkpoint]  # not format-3 ones
    try:
        floor = table.timeline.history_floor()
    except CorruptFileError as exc:
        check.damaged.append({"path": table.io.path(FLOOR_DIR), "problem": str(exc)})
        return
    start = 1
    if floor is not None:
        start = floor.seq + 1
        check.history_floor = floor.seq
        check.not_checked.append(
            f"completions 1..{floor.seq} were expired by archive retention "
            f"({floor.where}): the state the floor saved at seq {floor.seq} is the replay's "
            "start and is checked only for its checksum and form, not against those records"
        )
        if not seqs or seqs[-1] < floor.seq:
            check.damaged.append(
                {
                    "path": floor.where,
                    "problem": "no checkpoint at or above the history floor "
                    f"(seq {floor.seq}): the table cannot be opened without the expired records",
                }
            )
            return
    if not seqs:
        return
    try:
        cp = read_checkpoint(table.io, seqs[-1], table.props.table_id)
        index, data = views_at(table.timeline, cp.seq)
    except CorruptFileError as exc:
        where = (
            floor.where
            if floor is not None and str(floor.where) in str(exc)
            else table.io.path(layout.checkpoint_file(seqs[-1]))
        )
        check.damaged.append({"path": where, "problem": str(exc)})
        return
    check.checkpoint_seq = cp.seq
    for name, replayed, stored in (("index", index.to_dict(), cp.index), ("data", data.to_dict(), cp.data)):
        if replayed != stored:
            check.damaged.append(
                {
                    "path": cp.where,
                    "problem": f"its {name} view differs from a replay of "
                    f"completions {start}..{cp.seq}; remove the checkpoint (the table then opens from "
                    "an older one or from the log)",
                }
            )
