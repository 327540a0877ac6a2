"""Token ids as the store takes them (u32 little-endian): `token_bytes` and `largest_id` against their
slow twins, on fresh random ids (the full u32 range, empty, one id), and bad input refused; the store's
memo of chunk addresses (`ChainAddresses`) against `chunk_address` on random growing, branching chains."""

from __future__ import annotations

import random
import secrets
import struct

import pytest

from storage import largest_id, token_bytes
from storage.chunk_key import ChainAddresses, chunk_address, largest_id_reference


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


@pytest.mark.parametrize("capacity", [0, 3 * 64 * 4, 16 << 20])
def test_chain_addresses_equal_chunk_address_on_random_chains(capacity) -> None:
    """Chains that share prefixes, branch, end in partial tails and grow at their end, walked again and
    again (as a store walks a session's history each turn), with a memo that keeps nothing, a few
    chunks (evicting), or everything: every address is `chunk_address`'s."""
    rng = random.Random(secrets.randbits(64))
    memo = ChainAddresses(capacity)
    size = 64
    roots = [secrets.token_bytes(32) for _ in range(2)]
    histories = [[rng.randrange(2**17) for _ in range(rng.randrange(1, 6 * size))] for _ in range(3)]
    for _ in range(60):
        h = rng.randrange(len(histories))
        hist = histories[h]
        if rng.random() < 0.5:
            hist += [rng.randrange(2**17) for _ in range(rng.randrange(1, 2 * size))]  # grows at its end
        elif rng.random() < 0.3:
            # a branch: a copy of another history's prefix with other tokens after it
            other = histories[rng.randrange(len(histories))]
            histories.append(other[: rng.randrange(len(other) + 1)] + [rng.randrange(2**17)])
            hist = histories[-1]
        toks, root = token_bytes(hist), rng.choice(roots)
        parent = twin = root
        for start in range(0, len(hist), size):
            chunk = toks[start * 4 : min(start + size, len(hist)) * 4]
            got, want = memo.address(parent, chunk), chunk_address(twin, chunk)
            assert got == want
            parent = twin = want
        assert memo.kept_bytes <= capacity
    # a memo that holds every chunk serves the walks' repeats; a few chunks may all be evicted in between
    assert memo.misses > 0 and (memo.hits > 0 or capacity < 1 << 20)


def test_chain_addresses_refuse_a_negative_capacity() -> None:
    with pytest.raises(ValueError, match="capacity_bytes must be >= 0, got -1"):
        ChainAddresses(-1)


@pytest.mark.parametrize("walk_capacity", [0, 2 * 3 * 64 * 4, 32 << 20])
def test_kept_walks_give_chunk_address_chains_on_random_histories(walk_capacity) -> None:
    """Histories that grow at their end, shrink, branch inside a kept chunk and share first chunks, walked
    as the store walks them (kept leading addresses first, the rest computed, the walk remembered):
    every address `leading` gives is the chain's `chunk_address`, and the kept bytes stay bounded."""
    rng = random.Random(secrets.randbits(64))
    memo = ChainAddresses(walk_capacity_bytes=walk_capacity)
    size = 64
    roots = [secrets.token_bytes(32) for _ in range(2)]
    histories = [[rng.randrange(2**17) for _ in range(rng.randrange(size, 6 * size))] for _ in range(3)]
    served = 0
    for _ in range(80):
        hist = histories[rng.randrange(len(histories))]
        roll = rng.random()
        if roll < 0.4:
            hist += [rng.randrange(2**17) for _ in range(rng.randrange(1, 2 * size))]  # grows at its end
        elif roll < 0.55 and len(hist) > 1:
            del hist[rng.randrange(1, len(hist)) :]  # shorter: a prefix of what was walked
        elif roll < 0.75 and len(hist) > 1:
            # an edit anywhere (inside a kept chunk, too): the same first chunk or not, other bytes after it
            at = rng.randrange(len(hist))
            histories.append(hist[:at] + [(hist[at] + 1) % 2**17] + hist[at + 1 :])
            hist = histories[-1]
        toks, root = token_bytes(hist), rng.choice(roots)
        full = len(hist) // size
        limit = rng.randrange(full + 1)
        known = memo.leading(root, toks, size, limit)
        assert len(known) <= limit
        chain, parent = [], root
        for k in range(full):
            parent = chunk_address(parent, toks[k * size * 4 : (k + 1) * size * 4])
            chain.append(parent)
        assert known == chain[: len(known)]
        served += len(known)
        memo.remember_walk(root, toks, size, chain[: rng.randrange(full + 1)])
        assert memo.walk_bytes <= walk_capacity
    # a memo with room for every walk serves walks again (a small one may have evicted each in between);
    # one without room keeps nothing
    assert served > 0 if walk_capacity >= 1 << 20 else served == 0 or walk_capacity > 0


def test_a_history_that_differs_further_on_takes_the_chunks_before_the_difference() -> None:
    """Two sessions that share a prompt, or an edit further on: a kept walk serves the whole chunks before
    the first differing byte, and none after it (an edit in the last byte of chunk 3 keeps chunks 0-2)."""
    rng = random.Random(secrets.randbits(64))
    memo, root, size = ChainAddresses(), secrets.token_bytes(32), 64
    first = [rng.randrange(2**17) for _ in range(6 * size + 5)]
    toks = token_bytes(first)
    chain, parent = [], root
    for k in range(6):
        parent = chunk_address(parent, toks[k * size * 4 : (k + 1) * size * 4])
        chain.append(parent)
    memo.remember_walk(root, toks, size, chain)
    for at in (size, 3 * size + size - 1, 5 * size, rng.randrange(size, 6 * size)):
        other = list(first)
        other[at] = (other[at] + 1) % 2**17
        assert memo.leading(root, token_bytes(other), size, 6) == chain[: at // size], at
    assert memo.leading(root, token_bytes(first[:200] + [7] * 300), size, 6) == chain[:3]


def test_a_walk_of_mutable_bytes_is_not_kept() -> None:
    """Only immutable bytes are kept: a buffer could change under the addresses kept for it."""
    memo, root = ChainAddresses(), secrets.token_bytes(32)
    buf = bytearray(token_bytes(list(range(128))))
    memo.remember_walk(root, buf, 64, [chunk_address(root, bytes(buf[: 64 * 4]))])  # type: ignore[arg-type]
    assert memo.walk_bytes == 0 and memo.leading(root, bytes(buf), 64, 2) == []


def test_chain_addresses_refuse_a_negative_walk_capacity() -> None:
    with pytest.raises(ValueError, match="walk_capacity_bytes must be >= 0, got -1"):
        ChainAddresses(walk_capacity_bytes=-1)
