"""A long-lived file view forgets files that were both replaced and cleaned, as a checkpoint does: it holds what a
view opened from a checkpoint at the same seq holds (so its size and the cost of every listing stay bounded however
long the process runs), and every read that would need a forgotten file stays a HistoryCompactedError.

The reference is an independent fold of docs/FORMAT.md section 7 (every file ever written, with its replaced and
cleaned marks), against which both the long-lived Table and a fresh `Table.open` are checked at every seq."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

from dbidx.buckets.assigner import BucketSpec
from dbidx.cache.catchup import sync
from dbidx.cache.loading import load_from_snapshot
from dbidx.config import CacheConfig
from dbidx.errors import HistoryCompactedError
from dbidx.table.facade import Table
from dbidx.spark_integration.local import upsert_arrow
from dbidx.storage import checkpoint, layout
from dbidx.storage.data_view import DataView
from dbidx.storage.index_view import GONE_MEMORY, IndexView
from dbidx.storage.records import ACTION_CLEAN, ACTION_COMPACTION, ENTRY_ACTIONS, CompletedInstant, FileRecord

from tests.cache_helpers import open_cache, truth
from tests.data.test_compaction import as_arrow, current
from tests.retention import clean_without_waiting
from tests.spark_helpers import Oracle, random_batch

INTERVAL = 7  # checkpoints every 7 completions: a fresh open starts from one with a history floor


@dataclass
class Reference:
    """Section 7's fold, kept whole: every file ever added, with when it was replaced and cleaned."""

    added: dict[str, tuple[int, tuple[int, int], FileRecord]] = field(default_factory=dict)
    replaced: dict[str, int] = field(default_factory=dict)
    cleaned: set[str] = field(default_factory=set)
    applied_seq: int = 0

    def apply(self, records: list[CompletedInstant]) -> None:
        for rec in records:
            assert rec.seq == self.applied_seq + 1
            self.applied_seq = rec.seq
            if rec.action in ENTRY_ACTIONS:
                for f in rec.files:
                    self.added[f.path] = (rec.seq, (rec.seq, 0), f)
            if rec.action == ACTION_COMPACTION:
                covered: dict[tuple, int] = {}
                for path in rec.replaced:
                    if path in self.added:
                        self.replaced[path] = rec.seq
                        f = self.added[path][2]
                        covered[(f.partition, f.shard)] = max(
                            covered.get((f.partition, f.shard), 0), self.added[path][1][0]
                        )
                for f in rec.files:
                    self.added[f.path] = (rec.seq, (covered.get((f.partition, f.shard), 0), 1), f)
            if rec.action == ACTION_CLEAN:
                self.cleaned.update(rec.deleted)

    def files(self, group: tuple, upto: int) -> list[str] | None:
        """Paths live in the group as of upto, oldest first; None if one of them was cleaned (must raise)."""
        live = [
            (order, path)
            for path, (seq, order, f) in self.added.items()
            if (f.partition, f.shard) == group and seq <= upto and self.replaced.get(path, upto + 1) > upto
        ]
        if any(path in self.cleaned for _, path in live):
            return None
        return [path for _, path in sorted(live, key=lambda item: item[0])]

    def groups(self) -> set[tuple]:
        return {(f.partition, f.shard) for _, _, f in self.added.values()}

    def dropped(self) -> set[str]:
        return {p for p in self.replaced if p in self.cleaned}

    def checkpoint_index(self, applied_seq: int, stats: list[dict]) -> dict:
        """The checkpoint's index section as FORMAT.md 7a defines it, built from the whole fold."""
        floor, files = 0, []
        for path, (seq, order, f) in sorted(self.added.items(), key=lambda item: (item[1][0], item[0])):
            if path in self.replaced and path in self.cleaned:
                floor = max(floor, self.replaced[path])
                continue
            files.append(
                {
                    "file": asdict(f),
                    "seq": seq,
                    "order": list(order),
                    "replaced_at": self.replaced.get(path),
                    "cleaned_at": None,
                }
            )
        return {"applied_seq": applied_seq, "history_floor": floor, "files": files, "stats": stats}


def entries(view: IndexView) -> int:
    """What the view holds per file, in all its structures."""
    return len(view._by_path) + sum(len(v) for v in view._groups.values()) + len(view._cleaned)


def read(view: IndexView, group: tuple, upto: int) -> list[str] | None:
    try:
        return [f.path for f in view.files(group[0], group[1], upto)]
    except HistoryCompactedError:
        return None


def canonical(data: dict) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def compare(table: Table, fresh: Table, ref: Reference) -> int:
    """The long-lived table's view against a fresh open's and the reference; returns the (group, seq) reads only
    the long-lived one could answer (its per-group floors refuse less than a checkpoint's global one)."""
    long, new = table.refresh(), fresh.refresh()
    latest = table.timeline.latest_seq
    assert long.applied_seq == new.applied_seq == latest
    # What it holds: exactly the checkpoint's files (no replaced-and-cleaned one), as the fresh view does.
    assert long.to_dict() == new.to_dict()
    assert canonical(long.to_dict()) == canonical(ref.checkpoint_index(latest, long.to_dict()["stats"]))
    assert {f.path for f in long.all_files()} == {f.path for f in new.all_files()} == set(ref.added) - ref.dropped()
    assert long.groups() == new.groups()
    held = {(f.partition, f.shard) for p, (_, _, f) in ref.added.items() if p not in ref.dropped()}
    assert set(long.groups()) == held
    assert long.referenced_paths() == new.referenced_paths()
    assert long.partition_stats() == new.partition_stats()
    assert long.replaced_files(latest) == new.replaced_files(latest)
    assert set(long._cleaned) <= set(long._by_path) and len(long._gone) <= GONE_MEMORY
    # Every (group, seq): a read the reference says needs a cleaned file raises in both; any other read either
    # answers exactly the reference's files or raises (a floor refuses conservatively); never a shorter list.
    only_long = 0
    for group in sorted(ref.groups(), key=lambda g: ("" if g[0] is None else g[0], g[1])):
        for seq in range(latest + 1):
            want = ref.files(group, seq)
            got_long, got_new = read(long, group, seq), read(new, group, seq)
            if want is None:
                assert got_long is None and got_new is None, (group, seq)
            assert got_long in (None, want), (group, seq)
            assert got_new in (None, want), (group, seq)
            if got_new is not None:
                assert got_long == want, (group, seq)  # the long-lived view refuses no more than a fresh one
            only_long += got_long is not None and got_new is None
        assert read(long, group, latest) == ref.files(group, latest)  # the current state always reads
    # Incremental listings: from any start, the exact deltas, or a refusal if one of them is gone.
    deltas = {p: (seq, f) for p, (seq, _, f) in ref.added.items() if f.kind == "delta"}
    for start in range(latest + 1):
        want_paths = sorted((seq, p) for p, (seq, f) in deltas.items() if seq > start)
        needs_gone = any(p in ref.cleaned for _, p in want_paths)
        for view in (long, new):
            try:
                got = [(seq, f.path) for seq, f in view.delta_files_between(start, latest)]
            except HistoryCompactedError:
                continue
            assert not needs_gone, start
            assert got == want_paths, start
        if needs_gone:
            with pytest.raises(HistoryCompactedError):
                long.delta_files_between(start, latest)
    return only_long


def stream(tmp_path: Path, global_index: bool, steps: int, seed: int, every=None):
    """A long-lived Table written by a random stream of upserts, index and data compactions and cleans; `every`
    is called after each step with (step, table, reference, oracle)."""
    rng = random.Random(seed)
    table = Table.create(str(tmp_path / "t"), num_shards=2, global_index=global_index, checkpoint_interval=INTERVAL)
    clean_without_waiting(table)  # the cleans take replaced data and DV files too, as soon as their count allows
    config = CacheConfig(base_path=str(tmp_path / "cache"))
    oracle, serial, ref = Oracle(global_index), [0], Reference()
    for step in range(steps):
        batch = random_batch(rng, oracle, serial, size=12)
        upsert_arrow(
            as_arrow(batch), table, key="id", partition="dt", buckets=BucketSpec(capacity=5), cache_config=config
        )
        oracle.apply(batch)
        if rng.random() < 0.35:
            table.compact(min_files=2)
        if rng.random() < 0.15:
            table.compact_data()
        if rng.random() < 0.3:
            table.clean(retain_completions=rng.randint(0, 3))
        ref.apply(table.timeline.completed(after_seq=ref.applied_seq))
        if every is not None:
            every(step, table, ref, oracle)
    return table, oracle, ref


@pytest.mark.slow
@pytest.mark.parametrize("global_index", [False, True], ids=["partitioned", "global"])
def test_a_long_lived_view_holds_what_a_fresh_open_holds_and_stays_bounded(tmp_path: Path, global_index: bool) -> None:
    counts: list[tuple[int, int, int]] = []  # (step, long-lived view's entries, the whole fold's entries)
    only_long = [0]

    def check(step: int, table: Table, ref: Reference, oracle: Oracle) -> None:
        view = table.refresh()
        whole = 2 * len(ref.added) + len(ref.cleaned & set(ref.added))  # what the view held before pruning
        counts.append((step, entries(view), whole))
        if step % 15 == 14:
            fresh = Table.open(table.uri)
            only_long[0] += compare(table, fresh, ref)
            assert current(fresh) == current(table) == oracle.expected_rows()

    table, _, ref = stream(tmp_path, global_index, 60, 4242 + global_index, check)
    view = table.refresh()
    assert view.history_floor == 0  # never reopened from a checkpoint: every pruning was the fold's own
    assert ref.dropped(), "the stream must replace and clean files"
    if not global_index:  # (global mode: two groups, both compacted together; no difference to show)
        assert only_long[0] > 0  # per-group floors: some old reads a checkpoint-opened view refuses still answer
    # Bounded: the whole fold keeps growing with the stream, the long-lived view tracks only what is live or
    # awaiting a clean (its later entries are no more than the earlier ones plus the live set's own growth).
    first, last = counts[len(counts) // 2 - 1], counts[-1]
    assert last[2] > 1.6 * first[2]
    assert last[1] < last[2] / 3
    live_now = len(view._by_path)
    assert entries(view) <= 2 * live_now and live_now == len(view.to_dict()["files"])
    print("\nentries (step, long-lived, whole fold):", counts[::10] + [counts[-1]])


@pytest.mark.slow
def test_reads_needing_a_dropped_file_raise_in_the_long_lived_and_a_fresh_table(tmp_path: Path) -> None:
    table, _, ref = stream(tmp_path, False, 30, 99)
    fresh = Table.open(table.uri)
    long, new = table.refresh(), fresh.refresh()
    dropped = sorted(ref.dropped())
    assert dropped
    path = dropped[-1]
    seq, _, record = ref.added[path]
    alive_at = ref.replaced[path] - 1  # the file was live from `seq` up to here
    partition = record.partition
    assert ref.files((partition, record.shard), alive_at) is None
    for t in (table, fresh):
        with pytest.raises(HistoryCompactedError):
            t.snapshot(partition, shard=record.shard, as_of=alive_at)
        with pytest.raises(HistoryCompactedError):
            t.incremental(seq - 1)
        plan_start = seq - 1
        t.incremental_plan(plan_start, t.timeline.latest_seq)  # lax listing: answers (the read below refuses)
        with pytest.raises(HistoryCompactedError):
            t.incremental(plan_start, partitions=[partition], shard=record.shard)
    # The long-lived view forgot the file but still knows a clean removed it: a read planned before the clean
    # that finds it gone is told so (HistoryCompactedError), not that the table is damaged.
    assert path not in long._by_path and long.is_cleaned(path)
    with pytest.raises(HistoryCompactedError, match="removed by a clean"):
        table.read_index_file(record)
    # The current state reads the same everywhere.
    for p in {f.partition for f in long.all_files()}:
        assert table.snapshot(p).sort_by("key").equals(fresh.snapshot(p).sort_by("key"))
    assert new.to_dict() == long.to_dict()


@pytest.mark.slow
def test_checkpoints_of_a_long_lived_writer_equal_a_fresh_fold(tmp_path: Path) -> None:
    """Every checkpoint the long-lived process wrote (its pruned view) is the checkpoint a fold of records 1..C
    gives, byte for byte once sealed, and the reference's section-7a content."""
    written: dict[int, bytes] = {}

    def keep(step: int, table: Table, ref: Reference, oracle: Oracle) -> None:
        for seq in checkpoint.checkpoint_seqs(table.io):
            if seq not in written:
                written[seq] = table.io.read_bytes(layout.checkpoint_file(seq))

    table, _, ref = stream(tmp_path, False, 40, 7, keep)
    records = table.timeline.completed()
    assert ref.dropped() and len(written) >= 4
    pruned_before = 0
    for seq, raw in sorted(written.items()):
        stored = checkpoint.unseal(raw, str(seq), table.props.table_id, {"seq", "max_instant", "index", "data"})
        index, data = IndexView(), DataView()
        index.apply(records[:seq])
        data.apply(records[:seq])
        assert stored["index"] == index.to_dict()
        part = Reference()
        part.apply(records[:seq])
        assert canonical(stored["index"]) == canonical(part.checkpoint_index(seq, stored["index"]["stats"]))
        payload = {
            "format": checkpoint.CHECKPOINT_FORMAT,
            "table_id": table.props.table_id,
            "seq": seq,
            "max_instant": stored["max_instant"],
            "index": index.to_dict(),
            "data": data.to_dict(),
        }
        assert checkpoint.seal(payload) == raw
        pruned_before += stored["index"]["history_floor"] > 0
    assert pruned_before  # some checkpoint was written after the long-lived view had pruned files
    # And at the latest seq: the long-lived view, a fold from record 1 and a fresh open are one checkpoint.
    fresh = Table.open(table.uri)
    whole = IndexView()
    whole.apply(records)
    assert canonical(table.refresh().to_dict()) == canonical(whole.to_dict()) == canonical(fresh.refresh().to_dict())


def test_a_cache_behind_a_dropped_history_reloads_and_one_partition_stays_readable(tmp_path: Path) -> None:
    """Catch-up on a long-lived table: a cache whose gap needs a dropped delta reloads (never applies a short
    history) and ends equal to the table; a group with no dropped file still reads as of old seqs."""
    table = Table.create(str(tmp_path / "t"), num_shards=1, checkpoint_interval=0)
    a, b = "dt=a", "dt=b"
    for i in range(3):
        with table.new_commit() as w:
            w.insert(a, [f"a{i}-{j}" for j in range(20)], "fg-a")
            w.insert(b, [f"b{i}-{j}" for j in range(20)], "fg-b")
    cache = open_cache(table, 0, tmp_path / "c")
    with cache:
        for p in (a, b):
            load_from_snapshot(cache, table, p, table.timeline.latest_seq)
        cache.set_watermark(table.timeline.latest_seq)
        behind = table.timeline.latest_seq
        with table.new_commit() as w:
            w.insert(a, ["late-a"], "fg-a2")
        table.compact(partitions=[a], min_files=2)
        table.clean(retain_completions=0)
        view = table.refresh()
        assert view.history_floor == 0 and view._group_floors == {(a, 0): table.timeline.latest_seq - 1}
        assert len(view.files(a, 0)) == 1 and len(view._groups[(a, 0)]) == 1
        # Partition b lost nothing: readable as of every seq; partition a as of before its compaction: refused.
        assert [len(view.files(b, 0, s)) for s in range(1, behind + 1)] == [1, 2, 3]
        with pytest.raises(HistoryCompactedError, match="replaced"):
            view.files(a, 0, behind)
        with pytest.raises(HistoryCompactedError):
            table.incremental(behind)
        result = sync(cache, table)
        assert a in result.reloaded_partitions
        for p in (a, b):
            assert dict(cache.items(p)) == truth(table, p, 0)
        assert cache.lookup(a, ["late-a"]) == ["fg-a2"]
