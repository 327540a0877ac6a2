"""WindowPool's ordered sweep (it stops at the first live entry in recency order) against its twin, the
sweep that reads every entry (`ordered_sweep = False`): the same random puts, gets, prefix finds,
discards and sweeps, with a clock that mostly moves on, sometimes stands still and sometimes goes back,
on two pools; every answer, the entries in order with their expiries, and the counters must agree."""

from __future__ import annotations

import random
import secrets

from storage import ContentKey, PoolConfig, WindowPool


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _state(pool: WindowPool) -> tuple:
    return list(pool._entries.items()), pool.stats(), pool.indexed()  # noqa: SLF001 - the twin's whole state


def test_the_ordered_sweep_drops_what_the_full_sweep_drops() -> None:
    expired = out_of_order = 0
    for _ in range(20):
        seed = secrets.randbits(64)
        rng = random.Random(seed)
        clocks = (_Clock(), _Clock())
        config = PoolConfig(budget_bytes=rng.choice([200, 600, 5000]), ttl_s=rng.choice([1.0, 5.0, 30.0]))
        fast, twin = (WindowPool(config, clock=c) for c in clocks)
        twin.ordered_sweep = False
        histories = [[rng.randrange(16, 512) for _ in range(rng.randrange(1, 12))] for _ in range(6)]
        for step in range(300):
            roll = rng.random()
            if roll < 0.6:
                # the clock moves on (most often), stands still, or goes back
                dt = rng.choice([0.0, 0.2, 1.0, 3.0, -2.0 if rng.random() < 0.05 else 0.5])
                for c in clocks:
                    c.now += dt
            tenant, session = rng.choice(["acme", "globex"]), f"s{rng.randrange(8)}"
            op = rng.random()
            if op < 0.45:
                value = bytes(rng.randrange(1, 150))
                hist = rng.choice(histories)
                content = ContentKey.of("m", hist) if rng.random() < 0.7 else None
                out = [p.put(tenant, session, value, content=content) for p in (fast, twin)]
            elif op < 0.7:
                out = [p.get(tenant, session) for p in (fast, twin)]
            elif op < 0.85:
                prompt = rng.choice(histories) + [rng.randrange(16, 512)]
                out = [p.find_prefix(tenant, "m", prompt) for p in (fast, twin)]
            elif op < 0.93:
                out = [p.discard(tenant, session) for p in (fast, twin)]
            else:
                out = [p.sweep() for p in (fast, twin)]
            assert out[0] == out[1], f"seed {seed} step {step}"
            assert _state(fast) == _state(twin), f"seed {seed} step {step}"
            out_of_order += not fast._in_order  # noqa: SLF001 - a clock that went back was met
        expired += fast.stats().expired
    assert expired > 0 and out_of_order > 0, (expired, out_of_order)
