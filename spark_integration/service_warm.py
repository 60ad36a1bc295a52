"""Between requests, the cache service indexes the key columns of a data compaction's new files, so the next task
does not decode them (docs/DESIGN.md section 2).

Why: the table services run after a batch's publish, and a data compaction rewrites the file groups a shard's tasks
keep writing into. The next task's deletion-vector search needs each new base's key index (data/key_columns.py);
without this it read, hashed and sorted their key columns itself: at 10 M keys the batch after a compaction took
2.3 s against about 1.3 s. The service does it while it waits, one file at a time and only while no task is waiting,
and keeps each index as the worker would (in memory and as a key file); the next task finds them in memory.
"""

from __future__ import annotations

import logging
import select
import socket
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

log = logging.getLogger("dbidx.shard_service")
# After the catch-up, how long the service keeps watching for a data compaction's commit (the services after a
# batch's publish took 6-10 s at 10 M keys on 2 cores), and how often it looks (one stat; on an object store one HEAD
# request, so less often there).
WARM_WAIT_S = 30.0
WARM_POLL_S = 0.05
WARM_POLL_REMOTE_S = 0.5


@dataclass
class WarmKeys:
    """The file groups the last upsert wrote into, the completions looked at so far, and the new files to index."""

    table: Any
    options: Any
    shard: int
    seq: int
    until: float
    groups: frozenset[tuple[str, str]]
    pending: list[Any] = field(default_factory=list)

    @classmethod
    def after(cls, table: Any, options: Any, shard: int, seq: int, groups: frozenset[tuple[str, str]]) -> "WarmKeys":
        """Watch the completions after `seq` for WARM_WAIT_S."""
        return cls(table, options, shard, seq, time.monotonic() + WARM_WAIT_S, groups)

    def poll_s(self) -> float:
        """How long to wait for a request before looking for a compaction's commit again."""
        return WARM_POLL_S if self.table.io.is_local else WARM_POLL_REMOTE_S

    def step(self, listener: socket.socket, deadline: float) -> bool:
        """One look, between requests: index the new files of the data compactions that landed, in the watched
        groups, while no connection waits on `listener` and until `deadline` (the service's idle exit; a file being
        indexed is finished first). False once done watching, or after a failure (only logged: the next task reads
        the files itself)."""
        if time.monotonic() > self.until:
            return False
        try:
            from dbidx.data.key_columns import KEYS, KeySources
            from dbidx.data.superseded import read_key_column
            from dbidx.spark_integration import datafiles
            from dbidx.spark_integration.shard_sessions import warm_table
            from dbidx.storage import layout
            from dbidx.storage.records import ACTION_DATA_COMPACTION

            # 1. New completions: the files of the data compactions among them, in the watched groups.
            if not self.pending:
                if not self.table.io.exists(layout.completed_file(self.seq + 1)):
                    return True
                table = warm_table(self.table)
                for record in table.timeline.completed(after_seq=self.seq):
                    if record.action == ACTION_DATA_COMPACTION:
                        self.pending += [f for f in record.data_files if (f.partition, f.file_group) in self.groups]
                    self.seq = max(self.seq, record.seq)
            # 2. Each one's key index built (and kept as a key file) unless this process holds it, one at a time
            #    while no task is waiting: a request always comes first.
            disk = datafiles.key_files_for(self.table, self.shard, self.options.cache)
            reader = partial(read_key_column, self.table.io, key=self.options.key)
            end = min(self.until, deadline)
            while self.pending and time.monotonic() < end and not select.select([listener], [], [], 0)[0]:
                KEYS.get(self.pending.pop(), reader, disk, KeySources())
            return True
        except Exception as exc:  # noqa: BLE001 - never needed: the next task reads what it lacks itself
            log.warning("indexing a data compaction's new files ahead of the next task failed (it will): %s", exc)
            return False
