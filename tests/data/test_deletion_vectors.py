"""Building and encoding deletion vectors fast gives the same bitmaps and the same inline forms as the plain way."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pyroaring import BitMap

from dbidx.data import deletion_vectors
from dbidx.data.deletion_vectors import (
    decode_vector,
    encode_vector,
    inline_form,
    positions_bitmap,
    z85_decode,
    z85_encode,
)

POSITIONS = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=300)


@given(POSITIONS, st.sampled_from([np.int32, np.int64, np.uint32, np.uint64]))
def test_a_bitmap_of_positions_in_any_order_holds_each_once(positions: list[int], dtype: type) -> None:
    values = np.array(positions, dtype=np.uint64).astype(dtype)  # int32: positions past 2^31 wrap, as a cast does
    expected = BitMap(int(v) for v in values.astype(np.uint64) & 0xFFFFFFFF)
    assert positions_bitmap(values) == expected
    assert positions_bitmap(values[::-1]) == expected  # unsorted, and a view with a negative stride


@given(POSITIONS)
def test_an_encoded_vector_decodes_to_its_positions(positions: list[int]) -> None:
    assert decode_vector(encode_vector(np.array(positions, dtype=np.int64)), "test") == BitMap(positions)


@pytest.mark.parametrize("size", [0, 4, 7, 400, 4001])
def test_an_inline_form_is_the_z85_of_its_padded_bytes_again_and_again(size: int) -> None:
    body = os.urandom(size)
    padded = body + b"\0" * (-size % 4)
    first, again = inline_form(body), inline_form(bytes(body))  # the second from the memo (an equal bytes object)
    assert first == again == z85_encode(padded)
    assert z85_decode(again) == padded


def test_the_inline_memo_keeps_to_its_byte_budget_and_skips_large_vectors() -> None:
    memo = deletion_vectors._InlineMemo(1600)
    for i in range(100):
        memo.put(bytes([i]) * 40, "x" * 50)
    assert memo._bytes <= 1600 and len(memo._items) == 1600 // 90
    assert memo.get(bytes([99]) * 40) == "x" * 50 and memo.get(bytes([0]) * 40) is None  # oldest dropped first
    memo.put(b"y" * 100, "z" * 125)  # past 1/16 of the budget: not kept
    assert memo.get(b"y" * 100) is None
