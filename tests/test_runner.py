"""The in-process runner: pieces on a few threads, results in item order, and a failure or an early stop that
leaves nothing running behind the caller."""

from __future__ import annotations

import threading
import time

import pytest

from dbidx.runner import InProcessRunner, pack, results_of


def test_pieces_run_at_once_and_come_back_in_item_order() -> None:
    both_running = threading.Barrier(2, timeout=10)  # broken (BrokenBarrierError) unless two pieces overlap

    def work(item: int, attempt: int) -> bytes:
        if item < 2:
            both_running.wait()
        time.sleep(0.01 * (5 - item))  # later items finish first
        return pack({"item": item, "attempt": attempt})

    results = list(InProcessRunner(threads=2).run(work, list(range(5)), "test"))
    assert results == [pack({"item": i, "attempt": 0}) for i in range(5)]


def test_one_thread_runs_the_pieces_one_after_another() -> None:
    seen: list[tuple[int, str]] = []

    def work(item: int, attempt: int) -> bytes:
        seen.append((item, threading.current_thread().name))
        return pack({"item": item})

    assert len(list(InProcessRunner(threads=1).run(work, [1, 2, 3], "test"))) == 3
    assert [i for i, _ in seen] == [1, 2, 3]
    assert {name for _, name in seen} == {threading.current_thread().name}


def test_a_failure_is_raised_after_the_running_pieces_end_and_the_rest_never_start() -> None:
    started: list[int] = []
    finished: list[int] = []
    lock = threading.Lock()
    release = threading.Event()

    def work(item: int, attempt: int) -> bytes:
        with lock:
            started.append(item)
        if item == 0:
            release.wait(10)  # still running when item 1 fails
            with lock:
                finished.append(item)
            return pack({"item": item})
        if item == 1:
            threading.Timer(0.2, release.set).start()
            raise ValueError("piece 1 failed")
        with lock:
            finished.append(item)
        return pack({"item": item})

    with pytest.raises(ValueError, match="piece 1 failed"):
        for _ in InProcessRunner(threads=2).run(work, list(range(50)), "test"):
            pass
    assert 0 in finished  # it ended before the failure reached the caller
    with lock:
        after = list(started)
    time.sleep(0.2)
    assert started == after  # nothing started once the failure was raised
    assert len(started) < 50  # the pieces not started were cancelled


def test_a_caller_that_stops_early_leaves_no_piece_running() -> None:
    active: list[int] = []
    lock = threading.Lock()

    def work(item: int, attempt: int) -> bytes:
        with lock:
            active.append(item)
        time.sleep(0.05)
        with lock:
            active.remove(item)
        return pack({"item": item})

    results = InProcessRunner(threads=2).run(work, list(range(20)), "test")
    next(results)
    results.close()  # the caller stops reading
    assert active == []


def test_a_caller_failing_on_a_result_leaves_the_block_with_no_piece_running() -> None:
    active: list[int] = []
    lock = threading.Lock()

    def work(item: int, attempt: int) -> bytes:
        with lock:
            active.append(item)
        time.sleep(0.05)
        with lock:
            active.remove(item)
        return pack({"item": item})

    with pytest.raises(RuntimeError, match="a result the caller refuses"):
        with results_of(InProcessRunner(threads=2).run(work, list(range(20)), "test")) as results:
            for payload in results:
                raise RuntimeError("a result the caller refuses")  # e.g. a piece's file of the wrong size
    assert active == []  # what a rollback after the block deletes is not being written any more


def test_a_pieces_error_keeps_its_type_and_cause() -> None:
    class PieceError(Exception):
        pass

    def work(item: int, attempt: int) -> bytes:
        if item == 3:
            try:
                raise OSError("the file could not be read")
            except OSError as exc:
                raise PieceError("piece 3 failed") from exc
        return pack({"item": item})

    with pytest.raises(PieceError, match="piece 3 failed") as raised:
        list(InProcessRunner(threads=2).run(work, list(range(6)), "test"))
    assert isinstance(raised.value.__cause__, OSError)
