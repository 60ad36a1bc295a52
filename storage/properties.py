"""Table properties: what is fixed at a table's creation (`.dbidx/table.json`, docs/FORMAT.md section 3), parsed
strictly when read back."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

from dbidx.errors import CorruptFileError

FORMAT_VERSION = 4  # 4: the data layer is a Delta table (`_delta_log/`, deletion vectors); 3 merged data by key
DEFAULT_CHECKPOINT_INTERVAL = 100
INDEX_PARTITIONED = "partitioned"
INDEX_GLOBAL = "global"


@dataclass(frozen=True)
class TableProperties:
    """Fixed at creation: identity, sharding and layout choices every reader and cache must agree on."""

    table_id: str
    num_shards: int
    index_mode: str
    key_hash: str
    row_group_size: int
    format_version: int = FORMAT_VERSION
    created_at_ms: int = 0
    checkpoint_interval: int = DEFAULT_CHECKPOINT_INTERVAL  # a checkpoint every N completions; 0: none
    upgraded_at_seq: int = 0  # the completion of `dbidx upgrade` from format 3 (0: created in this format)

    @property
    def global_index(self) -> bool:
        """True when one index spans all partitions (keys are unique table-wide)."""
        return self.index_mode == INDEX_GLOBAL


def properties_json(props: TableProperties) -> bytes:
    """table.json's bytes (fields at their defaults that older readers do not know are left out)."""
    data = asdict(props)
    if not props.upgraded_at_seq:
        del data["upgraded_at_seq"]
    return json.dumps(data, indent=2, sort_keys=True).encode()


def parse_properties(raw: bytes, where: str) -> TableProperties:
    """Parse table.json strictly: every field with its type (FORMAT.md section 3), else a CorruptFileError."""
    types = {
        "table_id": str,
        "num_shards": int,
        "index_mode": str,
        "key_hash": str,
        "row_group_size": int,
        "format_version": int,
        "created_at_ms": int,
        "checkpoint_interval": int,
        "upgraded_at_seq": int,
    }
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        for name, value in data.items():
            kind = types.get(name)
            if kind is None or not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"field {name!r} = {value!r} is unknown or not a {getattr(kind, '__name__', '?')}")
        props = TableProperties(**data)
        if (
            not re.fullmatch(r"[0-9a-f]{32}", props.table_id)
            or not 1 <= props.num_shards <= 65536
            or props.index_mode not in (INDEX_PARTITIONED, INDEX_GLOBAL)
            or props.row_group_size < 64
            or props.checkpoint_interval < 0
            or props.upgraded_at_seq < 0
        ):
            raise ValueError(f"values out of range: {data}")
    except (ValueError, TypeError) as exc:
        raise CorruptFileError(f"table properties {where} are invalid: {exc}") from exc
    return props
