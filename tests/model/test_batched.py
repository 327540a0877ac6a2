"""`decode_many` (one step over the stacked rows of many sequences) equals decoding each sequence alone,
bit for bit: logits, every state tensor and the exported cache bytes, on fresh random states of unequal
lengths that straddle window and compression-group boundaries, with histories shorter than the indexer's
top-k (so a step holds sequences of several selection widths), groups that close at the step and not,
and states the batched attention stage does not take (empty, windows dropped), at 1 and 2 threads. The
batched attention stage is compared with its slow twin (each sequence's `Attention.attend` alone) too.
Also the row-invariance of the products the batched step relies on."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F

from kernels import wide_fp32
from model import (
    Transformer,
    decode,
    decode_many,
    export_global,
    export_windows,
    init_random,
    invariant,
    load_preset,
    prefill,
)
from model.batched_attention import batchable
from model.invariant import fp32_linear, fp32_rows_free, rowwise_linear, stacked_fp32_linear
from model.moe import Gate


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return init_random(Transformer(load_preset("v41-tiny")), seed=int(torch.randint(0, 10_000, ()))).eval()


def _state_tensors(state) -> list[torch.Tensor]:
    out = [state.tokens, state.enc_lanes, state.enc_pre]
    out += list(state.windows) + list(state.window_codes) + list(state.window_scales)
    for layer in sorted(state.sources):
        src = state.sources[layer]
        out += [src.kv, src.index_k, src.kv_packed, src.kv_scales, src.index_packed, src.index_scales]
        out += [t for t in (src.carry_kv, src.carry_score) if t is not None]
    return out


def _assert_same_state_tensors(a: list[torch.Tensor], b: list[torch.Tensor], where: str) -> None:
    """The same tensors, byte for byte: NaN payloads and signed zeros count, fp8 codes and e8m0 scales too."""
    assert len(a) == len(b), where
    for k, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.dtype == y.dtype and x.shape == y.shape, f"{where}: tensor {k}"
        x, y = x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)
        assert torch.equal(x, y), f"{where}: tensor {k} differs at byte {int((x != y).nonzero()[0, 0])}"


def _assert_same_exports(model, alone, together) -> None:
    """Each pair of states exports the same global and window bytes (what the store would keep)."""
    f = b"f" * 32
    for a, b in zip(alone, together, strict=True):
        n = a.n_tokens
        assert export_global(a, 0, n, fingerprint=f) == export_global(b, 0, n, fingerprint=f)
        assert export_windows(model, a, fingerprint=f) == export_windows(model, b, fingerprint=f)


def _assert_same_state(a, b) -> None:
    assert a.window_from == b.window_from and a.enc_from == b.enc_from
    assert a.extra.get("index_k_slot") == b.extra.get("index_k_slot")
    _assert_same_state_tensors(_state_tensors(a), _state_tensors(b), "state")


def test_rowwise_linear_equals_one_row_products() -> None:
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    # (96, 2): a gate of two experts, a product torch's bmm runs with a loop of its own
    for k, n in ((384, 24), (96, 4096), (1000, 7), (96, 2), (256, 8)):
        w = torch.randn(n, k, generator=gen)
        x = torch.randn(37, k, generator=gen)
        alone = torch.cat([fp32_linear(x[i : i + 1], w) for i in range(37)])
        assert torch.equal(rowwise_linear(x, w), alone), (k, n)
        assert torch.equal(rowwise_linear(x[:1], w), fp32_linear(x[:1], w))


@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_a_rowwise_gate_routes_each_row_as_a_one_row_gate(score_func: str) -> None:
    """The router of a batched decode: every row's weights and experts equal the row's gate alone, bit for
    bit, for few experts (a lone row of 8 scores is all SIMD remainder, the scalar softplus; the same row
    inside [N, 8] runs vectorized, one bit apart, unless the rows lie apart)."""
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    for n_experts, topk in ((8, 2), (4, 1), (6, 2), (16, 4)):
        gate = Gate(64, n_experts, topk, score_func, 1.0, True, 2.5)
        with torch.no_grad():
            gate.weight.copy_(torch.randn(n_experts, 64, generator=gen).bfloat16())
            gate.bias.copy_(torch.randn(n_experts, generator=gen) * 0.1)
        x = torch.randn(512, 64, generator=gen).bfloat16()
        weights, indices = gate(x, rowwise=True)
        alone = [gate(x[i : i + 1]) for i in range(x.size(0))]
        assert torch.equal(indices, torch.cat([a[1] for a in alone])), (seed, n_experts)
        assert torch.equal(weights, torch.cat([a[0] for a in alone])), (seed, n_experts)


def test_fp32_linear_gives_small_products_the_rows_of_a_large_one() -> None:
    """Products of 2 and 3 rows (and of 1 where rows are free) run inside a 4-row one: each row equals the
    same row of a 40-row product (on an AMD EPYC Zen 4, plain F.linear of 2 or 3 rows does not)."""
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    for k, n in ((64, 32), (1024, 24), (96, 4096)):
        w = torch.randn(n, k, generator=gen).bfloat16().float()
        x = torch.randn(40, k, generator=gen).bfloat16().float()
        whole = F.linear(x, w)
        for m in (2, 3, 4, 5, 8) + ((1,) if fp32_rows_free() else ()):
            for start in range(0, 40 - m + 1, m):
                got = fp32_linear(x[start : start + m].view(1, m, k), w)
                assert got.shape == (1, m, n)
                assert torch.equal(got[0], whole[start : start + m]), (k, n, m, start)
    assert fp32_linear(x[:0], w).shape == (0, w.size(0))


@pytest.mark.parametrize("stacks", [True, False])
def test_stacked_products_give_each_sequence_its_own_product(monkeypatch, stacks: bool) -> None:
    """`stacked_fp32_linear` over ragged runs (one-row sequences among them) equals each run's own
    `fp32_linear`, bit for bit, on fresh wide-range values; also where the first-use check refuses to
    stack (then one product per sequence)."""
    if not stacks:
        monkeypatch.setattr(invariant, "_stacks_freely", lambda k, n, threads: False)
    rng = random.Random(random.randrange(1 << 30))
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for k, n in ((384, 24), (96, 2), (96, 64)):
        w = wide_fp32(gen, n, k)
        for _ in range(4):
            sizes = [1, 1, 2, 3, 5, 24, rng.randrange(1, 60)]
            runs = [rng.choice(sizes) for _ in range(rng.randrange(1, 12))]
            x = wide_fp32(gen, sum(runs), k)
            got = stacked_fp32_linear(x, w, runs)
            at, alone = 0, []
            for t in runs:
                alone.append(fp32_linear(x[at : at + t], w))
                at += t
            assert torch.equal(got, torch.cat(alone)), (k, n, runs)
    with pytest.raises(ValueError, match="must add up"):
        stacked_fp32_linear(torch.zeros(3, 8), torch.zeros(2, 8), [1, 1])


def _new_states(model: Transformer, rng: random.Random, lengths: list[int]) -> list:
    """ced prefills of random prompts; length 0 is an empty state, a negative length -n a prefill of n
    tokens whose decoder windows were then dropped (neither takes the batched attention stage)."""
    cfg = model.cfg
    states = []
    for n in lengths:
        if n == 0:
            states.append(model.new_state(1))
            continue
        prompt = torch.tensor([[rng.randrange(16, cfg.vocab_size) for _ in range(abs(n))]])
        state = prefill(model, prompt, mode="ced").state
        if n < 0:
            state.drop_windows(cfg.decoder_layers)
        states.append(state)
    return states


def _step_and_compare(model: Transformer, rng: random.Random, states: list, steps: int, *, twin: bool,
                      seed: int) -> None:  # fmt: skip
    cfg = model.cfg
    alone = [s.clone() for s in states]
    together = [s.clone() for s in states]
    slow = [s.clone() for s in states] if twin else []
    # what the snapshots the steps start from hold now: no step may change them (ModelState.clone)
    before = [[t.clone() for t in _state_tensors(s)] for s in states]
    for step in range(steps):  # crosses group boundaries of every ratio at some lengths
        tokens = [rng.randrange(16, cfg.vocab_size) for _ in states]
        ref = [decode(model, torch.tensor([t]), s) for t, s in zip(tokens, alone, strict=True)]
        # a different subset and order each step: who shares the batch must not matter
        order = list(range(len(states)))
        rng.shuffle(order)
        order = order[: rng.randrange(1, len(order) + 1)] if step % 2 else order
        got = decode_many(model, [tokens[i] for i in order], [together[i] for i in order])
        if twin:
            got_slow = decode_many(model, [tokens[i] for i in order], [slow[i] for i in order],
                                   batched_attention=False)  # fmt: skip
        for j, i in enumerate(order):
            assert torch.equal(got[j].logits, ref[i].logits), f"seed {seed} step {step} seq {i}"
            assert got[j].stats == ref[i].stats
            if twin:
                assert torch.equal(got_slow[j].logits, ref[i].logits), f"twin: seed {seed} step {step}"
        # the sequences left out of this step are decoded alone, to stay in lockstep with the reference
        for i in set(range(len(states))) - set(order):
            decode(model, torch.tensor([tokens[i]]), together[i])
            if twin:
                decode(model, torch.tensor([tokens[i]]), slow[i])
        for i in range(len(states)):
            _assert_same_state(alone[i], together[i])
            if twin:
                _assert_same_state(alone[i], slow[i])
    _assert_same_exports(model, alone, together)
    for i, s in enumerate(states):
        _assert_same_state_tensors(_state_tensors(s), before[i], f"seed {seed}: snapshot {i} changed")


@torch.inference_mode()
def test_decode_many_equals_each_sequence_decoded_alone(model: Transformer) -> None:
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    w, topk = model.cfg.window_size, model.cfg.index_topk
    # lengths around the window and the compression groups, histories with fewer visible entries than
    # top-k (ratio 2: below 2 * topk), a fresh 1-token state, an empty one and one with dropped windows
    lengths = [1, 3, topk - 1, 2 * topk - 2, w - 1, w, w + 1, 2 * w + 3, 0, -(w + 5)]
    lengths += [rng.randrange(2, 4 * w) for _ in range(6)]
    states = _new_states(model, rng, lengths)
    assert not batchable(model, states[8]) and not batchable(model, states[9])
    assert all(batchable(model, s) for s in states[1:8])
    _step_and_compare(model, rng, states, 6, twin=False, seed=seed)


@torch.inference_mode()
def test_batched_attention_equals_its_slow_twin_at_one_thread(model: Transformer) -> None:
    """The same at 1 thread (the suite runs at the machine's cores), and the batched attention stage
    against `decode_many(batched_attention=False)`, which runs each sequence's attention alone."""
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        topk = model.cfg.index_topk
        lengths = [2, topk - 3, 2 * topk + 1, 0]
        lengths += [rng.randrange(2, 4 * model.cfg.window_size) for _ in range(4)]
        _step_and_compare(model, rng, _new_states(model, rng, lengths), 3, twin=True, seed=seed)
    finally:
        torch.set_num_threads(threads)


def test_decode_many_refuses_bad_batches(model: Transformer) -> None:
    state = model.new_state(1)
    with pytest.raises(ValueError, match="one token per state"):
        decode_many(model, [1, 2], [state])
    with pytest.raises(ValueError, match="same state twice"):
        decode_many(model, [1, 2], [state, state])
    with pytest.raises(ValueError, match="must lie in"):
        decode_many(model, [cfg_vocab := model.cfg.vocab_size], [state])
    assert cfg_vocab > 0



def test_the_experts_silu_gives_stacked_rows_their_lone_bits() -> None:
    """The premise of the batched passes' experts: SiLU over stacked contiguous rows gives each row the bits
    of the row alone when rows start on SIMD block boundaries (torch runs a contiguous run's full blocks of
    2 x 8 floats, 2 x 16 under AVX-512, vectorized and its tail scalar). moe_inter_dim is a multiple of 32
    by the config's rule for FP8/FP4 groups, so it always holds."""
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    for width in (32, 96, 128, 2304):
        x = torch.randn(64, width, generator=gen) * 4
        alone = torch.cat([F.silu(x[i : i + 1]) for i in range(x.size(0))])
        assert torch.equal(F.silu(x), alone), width
    with pytest.raises(ValueError, match="moe_inter_dim must be a multiple of 32"):
        dataclasses.replace(load_preset("v41-tiny"), moe_inter_dim=72)
