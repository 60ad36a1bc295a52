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


def test_the_inline_memo_keeps_small_vectors_and_skips_large_ones() -> None:
    small, large = os.urandom(400), os.urandom(600 << 10)  # large: with its text past 1/16 of the memo's 16 MiB
    assert deletion_vectors._INLINE.get(small) is None and deletion_vectors._INLINE.get(large) is None
    inline_form(small), inline_form(large)
    assert deletion_vectors._INLINE.get(small) == inline_form(small)
    assert deletion_vectors._INLINE.get(large) is None
