"""How a catch-up's exact changes reach a column family: a write batch, or one ingested SST when they are many.

Why two ways: a write batch costs a memtable insert now and a flush later (~0.8 us an entry together, measured on
450 k UUID keys); an SST holding each key's last change costs ~0.35 us an entry plus a few milliseconds per file,
and its ingest is durable at once. The crossover is a few thousand entries; SST_APPLY_MIN_ENTRIES stays well above
it so a steady batch's small catch-ups (hundreds of entries per partition) never create files.
"""

from __future__ import annotations

import uuid
from itertools import compress
from pathlib import Path
from typing import Any

from dbidx.cache.changes import ExactChanges
from dbidx.cache.sst_builder import build_changes_sst
from dbidx.cache.store import Store
from dbidx.config import CacheConfig

SST_APPLY_MIN_ENTRIES = 16_384


def write_changes(
    store: Store,
    cf: str,
    plan: ExactChanges,
    values: list[bytes],
    batch: Any,
    dictionary: list[str] | None,
    scratch_dir: Path,
    config: CacheConfig,
) -> bool:
    """Write the plan's changes (keys sorted, `values` aligned with them) into family `cf`: into `batch` (written by
    the caller together with the registry), or, when large, as one SST ingested now. Returns whether it ingested
    (the data is then durable ahead of the registry: the caller flushes the registry at once).

    `dictionary`: the family's whole location dictionary when these changes extended it (the SST carries it too,
    so values never arrive without the dictionary they reference).
    """
    if plan.changed >= SST_APPLY_MIN_ENTRIES:
        # 1. Each key's last change (an SST holds a key once), ingested over what the family holds.
        last = plan.last.tolist()
        sst = scratch_dir / f"apply-{uuid.uuid4().hex[:12]}.sst"
        try:
            build_changes_sst(
                sst,
                list(compress(plan.keys, last)),
                list(compress(values, last)),
                plan.deleted[plan.last].tolist(),
                dictionary,
                config,
            )
            store.ingest(cf, [str(sst)])
        finally:
            sst.unlink(missing_ok=True)
        return True
    # 2. Small: every entry into the batch, in key order (a later entry of a key overrides an earlier one).
    handle, put, delete = store.handle(cf), batch.put, batch.delete
    if plan.entries_delta == plan.changed:  # inserts only (the usual catch-up): no branch per entry
        for key, value in zip(plan.keys, values):
            put(key, value, handle)
        return False
    for key, value, gone in zip(plan.keys, values, plan.deleted.tolist()):
        if gone:
            delete(key, handle)
        else:
            put(key, value, handle)
    return False
