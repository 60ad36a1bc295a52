"""How a Spark service job packs its pieces into tasks (service_jobs.balanced): every piece once, no task empty,
loads within one piece of even."""

from __future__ import annotations

from hypothesis import given, strategies as st

from dbidx.spark_integration.service_jobs import balanced


@given(st.lists(st.integers(min_value=0, max_value=1 << 30), min_size=1, max_size=200), st.integers(1, 64))
def test_every_piece_once_in_groups_of_about_equal_weight(weights: list[int], slices: int) -> None:
    slices = min(slices, len(weights))
    groups = balanced(weights, slices)
    assert sorted(i for g in groups for i in g) == list(range(len(weights)))
    assert len(groups) == slices and all(g == sorted(g) for g in groups)
    loads = [sum(max(weights[i], 1) for i in g) for g in groups]
    heaviest = max(max(w, 1) for w in weights)
    assert max(loads) <= sum(max(w, 1) for w in weights) / slices + heaviest


def test_heavy_pieces_go_to_different_tasks() -> None:
    groups = balanced([100, 1, 1, 100, 1], 2)
    assert [len(set(g) & {0, 3}) for g in groups] == [1, 1]
    assert sorted(len(g) for g in groups) == [2, 3]
