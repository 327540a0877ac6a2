"""Shared fixtures for storage tests: a small-chunk store on tmp_path with an injected clock."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from storage import GlobalKVStore, StoreConfig

CHUNK = 8
FP = "v41-tiny/fp-test"


class FakeClock:
    """Seconds since the epoch, moved only by the test."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def payloads_for(
    tokens: list[int], *, upto: int | None = None, size: int = 40
) -> dict[tuple[int, int], bytes]:
    """Random payloads for every chunk of `tokens[:upto]`, the last one possibly partial."""
    end = len(tokens) if upto is None else upto
    out: dict[tuple[int, int], bytes] = {}
    for start in range(0, end, CHUNK):
        stop = min(start + CHUNK, end)
        out[(start, stop)] = os.urandom(size)
    return out


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_store(tmp_path: Path, clock: FakeClock) -> Iterator[Callable[..., GlobalKVStore]]:
    opened: list[GlobalKVStore] = []

    def make(**overrides: object) -> GlobalKVStore:
        fields = {"path": str(tmp_path / "store"), "chunk_tokens": CHUNK, "compression_ratios": (4,)}
        fields.update(overrides)
        store = GlobalKVStore(StoreConfig(**fields), clock=clock)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()
