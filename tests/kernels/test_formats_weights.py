"""kernels.formats weight helpers and entry-point validation: exact FP8/FP4 weight dequantization,
the reference-order FP8/FP4 linears, and ValueErrors that name the bad shape or dtype."""

from __future__ import annotations

import pytest
import torch

import kernels

U8 = torch.uint8


def e8m0(exponents: torch.Tensor) -> torch.Tensor:
    return (exponents + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def random_fp8_weight(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=g) * 40).to(torch.float8_e4m3fn)
    blocks = (-(-out_features // 32), -(-in_features // 32))
    return weight, e8m0(torch.randint(-12, -4, blocks, generator=g))


def random_fp4_weight(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (out_features, in_features // 2), generator=g, dtype=torch.uint8)
    scale = e8m0(torch.randint(-10, -4, (out_features, in_features // 32), generator=g))
    return packed.view(torch.float4_e2m1fn_x2), scale


def test_dequantize_fp8_block_weight_by_blocks() -> None:
    weight, scale = random_fp8_weight(70, 96, seed=1)
    out = kernels.dequantize_fp8_block_weight(weight, scale)
    for i in range(70):
        for j in range(0, 96, 32):
            expected = weight[i, j : j + 32].float() * scale[i // 32, j // 32].float()
            assert torch.equal(out[i, j : j + 32], expected)
    as_bytes = kernels.dequantize_fp8_block_weight(weight, scale.view(torch.uint8), torch.bfloat16)
    assert torch.equal(as_bytes, out.bfloat16())


def test_dequantize_fp4_weight_by_nibbles() -> None:
    packed, scale = random_fp4_weight(5, 64, seed=2)
    out = kernels.dequantize_fp4_weight(packed, scale)
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    raw = packed.view(torch.uint8)
    for i in range(5):
        for j in range(64):
            nibble = (raw[i, j // 2].item() >> (4 * (j % 2))) & 0xF
            assert out[i, j].item() == table[nibble] * scale[i, j // 32].float().item()
    # the same values come out of the MXFP4 activation dequantizer (same codes, same E8M0 scales)
    assert torch.equal(kernels.dequantize_mxfp4(raw, scale.view(torch.uint8), torch.float32), out)


def test_fp8_linear_single_block_is_exact_matmul() -> None:
    """With in = 32 there is one K block, and power-of-two scales commute with the sum: the reference
    order equals qdq(x) @ dequant(w)^T exactly."""
    weight, scale = random_fp8_weight(48, 32, seed=3)
    x = torch.randn(7, 32).bfloat16()
    y = kernels.fp8_linear(x, weight, scale, out_dtype=torch.float32)
    expected = kernels.qdq_fp8_ue8m0(x).float() @ kernels.dequantize_fp8_block_weight(weight, scale).T
    assert torch.equal(y, expected)


@pytest.mark.parametrize("leading", [(1,), (3, 5)], ids=["rows1", "3x5"])
def test_fp8_and_fp4_linear_close_to_one_matmul(leading: tuple[int, ...]) -> None:
    """Many K blocks: only the fp32 summation order differs from one dequantized matmul."""
    x = (torch.randn(*leading, 256) * 3).bfloat16()
    weight, scale = random_fp8_weight(63, 256, seed=4)
    y = kernels.fp8_linear(x, weight, scale, out_dtype=torch.float32)
    expected = kernels.qdq_fp8_ue8m0(x).float() @ kernels.dequantize_fp8_block_weight(weight, scale).T
    assert y.shape == (*leading, 63)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    packed, scale4 = random_fp4_weight(63, 256, seed=5)
    y4 = kernels.fp4_linear(x, packed, scale4)
    expected4 = kernels.qdq_fp8_ue8m0(x).float() @ kernels.dequantize_fp4_weight(packed, scale4).T
    assert y4.dtype == torch.get_default_dtype()
    torch.testing.assert_close(y4.float(), expected4.to(y4.dtype).float(), rtol=2**-7, atol=1e-6)


def test_weight_helpers_reject_bad_shapes() -> None:
    weight, scale = random_fp8_weight(64, 64, seed=6)
    with pytest.raises(ValueError, match=r"needs scale shape \(2, 2\)"):
        kernels.dequantize_fp8_block_weight(weight, scale[:1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        kernels.dequantize_fp8_block_weight(weight.float(), scale)
    with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
        kernels.fp8_linear(torch.randn(2, 32).bfloat16(), weight, scale)
    packed, scale4 = random_fp4_weight(4, 64, seed=7)
    with pytest.raises(ValueError, match="needs scale shape"):
        kernels.dequantize_fp4_weight(packed, scale4[:, :1])


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: kernels.quantize_fp4_e4m3(torch.randn(2, 24)), r"\(2, 24\) must be a positive multiple of"),
        (lambda: kernels.quantize_mxfp4(torch.randn(2, 32).half()), "bf16 or fp32, got torch.float16"),
        (lambda: kernels.qdq_fp8_ue8m0(torch.randn(2, 48)), r"\(2, 48\) must be a positive multiple of 32"),
        (lambda: kernels.qdq_fp8_ue8m0(torch.randn(2, 48), block=24), "power of two >= 2, got 24"),
        (lambda: kernels.qdq_mxfp4(torch.tensor(1.0)), r"last dim of x \(\)"),
        (lambda: kernels.qdq_mxfp4(torch.randn(2, 32), backend="cuda"), "got 'cuda'"),
        (
            lambda: kernels.dequantize_mxfp4(torch.zeros(2, 16, dtype=U8), torch.zeros(2, 2, dtype=U8)),
            r"scales of shape \(2, 1\), got \(2, 2\)",
        ),
        (
            lambda: kernels.dequantize_fp4_e4m3(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 1)),
            "scales must be one of",
        ),
        (
            lambda: kernels.dequantize_fp8_ue8m0(
                torch.zeros(2, 32, dtype=torch.float8_e4m3fn), torch.zeros(2, 1, dtype=U8), torch.float16
            ),
            "dtype must be bf16 or fp32, got torch.float16",
        ),
    ],
    ids=[
        "fp4-width", "mx-dtype", "fp8-width", "fp8-block", "0-dim", "backend", "mx-scales", "fp4-scale-dtype",
        "out-dtype",
    ],  # fmt: skip
)
def test_entry_points_reject_bad_input(call, match: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("rows", [1, 63, 300], ids=["M1", "M63", "M300"])
@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_prepared_linear_exact_equals_linear_on_the_stored_weight(kind: str, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    if kind == "fp8":
        stored = random_fp8_weight(70, 160, seed=rows)
        prepared, slow = kernels.prepare_fp8_weight(*stored, fold=True), kernels.fp8_linear
    else:
        stored = random_fp4_weight(70, 160, seed=rows)
        prepared, slow = kernels.prepare_fp4_weight(*stored, fold=True), kernels.fp4_linear
    x = (torch.randn(rows, 160, generator=g) * torch.logspace(-3, 2, 160)).bfloat16()
    want = slow(x, *stored, out_dtype=torch.bfloat16)
    got = kernels.prepared_linear(x, prepared, torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # fast: the same real product summed in one GEMM; close, not bitwise
    fast = kernels.prepared_linear(x, prepared, torch.float32, math="fast")
    ref = slow(x, *stored, out_dtype=torch.float32)
    rel = ((fast - ref).norm() / ref.norm()).item()
    assert rel < 1e-5, f"fast rel err {rel}"


def test_prepared_linear_rejects_fast_without_fold_and_unknown_math() -> None:
    prepared = kernels.prepare_fp8_weight(*random_fp8_weight(32, 64, seed=0))
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(ValueError, match="fold=True"):
        kernels.prepared_linear(x, prepared, math="fast")
    with pytest.raises(ValueError, match="math must be"):
        kernels.prepared_linear(x, prepared, math="quick")


@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_block_scaled_linear_rows_do_not_depend_on_how_many_share_the_call(kind: str) -> None:
    """A row's exact product is the same in a call of 1, 2, 3 or more rows as in a 48-row call, bit for bit
    in fp32, on fresh random activations spanning many binades (a batched decode stacks lone rows; on an
    AMD EPYC Zen 4 a plain 1-row block product differed from the stacked row in about 1 block in 60)."""
    seed = int(torch.randint(0, 1 << 30, ()))
    g = torch.Generator().manual_seed(seed)
    stored = random_fp8_weight(96, 256, seed) if kind == "fp8" else random_fp4_weight(96, 256, seed)
    linear = kernels.fp8_linear if kind == "fp8" else kernels.fp4_linear
    x = (torch.randn(48, 256, generator=g) * torch.logspace(-3, 3, 256)[torch.randperm(256, generator=g)])
    x = x.bfloat16()
    whole = linear(x, *stored, out_dtype=torch.float32)
    for m in (1, 2, 3, 4, 5, 7):
        for start in range(0, 48 - m + 1, m):
            got = linear(x[start : start + m], *stored, out_dtype=torch.float32)
            assert torch.equal(got, whole[start : start + m]), (seed, kind, m, start)


@pytest.mark.parametrize("shape", [(96, 256), (512, 256), (256, 1024)])
def test_batched_block_partials_equal_the_per_block_loop(shape: tuple[int, int]) -> None:
    """The block-scaled GEMM of a few rows (a decode step's) with every K block's partial in one batched
    matmul equals its slow twin, one matmul per block, bit for bit, on fresh random FP8 activations and
    weights with scales over many binades, at every row count up to past the batched path's limit."""
    from kernels.formats import weights

    seed = int(torch.randint(0, 1 << 30, ()))
    g = torch.Generator().manual_seed(seed)
    n, k = shape
    b = (torch.randn(n, k, generator=g) * 40).to(torch.float8_e4m3fn).float()
    b_scale = torch.exp2(torch.randint(-12, 4, (n, k // 32), generator=g).float())
    for m in range(1, weights.BATCHED_BLOCKS_MAX_ROWS + 3):
        a = (torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k)).to(torch.float8_e4m3fn).float()
        a_scale = torch.exp2(torch.randint(-12, 4, (m, k // 32), generator=g).float())
        fast = weights._block_scaled_matmul(a, a_scale, b, b_scale)
        slow = weights._block_scaled_matmul(a, a_scale, b, b_scale, batched=False)
        assert torch.equal(fast, slow), (seed, shape, m)


@pytest.mark.parametrize("shape", [(96, 256), (4096, 2048)])
def test_the_batched_block_probe_accepts_this_machine_or_leaves_the_loop(shape, monkeypatch) -> None:  # noqa: ANN001
    """The first-use probe decides per shape; where it agrees (every CPU measured so far), linears of a
    few rows take the batched path, unless their partials would pass BATCHED_BLOCKS_MAX_BYTES (a
    full-size model's projections): the count of the per-block loop's calls shows which one ran."""
    from kernels.formats import weights

    n, k = shape
    small = weights.batched_blocks_fit(k, n)
    agrees = small and weights.batched_blocks_agree(k, n, torch.get_num_threads())
    calls = []
    loop = weights._block_partials_loop
    monkeypatch.setattr(weights, "_block_partials_loop", lambda *args: calls.append(1) or loop(*args))
    a, scale = torch.ones(4, k), torch.ones(4, k // 32)
    weights._block_scaled_matmul(a, scale, torch.ones(n, k), torch.ones(n, k // 32))
    assert len(calls) == (0 if agrees else k // 32)
    assert small == (shape == (96, 256))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_activation_quantizer_equals_the_torch_reference(dtype: torch.dtype) -> None:
    """The FP8 quantization of a linear's input on the compiled CPU path gives the torch reference's
    values and scales bit for bit, on fresh random rows over many binades with zeros, NaN and inf in
    some groups (those groups are poisoned alike)."""
    from kernels.formats import cpu, weights

    if not cpu.available():
        pytest.skip("the compiled CPU path does not build here")
    seed = int(torch.randint(0, 1 << 30, ()))
    g = torch.Generator().manual_seed(seed)
    for rows in (1, 3, 4, 17):
        binades = torch.exp2(torch.randint(-40, 40, (rows, 256), generator=g).float())
        x = torch.randn(rows, 256, generator=g) * binades
        x[torch.rand(rows, 256, generator=g) < 0.05] = 0.0
        poisoned = torch.randperm(rows * 256, generator=g)[:3]
        x.view(-1)[poisoned] = torch.tensor([float("nan"), float("inf"), -float("inf")])
        x = x.to(dtype)
        fast = weights._quantized_activation(x, 256)
        slow = weights._quantized_activation(x, 256, compiled=False)
        for a, b in zip(fast, slow, strict=True):  # bit for bit, NaN scales of poisoned groups included
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (seed, dtype, rows)
