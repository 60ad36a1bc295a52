"""The older live files of one file group as one hash index, kept per process and grown batch by batch.

Why: a batch's new rows supersede rows of their group's older files (data/superseded.py). Searching each older file
on its own (data/key_columns.hash_matches per file, as dbidx did before) costs a binary search per probe key per
file and a few array calls per file: a steady stream of 100 k-row batches on 2 M keys probes ~350 files per task.
Merged, the group's files are one sorted hash array with the file and row of each hash: one search per probe key, and
the candidates confirmed by key, file by file. Each batch adds a file or two to a group, so the merged index is kept
and the new files merged into it (their insertion points: linear); a group whose files left (a data compaction) is
merged again from its files' own indexes. Measured on one group of a 2 M-key table (a 33,000-row base, ten
1,600-row files, 1,600 probe keys): 1.4-1.5 ms with the merge of the newest file, against 2.7 ms file by file.

The file indexes themselves stay in key_columns.KEYS (the caller passes them in); this keeps only the merged order,
12 bytes per row, under its own byte budget. Every hit is confirmed by comparing the key itself, so a stale or
colliding entry can never make a false hit: an entry is used only for exactly the files it was built from (by path
and checksum), and otherwise built again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dbidx.data.key_columns import FileKeys, Probe, hash_matches
from dbidx.lru import BytesLRU

GROUP_CACHE_BYTES = int(os.environ.get("DBIDX_GROUP_KEYS_MB", "128")) * 2**20

FileId = tuple[str, str]  # (data file path, checksum): a data file's identity


@dataclass(frozen=True)
class GroupKeys:
    """Files' sorted hashes merged into one order: per entry, its hash, the file (index into `files`) and row."""

    files: tuple[FileId, ...]
    sorted_hashes: np.ndarray  # uint32
    file_of: np.ndarray  # int32: index into files
    row_of: np.ndarray  # int32: row in that file

    @classmethod
    def of(cls, files: Sequence[FileId], indexes: Sequence[FileKeys]) -> "GroupKeys":
        """Merge the files' indexes (each sorted by hash already: a stable sort of k sorted runs)."""
        empty = cls((), np.empty(0, np.uint32), np.empty(0, np.int32), np.empty(0, np.int32))
        return empty.grown(files, indexes)

    def grown(self, files: Sequence[FileId], indexes: Sequence[FileKeys]) -> "GroupKeys":
        """This index with more files merged in (none of them in it already)."""
        if not files:
            return self
        # 1. The new files' entries in hash order (a stable sort of their own sorted runs: few rows).
        first = len(self.files)
        hashes = np.concatenate([f.sorted_hashes for f in indexes])
        file_of = np.concatenate([np.full(len(f.order), first + i, np.int32) for i, f in enumerate(indexes)])
        row_of = np.concatenate([f.order.astype(np.int32, copy=False) for f in indexes])
        if len(indexes) > 1:
            order = np.argsort(hashes, kind="stable")
            hashes, file_of, row_of = hashes[order], file_of[order], row_of[order]
        if not len(self.sorted_hashes):
            return GroupKeys((*self.files, *files), hashes, file_of, row_of)
        # 2. Merged into the kept order: where each new entry goes, then both placed (no sort of the kept entries).
        at = np.searchsorted(self.sorted_hashes, hashes, side="right") + np.arange(len(hashes))
        kept = np.ones(len(self.sorted_hashes) + len(hashes), dtype=bool)
        kept[at] = False

        def placed(old: np.ndarray, new: np.ndarray) -> np.ndarray:
            out = np.empty(len(kept), dtype=old.dtype)
            out[at], out[kept] = new, old
            return out

        return GroupKeys(
            (*self.files, *files),
            placed(self.sorted_hashes, hashes),
            placed(self.file_of, file_of),
            placed(self.row_of, row_of),
        )

    @property
    def nbytes(self) -> int:
        """Memory held by the merged arrays (the files' own indexes are counted by key_columns.KEYS)."""
        return self.sorted_hashes.nbytes + self.file_of.nbytes + self.row_of.nbytes

    def rows_of(self, probe: Probe, indexes: Mapping[FileId, FileKeys]) -> dict[FileId, np.ndarray]:
        """Per file with a hit: its rows (int32, in no particular order, a row twice if the probe has its key twice)
        whose key is one of the probe's. `indexes` holds each of `files`' own index (its keys confirm a hit)."""
        # 1. Candidates: every entry whose hash equals a probe key's hash, over all the group's files at once.
        entries, which = hash_matches(self.sorted_hashes, probe)
        if not len(entries):
            return {}
        files, rows = self.file_of[entries], self.row_of[entries]
        # 2. Split by file: each file's candidates in one run.
        order = np.argsort(files, kind="stable")
        files, rows, which = files[order], rows[order], which[order]
        bounds = np.flatnonzero(np.diff(files)) + 1
        runs = [(int(part[0]), part_rows) for part, part_rows in zip(np.split(files, bounds), np.split(rows, bounds))]
        # 3. Confirmed by the keys themselves: a collision is never a hit. Each file gives only its candidates' keys
        #    (a gather over all the group's key columns at once would copy them whole on every call).
        found = pa.concat_arrays([indexes[self.files[f]].keys.take(pa.array(part_rows)) for f, part_rows in runs])
        same = pc.equal(found, probe.keys.take(pa.array(which))).to_numpy(zero_copy_only=False)
        hits: dict[FileId, np.ndarray] = {}
        start = 0
        for f, part_rows in runs:
            confirmed = part_rows[same[start : start + len(part_rows)]]
            start += len(part_rows)
            if len(confirmed):
                hits[self.files[f]] = confirmed
        return hits


class GroupIndexes:
    """Per process: the last GroupKeys of each file group, least recently used dropped past a byte budget."""

    def __init__(self, max_bytes: int) -> None:
        self._kept: BytesLRU[tuple[str, str, str], GroupKeys] = BytesLRU(max_bytes)

    def of(self, group: tuple[str, str, str], indexes: Mapping[FileId, FileKeys]) -> GroupKeys:
        """The merged index of exactly these files of `group` (table root, partition, file group): the kept one
        when it has exactly these files, grown when it has some of them and no other, else merged anew."""
        kept = self._kept.pop(group)  # taken out: a thread searching the same group at once merges its own
        known = set(kept.files) if kept is not None else set()
        if kept is not None and known <= set(indexes):
            new = [f for f in indexes if f not in known]
            merged = kept.grown(new, [indexes[f] for f in new])
        else:
            merged = GroupKeys.of(list(indexes), list(indexes.values()))
        self._kept.put(group, merged, merged.nbytes)  # (another thread's may stay instead: this one is still exact)
        return merged


GROUPS = GroupIndexes(GROUP_CACHE_BYTES)
