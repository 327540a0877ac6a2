"""chunk_ranges: full chunks then one tail, from the chunk holding the first unstored position."""

from __future__ import annotations

import pytest

from orchestrator.engine import chunk_ranges


@pytest.mark.parametrize(
    ("n", "size", "from_pos", "want"),
    [
        (0, 32, 0, []),
        (1, 32, 0, [(0, 1)]),
        (64, 32, 0, [(0, 32), (32, 64)]),
        (65, 32, 0, [(0, 32), (32, 64), (64, 65)]),
        (70, 32, 0, [(0, 32), (32, 64), (64, 70)]),
        (70, 32, 40, [(32, 64), (64, 70)]),
        (70, 32, 64, [(64, 70)]),
        (1000, 256, 300, [(256, 512), (512, 768), (768, 1000)]),
    ],
)
def test_chunk_ranges(n: int, size: int, from_pos: int, want: list[tuple[int, int]]) -> None:
    assert chunk_ranges(n, size, from_pos=from_pos) == want


def test_chunk_ranges_matches_a_slow_twin() -> None:
    for n in range(0, 140, 7):
        for from_pos in range(0, n + 1, 5):
            got = chunk_ranges(n, 16, from_pos=from_pos)
            positions = [p for a, b in got for p in range(a, b)]
            first = from_pos // 16 * 16
            assert positions == list(range(first, max(first, n)))
            assert all(a % 16 == 0 and b - a <= 16 for a, b in got)
