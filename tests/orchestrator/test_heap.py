"""orchestrator/heap.py: the collector tuned for serving (the start-up heap frozen, the youngest generation
collected less often), and handed back.

In this process (the test owns it for its length): every test releases what it tuned.
"""

from __future__ import annotations

import gc
import weakref

from orchestrator.heap import YOUNG_THRESHOLD, tune_gc_for_serving


class _Node:
    other: _Node | None = None


def _cycle() -> weakref.ref:
    """A garbage reference cycle of two objects; a weak reference to one of them."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_tuning_collects_the_garbage_first_then_freezes_what_is_left() -> None:
    before = gc.get_threshold()
    dead = _cycle()
    alive = _Node()
    tuned = tune_gc_for_serving()
    try:
        assert dead() is None  # collected before the freeze, never frozen
        assert tuned.objects == gc.get_freeze_count() > 0
        assert tuned.seconds >= 0
        # frozen objects are out of every generation a collection walks
        assert not any(o is alive for o in gc.get_objects())
        assert gc.get_threshold() == (YOUNG_THRESHOLD, *before[1:])
        assert tuned.previous_thresholds == before
    finally:
        tuned.release()
    assert gc.get_freeze_count() == 0
    assert any(o is alive for o in gc.get_objects())
    assert gc.get_threshold() == before


def test_a_cycle_of_frozen_objects_waits_for_the_release() -> None:
    # the documented trade: an object tracked at the freeze that later becomes cyclic garbage is only
    # reclaimed once the heap is handed back
    a, b = _Node(), _Node()
    tuned = tune_gc_for_serving()
    try:
        a.other, b.other = b, a
        dead = weakref.ref(a)
        del a, b
        gc.collect()
        assert dead() is not None
    finally:
        tuned.release()
    gc.collect()
    assert dead() is None


def test_cycles_made_after_the_tuning_are_still_collected() -> None:
    tuned = tune_gc_for_serving()
    try:
        dead = _cycle()
        gc.collect()
        assert dead() is None
    finally:
        tuned.release()
