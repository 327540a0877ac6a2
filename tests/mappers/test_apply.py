"""apply_mapper and identity_mapper: identity between siblings of identical geometry re-expresses the
sender's stored codes bit for bit, the output imports into a receiver state and a prefill continues, and
the general (dequantize -> strip -> map -> re-rotate -> re-quantize) path agrees with a slow twin."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import quantize_fp4_e4m3, quantize_mxfp4
from mappers import (
    KVMapper,
    LayerMap,
    MapperMismatch,
    PartMap,
    applicability,
    apply_mapper,
    identity_mapper,
)
from model import (
    HEADER_BYTES,
    CacheFormatError,
    Transformer,
    apply_rope,
    export_global,
    init_random,
    load_preset,
    model_fingerprint,
    prefill,
    state_from_global,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pair() -> tuple[Transformer, Transformer]:
    cfg = load_preset("v41-tiny")
    return (
        init_random(Transformer(cfg), seed=0).eval(),
        init_random(Transformer(cfg), seed=1).eval(),
    )


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def test_apply_mapper_identity_copies_codes_bitwise(pair: tuple[Transformer, Transformer]) -> None:
    sender, receiver = pair
    fp_s, fp_r = model_fingerprint(sender), model_fingerprint(receiver)
    assert fp_s != fp_r
    toks = _tokens(70, 1)
    state = prefill(sender, toks).state
    blobs = [export_global(state, a, b, fingerprint=fp_s) for a, b in [(0, 32), (32, 64), (64, 70)]]
    mapper = identity_mapper(
        sender.cfg, receiver.cfg, sender_fingerprint=fp_s, receiver_fingerprint=fp_r
    )
    out = apply_mapper(mapper, blobs, sender_fingerprint=fp_s, receiver_fingerprint=fp_r)
    assert out.bounds == ((0, 32), (32, 64), (64, 70))
    assert len(out.copied_parts) == 2 * len(sender.cfg.kv_source_layers)
    for got, want in zip(out.blobs, blobs, strict=True):
        # the payload (codes and scales, and its checksum) is the sender's; only the fingerprint differs
        assert got[HEADER_BYTES:] == want[HEADER_BYTES:]
        assert got[:8] == want[:8] and got[40:HEADER_BYTES] == want[40:HEADER_BYTES]
        assert got[8:40] == fp_r
    # the same from the live state
    live = apply_mapper(mapper, state, sender_fingerprint=fp_s, receiver_fingerprint=fp_r, chunk_tokens=32)
    assert live.blobs == out.blobs

    rstate = state_from_global(receiver, toks, list(out.blobs), fingerprint=fp_r)
    for layer, src in state.sources.items():
        got = rstate.sources[layer]
        n = src.n_entries
        for f in ("kv_packed", "kv_scales", "index_packed", "index_scales", "kv", "index_k"):
            assert torch.equal(getattr(got, f), getattr(src, f)[:, :n]), f"layer {layer} {f}"
    more = _tokens(5, 2)
    cont = prefill(receiver, more, rstate)
    assert cont.logits is not None and torch.isfinite(cont.logits).all()
    assert cont.state.n_tokens == 75
    # the receiver's own continuation must not have rewritten any mapped entry
    for layer, src in state.sources.items():
        kept = cont.state.sources[layer].kv_packed[:, : src.n_entries]
        assert torch.equal(kept, src.kv_packed[:, : src.n_entries])


@torch.inference_mode()
def test_apply_mapper_identity_with_other_rope_rerotates(pair: tuple[Transformer, Transformer]) -> None:
    sender, _ = pair
    other = dataclasses.replace(sender.cfg, compress_rope_theta=40000.0)
    fp_s = model_fingerprint(sender)
    state = prefill(sender, _tokens(40, 3)).state
    mapper = identity_mapper(sender.cfg, other)
    out = apply_mapper(mapper, state, sender_fingerprint=fp_s, receiver_fingerprint=bytes(32))
    assert out.copied_parts == ()
    rstate = state_from_global(
        Transformer(other), torch.zeros(1, 40, dtype=torch.int64), list(out.blobs), fingerprint=bytes(32)
    )
    rd = other.rope_head_dim
    for layer, src in state.sources.items():
        m = src.ratio
        n = 40 // m
        pos = torch.arange(n) * m
        s_table = sender.rope_for(layer, 64, torch.device("cpu"))[pos]
        r_table = Transformer(other).rope_for(layer, 64, torch.device("cpu"))[pos]
        # slow twin: rotate each entry back with the sender's table and forward with the receiver's
        want_kv = apply_rope(apply_rope(src.kv.float(), s_table, rd, inverse=True), r_table, rd)
        want_ix = apply_rope(apply_rope(src.index_k.float(), s_table, rd, inverse=True), r_table, rd)
        got = rstate.sources[layer]
        packed, scales = quantize_fp4_e4m3(want_kv)
        assert torch.equal(got.kv_packed, packed) and torch.equal(got.kv_scales, scales.view(torch.uint8))
        packed, scales = quantize_mxfp4(want_ix)
        assert torch.equal(got.index_packed, packed) and torch.equal(got.index_scales, scales)
        # the non-rotated channels pass through unchanged in value
        assert torch.equal(got.kv[..., :-rd], src.kv[..., :-rd])


def _linear_identity(cfg) -> KVMapper:
    """The identity written as linear parts (coef I, intercept 0): it takes the general path."""
    ident = identity_mapper(cfg, cfg)
    layers, arrays = [], {}
    for lm in ident.layers:
        layers.append(
            dataclasses.replace(
                lm,
                kv=PartMap(kind="linear", sender_layers=lm.kv.sender_layers, alpha=0.0),
                index=PartMap(kind="linear", sender_layers=lm.index.sender_layers, alpha=0.0),
            )
        )
        for part, d in (("kv", cfg.head_dim), ("index", cfg.index_head_dim)):
            arrays[f"layers.{lm.receiver_layer}.{part}.coef"] = torch.eye(d)
            arrays[f"layers.{lm.receiver_layer}.{part}.intercept"] = torch.zeros(d)
    return KVMapper(sender=ident.sender, receiver=ident.receiver, layers=tuple(layers), arrays=arrays)


@torch.inference_mode()
def test_apply_mapper_linear_identity_weights_stay_close(pair: tuple[Transformer, Transformer]) -> None:
    sender, _ = pair
    cfg = sender.cfg
    fp_s = model_fingerprint(sender)
    state = prefill(sender, _tokens(48, 4)).state
    linear = _linear_identity(cfg)
    out = apply_mapper(linear, state, sender_fingerprint=fp_s, receiver_fingerprint=fp_s)
    assert out.copied_parts == ()
    rstate = state_from_global(sender, state.tokens, list(out.blobs), fingerprint=fp_s)
    for layer, src in state.sources.items():
        got = rstate.sources[layer]
        # re-quantizing dequantized values gives back almost every value (codes may differ: -0 vs +0,
        # or another scale for a group whose largest code is small)
        cos = torch.nn.functional.cosine_similarity(got.kv.float(), src.kv.float(), dim=-1)
        assert cos.min() > 0.999, f"layer {layer}: min cosine {cos.min():.6f}"
        for f in ("kv", "index_k"):
            same = (getattr(got, f) == getattr(src, f)).float().mean()
            assert same > 0.95, f"layer {layer}: only {same:.3f} of {f} values unchanged"


@torch.inference_mode()
def test_apply_mapper_recompute_index_from_the_latent(pair: tuple[Transformer, Transformer]) -> None:
    sender, _ = pair
    cfg, fp = sender.cfg, model_fingerprint(sender)
    ident = identity_mapper(cfg, cfg)
    layers = tuple(
        dataclasses.replace(lm, index=PartMap(kind="recompute", sender_layers=lm.kv.sender_layers))
        for lm in ident.layers
    )
    mapper = dataclasses.replace(ident, layers=layers)
    assert mapper.needs_receiver_weights
    state = prefill(sender, _tokens(48, 6)).state
    with pytest.raises(ValueError, match="receiver_model"):
        apply_mapper(mapper, state, sender_fingerprint=fp, receiver_fingerprint=fp)
    out = apply_mapper(mapper, state, sender_fingerprint=fp, receiver_fingerprint=fp, receiver_model=sender)
    assert out.copied_parts == ((2, "kv"), (4, "kv"), (6, "kv"))
    rstate = state_from_global(sender, state.tokens, list(out.blobs), fingerprint=fp)
    for layer, src in state.sources.items():
        own, got = src.index_k.float(), rstate.sources[layer].index_k.float()
        # the model derives index K from the unquantized latent, the recompute from its FP4 form
        r2 = 1 - ((own - got) ** 2).sum() / ((own - own.mean((0, 1))) ** 2).sum()
        assert 0.9 < r2 < 0.999, f"layer {layer}: index R² {r2:.4f}"


def test_applicability_and_mismatch(pair: tuple[Transformer, Transformer]) -> None:
    sender, receiver = pair
    fp_s, fp_r = model_fingerprint(sender), model_fingerprint(receiver)
    mapper = identity_mapper(sender.cfg, receiver.cfg, sender_fingerprint=fp_s, receiver_fingerprint=fp_r)
    assert applicability(mapper, sender_fingerprint=fp_s, receiver_fingerprint=fp_r).ok
    miss = applicability(mapper, sender_fingerprint=fp_r, receiver_fingerprint=fp_r)
    assert not miss.ok and miss.reason == "sender_fingerprint_mismatch"
    gated = dataclasses.replace(mapper, passed_gate=False)
    verdict = applicability(gated, sender_fingerprint=fp_s, receiver_fingerprint=fp_r)
    assert verdict.reason == "gate_not_passed"
    with pytest.raises(MapperMismatch, match="receiver fingerprint"):
        apply_mapper(mapper, [], sender_fingerprint=fp_s, receiver_fingerprint=fp_s)


def test_identity_mapper_rejects_other_geometry() -> None:
    cfg = load_preset("v41-tiny")
    with pytest.raises(ValueError, match="head_dim"):
        identity_mapper(cfg, dataclasses.replace(cfg, index_head_dim=32))
    fewer = dataclasses.replace(cfg, kv_source_layers=(2, 6), index_source_layers=(2, 6, 8, 10))
    with pytest.raises(ValueError, match="as many kv sources"):
        identity_mapper(cfg, fewer)
    assert isinstance(identity_mapper(cfg, cfg).layers[0], LayerMap)


@pytest.mark.gpu
@torch.inference_mode()
def test_apply_mapper_on_cuda_matches_cpu(pair: tuple[Transformer, Transformer]) -> None:
    sender, receiver = pair
    fp_s, fp_r = model_fingerprint(sender), model_fingerprint(receiver)
    state = prefill(sender, _tokens(80, 5)).state
    ident = identity_mapper(sender.cfg, receiver.cfg)
    kw = dict(sender_fingerprint=fp_s, receiver_fingerprint=fp_r, chunk_tokens=32)
    assert apply_mapper(ident, state, device="cuda", **kw).blobs == apply_mapper(ident, state, **kw).blobs
    linear = _linear_identity(sender.cfg)
    on_gpu = apply_mapper(linear, state, device="cuda", **kw).blobs
    on_cpu = apply_mapper(linear, state, **kw).blobs
    # fp32 rotations and matmuls may round differently on the GPU: a code flips only at a rounding tie
    same = sum(a == b for x, y in zip(on_gpu, on_cpu, strict=True) for a, b in zip(x, y, strict=True))
    assert same >= 0.99 * sum(len(x) for x in on_cpu)


@torch.inference_mode()
def test_apply_mapper_refuses_a_damaged_sender_chunk_by_number(pair: tuple[Transformer, Transformer]) -> None:
    """The sender's chunks are imported in one linear-time call (model.import_global_chunks); a chunk it
    refuses fails the whole map with CacheFormatError naming the chunk, and no chunks map to nothing."""
    sender, receiver = pair
    fp_s, fp_r = model_fingerprint(sender), model_fingerprint(receiver)
    state = prefill(sender, _tokens(64, 3)).state
    blobs = [export_global(state, a, b, fingerprint=fp_s) for a, b in [(0, 32), (32, 64)]]
    mapper = identity_mapper(sender.cfg, receiver.cfg, sender_fingerprint=fp_s, receiver_fingerprint=fp_r)
    damaged = bytearray(blobs[1])
    damaged[-1] ^= 0xFF
    with pytest.raises(CacheFormatError, match="sender chunk 1"):
        apply_mapper(mapper, [blobs[0], bytes(damaged)], sender_fingerprint=fp_s, receiver_fingerprint=fp_r)
    with pytest.raises(CacheFormatError, match="sender chunk 0"):
        apply_mapper(mapper, [blobs[1]], sender_fingerprint=fp_s, receiver_fingerprint=fp_r)
    empty = apply_mapper(mapper, [], sender_fingerprint=fp_s, receiver_fingerprint=fp_r)
    assert empty.n_tokens == 0 and empty.bounds == () and empty.blobs == ()
