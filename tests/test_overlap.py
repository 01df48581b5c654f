"""grpo_core/rewards/overlap.py: work done on a helper thread, a chunk of pieces at a time, all or nothing."""
from __future__ import annotations

import logging
import threading

from grpo_core.rewards.overlap import Overlapped


def test_pieces_added_while_the_helper_works_are_done_together_and_returned_by_key():
    gate, calls = threading.Event(), []

    def double(items):
        calls.append(list(items))
        gate.wait(10)                                   # the first chunk holds the helper while more arrive
        return [2 * x for x in items]

    work = Overlapped(double, "doubling")
    work.add("a", [1, 2])
    for _ in range(100):                                # the helper has taken "a" and waits at the gate
        if calls:
            break
        threading.Event().wait(0.01)
    work.add("b", [3])
    work.add("c", [4, 5])
    gate.set()
    assert work.finish() == {"a": [2, 4], "b": [6], "c": [8, 10]}
    assert calls == [[1, 2], [3, 4, 5]]                 # "b" and "c" in one call


def test_after_an_error_nothing_more_is_done_and_finish_says_so(caplog):
    calls = []

    def fails_once(items):
        calls.append(items)
        raise RuntimeError("no sandbox here")

    with caplog.at_level(logging.INFO, logger="grpo_core.rewards.overlap"):
        work = Overlapped(fails_once, "scoring")
        work.add(0, [1])
        work.add(1, [2])
        assert work.finish() is None
    assert "scoring stopped (RuntimeError: no sandbox here); it is done afterwards instead" in caplog.text
    assert len(calls) == 1


def test_a_wrong_number_of_results_is_an_error_and_abandon_stops_without_waiting():
    short = Overlapped(lambda items: items[:-1], "shortening")
    short.add(0, [1, 2])
    assert short.finish() is None
    started, gate = threading.Event(), threading.Event()
    stuck = Overlapped(lambda items: started.set() or gate.wait(10) and items, "waiting")
    stuck.add(0, [1])
    assert started.wait(10)
    stuck.abandon()                                     # returns at once though the helper is busy
    assert stuck._thread.is_alive()
    gate.set()
    stuck._thread.join(10)                              # and the helper ends after the chunk in hand
    assert not stuck._thread.is_alive()


def test_leaving_the_block_on_an_exception_abandons_the_work():
    import pytest
    work = Overlapped(lambda items: items, "copying")
    with pytest.raises(KeyboardInterrupt), work:
        work.add(0, [1])
        raise KeyboardInterrupt                     # the producer was stopped
    work._thread.join(10)
    assert not work._thread.is_alive() and work.finish() is None
