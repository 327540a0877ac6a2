"""The garbage collector of a long-lived kvresume process: its start-up heap frozen out of the collector's
reach once the process is ready to serve.

Why: a collection of CPython's oldest generation walks every object the collector tracks, and holds the
GIL while it does, so every thread of the process waits. In the service's process most of those objects
are start-up state that lives as long as the process: the modules of torch, SQLAlchemy, grpc and
protobuf, the registry's metadata, the served models' specs (about 250,000 objects, v41-sib-s). The turn
path's own garbage is acyclic, freed by reference counting, so those walks find next to nothing.
Measured (session 30, AMD EPYC Zen 4, 2 vCPUs, 64 sessions x 20 turns of v41-sib-s with a model process,
a `gc.callbacks` probe in the service's process): one such collection during the 13-16 s load, 130-205 ms
of CPU; the model process then had no pass to run for 190-440 ms (its calls' timeline), and in three
alternating pairs of the load the frozen heap gave 94.6 / 92.3 / 97.5 turns/s against 85.4 / 90.4 / 78.9
(orchestrator/README.md, "Session 30").

`gc.freeze()` moves every object tracked now into a permanent generation that no collection walks
(Python's `gc` documentation). vLLM freezes its API server's, engine core's and workers' heaps after
start-up for the same reason (vllm-project/vllm#24008, "Freeze core engine proc heap after init").

The trade: an object tracked at the freeze that later becomes part of a garbage reference cycle is never
reclaimed. So only code that owns a whole process's life freezes (`kvresume serve`, the model process,
the benchmarks' service harnesses), never a library path that one process runs many times (a test
process builds hundreds of nodes); `FrozenHeap.release` (`gc.unfreeze`) hands the objects back.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

__all__ = ["FrozenHeap", "freeze_startup_heap"]


@dataclass(frozen=True)
class FrozenHeap:
    """What one freeze moved out of the collector's reach: objects frozen (the process's total, earlier
    freezes included) and how long the collection and the freeze took."""

    objects: int
    seconds: float

    def release(self) -> None:
        """Hand every frozen object back to the collector (its oldest generation)."""
        gc.unfreeze()


def freeze_startup_heap() -> FrozenHeap:
    """Collect what start-up left as garbage, then freeze every object still tracked (`gc.freeze`).

    Call it once the process is ready to serve, and only where the caller owns the whole process's life
    (module docstring). It logs nothing (the model process's stdout carries its ready line): the caller
    reports the figures (`kvresume serve` logs `startup_heap_frozen`, the model process's `stats` call
    returns them).
    """
    started = time.perf_counter()
    # garbage first: a cycle frozen now would never be reclaimed
    gc.collect()
    gc.freeze()
    return FrozenHeap(objects=gc.get_freeze_count(), seconds=time.perf_counter() - started)
