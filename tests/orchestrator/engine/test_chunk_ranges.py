"""chunk_ranges: full chunks then one tail, from the chunk holding the first unstored position."""

from __future__ import annotations

import pytest

from orchestrator.engine import chunk_ranges


@pytest.mark.parametrize(
    ("n", "size", "from_pos", "min_tail", "want"),
    [
        (0, 32, 0, 1, []),
        (1, 32, 0, 1, [(0, 1)]),
        (64, 32, 0, 1, [(0, 32), (32, 64)]),
        (70, 32, 0, 1, [(0, 32), (32, 64), (64, 70)]),
        (70, 32, 40, 1, [(32, 64), (64, 70)]),
        (70, 32, 64, 1, [(64, 70)]),
        (65, 32, 0, 2, [(0, 32), (32, 64)]),
        (66, 32, 0, 2, [(0, 32), (32, 64), (64, 66)]),
        (1000, 256, 300, 4, [(256, 512), (512, 768), (768, 1000)]),
    ],
)
def test_chunk_ranges(n: int, size: int, from_pos: int, min_tail: int, want: list[tuple[int, int]]) -> None:
    assert chunk_ranges(n, size, from_pos=from_pos, min_tail=min_tail) == want


def test_chunk_ranges_matches_a_slow_twin() -> None:
    for n in range(0, 140, 7):
        for from_pos in range(0, n + 1, 5):
            for min_tail in (1, 2, 4):
                got = chunk_ranges(n, 16, from_pos=from_pos, min_tail=min_tail)
                positions = [p for a, b in got for p in range(a, b)]
                first = from_pos // 16 * 16
                tail = n - n // 16 * 16
                end = n if tail == 0 or tail >= min_tail else n // 16 * 16
                assert positions == list(range(first, max(first, end)))
                assert all(a % 16 == 0 and b - a <= 16 for a, b in got)
