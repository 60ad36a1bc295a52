"""Rows grouped by an integer code (a dictionary-encoded partition, or partition x file group): one stable sort,
no per-row Python object. What a task uses to split its rows per partition or per data file."""

from __future__ import annotations

from typing import Iterator

import numpy as np


def runs(codes: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(code, positions of its rows in arrival order) for each distinct code, codes ascending."""
    if not len(codes):
        return
    # numpy's stable sort is a radix sort for integers of 16 bits or less: ~6x faster than the merge sort it uses
    # for wider ones (5 M rows: 0.05 s against 0.31 s), and codes rarely reach 2**16.
    narrow = codes.min() >= 0 and codes.max() < 2**16
    order = np.argsort(codes.astype(np.uint16) if narrow else codes, kind="stable")
    ordered = codes[order]
    starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
    for start, end in zip(starts.tolist(), np.append(starts[1:], len(ordered)).tolist()):
        yield int(ordered[start]), order[start:end]
