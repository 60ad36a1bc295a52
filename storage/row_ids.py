"""Delta row tracking as dbidx keeps it (PROTOCOL.md "Row Tracking"): fresh row ids and row commit versions for the
files dbidx adds, and the high-water mark every writer moves forward.

Why in the data view: a file's `baseRowId` must be above the table's high-water mark when it is added, and every
later `add` or `remove` of the file (a new deletion vector, a vector moved, a compaction's remove) must repeat the
values of its first `add`. The Delta version of a dbidx completion is a function of the record and the data view
right before it (data/delta_derive.py), so the view holds what that needs: the mark, and each live file's values on
its record (`DataFileRecord.base_row_id`, `row_commit_version`). Another engine's values come with its `add`s and
its `delta.rowTracking` domain (absorbed, adopted); a dbidx file's are assigned here, in the order of the record's
files, from the mark before it: the same log, the same values, in the view (`DataView.apply`) and in the Delta
version (`version_for`) alike.

What dbidx does not do: preserve the stable row id of a row it updates, or of a row its data compaction copies, in
the materialized row-id column (a Delta writer "should"; dbidx would have to read each superseded row's id back).
An updated row gets a fresh id, and such a commit says so (`delta.rowTracking.preserved` = false in its
commitInfo tags), as the protocol asks.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Mapping, Sequence

from dbidx.errors import CorruptFileError
from dbidx.storage.records import DataFileRecord

ROW_TRACKING_DOMAIN = "delta.rowTracking"
SUSPENDED = "delta.rowTrackingSuspended"
# Extras of an absorb record: the `delta.rowTracking` mark its versions left, and the protocol its versions set
# (the data view decides from the protocol whether dbidx assigns row ids).
HIGH_WATER_MARK_EXTRA = "row_id_high_water_mark"
PROTOCOL_EXTRA = "delta_protocol"
# ... and the files whose row ids another engine's `add` of a live path changed (Delta Spark's backfill when row
# tracking is turned on): path -> [baseRowId, defaultRowCommitVersion].
ROW_IDS_EXTRA = "row_ids"


def tracks_rows(protocol: Mapping[str, Any] | None, configuration: Mapping[str, str]) -> bool:
    """Row tracking is supported (the protocol lists `rowTracking`) and not suspended: writers assign row ids."""
    features = (protocol or {}).get("writerFeatures") or []
    return "rowTracking" in features and str(configuration.get(SUSPENDED, "false")).lower() != "true"


def assign(files: Sequence[DataFileRecord], high_water_mark: int, version: int) -> tuple[list[DataFileRecord], int]:
    """`files` with fresh row ids (each file's rows numbered from above the mark, in order) and `version` as their
    row commit version; and the mark after them."""
    out = []
    for f in files:
        base = high_water_mark + 1
        out.append(replace(f, base_row_id=base, row_commit_version=version))
        high_water_mark = max(high_water_mark, base + f.rows - 1)
    return out, high_water_mark


def high_water_mark_of(configuration: Any, where: str) -> int:
    """The `rowIdHighWaterMark` of a `delta.rowTracking` domain's configuration (read back: untrusted)."""
    try:
        value = json.loads(configuration)["rowIdHighWaterMark"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptFileError(f"the {ROW_TRACKING_DOMAIN} domain of {where} has no rowIdHighWaterMark") from exc
    if not isinstance(value, int) or isinstance(value, bool) or value < -1:
        raise CorruptFileError(f"the {ROW_TRACKING_DOMAIN} domain of {where} has a bad rowIdHighWaterMark {value!r}")
    return value


def domain_action(high_water_mark: int) -> dict[str, Any]:
    """The `delta.rowTracking` domainMetadata action of a version that assigned row ids up to `high_water_mark`."""
    configuration = json.dumps(
        {"rowIdHighWaterMark": high_water_mark, "domainName": ROW_TRACKING_DOMAIN}, separators=(",", ":")
    )
    return {"domainMetadata": {"domain": ROW_TRACKING_DOMAIN, "configuration": configuration, "removed": False}}


def row_fields(f: DataFileRecord) -> dict[str, int]:
    """The row-tracking fields an `add` or `remove` of the file carries (none for a file without them)."""
    out = {}
    if f.base_row_id is not None:
        out["baseRowId"] = f.base_row_id
    if f.row_commit_version is not None:
        out["defaultRowCommitVersion"] = f.row_commit_version
    return out
