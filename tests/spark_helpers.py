"""An independent in-memory oracle of upsert semantics and a random change-stream generator for the Spark tests."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from dbidx.buckets.naming import bucket_of
from dbidx.index import rli_files
from dbidx.table.facade import Table

SCHEMA = "id string, dt string, v long, _dbidx_delete boolean"
DAYS = [f"2025-03-{d:02d}" for d in range(1, 9)]


@dataclass
class Oracle:
    """Expected table state: record identity -> (day, value). Global mode: identity = key."""

    global_mode: bool
    rows: dict[tuple[str, ...], tuple[str, int]] = field(default_factory=dict)
    deleted: set[tuple[str, ...]] = field(default_factory=set)

    def ident(self, key: str, day: str) -> tuple[str, ...]:
        return (key,) if self.global_mode else (day, key)

    def apply(self, batch: list[tuple[str, str, int, bool]]) -> None:
        """Last row per identity wins; a delete removes the record wherever it lives (global) or in its day."""
        latest: dict[tuple[str, ...], tuple[str, str, int, bool]] = {}
        for row in batch:
            latest[self.ident(row[0], row[1])] = row
        for ident, (key, day, value, delete) in latest.items():
            if delete:
                if self.rows.pop(ident, None) is not None:
                    self.deleted.add(ident)
            else:
                self.rows[ident] = (day, value)
                self.deleted.discard(ident)

    def expected_counts(self, batch: list[tuple[str, str, int, bool]]) -> dict[str, int]:
        """What the summary of upserting `batch` must report (computed before apply())."""
        latest: dict[tuple[str, ...], tuple[str, str, int, bool]] = {}
        for row in batch:
            latest[self.ident(row[0], row[1])] = row
        counts = dict(
            inserts=0, updates=0, deletes=0, deletes_missing=0, moves=0, duplicates_dropped=len(batch) - len(latest)
        )
        for ident, (_key, day, _value, delete) in latest.items():
            current = self.rows.get(ident)
            if delete:
                counts["deletes" if current else "deletes_missing"] += 1
            elif current is None:
                counts["inserts"] += 1
            else:
                counts["updates"] += 1
                counts["moves"] += int(self.global_mode and current[0] != day)
        return counts

    def expected_rows(self) -> set[tuple[str, str, int]]:
        return {(ident[-1], day, value) for ident, (day, value) in self.rows.items()}


def random_batch(rng: random.Random, oracle: Oracle, serial: list[int], size: int = 60) -> list[tuple]:
    """Updates (mostly recent days), new keys, deletes, re-inserts of deleted keys, late days, moves, repeats."""
    rows: list[tuple] = []
    live = list(oracle.rows.items())
    dead = sorted(oracle.deleted)  # sorted: a set's order moves with the string hash seed, and a seed must repeat
    for _ in range(size):
        roll = rng.random()
        value = rng.randrange(1_000_000)
        if live and roll < 0.45:  # update in place (global) / same record (partitioned)
            ident, (day, _) = rng.choice(live)
            rows.append((ident[-1], day, value, False))
        elif live and roll < 0.55:  # delete an existing record
            ident, (day, _) = rng.choice(live)
            rows.append((ident[-1], day, value, True))
        elif live and roll < 0.62:  # another day: a move in global mode, a second record in partitioned mode
            ident, (day, _) = rng.choice(live)
            rows.append((ident[-1], rng.choice(DAYS), value, False))
        elif dead and roll < 0.68:  # re-insert after delete
            ident = rng.choice(dead)
            day = ident[0] if len(ident) == 2 else rng.choice(DAYS)
            rows.append((ident[-1], day, value, False))
        elif roll < 0.70:  # delete of a key that never existed
            rows.append((f"ghost-{rng.randrange(10**9)}", rng.choice(DAYS), value, True))
        else:  # new key, mostly recent days, some late ones
            serial[0] += 1
            day = DAYS[-1 - min(int(rng.expovariate(0.8)), len(DAYS) - 1)]
            rows.append((f"key-{serial[0]:06d}", day, value, False))
    if rows:  # a repeated key within the batch: the later row wins
        key, day, _, delete = rng.choice(rows)
        rows.append((key, day, rng.randrange(1_000_000), delete))
    return rows


def index_state(table: Table) -> dict[tuple[str, ...], str]:
    """Record identity -> file group, read from the index with pyarrow (no cache, no Spark)."""
    table.refresh()
    out: dict[tuple[str, ...], str] = {}
    if table.global_index:
        snap = table.snapshot(None)
        for key, part, fg in zip(
            snap.column(rli_files.KEY).to_pylist(),
            snap.column(rli_files.PARTITION).to_pylist(),
            snap.column(rli_files.FILE_GROUP).to_pylist(),
        ):
            out[(key,)] = f"{part}|{fg}"
        return out
    for stats in table.partitions():
        snap = table.snapshot(stats.partition)
        for key, fg in zip(snap.column(rli_files.KEY).to_pylist(), snap.column(rli_files.FILE_GROUP).to_pylist()):
            out[(stats.partition, key)] = fg
    return out


def bucket_layout(state: dict[tuple[str, ...], str]) -> dict[tuple[str, ...], str]:
    """File groups replaced by bucket numbers (file group ids differ between tables, bucket numbers must not)."""
    out = {}
    for ident, loc in state.items():
        part, _, fg = loc.rpartition("|")
        out[ident] = f"{part}|{bucket_of(fg)}"
    return out


def hive(day: str) -> str:
    return f"dt={day}"


def as_expected_index(oracle: Oracle) -> set[tuple[str, ...]]:
    if oracle.global_mode:
        return set(oracle.rows)
    return {(hive(ident[0]), ident[1]) for ident in oracle.rows}
