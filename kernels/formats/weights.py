"""Quantized weights of the released checkpoint format, and the GEMMs that consume them (torch, with the
compiled CPU quantizer of cpu_formats.c for their activations where it builds).

FP8 weights are float8_e4m3fn [out, in] with one E8M0 scale per 32x32 block; FP4 expert weights are
E2M1 pairs [out, in/2] (float4_e2m1fn_x2 or uint8, even element in the low nibble) with one E8M0 scale
per 32 inputs. `fp8_linear` / `fp4_linear` reproduce the official reference's `linear()` (act_quant of the
input to FP8 with power-of-two scales per 32, then the block-scaled GEMM of its CPU port, kernel_cpu.py
`fp8_gemm` / `fp4_gemm`): one fp32 matmul per 32-wide K block, each partial scaled by the activation and
weight scales and added to an fp32 accumulator in K order, the sum cast to the output dtype. Knows
nothing of layers or models.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from kernels.formats import reference
from kernels.formats.api import quantize_fp8_ue8m0
from kernels.formats.reference import e2m1_values, e8m0_to_float, unpack_nibbles

# Weight and activation scales cover 32 values along K (and 32 rows of an FP8 weight).
WEIGHT_BLOCK = 32


def _e8m0_bytes(scale: torch.Tensor, name: str) -> torch.Tensor:
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise ValueError(f"{name} must be float8_e8m0fnu or uint8 exponent bytes, got {scale.dtype}")
    return scale.view(torch.uint8)


def _fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    if packed.dtype not in (torch.float4_e2m1fn_x2, torch.uint8):
        raise ValueError(f"FP4 weight must be float4_e2m1fn_x2 or uint8, got {packed.dtype}")
    return unpack_nibbles(packed.view(torch.uint8))


def _check_fp8_weight(weight: torch.Tensor, scale: torch.Tensor) -> None:
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"FP8 weight must be 2-D float8_e4m3fn, got {weight.dtype} {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    blocks = (-(-out_features // WEIGHT_BLOCK), -(-in_features // WEIGHT_BLOCK))
    if tuple(scale.shape) != blocks:
        raise ValueError(
            f"FP8 weight {tuple(weight.shape)} needs scale shape {blocks}, got {tuple(scale.shape)}"
        )


def _check_fp4_weight(packed: torch.Tensor, scale: torch.Tensor) -> None:
    if packed.dim() != 2:
        raise ValueError(f"FP4 weight must be 2-D [out, in/2], got shape {tuple(packed.shape)}")
    out_features, in_features = packed.shape[0], packed.shape[1] * 2
    if in_features % WEIGHT_BLOCK or tuple(scale.shape) != (out_features, in_features // WEIGHT_BLOCK):
        raise ValueError(
            f"FP4 weight {tuple(packed.shape)} (in={in_features}) needs scale shape "
            f"({out_features}, {in_features // WEIGHT_BLOCK}) and in % {WEIGHT_BLOCK} == 0, "
            f"got {tuple(scale.shape)}"
        )


def _weight_block_scales(scale: torch.Tensor, out_features: int) -> torch.Tensor:
    """E8M0 [ceil(out/32), ceil(in/32)] -> fp32 [out, ceil(in/32)], one row per output feature."""
    return e8m0_to_float(_e8m0_bytes(scale, "scale")).repeat_interleave(WEIGHT_BLOCK, dim=0)[:out_features]


def dequantize_fp8_block_weight(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Exact dequantization of an FP8 weight with 32x32 block scales.

    Args:
        weight: float8_e4m3fn [out, in].
        scale: float8_e8m0fnu or uint8 exponent bytes [ceil(out/32), ceil(in/32)].
        dtype: output dtype; the fp32 products are exact, bf16 is exact unless out of bf16 range.
    Returns:
        dtype [out, in].
    Raises:
        ValueError: wrong dtypes or a scale shape that does not match the weight.
    """
    _check_fp8_weight(weight, scale)
    out_features, in_features = weight.shape
    row_scales = _weight_block_scales(scale, out_features)
    per_value = row_scales.repeat_interleave(WEIGHT_BLOCK, dim=1)[:, :in_features]
    return (weight.float() * per_value).to(dtype)


def dequantize_fp4_weight(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Exact dequantization of an FP4 expert weight with one E8M0 scale per 32 inputs.

    Args:
        packed: float4_e2m1fn_x2 or uint8 [out, in/2], even element in the low nibble.
        scale: float8_e8m0fnu or uint8 exponent bytes [out, in/32].
        dtype: output dtype (products are exact in fp32 and bf16).
    Returns:
        dtype [out, in].
    Raises:
        ValueError: wrong dtypes or shapes.
    """
    _check_fp4_weight(packed, scale)
    values = e2m1_values(_fp4_codes(packed)).unflatten(-1, (-1, WEIGHT_BLOCK))
    scales = e8m0_to_float(_e8m0_bytes(scale, "scale")).unsqueeze(-1)
    return (values * scales).flatten(-2).to(dtype)


# The row count from which MKL's fp32 GEMM computes every row alike (model/invariant.py, which pads the
# model's other fp32 products the same way; its GEMM probe checks the 32-wide block shape).
GEMM_MIN_ROWS = 4


# Products of at most this many rows (decode steps, padded to GEMM_MIN_ROWS) run every K block's partial
# product in one batched matmul (`_block_partials_batched`) where its first-use probe agrees: the
# per-block loop's 2-32 small GEMM calls were most of a CPU decode step of an FP8 model (v41-tiny: 0.23 ms
# a linear, 2.5-3.5x more than the batched call). Past it the loop is cheaper (the [blocks, M, N]
# partials outgrow the caches).
BATCHED_BLOCKS_MAX_ROWS = 16
# ... and whose [blocks, rows, N] fp32 partials fit this many bytes: a full-size model's [7168 -> 7168]
# projection would take 100 MiB at 16 rows (v41-tiny's largest 0.5 MiB; measured up to 1 MiB, where the
# batched call was still 1.6x cheaper than the loop).
BATCHED_BLOCKS_MAX_BYTES = 2 << 20


def batched_blocks_fit(k: int, n: int) -> bool:
    """Whether the batched partials of weights [n, k] at BATCHED_BLOCKS_MAX_ROWS rows fit
    BATCHED_BLOCKS_MAX_BYTES (the size the path and its probe take at most)."""
    return (k // WEIGHT_BLOCK) * BATCHED_BLOCKS_MAX_ROWS * n * 4 <= BATCHED_BLOCKS_MAX_BYTES


def _block_partials_loop(a: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
    """K block `k`'s partial product a_k @ b_k^T, fp32 [M, N] (the reference's one matmul per block)."""
    block = slice(k * WEIGHT_BLOCK, (k + 1) * WEIGHT_BLOCK)
    return a[:, block] @ b[:, block].T


def _block_partials_batched(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Every K block's partial product at once: fp32 [K/32, M, N], slice k = `_block_partials_loop(a, b,
    k)` where `batched_blocks_agree` says so."""
    blocks = a.shape[1] // WEIGHT_BLOCK
    a_blocks = a.view(a.shape[0], blocks, WEIGHT_BLOCK).transpose(0, 1)  # [blocks, M, 32]
    b_blocks = b.view(b.shape[0], blocks, WEIGHT_BLOCK).permute(1, 2, 0)  # [blocks, 32, N]
    return torch.bmm(a_blocks, b_blocks)


def _fp8_grid_values(gen: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    """Random FP8 (e4m3) values over most of the format's range, as fp32: what the block products take."""
    magnitude = torch.exp2(torch.randint(-9, 9, (rows, cols), generator=gen).float())
    mantissa = 1 + torch.randint(0, 8, (rows, cols), generator=gen).float() / 8
    sign = torch.randint(0, 2, (rows, cols), generator=gen).float() * 2 - 1
    return (sign * magnitude * mantissa).to(torch.float8_e4m3fn).float()


@lru_cache(maxsize=256)
def batched_blocks_agree(k: int, n: int, threads: int) -> bool:
    """Whether, in this process (at `threads` intra-op threads), the batched partial products of weights
    [n, k] equal the per-block loop's bit for bit at every row count from GEMM_MIN_ROWS to
    BATCHED_BLOCKS_MAX_ROWS: checked once per shape on random FP8 values (the loop's small GEMMs and the
    batched call may pick different kernels, which need not sum a block's 32 products alike)."""
    gen = torch.Generator().manual_seed(20261207 + 7919 * k + n)
    b = _fp8_grid_values(gen, n, k)
    with torch.inference_mode():
        for m in range(GEMM_MIN_ROWS, BATCHED_BLOCKS_MAX_ROWS + 1):
            a = _fp8_grid_values(gen, m, k)
            batched = _block_partials_batched(a, b)
            for block in range(k // WEIGHT_BLOCK):
                if not torch.equal(batched[block], _block_partials_loop(a, b, block)):
                    return False
    return True


def _block_scaled_matmul(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, *, batched: bool = True
) -> torch.Tensor:
    """sum over K blocks k of (a_k @ b_k^T) * a_scale[:, k] * b_scale[:, k], fp32, in K order.

    a fp32 [M, K] (FP8 values), a_scale fp32 [M, K/32], b fp32 [N, K] (FP8 or E2M1 values),
    b_scale fp32 [N, K/32] -> fp32 [M, N]. Same operations, in the same order, as the reference port.
    `batched=False` always takes the per-block loop (the slow twin tests compare).
    """
    m = a.shape[0]
    if 0 < m < GEMM_MIN_ROWS:
        # MKL runs products of 1, 2 and 3 rows with kernels of their own, whose sums differ from a stacked
        # row's now and then (an FP8 block's 32 products are not always exact in fp32: on an AMD EPYC Zen 4,
        # 283 of 16000 one-row blocks differed): a few rows run inside a 4-row product, so a row's sums do
        # not depend on how many rows share the call (lone decode = batched decode, chunked = one-shot).
        a = torch.cat([a, a.new_zeros(GEMM_MIN_ROWS - m, a.shape[1])])
        a_scale = torch.cat([a_scale, a_scale.new_zeros(GEMM_MIN_ROWS - m, a_scale.shape[1])])
    rows, blocks = a.shape[0], a.shape[1] // WEIGHT_BLOCK
    acc = torch.zeros(rows, b.shape[0], dtype=torch.float32, device=a.device)
    if (
        batched
        and rows <= BATCHED_BLOCKS_MAX_ROWS
        and batched_blocks_fit(a.shape[1], b.shape[0])
        and a.device.type == "cpu"
        and a.is_contiguous()
        and b.is_contiguous()
        and batched_blocks_agree(a.shape[1], b.shape[0], torch.get_num_threads())
    ):
        # the same elementwise products as the loop's, all blocks at once; the sum stays in K order
        scaled = _block_partials_batched(a, b) * a_scale.T.unsqueeze(-1) * b_scale.T.unsqueeze(1)
        for k in range(blocks):
            acc += scaled[k]
        return acc[:m]
    for k in range(blocks):
        partial = _block_partials_loop(a, b, k)  # [M, N]
        acc += partial * a_scale[:, k : k + 1] * b_scale[:, k].unsqueeze(0)
    return acc[:m]


def _quantized_activation(
    x: torch.Tensor, in_features: int, *, compiled: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 [..., in] -> (FP8 values as fp32 [M, in], fp32 power-of-two scales [M, in/32]).

    `quantize_fp8_ue8m0`, which runs the compiled quantizer (cpu_formats.c, one pass per group) on CPU
    where it builds: the torch reference's values and scale bytes bit for bit (tests/kernels compare
    them), where the reference's twenty-odd small torch ops per call were about a third of a CPU decode
    step of an FP8 model (v41-tiny). `compiled=False` always takes the reference (the slow twin).
    """
    if x.shape[-1] != in_features or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x must be bf16/fp32 [..., {in_features}], got {x.dtype} {tuple(x.shape)}")
    rows = x.reshape(-1, in_features)
    quantize = quantize_fp8_ue8m0 if compiled else reference.quantize_fp8_ue8m0
    values, exponent_bytes = quantize(rows, WEIGHT_BLOCK)
    return values.float(), e8m0_to_float(exponent_bytes)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The reference's `linear()` for an FP8 weight: y = act_quant(x) @ dequant(weight)^T.

    Args:
        x: bf16 [..., in] (fp32 is accepted and quantized directly); in % 32 == 0.
        weight: float8_e4m3fn [out, in].
        scale: float8_e8m0fnu or uint8 [ceil(out/32), ceil(in/32)].
        out_dtype: defaults to torch's default dtype, as in the reference (bf16 in the model).
    Returns:
        out_dtype [..., out].
    Raises:
        ValueError: mismatched shapes or dtypes.
    """
    _check_fp8_weight(weight, scale)
    out_features, in_features = weight.shape
    if in_features % WEIGHT_BLOCK:
        raise ValueError(f"FP8 linear needs in_features % {WEIGHT_BLOCK} == 0, got {in_features}")
    a, a_scale = _quantized_activation(x, in_features)
    acc = _block_scaled_matmul(a, a_scale, weight.float(), _weight_block_scales(scale, out_features))
    return acc.to(out_dtype or torch.get_default_dtype()).view(*x.shape[:-1], out_features)


def fp4_linear(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The reference's `linear()` for an FP4 expert weight: y = act_quant(x) @ dequant(packed)^T.

    Args:
        x: bf16 [..., in] (fp32 is accepted and quantized directly).
        packed: float4_e2m1fn_x2 or uint8 [out, in/2].
        scale: float8_e8m0fnu or uint8 [out, in/32].
        out_dtype: defaults to torch's default dtype, as in the reference (bf16 in the model).
    Returns:
        out_dtype [..., out].
    Raises:
        ValueError: mismatched shapes or dtypes.
    """
    _check_fp4_weight(packed, scale)
    out_features, in_features = packed.shape[0], packed.shape[1] * 2
    a, a_scale = _quantized_activation(x, in_features)
    b = e2m1_values(_fp4_codes(packed))
    b_scale = e8m0_to_float(_e8m0_bytes(scale, "scale"))
    acc = _block_scaled_matmul(a, a_scale, b, b_scale)
    return acc.to(out_dtype or torch.get_default_dtype()).view(*x.shape[:-1], out_features)


LINEAR_MATH = ("exact", "fast")


@dataclass(frozen=True, kw_only=True)
class PreparedWeight:
    """A quantized weight decoded once for `prepared_linear`: what `fp8_linear` / `fp4_linear` rebuild from
    the stored codes on every call.

    Attributes:
        values: fp32 [out, in] element values (E4M3 or E2M1), unscaled.
        scales: fp32 [out, in/32] the weight scale of each (row, 32-wide K block).
        folded: fp32 [out, in] values * scales (exact: a power of two times a short mantissa), for the
            `fast` math only; None when not built.
    """

    values: torch.Tensor
    scales: torch.Tensor
    folded: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held (the cache's cost: 4 or 8 per weight, against 1 for FP8 and 0.5 for FP4 codes)."""
        tensors = [self.values, self.scales] + ([self.folded] if self.folded is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def _fold(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (values.unflatten(-1, (-1, WEIGHT_BLOCK)) * scales.unsqueeze(-1)).flatten(-2)


def prepare_fp8_weight(weight: torch.Tensor, scale: torch.Tensor, *, fold: bool = False) -> PreparedWeight:
    """Decode an FP8 weight [out, in] e4m3 with 32x32 E8M0 block scales once (see `PreparedWeight`).

    Raises:
        ValueError: wrong dtypes or shapes, or in % 32 != 0.
    """
    _check_fp8_weight(weight, scale)
    out_features, in_features = weight.shape
    if in_features % WEIGHT_BLOCK:
        raise ValueError(f"FP8 linear needs in_features % {WEIGHT_BLOCK} == 0, got {in_features}")
    values, scales = weight.float(), _weight_block_scales(scale, out_features)
    return PreparedWeight(values=values, scales=scales, folded=_fold(values, scales) if fold else None)


def prepare_fp4_weight(packed: torch.Tensor, scale: torch.Tensor, *, fold: bool = False) -> PreparedWeight:
    """Decode an FP4 expert weight [out, in/2] with per-32 E8M0 scales once (see `PreparedWeight`).

    Raises:
        ValueError: wrong dtypes or shapes.
    """
    _check_fp4_weight(packed, scale)
    values = e2m1_values(_fp4_codes(packed))
    scales = e8m0_to_float(_e8m0_bytes(scale, "scale"))
    return PreparedWeight(values=values, scales=scales, folded=_fold(values, scales) if fold else None)


def prepared_linear(
    x: torch.Tensor, weight: PreparedWeight, out_dtype: torch.dtype | None = None, *, math: str = "exact"
) -> torch.Tensor:
    """`fp8_linear` / `fp4_linear` on a prepared weight.

    Args:
        x: bf16 [..., in] (fp32 is accepted and quantized directly).
        weight: from `prepare_fp8_weight` / `prepare_fp4_weight` (with fold=True for math="fast").
        out_dtype: defaults to torch's default dtype.
        math: "exact": the reference's block-scaled GEMM (one fp32 matmul per 32-wide K block, scaled
            partials summed in K order), bitwise equal to `fp8_linear` / `fp4_linear` on the stored
            weight. "fast": the exactly dequantized activation times the folded weight in one fp32 GEMM;
            the same real product, summed in the GEMM's order instead (not bitwise; its drift is measured
            in kernels/README.md).

    Returns:
        out_dtype [..., out].

    Raises:
        ValueError: an unknown math, math="fast" on a weight prepared without folding, or x of the wrong
            shape or dtype.
    """
    if math not in LINEAR_MATH:
        raise ValueError(f"math must be one of {LINEAR_MATH}, got {math!r}")
    out_features, in_features = weight.values.shape
    a, a_scale = _quantized_activation(x, in_features)
    if math == "exact":
        acc = _block_scaled_matmul(a, a_scale, weight.values, weight.scales)
    else:
        if weight.folded is None:
            raise ValueError('math="fast" needs a weight prepared with fold=True')
        acc = _fold(a, a_scale) @ weight.folded.T  # [M, out]
    return acc.to(out_dtype or torch.get_default_dtype()).view(*x.shape[:-1], out_features)
