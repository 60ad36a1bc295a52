"""The file view: which RLI files make up each (partition, shard) at any point of the completion log.

Built by replaying completion records in order (deltas add files, compactions swap replaced files for a base,
cleans mark files as physically gone), so a snapshot "as of seq S" is a pure function of the log.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

from dbidx.errors import CorruptFileError, HistoryCompactedError
from dbidx.storage.records import (
    ACTION_CLEAN,
    ACTION_COMPACTION,
    ENTRY_ACTIONS,
    CompletedInstant,
    FieldError,
    FileRecord,
    parse_instant,
    parse_int,
    parse_items,
    parse_object,
    parse_order,
    parse_str,
)

GroupKey = tuple[str | None, int]  # (partition, or None for the global index; shard)

# How many paths of dropped files (replaced and cleaned) `is_cleaned` still recognizes: a read planned before a
# clean that finds its file gone is told "cleaned" (HistoryCompactedError), not "damaged", unless more files than
# this were dropped between its plan and its look (hours of a busy table's cleans). A bounded memory, not a view.
GONE_MEMORY = 4096


@dataclass
class _Added:
    seq: int
    record: FileRecord
    order: tuple[int, int]  # (seq of the newest delta it reflects, 0 for a delta / 1 for a base)
    replaced_at: int | None = None


@dataclass
class PartitionStats:
    """Per data partition: last commit, live keys and fill per file group (what `dbidx stats` shows)."""

    partition: str
    last_instant: str
    last_commit_ms: int
    live_keys: int
    bucket_fills: dict[str, int] = field(default_factory=dict)

    @property
    def last_commit_time(self) -> datetime:
        """Wall-clock time of the last commit that touched the partition (UTC)."""
        return datetime.fromtimestamp(self.last_commit_ms / 1000, tz=timezone.utc)


class IndexView:
    """Replays the completion log incrementally; answers file lists and partition stats."""

    def __init__(self) -> None:
        self.applied_seq = 0
        # Reads as of a seq below this one, or incremental reads from below it, lack files a checkpoint dropped
        # (replaced and cleaned): they raise HistoryCompactedError. 0 for a view replayed from the first record.
        self.history_floor = 0
        self._groups: dict[GroupKey, list[_Added]] = {}
        self._by_path: dict[str, _Added] = {}
        self._cleaned: dict[str, int] = {}  # files cleaned and not (yet) replaced -> the clean's seq
        self._stats: dict[str, PartitionStats] = {}
        # Files both replaced and cleaned are dropped when the fold meets the second of the two (`_drop`), so a
        # long-lived view holds what one opened from a checkpoint at the same seq holds, not every file ever
        # written. What they leave: per group the largest `replaced_at` among its dropped files (reads of that
        # group as of a seq below it raise, other groups read on), and the largest seq that added a dropped delta
        # (incremental reads starting below it raise). `to_dict` folds both into the checkpoint's history_floor.
        self._group_floors: dict[GroupKey, int] = {}
        self._delta_floor = 0
        self._gone: dict[str, int] = {}  # the last GONE_MEMORY dropped paths -> the seq of the clean that removed them

    def apply(self, records: list[CompletedInstant]) -> None:
        """Fold newly published completion records (in seq order) into the view."""
        for rec in records:
            if rec.seq <= self.applied_seq:
                continue
            if rec.action in ENTRY_ACTIONS:
                for f in rec.files:
                    self._add(_Added(rec.seq, f, (rec.seq, 0)))
            if rec.action == ACTION_COMPACTION:
                # A base stands where the newest file it replaced stood: a delta published while the compaction
                # ran (not replaced) is newer than the base even though its seq is smaller.
                covered: dict[GroupKey, int] = {}
                for path in rec.replaced:
                    if path in self._by_path:
                        old = self._by_path[path]
                        old.replaced_at = rec.seq
                        group = (old.record.partition, old.record.shard)
                        covered[group] = max(covered.get(group, 0), old.order[0])
                for f in rec.files:
                    self._add(_Added(rec.seq, f, (covered.get((f.partition, f.shard), 0), 1)))
                # Cleaned before being replaced (a clean only deletes replaced files, so only a crafted log): gone.
                self._drop({p: self._cleaned[p] for p in rec.replaced if p in self._cleaned and p in self._by_path})
            if rec.action == ACTION_CLEAN:
                doomed: dict[str, int] = {}
                for path in rec.deleted:
                    added = self._by_path.get(path)
                    if added is None:
                        continue  # a data or DV file (the data view's), or one the view never held: nothing to keep
                    if added.replaced_at is None:
                        self._cleaned[path] = rec.seq  # kept, as a checkpoint keeps it: reads needing it raise
                    else:
                        doomed[path] = rec.seq
                self._drop(doomed)
            if rec.action in ENTRY_ACTIONS:
                self._apply_stats(rec)
            self.applied_seq = rec.seq

    def _add(self, added: _Added) -> None:
        self._groups.setdefault((added.record.partition, added.record.shard), []).append(added)
        self._by_path[added.record.path] = added

    def _drop(self, doomed: dict[str, int]) -> None:
        """Forget files that were both replaced and cleaned (path -> the clean's seq): they can never be read again.
        What a checkpoint leaves out (FORMAT.md 7a), with the floors that keep every read that needed them loud."""
        if not doomed:
            return
        by_group: dict[GroupKey, set[str]] = {}
        for path, cleaned_at in doomed.items():
            added = self._by_path.pop(path)
            self._cleaned.pop(path, None)
            group = (added.record.partition, added.record.shard)
            by_group.setdefault(group, set()).add(path)
            self._group_floors[group] = max(self._group_floors.get(group, 0), added.replaced_at or 0)
            if added.record.kind == "delta":
                self._delta_floor = max(self._delta_floor, added.seq)
            self._gone[path] = cleaned_at
        for group, paths in by_group.items():
            kept = [a for a in self._groups.get(group, []) if a.record.path not in paths]
            if kept:
                self._groups[group] = kept
            else:
                self._groups.pop(group, None)  # no file left: a checkpoint has no trace of the group either
        while len(self._gone) > GONE_MEMORY:
            del self._gone[next(iter(self._gone))]

    def _apply_stats(self, rec: CompletedInstant) -> None:
        for partition, change in rec.partitions.items():
            stats = self._stats.get(partition)
            if stats is None:
                stats = self._stats[partition] = PartitionStats(partition, rec.instant, rec.completed_at_ms, 0)
            stats.last_instant = rec.instant
            stats.last_commit_ms = rec.completed_at_ms
            stats.live_keys += change.live
            for fg, delta in change.fills.items():
                fill = stats.bucket_fills.get(fg, 0) + delta
                if fill:
                    stats.bucket_fills[fg] = fill
                else:
                    stats.bucket_fills.pop(fg, None)

    def groups(self) -> list[GroupKey]:
        """Every (partition, shard) with a file the view holds (one whose files were all replaced and cleaned is
        gone, as from a checkpoint)."""
        return sorted(self._groups, key=lambda g: ("" if g[0] is None else g[0], g[1]))

    def files(self, partition: str | None, shard: int, upto_seq: int | None = None) -> list[FileRecord]:
        """Live files of a (partition, shard) as of `upto_seq`, oldest first (base before the deltas after it)."""
        upto = self.applied_seq if upto_seq is None else upto_seq
        if upto < self.history_floor:
            raise HistoryCompactedError(
                f"a read as of seq {upto} needs index files a clean removed before seq {self.history_floor} (the "
                "table was opened from a checkpoint past them); read a newer snapshot (caches reload the partition)"
            )
        floor = self._group_floors.get((partition, shard), 0)
        if upto < floor:
            raise HistoryCompactedError(
                f"a read of {'the global index' if partition is None else repr(partition)}, shard {shard} as of seq "
                f"{upto} needs index files that a compaction replaced (by seq {floor}) and a clean removed since; "
                "read a newer snapshot (caches reload the partition)"
            )
        live = [
            a
            for a in self._groups.get((partition, shard), [])
            if a.seq <= upto and (a.replaced_at is None or a.replaced_at > upto)
        ]
        for a in live:
            if a.record.path in self._cleaned:
                raise HistoryCompactedError(
                    f"index file {a.record.path} needed for a read as of seq {upto} was removed by a clean at seq "
                    f"{self._cleaned[a.record.path]}; read a newer snapshot (caches reload the partition)"
                )
        return [a.record for a in sorted(live, key=lambda a: a.order)]

    def all_files(self) -> list[FileRecord]:
        """Every file the view holds: live, replaced, and cleaned ones not both (those are dropped)."""
        return [a.record for a in self._by_path.values()]

    def referenced_paths(self) -> set[str]:
        """Index files the table still names: live ones, and replaced ones no clean has deleted yet."""
        return {p for p, a in self._by_path.items() if a.replaced_at is None or p not in self._cleaned}

    def is_cleaned(self, path: str) -> bool:
        """Whether a clean has deleted this index file: one the view holds, or one of the last GONE_MEMORY it
        dropped (a read planned before the clean that finds its file gone asks this)."""
        return path in self._cleaned or path in self._gone

    def delta_files_between(self, after_seq: int, upto_seq: int, strict: bool = True) -> list[tuple[int, FileRecord]]:
        """Delta files published by commits with after_seq < seq <= upto_seq, in order, with their seq.

        strict: raise HistoryCompactedError if one of them was cleaned (else the caller checks is_cleaned()). A
        delta both replaced and cleaned is no longer held (as in a view opened from a checkpoint past it): a strict
        read starting before the seq that published it raises; a lax one does not list it.
        """
        if strict and after_seq < self.history_floor:
            raise HistoryCompactedError(
                f"incremental read ({after_seq}, {upto_seq}] reaches back before seq {self.history_floor}, whose "
                "replaced files a clean removed (the table was opened from a checkpoint past them); reload from a "
                "snapshot instead"
            )
        if strict and after_seq < self._delta_floor:
            raise HistoryCompactedError(
                f"incremental read ({after_seq}, {upto_seq}] reaches back before seq {self._delta_floor}, which "
                "published a delta file that a compaction replaced and a clean removed since; reload from a snapshot "
                "instead"
            )
        out = []
        for added in self._by_path.values():
            if after_seq < added.seq <= upto_seq and added.record.kind == "delta":
                if strict and added.record.path in self._cleaned:
                    raise HistoryCompactedError(
                        f"incremental read ({after_seq}, {upto_seq}] needs {added.record.path}, removed by the clean "
                        f"at seq {self._cleaned[added.record.path]}; reload from a snapshot instead"
                    )
                out.append((added.seq, added.record))
        return sorted(out, key=lambda item: (item[0], item[1].path))

    def replaced_files(self, upto_seq: int) -> list[tuple[str, int]]:
        """(path, replacing compaction seq) of files replaced at or before upto_seq and not cleaned yet."""
        return sorted(
            (path, a.replaced_at)
            for path, a in self._by_path.items()
            if a.replaced_at is not None and a.replaced_at <= upto_seq and path not in self._cleaned
        )

    def partition_stats(self) -> list[PartitionStats]:
        """Stats of every partition that has had a commit, sorted by partition path: copies, since `apply` updates
        the view's own in place (a caller reading one while another thread refreshes would see it change, or meet
        "dictionary changed size" in its fills)."""
        return [replace(self._stats[p], bucket_fills=dict(self._stats[p].bucket_fills)) for p in sorted(self._stats)]

    # ---- checkpoint form ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The view as a checkpoint stores it. Files that were replaced and then cleaned are left out (they can
        never be read again); `history_floor` then says which older reads must fail instead of missing them."""
        floor = max([self.history_floor, *self._group_floors.values()])
        files = []
        for path, a in sorted(self._by_path.items(), key=lambda item: (item[1].seq, item[0])):
            if a.replaced_at is not None and path in self._cleaned:
                floor = max(floor, a.replaced_at)
                continue
            files.append(
                {
                    "file": asdict(a.record),
                    "seq": a.seq,
                    "order": list(a.order),
                    "replaced_at": a.replaced_at,
                    "cleaned_at": self._cleaned.get(path),
                }
            )
        return {
            "applied_seq": self.applied_seq,
            "history_floor": floor,
            "files": files,
            "stats": [asdict(self._stats[p]) for p in sorted(self._stats)],
        }

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "IndexView":
        """Rebuild from a checkpoint, checking every field (read back from storage: untrusted)."""
        try:
            d = parse_object(data, "index", {"applied_seq", "history_floor", "files", "stats"})
            view = cls()
            view.applied_seq = parse_int(d["applied_seq"], "index.applied_seq")
            view.history_floor = parse_int(d["history_floor"], "index.history_floor")
            for i, item in enumerate(parse_items(d["files"], "index.files")):
                name = f"index.files[{i}]"
                e = parse_object(item, name, {"file", "seq", "order", "replaced_at", "cleaned_at"})
                replaced_at = None if e["replaced_at"] is None else parse_int(e["replaced_at"], f"{name}.replaced_at")
                added = _Added(
                    parse_int(e["seq"], f"{name}.seq", 1),
                    FileRecord.parse(e["file"], f"{name}.file"),
                    parse_order(e["order"], f"{name}.order"),
                    replaced_at,
                )
                view._add(added)
                if e["cleaned_at"] is not None:
                    view._cleaned[added.record.path] = parse_int(e["cleaned_at"], f"{name}.cleaned_at", 1)
            for i, item in enumerate(parse_items(d["stats"], "index.stats")):
                name = f"index.stats[{i}]"
                e = parse_object(
                    item, name, {"partition", "last_instant", "last_commit_ms", "live_keys", "bucket_fills"}
                )
                fills = parse_object(e["bucket_fills"], f"{name}.bucket_fills", set(e["bucket_fills"] or {}))
                stats = PartitionStats(
                    parse_str(e["partition"], f"{name}.partition"),
                    parse_instant(e["last_instant"], f"{name}.last_instant"),
                    parse_int(e["last_commit_ms"], f"{name}.last_commit_ms"),
                    parse_int(e["live_keys"], f"{name}.live_keys", -(2**62)),
                    {fg: parse_int(n, f"{name}.bucket_fills", -(2**62)) for fg, n in fills.items()},
                )
                view._stats[stats.partition] = stats
            return view
        except (FieldError, ValueError, TypeError) as exc:
            raise CorruptFileError(f"checkpoint {where}: its index view is not valid: {exc}") from exc
