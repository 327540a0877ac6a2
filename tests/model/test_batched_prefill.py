"""`prefill_many` (one pass over the stacked rows of many sequences' prefill chunks) equals prefilling each
sequence alone, bit for bit: logits, stats, every state tensor and the exported cache bytes, on random
ragged chunks of fresh random states: fresh prompts, extends, chunked prompts (chunks ending before and
inside the decoder's tail, continuing a chunked prompt), states whose windows were dropped (the encoder
replays stored tokens), compression groups that close inside a chunk and stay open, histories shorter
than the indexer's top-k (several selection widths in one call), at 1 and 2 threads. The batched
attention stage is compared with its slow twin (`prefill_many(batched_attention=False)`: each sequence's
`Attention.attend` alone) too, and a continuing chunk of a state with one decoder ring dropped takes the
twin inside a batched call."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

import model.batched_prefill as batched_prefill
from kernels import sparse_attn
from model import Transformer, init_random, load_preset, prefill
from model.batched_prefill import prefill_many
from model.ragged_attention import ragged_sparse_attn
from model.ragged_mixes import lone_runs, ragged_mixes
from tests.model.test_batched import (
    _assert_same_exports,
    _assert_same_state,
    _assert_same_state_tensors,
    _state_tensors,
)


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(1)
    return init_random(Transformer(load_preset("v41-tiny")), seed=int(torch.randint(0, 10_000, ()))).eval()


def _prompt(model: Transformer, rng: random.Random, n: int) -> torch.Tensor:
    return torch.tensor([[rng.randrange(16, model.cfg.vocab_size) for _ in range(n)]])


def _cases(model: Transformer, rng: random.Random, reps: int) -> list[tuple]:
    """(state or None, prompt_end offset past the chunk, kind) of each sequence's first round."""
    cfg = model.cfg
    w = cfg.window_size
    out: list[tuple] = []
    kinds = ["fresh", "fresh_chunked", "extend", "extend_chunked", "replay", "extend", "drop_mid_chunked"]
    for kind in kinds * reps:
        if kind.startswith("fresh"):
            state = None
        else:
            state = prefill(model, _prompt(model, rng, rng.randrange(1, 2 * w + 8)), mode="ced").state
            if kind == "replay":
                state.drop_windows(range(cfg.n_layers))
                state.drop_encoder_rows()
        more = rng.choice([rng.randrange(1, w), rng.randrange(w, 3 * w)]) if "chunked" in kind else 0
        if kind == "drop_mid_chunked":
            more = rng.randrange(1, w)  # the next chunk continues inside the decoder's tail
        out.append((state, more, kind))
    return out


def _compare(model: Transformer, seed: int, reps: int = 1) -> int:
    """Batched == lone == slow twin on fresh random cases; returns how many sequences took the batched
    attention stage (so that a test can tell it ran)."""
    rng = random.Random(seed)
    cases = _cases(model, rng, reps)
    alone = [s.clone() if s is not None else None for s, _, _ in cases]
    together = [s.clone() if s is not None else None for s, _, _ in cases]
    twin = [s.clone() if s is not None else None for s, _, _ in cases]
    # what the snapshots the passes start from hold now: no pass may change them (ModelState.clone)
    before = [[t.clone() for t in _state_tensors(s)] for s, _, _ in cases if s is not None]
    ends = []
    batched_rows = 0
    seen = batched_prefill.attend_chunks

    def counting(*args, **kwargs):
        nonlocal batched_rows
        batched_rows += len(args[5])
        return seen(*args, **kwargs)

    for rnd in range(2):  # the second round continues the chunked prompts of the first
        if rnd == 1:
            # one decoder ring dropped before a continuing chunk: its layers disagree on using the ring,
            # which the batched stage refuses (`chunk_batchable`); that sequence takes the twin
            layer = model.cfg.ced_split + 2
            for i, (_, _, kind) in enumerate(cases):
                if kind == "drop_mid_chunked":
                    for states in (alone, together, twin):
                        states[i].drop_windows(range(layer, layer + 1))
        chunks, prompt_ends = [], []
        for i, (_, more, _) in enumerate(cases):
            n0 = alone[i].n_tokens if alone[i] is not None else 0
            # repeated lengths: sequences of equal T share the blocked mHC mixes
            t = rng.choice([1, 5, 5, 24, 24, rng.randrange(2, 8), rng.randrange(8, 40)])
            if rnd == 1 and more:
                t = min(t, ends[i] - n0) or 1
            chunks.append(_prompt(model, rng, t))
            end = ends[i] if rnd == 1 and more and ends[i] >= n0 + t else n0 + t + (more if rnd == 0 else 0)
            prompt_ends.append(end)
        ends = prompt_ends
        ref = [prefill(model, c, s, mode="ced", prompt_end=e)
               for c, s, e in zip(chunks, alone, ends, strict=True)]  # fmt: skip
        order = list(range(len(cases)))
        rng.shuffle(order)  # who shares the pass and where must not matter
        batched_prefill.attend_chunks = counting
        try:
            got = prefill_many(model, [chunks[i] for i in order], [together[i] for i in order],
                               prompt_ends=[ends[i] for i in order])  # fmt: skip
        finally:
            batched_prefill.attend_chunks = seen
        slow = prefill_many(model, [chunks[i] for i in order], [twin[i] for i in order],
                            prompt_ends=[ends[i] for i in order], batched_attention=False)  # fmt: skip
        for j, i in enumerate(order):
            a = ref[i]
            where = f"seed {seed} round {rnd} seq {i} ({cases[i][2]}, T={chunks[i].size(1)})"
            for b in (got[j], slow[j]):
                assert (a.logits is None) == (b.logits is None), where
                if a.logits is not None:
                    assert torch.equal(a.logits, b.logits), where
                assert a.stats == b.stats, where
                _assert_same_state(a.state, b.state)
                assert a.state.extra.get("decoder_floor") == b.state.extra.get("decoder_floor"), where
            alone[i], together[i], twin[i] = a.state, got[j].state, slow[j].state
    _assert_same_exports(model, alone, together)
    _assert_same_exports(model, alone, twin)
    for k, s in enumerate(s for s, _, _ in cases if s is not None):
        _assert_same_state_tensors(_state_tensors(s), before[k], f"seed {seed}: snapshot {k} changed")
    return batched_rows


@torch.inference_mode()
def test_prefill_many_equals_each_sequence_prefilled_alone(model: Transformer) -> None:
    """At 1 thread: the suite's default of the machine's cores spins OpenMP workers on a loaded machine
    (200+ s here); 2 threads run in their own process below."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert _compare(model, random.randrange(1 << 30)) > 0
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
@torch.inference_mode()
def test_prefill_many_many_sequences(model: Transformer) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _compare(model, random.randrange(1 << 30), reps=3)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_prefill_many_at_two_threads() -> None:
    """The same comparison in a process of 2 intra-op threads (OMP_WAIT_POLICY=PASSIVE: spinning OpenMP
    workers make a loaded machine ten times slower)."""
    env = dict(os.environ, OMP_NUM_THREADS="2", OMP_WAIT_POLICY="PASSIVE")
    code = (
        "import random, torch; from tests.model.test_batched_prefill import _compare, _model; "
        "torch.set_num_threads(2); m = _model()\n"
        "with torch.inference_mode(): _compare(m, random.randrange(1 << 30), reps=2)"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=900)


def _model() -> Transformer:
    torch.manual_seed(1)
    return init_random(Transformer(load_preset("v41-tiny")), seed=int(torch.randint(0, 10_000, ()))).eval()


def test_prefill_many_refuses_bad_batches(model: Transformer) -> None:
    state = model.new_state(1)
    one = torch.tensor([[20]])
    with pytest.raises(ValueError, match="one chunk, state and prompt_end"):
        prefill_many(model, [one, one], [state])
    with pytest.raises(ValueError, match="same state twice"):
        prefill_many(model, [one, one], [state, state])
    with pytest.raises(ValueError, match="must lie in"):
        prefill_many(model, [torch.tensor([[model.cfg.vocab_size]])], [state])
    # the ids are checked over all chunks at once; the error names the first chunk out of range
    with pytest.raises(ValueError, match=r"got \[\[21, -1\]\]"):
        prefill_many(model, [one, torch.tensor([[21, -1]]), torch.tensor([[-5]])], [None, state, None])
    with pytest.raises(ValueError, match=r"\[1, T\]"):
        prefill_many(model, [torch.zeros(1, 0, dtype=torch.int64)], [state])
    with pytest.raises(ValueError, match="before the end"):
        prefill_many(model, [one, torch.tensor([[21, 22]])], [None, state], prompt_ends=[1, 1])
    assert state.n_tokens == 0 and "decoder_floor" not in state.extra  # refused before any change


@pytest.mark.parametrize("threads", [1, 2])
def test_ragged_mixes_equal_each_sequence_alone(model: Transformer, threads: int) -> None:
    """`ragged_mixes` (all sequences' mixes in one pass, each element of a transcendental op as its
    sequence's lone run has it) against each sequence's `Block._mixes` on fresh random ragged rows, at 1
    and 2 threads; and `lone_runs` against each run alone, where the plain op over the stack differs
    (sigmoid's SIMD body and scalar tail disagree in the last bit on this project's VMs)."""
    rng = random.Random(random.randrange(1 << 30))
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runs = [rng.randrange(1, 40) for _ in range(150)]
        x = torch.randn(sum(runs), 4, generator=gen) * 4
        got, plain = lone_runs(torch.sigmoid, x, runs), torch.sigmoid(x)
        at, plain_differs = 0, 0
        for t in runs:
            lone = torch.sigmoid(x[at : at + t].contiguous())
            assert torch.equal(got[at : at + t], lone), (t, at)
            plain_differs += not torch.equal(plain[at : at + t], lone)
            at += t
        assert plain_differs, "the plain op over the stack equals every lone run: this test has no teeth"
        dim = model.cfg.dim
        with torch.inference_mode():
            for _ in range(3):
                lens = [rng.choice([1, 5, 5, 24, rng.randrange(2, 40)]) for _ in range(9)]
                h = torch.randn(1, sum(lens), model.cfg.hc_mult, dim, generator=gen).to(torch.bfloat16)
                for layer in (0, model.cfg.n_layers - 1):
                    block = model.layers[layer]
                    for which in ("attn", "ffn"):
                        mixed = ragged_mixes(block, h, lens, which)
                        coeffs = [getattr(block, f"hc_{which}_{k}") for k in ("fn", "scale", "base")]
                        at = 0
                        for t in lens:
                            want = block._mixes(h[:, at : at + t], *coeffs)
                            for a, b in zip(mixed, want, strict=True):
                                assert torch.equal(a[:, at : at + t], b), (layer, which, t)
                            at += t
    finally:
        torch.set_num_threads(before)


def test_rsqrt_gives_the_same_bits_vectorized_and_scalar() -> None:
    """What lets `ragged_mixes` (and `decode_many`'s mixes, and RMSNorm) run rsqrt over stacked rows:
    torch's SIMD body and scalar tail agree on every element, on fresh wide-range positive floats
    (normal and subnormal, every exponent). Each element alone (a run of one, as `rows_apart` lays them
    out) is its scalar path; the contiguous stack puts most of them in whole SIMD steps."""
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    bits = torch.randint(1, 0x7F800000, (1 << 20,), dtype=torch.int32, generator=gen)
    x = bits.view(torch.float32)
    stacked = torch.rsqrt(x)
    alone = torch.rsqrt(x.repeat_interleave(2).view(-1, 2)[:, :1]).view(-1)
    assert torch.equal(stacked.view(torch.int32), alone.view(torch.int32))
    # the same comparison has teeth where the two paths differ (sigmoid: the reason for `lone_runs`)
    y = torch.randn(1 << 20, generator=gen) * 8
    y_alone = y.repeat_interleave(2).view(-1, 2)[:, :1]
    assert not torch.equal(torch.sigmoid(y), torch.sigmoid(y_alone).view(-1))


@pytest.mark.parametrize("threads", [1, 2])
def test_ragged_sparse_attn_equals_each_sequence_alone(threads: int) -> None:
    """`ragged_sparse_attn` over sequences of unequal lengths stacked along T against each sequence's lone
    `sparse_attn` (torch), on fresh random inputs: widths of one and several 64-wide blocks, -1 slots,
    rows with no index, a buffer per sequence laid end to end."""
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    rng = random.Random(random.randrange(1 << 30))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for h, d, k in ((4, 128, 48), (2, 64, 32), (3, 64, 150)):
            runs = [rng.choice([1, 3, 24, rng.randrange(2, 40)]) for _ in range(7)]
            sink = torch.randn(h, generator=gen)
            qs, bufs, ids = [], [], []
            for t in runs:
                n = rng.randrange(1, 200)
                qs.append(torch.randn(1, t, h, d, generator=gen).to(torch.bfloat16))
                bufs.append(torch.randn(1, n, d, generator=gen).to(torch.bfloat16))
                i = torch.randint(-1, n, (1, t, k), generator=gen)
                i[:, 0] = -1  # a row with no index at all
                ids.append(i)
            offsets = [0]
            for b in bufs:
                offsets.append(offsets[-1] + b.size(1))
            pairs = zip(ids, offsets[:-1], strict=True)
            shifted = torch.cat([torch.where(i >= 0, i + o, -1) for i, o in pairs], 1)
            got = ragged_sparse_attn(torch.cat(qs, 1), torch.cat(bufs, 1), sink, shifted.int(), d**-0.5, runs)
            at = 0
            for q, b, i, t in zip(qs, bufs, ids, runs, strict=True):
                want = sparse_attn(q, b, sink, i.int(), d**-0.5)
                assert torch.equal(got[:, at : at + t], want), (h, d, k, t)
                at += t
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_routes_equal_each_sequence_routed_alone(model: Transformer, threads: int) -> None:
    """The batched prefill's MoE routing over a ragged stack against each sequence's lone `Gate.forward`
    (its softplus's SIMD body and scalar tail differ in the last bit on this project's VMs: odd T_i put
    rows in a lone run's tail), on fresh random rows at 1 and 2 threads."""
    rng = random.Random(random.randrange(1 << 30))
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            for layer in (0, model.cfg.n_layers - 1):
                gate = model.layers[layer].ffn.gate
                runs = [rng.choice([1, 3, 5, 24, rng.randrange(2, 40)]) for _ in range(12)]
                flat = torch.randn(sum(runs), model.cfg.dim, generator=gen).to(torch.bfloat16)
                weights, ids = batched_prefill._route(gate, flat, runs)
                at = 0
                for t in runs:
                    w, i = gate(flat[at : at + t])
                    assert torch.equal(weights[at : at + t], w), (layer, t)
                    assert torch.equal(ids[at : at + t], i), (layer, t)
                    at += t
    finally:
        torch.set_num_threads(before)
