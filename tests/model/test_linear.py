"""Linear: the cached decoded weight against the stored-weight product, its invalidation, and the opt-in
`fast` math (folded scales, one GEMM) with its own fingerprint."""

from __future__ import annotations

import pytest
import torch

import kernels
from model import (
    NumericsProfile,
    Transformer,
    init_random,
    load_preset,
    model_fingerprint,
    prefill,
    set_linear_math,
)
from model.linear import Linear


def _fp8_linear(seed: int) -> Linear:
    g = torch.Generator().manual_seed(seed)
    layer = Linear(96, 70, "fp8")
    with torch.no_grad():
        layer.weight.copy_((torch.randn(70, 96, generator=g) * 40).to(torch.float8_e4m3fn))
        exps = torch.randint(-12, -4, layer.scale.shape, generator=g) + 127
        layer.scale.copy_(exps.to(torch.uint8).view(torch.float8_e8m0fnu))
    return layer


def test_linear_cached_weight_equals_stored_product_and_follows_updates() -> None:
    layer = _fp8_linear(1)
    x = torch.randn(5, 96).bfloat16()
    first = layer(x)
    assert torch.equal(first, kernels.fp8_linear(x, layer.weight, layer.scale, out_dtype=torch.bfloat16))
    assert layer.prepared_weight() is layer.prepared_weight()
    # an in-place update (what load_state_dict does) must not be served from the stale cache
    layer.load_state_dict(_fp8_linear(2).state_dict())
    second = layer(x)
    assert torch.equal(second, kernels.fp8_linear(x, layer.weight, layer.scale, out_dtype=torch.bfloat16))
    assert not torch.equal(first, second)


def test_set_linear_math_fast_is_close_opt_in_and_fingerprinted() -> None:
    model = init_random(Transformer(load_preset("v41-tiny")), seed=0).eval()
    toks = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        exact = prefill(model, toks, mode="ced").logits
        assert set_linear_math(model, "fast") > 0
        fast = prefill(model, toks, mode="ced").logits
        quantized = [m for m in model.modules() if isinstance(m, Linear) and m.quantized]
        assert all(m.prepared_weight().folded is not None for m in quantized)
        set_linear_math(model, "exact")
        again = prefill(model, toks, mode="ced").logits
    assert torch.equal(again, exact)
    # the fp32 sums differ in order only; after the bf16 rounding they often agree exactly (as here)
    assert ((fast - exact).norm() / exact.norm()).item() < 0.05
    assert model_fingerprint(model, NumericsProfile(math="fast")) != model_fingerprint(model)
    with pytest.raises(ValueError, match="math must be"):
        set_linear_math(model, "quick")


def test_linear_with_inference_tensor_weights_is_not_cached_but_equal() -> None:
    with torch.inference_mode():
        layer = _fp8_linear(4)
        x = torch.randn(3, 96).bfloat16()
        want = kernels.fp8_linear(x, layer.weight, layer.scale, out_dtype=torch.bfloat16)
        assert torch.equal(layer(x), want)
        assert layer._prepared is None


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 24, 97])
def test_one_group_output_projection_equals_the_official_einsum(rows: int) -> None:
    """`Attention.project_out` of one group runs wo_a as a plain bf16 Linear (the compiled path from two
    rows on) instead of the official einsum "bsgd,grd->bsgr": equal bit for bit, on fresh wide-range
    values (their last bits show any other summation order) and on ordinary ones."""
    seed = torch.randint(0, 2**31 - 1, ()).item()
    g = torch.Generator().manual_seed(seed)
    for d, r in ((128, 64), (64, 32), (256, 96)):
        layer = Linear(d, r, "bf16")
        with torch.no_grad():
            exponent = torch.randint(-6, 7, (r, d), generator=g).float()
            layer.weight.copy_((torch.exp2(exponent) * (torch.rand(r, d, generator=g) - 0.5)).bfloat16())
        for wide in (True, False):
            o = torch.randn(2, rows, d, generator=g)
            if wide:
                o = o * torch.exp2(torch.randint(-6, 7, o.shape, generator=g).float())
            o = o.bfloat16()
            official = torch.einsum("bsgd,grd->bsgr", o.unsqueeze(2), layer.weight.view(1, r, d)).flatten(2)
            with torch.inference_mode():
                assert torch.equal(layer(o), official), f"seed {seed}, d {d}, r {r}, wide {wide}"
