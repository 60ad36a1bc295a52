"""The metadata domains of a Delta table (PROTOCOL.md "Domain Metadata"), and the one dbidx has to honour as a writer:
liquid clustering's `delta.clustering`.

Why dbidx reads domains at all: it writes no domainMetadata action of its own (so a domain another engine set stays
as it is through every dbidx version, and the Delta checkpoints dbidx publishes carry them: data/delta_checkpoint.py
checks the count), but the clustering feature asks every writer for per-file statistics of the clustering columns in
each `add` (PROTOCOL.md "Writer Requirements for Clustered Table"). dbidx's adds carry statistics for the key column
only (its min and max, when it is a string column: data/delta_derive.py), so a table clustered by anything else is
refused by name, at adoption and when another engine's version clusters it by other columns; a table clustered by
its key is kept. dbidx's files are never clustered by it (no `clusteringProvider`), which the protocol allows: the
next OPTIMIZE of the clustering engine clusters them.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from dbidx.data.delta_checkpoint_files import checkpoint_actions, newest_checkpoint
from dbidx.data.delta_log import DELTA_LOG_DIR, version_file
from dbidx.errors import CorruptFileError, DeltaFeatureError
from dbidx.storage.column_names import ColumnNames
from dbidx.storage.fileio import FileIO

CLUSTERING_DOMAIN = "delta.clustering"


def domains_at(io: FileIO, version: int, origins: dict[str, str] | None = None) -> dict[str, str]:
    """Each live domain at `version` -> its configuration: the newest complete checkpoint at or below it, then the
    JSON versions after it (a domain's last action wins; `removed` drops it). Damage, and a version missing
    between them, is a CorruptFileError naming the file. `origins`, when given, gets each live domain's file (for
    naming one whose content is damaged)."""
    start, domains = _checkpoint_domains(io, version, origins)
    for v in range(start + 1, version + 1):
        where = io.path(version_file(v))
        try:
            lines = io.read_bytes(version_file(v)).decode("utf-8").splitlines()
            actions = [json.loads(line) for line in lines if line.strip()]
        except (UnicodeError, ValueError) as exc:
            raise CorruptFileError(f"Delta version {v} ({where}) is unreadable: {exc}") from exc
        for action in actions:
            if isinstance(action, dict) and "domainMetadata" in action:
                apply_domain(domains, action["domainMetadata"], where)
                if origins is not None:
                    origins[str(action["domainMetadata"]["domain"])] = where
    return domains


def apply_domain(domains: dict[str, str], body: Any, where: str) -> None:
    if not isinstance(body, dict) or not isinstance(body.get("domain"), str):
        raise CorruptFileError(f"a domainMetadata action of {where} has no domain name: {body!r:.200}")
    if body.get("removed") is True:
        domains.pop(body["domain"], None)
        return
    configuration = body.get("configuration")
    if not isinstance(configuration, str):
        raise CorruptFileError(f"the domainMetadata action of {body['domain']!r} in {where} has no configuration")
    domains[body["domain"]] = configuration


def _checkpoint_domains(io: FileIO, version: int, origins: dict[str, str] | None) -> tuple[int, dict[str, str]]:
    """The domains of the newest checkpoint at or below `version` (any kind: data/delta_checkpoint_files.py; the
    V2 spec keeps non-file actions in the checkpoint itself, never in sidecars): (its version, domains); (-1, {})."""
    checkpoint = newest_checkpoint(io.list_names(DELTA_LOG_DIR), version)
    if checkpoint is None:
        return -1, {}
    where = io.path(f"{DELTA_LOG_DIR}/{checkpoint.names[0]}")
    domains: dict[str, str] = {}
    for body in checkpoint_actions(io, checkpoint, ("domainMetadata",)).get("domainMetadata", []):
        apply_domain(domains, body, where)
        if origins is not None:
            origins[str(body["domain"])] = where
    return checkpoint.version, domains


def clustering_columns(domains: dict[str, str], where: str) -> list[list[str]]:
    """The clustering columns `delta.clustering` names (each a path of nested names); [] when unclustered."""
    raw = domains.get(CLUSTERING_DOMAIN)
    if raw is None:
        return []
    try:
        columns = json.loads(raw).get("clusteringColumns")
    except (ValueError, AttributeError) as exc:
        raise CorruptFileError(f"the {CLUSTERING_DOMAIN} domain of {where} is not a JSON object: {raw!r:.200}") from exc
    if not isinstance(columns, list) or not all(
        isinstance(c, list) and c and all(isinstance(n, str) for n in c) for c in columns
    ):
        raise CorruptFileError(f"the {CLUSTERING_DOMAIN} domain of {where} names no column list: {raw!r:.200}")
    return columns


def logical_columns(columns: list[list[str]], names: ColumnNames | None) -> list[list[str]]:
    """Clustering columns as the table names them (the domain names them physically under column mapping)."""
    if names is None:
        return columns
    logical = {physical: name for name, (physical, _id) in names.columns.items()}
    return [[logical.get(c[0], c[0]), *c[1:]] for c in columns]


def check_clustering(columns: list[list[str]], key: str | None, schema: pa.Schema | None, where: str) -> None:
    """Refuse a table clustered by columns dbidx writes no statistics for (module docstring): every clustering
    column must be the key, a string column (`columns` in the table's names: `logical_columns`)."""
    key_is_string = (
        key is not None
        and schema is not None
        and key in schema.names
        and (pa.types.is_string(schema.field(key).type) or pa.types.is_large_string(schema.field(key).type))
    )
    others = [".".join(c) for c in columns if not (key_is_string and c == [key])]
    if others:
        raise DeltaFeatureError(
            f"{where}: the table is liquid-clustered by {others}, and the Delta feature `clustering` asks every "
            "writer for statistics of the clustering columns in each file it adds; dbidx writes them for its key "
            f"column ({key!r}, when it is a string column) only, so it cannot keep this clustering; nothing was "
            f"written. Remedy: cluster by the key (ALTER TABLE delta.`<uri>` CLUSTER BY ({key})) or not at all "
            "(CLUSTER BY NONE) with Delta Spark, then adopt or sync the table again"
        )
