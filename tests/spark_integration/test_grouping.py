"""grouping.runs: rows grouped by an integer code, codes ascending, arrival order kept within a code."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dbidx.spark_integration.grouping import runs


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.one_of(st.integers(0, 40), st.integers(-3, 2**17)), max_size=80), st.sampled_from([np.int32, np.int64])
)
def test_runs_equal_a_plain_grouping(codes: list[int], dtype: type) -> None:
    """Narrow codes (the radix-sort path) and wide or negative ones group alike."""
    expected: dict[int, list[int]] = {}
    for row, code in enumerate(codes):
        expected.setdefault(code, []).append(row)
    got = [(code, rows.tolist()) for code, rows in runs(np.array(codes, dtype=dtype))]
    assert got == sorted(expected.items())
