"""Transformer pieces against slow twins (window layout, compressor streaming), training, weights I/O."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model import CheckpointMismatch, ModelConfig, Transformer, init_random, load_model, load_preset, prefill
from model.attention import window_ids
from model.compressor import Compressor
from model.weights import save_plain


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # small ops on a shared 2-core machine run much faster without OpenMP oversubscription
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _plain_tiny() -> ModelConfig:
    return ModelConfig.from_dict(load_preset("v41-tiny").to_dict() | {"dtype": "bf16", "expert_dtype": None})


@pytest.mark.parametrize(
    ("start", "rows", "floor", "ring_from"),
    [(0, 5, 0, 0), (0, 40, 0, 0), (37, 1, 0, 0), (37, 9, 30, 0), (100, 50, 0, 90), (5, 3, 0, 0)],
)
def test_window_ids_match_naive_mask(start: int, rows: int, floor: int, ring_from: int) -> None:
    w = 32
    eff = max(floor, ring_from)
    ids, uses_ring = window_ids(start, rows, w, eff, torch.device("cpu"))
    for r in range(rows):
        p = start + r
        want = {q for q in range(max(0, p - w + 1, eff), p + 1)}
        got = set()
        for i in ids[r].tolist():
            if i < 0:
                continue
            if uses_ring:
                q = start + i - w if i >= w else next(q for q in range(p - w + 1, start) if q % w == i)
            else:
                q = start + i
            got.add(q)
        assert got == want, (r, sorted(got), sorted(want))
        valid = [i for i in ids[r].tolist() if i >= 0]
        assert len(valid) == len(set(valid))


@pytest.mark.parametrize(
    "splits", [[7], [1, 1, 1, 4], [3, 4], [2, 5]], ids=["one-shot", "ones", "odd", "even"]
)
def test_compressor_streaming_matches_one_shot(splits: list[int]) -> None:
    torch.manual_seed(0)
    comp = Compressor(64, 32, 2, 1e-20)
    torch.nn.init.normal_(comp.wkv.weight, std=0.1)
    torch.nn.init.normal_(comp.wgate.weight, std=0.1)
    x = torch.randn(1, 7, 64).to(torch.bfloat16)
    ckv, csc = torch.zeros(1, 2, 32), torch.full((1, 2, 32), -torch.inf)
    whole = comp(x, 0, ckv, csc)
    pos, latents = 0, []
    for n in splits:
        out = comp(x[:, pos : pos + n], pos, ckv, csc)
        ckv, csc = out.carry_kv, out.carry_score
        latents.append(out.latent)
        pos += n
    # slow twin: softmax pooling written out per group
    xf = x.float()
    kv, sc = comp.wkv(xf), comp.wgate(xf)
    twin = torch.stack(
        [(kv[:, 2 * j : 2 * j + 2] * sc[:, 2 * j : 2 * j + 2].softmax(1)).sum(1) for j in range(3)], 1
    )
    torch.testing.assert_close(whole.latent, comp.norm(twin.to(torch.bfloat16)), rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(latents, 1), whole.latent, rtol=0, atol=0)
    torch.testing.assert_close(ckv[:, 0], kv[:, 6], rtol=0, atol=0)


def test_training_mode_gradients_reach_every_trainable_weight() -> None:
    model = init_random(Transformer(_plain_tiny()), seed=0).train()
    toks = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    out = prefill(model, toks, mode="reference", all_logits=True)
    loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 512), toks[:, 1:].reshape(-1))
    loss.backward()
    dead = [
        n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())
    ]
    # the gate bias only selects experts and the indexer only selects entries: neither gets a gradient
    assert dead and all(n.endswith("gate.bias") or ".indexer." in n for n in dead), dead


def test_save_plain_and_load_model_round_trip(tmp_path: Path) -> None:
    model = init_random(Transformer(_plain_tiny()), seed=3)
    save_plain(model, tmp_path)
    loaded = load_model(tmp_path)
    toks = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(prefill(loaded, toks).logits, prefill(model, toks).logits)


def test_load_model_names_missing_and_misshaped_tensors(tmp_path: Path) -> None:
    model = init_random(Transformer(_plain_tiny()), seed=3)
    save_plain(model, tmp_path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["layers.3.attn.wq_b.weight"]
    tensors["layers.6.attn.indexer.wk.weight"] = tensors["layers.6.attn.indexer.wk.weight"][
        :, :-1
    ].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointMismatch) as err:
        load_model(tmp_path)
    assert "layers.3.attn.wq_b.weight" in str(err.value)
    assert "layers.6.attn.indexer.wk.weight" in str(err.value)


@pytest.mark.gpu
def test_prefill_and_decode_on_cuda_match_cpu() -> None:
    model = init_random(Transformer(load_preset("v41-tiny")), seed=0)
    toks = torch.randint(0, 512, (1, 80), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        cpu = prefill(model, toks, mode="ced")
        gpu_model = model.to("cuda")
        gpu = prefill(gpu_model, toks.cuda(), mode="ced")
        step = gpu.logits.argmax(-1)
        from model import decode

        gpu_next = decode(gpu_model, step, gpu.state)
    assert gpu.state.device.type == "cuda"
    scale = cpu.logits.abs().max()
    assert (gpu.logits.cpu() - cpu.logits).abs().max() < 0.1 * scale
    assert torch.isfinite(gpu_next.logits).all()
