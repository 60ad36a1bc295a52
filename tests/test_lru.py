"""The byte-bounded LRU map that key indexes and inline vector forms are kept in."""

from __future__ import annotations

from dbidx.lru import BytesLRU


def test_the_least_recently_used_go_past_the_budget() -> None:
    kept: BytesLRU[int, str] = BytesLRU(1600)
    for i in range(100):
        assert kept.put(i, f"v{i}", 90) == f"v{i}"
    assert kept.nbytes <= 1600 and len(kept) == 1600 // 90
    assert kept.get(99) == "v99" and kept.get(0) is None  # oldest dropped first
    assert kept.get(83) == "v83"  # used again: now the most recent
    kept.put(100, "v100", 90)
    assert kept.get(83) == "v83" and kept.get(84) is None


def test_a_key_kept_already_keeps_its_first_value() -> None:
    kept: BytesLRU[str, str] = BytesLRU(1000)
    assert kept.put("k", "first", 10) == "first"
    assert kept.put("k", "second", 10) == "first"
    assert kept.get("k") == "first" and kept.nbytes == 10


def test_the_newest_value_stays_even_past_the_budget() -> None:
    kept: BytesLRU[str, str] = BytesLRU(100)
    kept.put("a", "small", 50)
    assert kept.put("b", "huge", 500) == "huge"
    assert kept.get("b") == "huge" and kept.get("a") is None and len(kept) == 1
