"""orchestrator/heap.py: the start-up heap frozen out of the collector's reach, and handed back.

In this process (the test process owns its life for the test's length): every test releases what it froze.
"""

from __future__ import annotations

import gc
import weakref

from orchestrator.heap import freeze_startup_heap


class _Node:
    other: _Node | None = None


def _cycle() -> weakref.ref:
    """A garbage reference cycle of two objects; a weak reference to one of them."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_freeze_collects_the_garbage_first_and_freezes_what_is_left() -> None:
    dead = _cycle()
    alive = _Node()
    frozen = freeze_startup_heap()
    try:
        assert dead() is None  # collected before the freeze, never frozen
        assert frozen.objects == gc.get_freeze_count() > 0
        assert frozen.seconds >= 0
        # frozen objects are out of every generation a collection walks
        assert not any(o is alive for o in gc.get_objects())
    finally:
        frozen.release()
    assert gc.get_freeze_count() == 0
    assert any(o is alive for o in gc.get_objects())


def test_a_cycle_of_frozen_objects_waits_for_the_release() -> None:
    # the documented trade: an object tracked at the freeze that later becomes cyclic garbage is only
    # reclaimed once the heap is handed back
    a, b = _Node(), _Node()
    frozen = freeze_startup_heap()
    try:
        a.other, b.other = b, a
        dead = weakref.ref(a)
        del a, b
        gc.collect()
        assert dead() is not None
    finally:
        frozen.release()
    gc.collect()
    assert dead() is None
