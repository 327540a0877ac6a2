"""Token ids as the store takes them (u32 little-endian): `token_bytes` and `largest_id` against their
slow twins, on fresh random ids (the full u32 range, empty, one id), and bad input refused."""

from __future__ import annotations

import random
import secrets
import struct

import pytest

from storage import largest_id, token_bytes
from storage.chunk_key import largest_id_reference


def _ids(rng: random.Random) -> list[int]:
    n = rng.choice([0, 1, 2, rng.randrange(3, 5000)])
    top = rng.choice([2**8, 2**17, 2**32])
    return [rng.randrange(top) for _ in range(n)]


@pytest.mark.parametrize("round_", range(6))
def test_token_bytes_and_largest_id_equal_their_twins_on_random_ids(round_) -> None:
    rng = random.Random(secrets.randbits(64))
    for _ in range(20):
        ids = _ids(rng)
        raw = token_bytes(ids)
        assert raw == b"".join(struct.pack("<I", v) for v in ids)
        assert largest_id(raw) == largest_id_reference(raw) == max(ids, default=0)
        # a slice of the encoded ids is the encoding of the slice (what a turn concatenates)
        cut = rng.randrange(len(ids) + 1)
        assert token_bytes(ids[:cut]) + token_bytes(ids[cut:]) == raw


def test_bad_token_bytes_are_refused() -> None:
    for fn in (largest_id, largest_id_reference):
        with pytest.raises(ValueError, match="length 7"):
            fn(b"\x00" * 7)
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        token_bytes([2**32])
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        token_bytes([-1])
