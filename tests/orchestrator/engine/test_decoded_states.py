"""DecodedStates: the decoded global KV kept beside pool entries.

The fast path (fill a fresh state from a turn end's kept tensors) against its slow twin (import the
chunks that turn end stored), tensor for tensor on fresh random histories of a seeded v41-tiny (ratios 2
and 1, so open compression groups and a partial tail chunk occur), after prefill chunks and decode steps
(whose appends write into shared buffers). Then the LRU byte budget, and ownership by a real window pool:
every way the pool drops an entry drops the decoded state, and a get never returns state kept beside
another value, another fingerprint or another tenant.
"""

from __future__ import annotations

import hashlib
import random

import pytest
import torch

from model import ModelState, decode, export_global, import_global_chunks, prefill
from orchestrator.engine import TorchCompute
from orchestrator.engine.decoded_states import (
    SOURCE_FIELDS,
    DecodedSources,
    DecodedStates,
    TensorSources,
    held_bytes,
    state_tensors,
)
from orchestrator.engine.global_kv import chunk_ranges
from orchestrator.engine.model_compute import export_windows_keeping, token_row
from orchestrator.engine.pool_entry import chunks_digest
from storage import PoolConfig, WindowPool

CHUNK = 32
_TORCH = TorchCompute()


def _sealed(served, state: ModelState, tokens: list[int]) -> ModelState:
    """The import path's finishing steps (TorchCompute.seal_prefix)."""
    state.tokens = torch.tensor([tokens], dtype=torch.int64)
    state.drop_windows(range(served.model.cfg.n_layers))
    state.drop_encoder_rows()
    return state


def _run(served, tokens: list[int], decode_steps: int, rng: random.Random) -> ModelState:
    """A live state over `tokens`: prefill in random-sized chunks, then decode steps of random ids."""
    model = served.model
    state = None
    pos = 0
    prompt = tokens[: len(tokens) - decode_steps]
    with torch.inference_mode():
        while pos < len(prompt):
            end = min(len(prompt), pos + rng.randrange(7, 90))
            out = prefill(model, torch.tensor([prompt[pos:end]]), state, mode="ced", prompt_end=len(prompt))
            state, pos = out.state, end
        for t in tokens[len(prompt) :]:
            state = decode(model, torch.tensor([t]), state).state
    assert state is not None and state.n_tokens == len(tokens)
    return state


def _assert_states_equal(a: ModelState, b: ModelState) -> None:
    assert torch.equal(a.tokens, b.tokens)
    assert a.sources.keys() == b.sources.keys()
    for layer in a.sources:
        sa, sb = a.sources[layer], b.sources[layer]
        assert sa.ratio == sb.ratio
        for name in (*SOURCE_FIELDS, "carry_kv", "carry_score"):
            ta, tb = getattr(sa, name), getattr(sb, name)
            if ta is None or tb is None:
                assert ta is None and tb is None, (layer, name)
                continue
            assert ta.dtype == tb.dtype and ta.shape == tb.shape, (layer, name)
            assert torch.equal(ta, tb), (layer, name)
    for name in ("windows", "window_codes", "window_scales"):
        for ta, tb in zip(getattr(a, name), getattr(b, name), strict=True):
            assert ta.dtype == tb.dtype and torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)), name
    assert a.window_from == b.window_from and a.enc_from == b.enc_from and a.extra == b.extra
    for name in ("enc_lanes", "enc_pre"):
        ta, tb = getattr(a, name), getattr(b, name)
        assert (ta is None) == (tb is None) and (ta is None or torch.equal(ta, tb)), name


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_filled_state_equals_the_import_of_the_stored_chunks(served, seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randrange(40, 260)
    tokens = [rng.randrange(0, served.vocab_size) for _ in range(n)]
    live = _run(served, tokens, decode_steps=rng.randrange(1, 12), rng=rng)
    ranges = chunk_ranges(n, CHUNK)
    blobs = [export_global(live, s, e, fingerprint=served.fingerprint) for s, e in ranges]
    digest = chunks_digest(ranges, blobs)
    kept = DecodedSources(fingerprint=served.fingerprint, chunks=digest, kept=TensorSources.of(live))
    # the live state continues (its appends write past the kept views into the same buffers)
    with torch.inference_mode():
        decode(served.model, torch.tensor([5]), live.clone())

    slow = served.model.new_state(1)
    done = import_global_chunks(slow, blobs, fingerprint=served.fingerprint)
    assert done.failure is None and done.end == n
    fast = served.model.new_state(1)
    assert kept.matches(ranges, [hashlib.sha256(b).digest() for b in blobs])
    _TORCH.fill_decoded(served, fast, kept.kept)
    _assert_states_equal(_sealed(served, fast, tokens), _sealed(served, slow, tokens))


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_restore_decoded_equals_new_state_fill_and_seal_then_takes_the_live_windows(served, seed) -> None:
    rng = random.Random(seed)
    n = rng.randrange(5, 200)  # from fewer tokens than the window up
    tokens = [rng.randrange(0, served.vocab_size) for _ in range(n)]
    live = _run(served, tokens, decode_steps=rng.randrange(1, 6), rng=rng)
    kept = TensorSources.of(live)
    slow = served.model.new_state(1)
    _TORCH.fill_decoded(served, slow, kept)
    slow = _sealed(served, slow, tokens)
    fast = _TORCH.restore_decoded(served, kept, tokens)
    _assert_states_equal(fast, slow)
    # a full hit then imports the turn end's windows: the encoder layers hold the live state's rings,
    # carries and encoder rows again, bit for bit
    windows = _TORCH.export_windows(served, live)
    _TORCH.import_windows(served, fast, windows)
    _TORCH.import_windows(served, slow, windows)
    _assert_states_equal(fast, slow)
    encoder = range(served.model.split)
    for name in ("windows", "window_codes", "window_scales"):
        for i in encoder:
            ta, tb = getattr(fast, name)[i], getattr(live, name)[i]
            assert ta.dtype == tb.dtype and torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)), (name, i)
    assert [fast.window_from[i] for i in encoder] == [live.window_from[i] for i in encoder]
    assert fast.enc_from == live.enc_from
    assert torch.equal(fast.enc_lanes, live.enc_lanes) and torch.equal(fast.enc_pre, live.enc_pre)
    for layer in fast.sources:
        if layer in encoder and live.sources[layer].carry_kv is not None:
            assert torch.equal(fast.sources[layer].carry_kv, live.sources[layer].carry_kv), layer
            assert torch.equal(fast.sources[layer].carry_score, live.sources[layer].carry_score), layer


def test_state_tensors_are_every_tensor_of_the_state_itself_never_a_copy(served) -> None:
    rng = random.Random(7)
    state = _run(served, [rng.randrange(16, 512) for _ in range(rng.randrange(40, 300))], 2, rng)
    got = state_tensors(state)
    want = [state.tokens, *state.windows, *state.window_codes, *state.window_scales, state.enc_lanes,
            state.enc_pre]  # fmt: skip
    for src in state.sources.values():
        names = (*SOURCE_FIELDS, "carry_kv", "carry_score")
        want += [getattr(src, n) for n in names if getattr(src, n) is not None]
    assert len(got) == len(want) and {id(t) for t in got} == {id(t) for t in want}
    # what a snapshot pins: at least every tensor's bytes, and what the decoded KV alone pins
    assert held_bytes(got) >= max(t.untyped_storage().nbytes() for t in got)
    assert held_bytes(got) > TensorSources.of(state).nbytes


def test_token_row_equals_torch_tensor_and_refuses_ids_out_of_int64() -> None:
    rng = random.Random(11)
    for n in (0, 1, 7, 700):
        ids = [rng.randrange(0, 1 << 40) for _ in range(n)]
        row = token_row(ids, "cpu")
        want = torch.tensor([ids], dtype=torch.int64).reshape(1, n)
        assert row.dtype == torch.int64 and row.shape == (1, n) and torch.equal(row, want)
    with pytest.raises(OverflowError):
        token_row([1 << 63], "cpu")
    with pytest.raises(TypeError):
        token_row([1.5], "cpu")


def test_matches_only_exactly_the_bytes_it_decodes(served) -> None:
    rng = random.Random(7)
    tokens = [rng.randrange(0, served.vocab_size) for _ in range(100)]
    live = _run(served, tokens, decode_steps=2, rng=rng)
    ranges = chunk_ranges(100, CHUNK)
    blobs = [export_global(live, s, e, fingerprint=served.fingerprint) for s, e in ranges]
    hashes = [hashlib.sha256(b).digest() for b in blobs]
    kept = DecodedSources(
        fingerprint=served.fingerprint, chunks=chunks_digest(ranges, blobs), kept=TensorSources.of(live)
    )
    assert kept.matches(ranges, hashes)
    assert not kept.matches(ranges[:-1], hashes[:-1])  # a shorter prefix (tail expired or purged)
    other = list(hashes)
    other[1] = hashlib.sha256(b"another writer's bytes").digest()
    assert not kept.matches(ranges, other)
    assert not kept.matches([], [])
    with pytest.raises(ValueError, match="not a fresh state"):
        _TORCH.fill_decoded(served, live.clone(), kept.kept)


def _fake_state(served, n: int, seed: int) -> ModelState:
    rng = random.Random(seed)
    return _run(served, [rng.randrange(0, served.vocab_size) for _ in range(n)], decode_steps=1, rng=rng)


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _put(cache: DecodedStates, served, tenant: str, session: str, state, **entry: bytes) -> bool:
    """`cache.put` of what TorchCompute keeps of `state` (as a turn end asks for it)."""
    kept = _TORCH.keep_decoded(served, state)
    return cache.put(tenant, session, kept=kept, fingerprint=served.fingerprint, **entry)


def test_lru_byte_budget_and_disabled(served) -> None:
    states = [_fake_state(served, 64, s) for s in range(3)]
    size = TensorSources.of(states[0]).nbytes
    assert size > 0
    cache = DecodedStates(2 * size + size // 2)
    for i, st in enumerate(states):
        assert _put(cache, served, "t", f"s{i}", st, chunks=b"\0" * 32, pool_value=b"v")
        if i == 1:
            # s0 used: s1 becomes the least recently used
            assert cache.get("t", "s0", fingerprint=served.fingerprint, pool_value=b"v") is not None
    stats = cache.stats()
    assert stats.entries == 2 and stats.evicted == 1 and stats.bytes_used <= stats.budget_bytes
    assert cache.get("t", "s1", fingerprint=served.fingerprint, pool_value=b"v") is None
    assert cache.get("t", "s0", fingerprint=served.fingerprint, pool_value=b"v") is not None
    small = DecodedStates(size - 1)
    assert not _put(small, served, "t", "s", states[0], chunks=b"", pool_value=b"v")
    off = DecodedStates(0)
    assert not off.enabled
    assert not _put(off, served, "t", "s", states[0], chunks=b"", pool_value=b"v")
    assert off.get("t", "s", fingerprint=served.fingerprint, pool_value=b"v") is None
    with pytest.raises(ValueError, match="decoded_state_budget_bytes=-1"):
        DecodedStates(-1)


def test_the_pool_owns_it(served) -> None:
    clock = _Clock()
    pool = WindowPool(PoolConfig(budget_bytes=1000, ttl_s=60.0), clock=clock)
    cache = DecodedStates(1 << 30, pool=pool)
    st = _fake_state(served, 40, 1)
    fp = served.fingerprint

    def keep(tenant: str, session: str, value: bytes) -> None:
        # the engine's order: decoded first, then the pool put that drops the previous value
        kept = _TORCH.keep_decoded(served, st)
        assert cache.put(tenant, session, kept=kept, fingerprint=fp, chunks=b"c" * 32, pool_value=value)
        assert pool.put(tenant, session, value).stored

    def held(tenant: str, session: str, value: bytes) -> bool:
        return cache.get(tenant, session, fingerprint=fp, pool_value=value) is not None

    keep("t", "a", b"v1")
    assert held("t", "a", b"v1")
    assert not held("t", "a", b"v2")  # the pool's value is another one: a miss
    assert not held("u", "a", b"v1")  # another tenant's session of the same id
    assert cache.get("t", "a", fingerprint=b"x" * 32, pool_value=b"v1") is None  # another fingerprint
    keep("t", "a", b"v2")  # the next turn end: the replaced value's state goes, the new one stays
    assert held("t", "a", b"v2") and cache.stats().entries == 1
    pool.discard("t", "a")  # session purge
    assert cache.stats().entries == 0
    keep("t", "a", b"v1")
    keep("t", "b", b"v1")
    keep("u", "a", b"v1")
    pool.discard_tenant("t")  # tenant purge / residency
    assert cache.stats().entries == 1 and held("u", "a", b"v1")
    clock.now += 61.0
    pool.sweep()  # TTL
    assert cache.stats().entries == 0 and cache.stats().bytes_used == 0
    keep("t", "a", b"x" * 600)
    keep("t", "b", b"y" * 600)  # the pool evicts a's entry to fit its budget
    assert not held("t", "a", b"x" * 600) and held("t", "b", b"y" * 600)
    assert cache.stats().entries == 1
    # a pool put refused (over the pool's budget): the engine discards what it kept first
    assert _put(cache, served, "t", "c", st, chunks=b"c" * 32, pool_value=b"z" * 2000)
    if not pool.put("t", "c", b"z" * 2000).stored:
        cache.discard("t", "c")
    assert cache.stats().entries == 1


def test_what_a_compute_keeps(served) -> None:
    """Only a compute with `keep_decoded` keeps anything, and TorchCompute only of a batch-1 ModelState;
    it fills only what it kept itself."""
    cache = DecodedStates(1 << 30)
    st = _fake_state(served, 40, 2)

    class StandIn:  # a compute without keep_decoded (a benchmark's stand-in)
        def export_windows(self, served, state) -> bytes:
            return b"w"

    windows, kept = export_windows_keeping(StandIn(), served, st, keep=True)
    assert windows == b"w" and kept is None
    assert not cache.put("t", "a", kept=kept, fingerprint=served.fingerprint, chunks=b"c", pool_value=b"v")
    assert _TORCH.keep_decoded(served, object()) is None
    assert cache.stats().entries == 0
    kept = _TORCH.keep_decoded(served, st)
    assert isinstance(kept, TensorSources) and kept.usable and kept.n_tokens == 40
    with pytest.raises(TypeError, match="not kept by this process's model"):
        _TORCH.fill_decoded(served, served.model.new_state(1), object())
