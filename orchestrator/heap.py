"""The garbage collector of a long-lived kvresume process, tuned for serving once the process is ready:
its start-up heap frozen out of the collector's reach, and its youngest generation collected less often.

Why: CPython's collector holds the GIL while it walks the objects it tracks, so every thread of the
process waits for it. The turn path's garbage is acyclic, freed by reference counting as it goes, so
the walks find next to nothing, and they cost in two ways (session 30, AMD EPYC Zen 4, 2 vCPUs,
v41-sib-s, a `gc.callbacks` probe in the service's process; orchestrator/README.md, "Session 30"):
- A collection of the oldest generation walks every tracked object, and in the service's process most
  are start-up state that lives as long as the process: the modules of torch, SQLAlchemy, grpc and
  protobuf, the registry's metadata (about 250,000 objects). One such collection during a 64 x 20 load
  took 130-205 ms of CPU; the model process then had no pass to run for 190-440 ms.
- The youngest generation was collected every 700 new objects, about 1 ms each: 150 collections (and 14
  of the middle generation, 5-9 ms each) in a load of 1280 turns, 3-5% of the service's CPU.
`gc.freeze()` moves every object tracked now into a permanent generation that no collection walks
(Python's `gc` documentation); vLLM freezes its API server's, engine core's and workers' heaps after
start-up for the same reason (vllm-project/vllm#24008, "Freeze core engine proc heap after init"). And the
youngest generation's threshold goes from 700 to `YOUNG_THRESHOLD` new objects, so a collection comes
about once a run instead of every few turns (what survives is collected as before, only later).

Measured in alternating runs on the same VM (`bench_ab_load` for the 64 x 20 load): the frozen heap
1.137x median turns/s over the untuned collector (4 pairs), the raised threshold 1.104x over the frozen
heap alone (3 pairs); the no-op stand-in at 64 sessions 1.09-1.12x turns/s from the threshold, one
session's p50 5.1-6.7 ms against 6.3-7.0.

The trade: an object tracked at the freeze that later becomes part of a garbage reference cycle is never
reclaimed, and cyclic garbage waits for up to `YOUNG_THRESHOLD` new objects. So only a process's
service entry points tune it (`kvresume serve`'s `serve`, the model process, the benchmarks' service
harnesses), never `build_node` (a test process builds hundreds of nodes), and an entry point that may run
inside someone else's process (`serve` in a test) hands everything back when it stops
(`ServingGc.release`: the frozen objects unfrozen, the thresholds restored).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

__all__ = ["YOUNG_THRESHOLD", "ServingGc", "tune_gc_for_serving"]

# New tracked objects between two collections of the youngest generation while serving (CPython's
# default is 700). At this size one collection came in a whole 64 x 20 load.
YOUNG_THRESHOLD = 20_000


@dataclass(frozen=True)
class ServingGc:
    """What `tune_gc_for_serving` did: the objects frozen (the process's total), the thresholds it
    replaced, and how long the collection and the freeze took."""

    objects: int
    previous_thresholds: tuple[int, int, int]
    seconds: float

    def release(self) -> None:
        """Hand every frozen object back to the collector (its oldest generation) and restore the
        thresholds."""
        gc.unfreeze()
        gc.set_threshold(*self.previous_thresholds)


def tune_gc_for_serving() -> ServingGc:
    """Collect what start-up left as garbage, freeze every object still tracked (`gc.freeze`), and raise
    the youngest generation's threshold to `YOUNG_THRESHOLD`.

    Call it once the process is ready to serve, and only where the caller owns the whole process's life
    (module docstring). It logs nothing (the model process's stdout carries its ready line): the caller
    reports the figures (`kvresume serve` logs `gc_tuned_for_serving`, the model process's `stats` call
    returns them).
    """
    started = time.perf_counter()
    # garbage first: a cycle frozen now would never be reclaimed
    gc.collect()
    gc.freeze()
    previous = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, *previous[1:])
    return ServingGc(
        objects=gc.get_freeze_count(), previous_thresholds=previous, seconds=time.perf_counter() - started
    )
