"""GlobalKVStore against a slow reference twin: a plain dict model of which chunks exist, who refers
to them and which payload each holds, driven by the same random operations (fixed seeds)."""

from __future__ import annotations

import random

import pytest

from storage import MissReason
from tests.storage.conftest import CHUNK, FP


class ReferenceStore:
    """Chunks keyed by (tenant, fp, history up to the chunk end, start); first payload wins."""

    def __init__(self) -> None:
        self.payload: dict[tuple, bytes] = {}
        self.refs: dict[tuple, set[str]] = {}

    def put(self, tenant: str, session: str, fp: str, toks: list[int], ranges: dict) -> None:
        for (start, end), payload in sorted(ranges.items()):
            key = (tenant, fp, tuple(toks[:end]), start)
            self.payload.setdefault(key, payload)
            self.refs.setdefault(key, set()).add(session)
            # Shorter tails of this session at the same position are superseded.
            for other in list(self.refs):
                t, f, hist, s = other
                if (t, f, s) == (tenant, fp, start) and hist[:start] == tuple(toks[:start]):
                    if len(hist) - s < end - start and session in self.refs[other]:
                        self._unref(other, session)

    def _unref(self, key: tuple, session: str) -> None:
        self.refs[key].discard(session)
        if not self.refs[key]:
            del self.refs[key], self.payload[key]

    def purge_session(self, tenant: str, session: str) -> None:
        for key in [k for k in self.refs if k[0] == tenant and session in self.refs[k]]:
            self._unref(key, session)

    def prefix(self, tenant: str, fp: str, toks: list[int]) -> list[bytes]:
        out, pos = [], 0
        while (tenant, fp, tuple(toks[: pos + CHUNK]), pos) in self.payload and pos + CHUNK <= len(toks):
            out.append(self.payload[(tenant, fp, tuple(toks[: pos + CHUNK]), pos)])
            pos += CHUNK
        for m in range(CHUNK - 1, 0, -1):
            key = (tenant, fp, tuple(toks[: pos + m]), pos)
            if pos + m <= len(toks) and key in self.payload:
                out.append(self.payload[key])
                break
        return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_longest_valid_prefix_matches_reference_model(make_store, seed) -> None:
    rng = random.Random(seed)
    store = make_store()
    ref = ReferenceStore()
    # A few stems so that histories share prefixes and diverge inside chunks.
    stems = [[rng.randrange(50) for _ in range(5 * CHUNK)] for _ in range(3)]
    histories: list[tuple[str, str, list[int]]] = []
    for step in range(70):
        op = rng.random()
        tenant = rng.choice(["tA", "tB"])
        if op < 0.6 or not histories:
            stem = rng.choice(stems)
            cut = rng.randrange(1, len(stem))
            toks = stem[:cut] + [rng.randrange(50) for _ in range(rng.randrange(0, CHUNK))]
            session = f"s{rng.randrange(6)}"
            first = rng.randrange(0, len(toks)) // CHUNK * CHUNK
            ranges = {
                (s, min(s + CHUNK, len(toks))): rng.randbytes(rng.randrange(1, 40))
                for s in range(first, len(toks), CHUNK)
            }
            store.put_chunks(tenant, session, FP, toks, ranges)
            ref.put(tenant, session, FP, toks, ranges)
            histories.append((tenant, session, toks))
        elif op < 0.7:
            session = f"s{rng.randrange(6)}"
            store.purge_session(tenant, session, actor="test")
            ref.purge_session(tenant, session)
        for t, _, toks in rng.sample(histories, min(4, len(histories))):
            got = store.longest_valid_prefix(t, FP, toks)
            want = ref.prefix(t, FP, toks)
            assert got.payloads == want, f"seed {seed} step {step}"
            assert got.miss is None or got.miss.reason == MissReason.ABSENT
    assert store.stats().chunks == len(ref.payload)
    assert store.audit.verify().ok
