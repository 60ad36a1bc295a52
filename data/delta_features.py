"""The Delta protocol's table features, and what dbidx does about each as a writer (docs/FORMAT.md section 12d).

Why one table for adoption and absorption: a feature changes what every writer of the table must do (write change
data, assign row ids, evaluate constraints, write physical column names, ...), and a writer that does not do it
breaks the feature for every other engine while each of its versions looks valid. So dbidx writes to a table only
when it keeps every feature the table's protocol lists and its properties turn on; everything else is refused by
name before anything is written: at adoption (`build-index`, data/delta_adopt.py) and when another engine's
versions are absorbed (table/absorb_checks.py), naming the feature, the Delta version that turned it on, and how to
turn it off. Several features are kept while they are listed but not in use (a table property off, no column
carrying them): a writer has nothing to do for them then, and Delta cannot always drop a feature from a protocol
(changeDataFeed, for one), so refusing the listing alone would leave no remedy.

Measured with Delta Spark 4.4.0 (tests/spark_integration/test_delta_spark_features.py): ALTER TABLE ... SET
TBLPROPERTIES / ADD CONSTRAINT add the feature to the protocol in the same version as the property; row tracking
adds `domainMetadata` and `rowTracking` in one version and backfills `baseRowId` in the next.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from dbidx.data.column_mapping import mapping_mode, nested_renames
from dbidx.errors import DeltaFeatureError

_ALTER = "ALTER TABLE delta.`<uri>`"
_DROP = _ALTER + " DROP FEATURE {name}"
_TRUNCATE = _DROP + " TRUNCATE HISTORY"


@dataclass(frozen=True)
class Feature:
    """One table feature: whether it is a reader-writer feature, when dbidx keeps it (`kept`: always; else while
    `in_use` finds nothing of it in the table), why dbidx cannot write while it is in use, and how to turn it off."""

    name: str
    reader: bool
    why: str
    remedy: str
    kept: bool = False
    in_use: Callable[[dict[str, str], str], str | None] | None = None  # (configuration, schemaString) -> what


def _property(key: str, on: str = "true") -> Callable[[dict[str, str], str], str | None]:
    def check(configuration: dict[str, str], _schema: str) -> str | None:
        return f"{key}={configuration[key]}" if str(configuration.get(key, "")).lower() == on else None

    return check


def _constraints(configuration: dict[str, str], _schema: str) -> str | None:
    names = sorted(k.removeprefix("delta.constraints.") for k in configuration if k.startswith("delta.constraints."))
    return f"constraint(s) {names}" if names else None


def _column_metadata(*keys: str) -> Callable[[dict[str, str], str], str | None]:
    def check(_configuration: dict[str, str], schema: str) -> str | None:
        found = sorted(_fields_with(schema, keys))
        return f"column(s) {found} carrying {' / '.join(keys)}" if found else None

    return check


def _column_mapping(configuration: dict[str, str], schema: str) -> str | None:
    """Column mapping by name is kept for top-level columns (data/column_mapping.py); `id` mode and nested columns
    renamed in the files are not."""
    mode = mapping_mode(configuration)
    if mode == "name":
        nested = nested_renames(schema)
        return f"nested column(s) {nested} with physical names of their own" if nested else None
    return f"delta.columnMapping.mode={mode}" if mode != "none" else None


def _fields_with(schema: str, keys: tuple[str, ...]) -> set[str]:
    """Names of the (nested) fields of a Delta schemaString whose metadata has a key starting with one of `keys`."""
    try:
        root = json.loads(schema) if schema else {}
    except ValueError:
        return set()
    found: set[str] = set()

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for f in node.get("fields") or []:
                if not isinstance(f, dict):
                    continue
                name = f"{prefix}{f.get('name')}"
                meta = f.get("metadata") or {}
                if isinstance(meta, dict) and any(str(k).startswith(keys) for k in meta):
                    found.add(name)
                walk(f.get("type"), name + ".")
            for inner in ("elementType", "valueType", "keyType"):
                walk(node.get(inner), prefix)

    walk(root, "")
    return found


_SET = _ALTER + " SET TBLPROPERTIES ('{key}' = 'false')"
FEATURES: dict[str, Feature] = {
    f.name: f
    for f in [
        Feature("deletionVectors", True, "", "", kept=True),
        Feature("timestampNtz", True, "", "", kept=True),
        Feature(
            "vacuumProtocolCheck",
            True,
            "",
            "",
            kept=True,  # dbidx checks the whole protocol before every write, its clean (its vacuum) included
        ),
        Feature(
            "appendOnly",
            False,
            "an upsert updates and deletes rows, which an append-only table forbids",
            "unset it: " + _SET.format(key="delta.appendOnly"),
            in_use=_property("delta.appendOnly"),
        ),
        Feature(
            "invariants",
            False,
            "dbidx does not evaluate column invariants on the rows it writes",
            "rewrite the table without the invariant (legacy Delta; use a CHECK constraint elsewhere)",
            in_use=_column_metadata("delta.invariants"),
        ),
        Feature(
            "changeDataFeed",
            False,
            "dbidx writes no change data (cdc files) for the rows its upserts update and delete, so "
            "table_changes / readChangeFeed would miss them",
            "turn it off: " + _SET.format(key="delta.enableChangeDataFeed") + " (Delta keeps the feature listed; "
            "dbidx writes to a table whose change data feed is off)",
            in_use=_property("delta.enableChangeDataFeed"),
        ),
        Feature(
            "checkConstraints",
            False,
            "dbidx does not evaluate CHECK constraints on the rows it upserts",
            f"drop the constraints ({_ALTER} DROP CONSTRAINT <name>); dbidx writes to a table with none",
            in_use=_constraints,
        ),
        Feature(
            "generatedColumns",
            False,
            "dbidx does not compute generated columns for the rows it upserts",
            "recreate the table without generation expressions (Delta cannot drop one), e.g. CREATE TABLE ... AS "
            "SELECT, and adopt that",
            in_use=_column_metadata("delta.generationExpression"),
        ),
        Feature(
            "identityColumns",
            False,
            "dbidx does not assign identity values, nor keep the high-water mark, for the rows it upserts",
            "recreate the table without the identity column (CREATE TABLE ... AS SELECT) and adopt that",
            in_use=_column_metadata("delta.identity."),
        ),
        Feature(
            "columnMapping",
            True,
            "dbidx maps top-level columns by name only (data/column_mapping.py), not by field id (`id` mode) or "
            "nested fields renamed in the files",
            "recreate the table with column mapping by name and flat physical names, or without column mapping "
            "(CREATE TABLE ... AS SELECT), and adopt that",
            in_use=_column_mapping,
        ),
        Feature(
            "inCommitTimestamp",
            False,
            "",
            "",
            kept=True,  # while delta.enableInCommitTimestamps is true, every dbidx commit is stamped (delta_derive)
        ),
        Feature(
            "rowTracking",
            False,
            "",
            "",
            kept=True,  # fresh row ids, the high-water mark, ids carried on every re-add (storage/row_ids.py)
        ),
        Feature(
            "domainMetadata",
            False,
            "",
            "",
            kept=True,  # dbidx writes no domain action; its checkpoints carry every domain (delta_checkpoint checks)
        ),
        Feature(
            "clustering",
            False,
            "",
            "",
            kept=True,  # while the table is clustered by its key or not at all (data/delta_domains.check_clustering)
        ),
        Feature(
            "v2Checkpoint",
            True,
            "",
            "",
            kept=True,  # dbidx reads V2 checkpoints and their sidecars, writes classic ones (the protocol allows them
            # beside V2 ones, and forbids only multi-part ones, which dbidx never writes) and its log cleanup keeps
            # every sidecar a checkpoint left names: data/delta_checkpoint_files.py
        ),
        Feature(
            "checkpointProtection",
            False,
            "dbidx's Delta log cleanup may delete checkpoints the feature protects",
            _TRUNCATE.format(name="checkpointProtection"),
        ),
        Feature(
            "typeWidening",
            True,
            "dbidx reads every data file in its recorded type and refuses type changes",
            _TRUNCATE.format(name="typeWidening"),
        ),
        Feature(
            "variantType",
            True,
            "Arrow has no variant type for dbidx to write one with",
            "recreate the table without variant columns and adopt that",
            in_use=lambda _c, schema: "a variant column" if '"variant"' in schema else None,
        ),
        Feature(
            "allowColumnDefaults",
            False,
            "dbidx does not fill column defaults",
            "recreate the table without column defaults and adopt that",
        ),
        Feature("icebergCompatV1", False, "dbidx writes no Iceberg metadata", "unset delta.enableIcebergCompatV1"),
        Feature("icebergCompatV2", False, "dbidx writes no Iceberg metadata", "unset delta.enableIcebergCompatV2"),
        Feature(
            "materializePartitionColumns",
            False,
            "dbidx's data files do not hold their partition columns",
            _DROP.format(name="materializePartitionColumns"),
        ),
    ]
}
# Reader version 1-3 and writer version 1, 2 or 7 only: writer 3-6 imply features without listing them
# (constraints, change data feed, generated and identity columns, column mapping).
LEGACY_WRITER_FEATURES = {2: ["appendOnly", "invariants"]}


def table_features(protocol: dict[str, Any]) -> list[str]:
    """Every feature the protocol names (writer version 2 implies appendOnly and invariants)."""
    names = set(protocol.get("readerFeatures") or []) | set(protocol.get("writerFeatures") or [])
    if "writerFeatures" not in protocol:
        names |= set(LEGACY_WRITER_FEATURES.get(int(protocol.get("minWriterVersion", 1)), []))
    return sorted(names)


def problems(protocol: dict[str, Any], configuration: dict[str, str], schema: str) -> dict[str, str]:
    """The features that stop dbidx from writing: name -> what of it is in use ('' for a feature dbidx never
    keeps). Properties are looked at whether or not the protocol lists their feature (a table on an older protocol
    turns them on by its writer version; the protocol's versions are checked apart, `check_versions`)."""
    out: dict[str, str] = {}
    listed = set(table_features(protocol))
    for name, feature in FEATURES.items():
        if feature.kept:
            continue
        used = feature.in_use(configuration, schema) if feature.in_use is not None else None
        if used is not None:
            out[name] = used
        elif name in listed and feature.in_use is None:
            out[name] = ""
    for name in sorted(listed - set(FEATURES)):
        out[name] = ""
    return out


def check_versions(protocol: dict[str, Any], where: str) -> None:
    reader, writer = int(protocol.get("minReaderVersion", 1)), int(protocol.get("minWriterVersion", 1))
    if reader not in (1, 2, 3) or writer not in (1, 2, 7):
        raise DeltaFeatureError(
            f"{where}: protocol reader {reader} / writer {writer} is not one dbidx can write to (reader 1-3, writer "
            "1, 2 or 7 with table features; writer 3-6 imply check constraints, change data feed, generated or "
            "identity columns, column mapping). Upgrade it to table features with Delta Spark (ALTER TABLE "
            "delta.`<uri>` SET TBLPROPERTIES ('delta.minWriterVersion' = '7')), or recreate it, and adopt that"
        )


def refusal(name: str, used: str, where: str, turned_on: str, then: str) -> DeltaFeatureError:
    """The error for one feature dbidx cannot keep: what, where, since which version, and the way out."""
    feature = FEATURES.get(name)
    why = feature.why if feature is not None else "dbidx does not know this feature"
    remedy = (
        feature.remedy
        if feature is not None
        else f"drop it if Delta allows ({_DROP.format(name=name)}), or recreate the table without it"
    )
    state = f" ({used})" if used else ""
    return DeltaFeatureError(
        f"{where}: the table uses the Delta feature `{name}`{state}, turned on {turned_on}, which dbidx cannot keep "
        f"when it writes: {why}; nothing was written. Remedy: {remedy}; then {then}"
    )


@dataclass(frozen=True)
class LogState:
    """The table as of one Delta version, for naming the version that turned a feature on: who wrote it, and the
    features in use then."""

    version: int
    writer: str
    in_use: dict[str, str]


def since(states: list[LogState]) -> dict[str, LogState]:
    """Each feature in use at the last state -> the state from which it has been in use without a break."""
    out: dict[str, LogState] = {}
    for state in states:
        out = {name: out.get(name, state) for name in state.in_use}
    return out


def writer_of(commit_info: Any) -> str:
    """Who wrote a version, as its commitInfo says (operation and engine)."""
    info = commit_info if isinstance(commit_info, dict) else {}
    engine = info.get("engineInfo") or info.get("clientVersion") or "an unknown engine"
    return f"{info.get('operation') or 'an unnamed operation'} by {engine}"


def check_adoptable(io: Any, version: int, protocol: dict[str, Any], metadata: dict[str, Any]) -> None:
    """Refuse, by name, the first feature of the table at `version` that dbidx cannot keep, naming the version that
    turned it on (found by replaying the protocol and metaData actions of the log's JSON versions; a feature in use
    since the oldest one left names that one, "at or before")."""
    configuration = dict(metadata.get("configuration") or {})
    schema = str(metadata.get("schemaString") or "")
    found = problems(protocol, configuration, schema)
    if not found:
        return
    from dbidx.data.delta_log import DELTA_LOG_DIR, listed_versions, version_file

    versions = [v for v in listed_versions(io) if v <= version]
    states: list[LogState] = []
    p: dict[str, Any] = protocol if versions and versions[0] > 0 else {}
    c, s = (configuration, schema) if versions and versions[0] > 0 else ({}, "")
    for v in versions:
        info: Any = None
        try:
            lines = io.read_bytes(version_file(v)).decode("utf-8").splitlines()
            for action in (json.loads(line) for line in lines if line.strip()):
                if not isinstance(action, dict):
                    continue
                info = action.get("commitInfo", info)
                if isinstance(action.get("protocol"), dict):
                    p = action["protocol"]
                if isinstance(action.get("metaData"), dict):
                    c = dict(action["metaData"].get("configuration") or {})
                    s = str(action["metaData"].get("schemaString") or "")
        except (OSError, UnicodeError, ValueError):
            continue  # (read_snapshot names a damaged version; here it only costs the version's name)
        states.append(LogState(v, writer_of(info), problems(p, c, s)))
    first = since(states)
    name = sorted(found)[0]
    state = first.get(name)
    if state is None:
        turned_on = f"at or before Delta version {version}"
    elif state.version == (versions[0] if versions else -1) and state.version > 0:
        turned_on = f"at or before Delta version {state.version} (the oldest commit left in the log)"
    else:
        turned_on = f"by Delta version {state.version} ({state.writer})"
    raise refusal(
        name,
        found[name],
        io.path(DELTA_LOG_DIR),
        turned_on,
        "`dbidx build-index URI --key COLUMN` adopts the table",
    )
