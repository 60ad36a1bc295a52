"""The switch of an upgrade from format 3 (docs/FORMAT.md section 14): the staged upgrade record, publishing it at
exactly the seq table.json names, and taking the switch back when a format-3 writer took that seq first.

Every open of a format-4 table calls `finish_upgrade` (a crash may have cut an upgrade short between the switch and
the publish), so this lives on the table's own floor; the upgrade itself (`dbidx upgrade`) is table/upgrade.py.
"""

from __future__ import annotations

from dataclasses import replace

from dbidx.errors import CorruptFileError, FormatUpgradeError, InstantStateError
from dbidx.storage import layout, markers
from dbidx.storage.fileio import FileIO
from dbidx.storage.properties import TableProperties, properties_json
from dbidx.storage.records import ACTION_UPGRADE, CompletedInstant
from dbidx.storage.timeline import Timeline
from dbidx.storage.timeline_writes import StartedInstant

UPGRADE_FROM = 3
STAGED_RECORD = f"{layout.META_DIR}/upgrade-from-3.json"


def finish_upgrade(io: FileIO, props: TableProperties) -> bool:
    """Publish the staged upgrade record if a crash left the table switched to format 4 without it; True if this
    call published it. Idempotent: any process that opens the table may do it, the record's bytes are fixed. If a
    format-3 writer published that seq instead, the switch is taken back (FormatUpgradeError): the table stays a
    format-3 table that its writers and readers read whole."""
    seq = props.upgraded_at_seq
    if not seq or not io.exists(STAGED_RECORD):
        return False  # never upgraded, or done (the staged record goes after the publish)
    where = io.path(STAGED_RECORD)
    try:
        staged = io.read_bytes(STAGED_RECORD)
    except CorruptFileError:
        if io.exists(STAGED_RECORD):
            raise
        return False  # the upgrading process published and removed it meanwhile
    record = CompletedInstant.from_json(staged, where)
    if record.seq != seq or record.action != ACTION_UPGRADE or record.table_id != props.table_id:
        raise CorruptFileError(
            f"{where} is not the upgrade record table.json names (seq {seq}): restore table.json "
            "from a backup or remove the staged record and run `dbidx upgrade URI` again"
        )
    # 1. The seq is taken: by the upgrade itself (the staged copy is left over), or by a format-3 writer.
    if io.exists(layout.completed_file(seq)):
        there = CompletedInstant.from_json(
            io.read_bytes(layout.completed_file(seq)), io.path(layout.completed_file(seq)), legacy=True
        )
        if there.action == ACTION_UPGRADE and there.instant == record.instant:
            io.delete(STAGED_RECORD)
            return False
        revert(io, properties_json(replace(props, format_version=UPGRADE_FROM, upgraded_at_seq=0)), record)
        raise FormatUpgradeError(
            f"a format-3 writer committed seq {seq} to {io.root} while it was being upgraded: the table is format 3 "
            "again; stop every writer of the table and run `dbidx upgrade URI` again"
        )
    # 2. Not taken: publish it.
    timeline = Timeline(io, props.table_id)
    timeline.legacy_upto = seq - 1
    timeline.first_checkpoint = seq
    timeline.refresh()
    if timeline.latest_seq >= seq:
        return False  # published (maybe archived) by another process meanwhile
    publish(timeline, StartedInstant(record.instant, ACTION_UPGRADE, record.start_seq), record)
    io.delete(STAGED_RECORD)
    return True


def revert(io: FileIO, format3_json: bytes, record: CompletedInstant) -> None:
    """Take the switch back: table.json in its format-3 form, and nothing of the upgrade left (its staged record,
    DV file, markers and timeline files), so format-3 readers and writers go on as before."""
    io.write_atomic(layout.PROPERTIES_FILE, format3_json)
    io.delete(STAGED_RECORD)
    for dv in record.dv_files:
        io.delete(dv.path)
    markers.discard_unlisted(io, record.instant, ())
    io.delete(layout.inflight_file(record.instant))
    io.delete(layout.requested_file(record.instant))


def publish(timeline: Timeline, started: StartedInstant, record: CompletedInstant) -> None:
    """Publish the upgrade record at exactly its seq; another record there is a format-3 writer that committed
    during the upgrade (FormatUpgradeError, nothing published)."""

    def build(seq: int) -> CompletedInstant:
        if seq != record.seq:
            raise FormatUpgradeError(
                f"a writer committed seq {record.seq} to {timeline.io.root} while it was being upgraded: the table "
                "stays in format 3; stop every writer of the table and run `dbidx upgrade URI` again"
            )
        return record

    try:
        timeline.publish(started, build)
    except InstantStateError as exc:
        mine = timeline.record_of(record.instant)
        if mine is None or mine.action != ACTION_UPGRADE or mine.seq != record.seq:
            # rolled back (e.g. by an older dbidx that took it for a dead writer's instant): not published
            raise FormatUpgradeError(
                f"the upgrade's instant {record.instant} of {timeline.io.root} was rolled back "
                "by another process: the table stays in format 3; run `dbidx upgrade URI` "
                "again"
            ) from exc
