"""Measure per-token costs by timing caller-supplied work functions at several sizes and fitting a slope.

Knows nothing of the model or the store: the caller passes closures (`encode(n)` runs n tokens through
the encoder, and so on), so the same harness calibrates any model on any device class.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

from orchestrator.planner.costs import Costs

__all__ = ["measure_costs", "per_token_seconds"]

WorkFn = Callable[[int], object]


def per_token_seconds(
    work: WorkFn, sizes: Sequence[int], *, repeats: int = 3, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Least-squares slope of median wall time against token count (fixed overheads fall in the intercept).

    Raises:
        ValueError: fewer than two distinct sizes, a non-positive size, or repeats < 1.
    """
    if len(set(sizes)) < 2 or min(sizes) <= 0:
        raise ValueError(f"sizes={list(sizes)} need two or more distinct positive token counts")
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    work(min(sizes))
    xs: list[float] = []
    ys: list[float] = []
    for n in sizes:
        times = []
        for _ in range(repeats):
            t0 = clock()
            work(n)
            times.append(clock() - t0)
        xs.append(float(n))
        ys.append(statistics.median(times))
    mean_x = sum(xs) / len(xs)
    mean_y = sum(ys) / len(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx
    return max(slope, 0.0)


def measure_costs(
    *,
    encode: WorkFn,
    load: WorkFn,
    decode_replay: WorkFn,
    map_tokens: WorkFn | None = None,
    restore_pool: Callable[[], object] | None = None,
    sizes: Sequence[int] = (64, 128, 256),
    repeats: int = 3,
    source: str = "measured",
) -> Costs:
    """Time each kind of work and return per-token Costs (`map_s` 0 when no mapper work is given)."""
    restore_s = 0.0
    if restore_pool is not None:
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            restore_pool()
            samples.append(time.perf_counter() - t0)
        restore_s = statistics.median(samples)
    return Costs(
        load_s=per_token_seconds(load, sizes, repeats=repeats),
        encode_s=per_token_seconds(encode, sizes, repeats=repeats),
        decode_replay_s=per_token_seconds(decode_replay, sizes, repeats=repeats),
        map_s=0.0 if map_tokens is None else per_token_seconds(map_tokens, sizes, repeats=repeats),
        pool_restore_s=restore_s,
        source=source,
    )
