"""The compiled CPU path of the sparse attention (cpu_sparse_attn.c): the reference's block loop with its
two products compiled, the indexed KV rows read where they lie instead of gathered, converted and masked
as tensors first; every other op of the loop (the running max, the exponentials, the sums, the bf16
rounding of the probabilities, the final division) is the reference's own torch op on the same shapes.

Its slow twin is `reference.sparse_attn_reference`: `sparse_attn_compiled` equals it bit for bit (NaN
payloads aside) wherever it runs. The products' orders are fixed in the C file (a fused chain per output in
index order, what MKL's strict CNR mode computes on an Intel Xeon, or for the scores the lanes of MKL's AVX2
kernels on an AMD EPYC VM); whether this process's torch sums one of those ways is not
assumed but probed at first use per shape (`takes`): the two products bit for bit against the reference's
expressions for them, then the whole loop on wide-range inputs with subnormal and overflowing products and
masked ids, from a fixed seed (every process of a machine decides alike). Where neither order is torch's
(the portable profile's MKL kernels on an Intel Xeon; on the AMD EPYC VMs one head, and four heads at
most blocks of fewer than 16 ids; a torch built without MKL), or the library does not build,
`sparse_attn_compiled` returns None and callers keep the reference's ops.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable, Iterable, Sequence
from functools import cache
from pathlib import Path

import torch

from kernels.native import load_functions
from kernels.sparse_attn.reference import RUNNING_MAX_INIT, SPARSE_ATTN_BLOCK, sparse_attn_reference

__all__ = ["prepare", "sparse_attn_compiled", "takes"]

_SOURCE = Path(__file__).with_name("cpu_sparse_attn.c")
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
# the C file's stack buffers: a row's query (H x D floats) and a block's transposed keys (D vectors)
_MAX_WIDTH = 1024
_COMMON = [_P, _I64, _I64, _I64, _I64, _INT, _INT, _I64]  # ids, ids_stride, rows, per batch, n_kv, H, D, blk


@cache
def _library() -> ctypes.CDLL | None:
    return load_functions(
        _SOURCE,
        {
            "sparse_scores": ([_P, _P, *_COMMON, ctypes.c_float, _INT, _P], _I64),
            "sparse_accumulate": ([_P, _P, _P, *_COMMON, _INT, _P], _I64),
        },
    )


# The products' orders the C file knows (its ORDER_*), in the order the probe tries them: fused chains (MKL's
# strict mode on an Intel Xeon), and MKL's AVX2 kernels at two heads on an AMD EPYC VM (products rounded
# before they are added, the scores in lanes; session 43).
ORDER_CHAIN, ORDER_LANES = 0, 1
_ORDERS = (ORDER_CHAIN, ORDER_LANES)


def _shape_covered(heads: int, head_dim: int) -> bool:
    return head_dim % 8 == 0 and 0 < head_dim <= _MAX_WIDTH and 0 < heads * head_dim <= _MAX_WIDTH


def _wide(g: torch.Generator, *shape: int, low: int, high: int) -> torch.Tensor:
    """bf16 values of random sign with exponents in [low, high]: products that underflow fp32's normal
    range (they tell a fused chain from rounded products) and overflow it, beside ordinary ones."""
    exponent = torch.randint(low, high + 1, shape, generator=g).float()
    sign = torch.randint(0, 2, shape, generator=g).float() * 2 - 1
    return (sign * torch.exp2(exponent) * (1 + torch.rand(shape, generator=g))).bfloat16()


# The probe's seed: fixed, so that every process on one machine and profile decides alike. A decision that
# changed between processes would give a session other bits after a restart than before it.
_PROBE_SEED = 20261207

# Rows of the products' check: MKL may pick its kernel by the batch's size (under the portable profile on an
# Intel Xeon with AVX-512 these products match the C order up to 100 rows and not from 128 on), so one size
# cannot vouch for the others; under the strict profile there no row count changed a bit (session 42).
_PRODUCT_ROWS = (1, 64, 300)

# The products' check's values, (q's exponents, kv's exponents, p's exponents): ordinary ones, where the
# order of the adds shows; and ones whose products fall below fp32's normal range (scores of tiny queries on
# tiny keys, probabilities over 2^-14..1 times values near bf16's least), where a fused multiply-add and a
# rounded product then an add differ. Session 43 found MKL rounding the products first on the AMD EPYC VM,
# which the ordinary values and the end-to-end cases alone had let through.
_PRODUCT_VALUES = (
    ((-4, 4), (-4, 4), (-4, 0)),
    ((-76, -62), (-76, -62), None),
    (None, (-133, -120), (-14, 0)),
)

# The end-to-end cases, (rows, (q's exponents, kv's exponents)): ordinary values; score products below fp32's
# normal range; huge queries on tiny values, so that probabilities spread over 2^-14..1 multiply values near
# bf16's least and the products underflow (they tell a fused accumulation from rounded products);
# overflowing scores.
_ORDINARY = ((-4, 4), (-4, 4))
_PROBE_CASES = (
    (64, _ORDINARY),
    (64, ((-70, -55), (-70, -55))),
    (64, ((120, 126), (-133, -120))),
    (64, ((-20, 60), (-20, 60))),
)


def _products_agree(
    g: torch.Generator,
    heads: int,
    head_dim: int,
    width: int,
    order: int,
    rows_checked: Sequence[int] = _PRODUCT_ROWS,
) -> bool:
    """Whether the C file's two products in `order` give every fp32 bit of the reference's expressions for
    them (the same torch ops on the same shapes), on `_PRODUCT_VALUES` at each of `rows_checked` rows (the
    probe: `_PRODUCT_ROWS`) over 96 KV rows.

    The products are where the order lives, and compared before the exponentials and the bf16 rounding an
    order that differs shows in most of their outputs: on an AMD EPYC VM (session 43), where MKL sums the
    scores in another order than ORDER_CHAIN under both profiles, about 70% of the scores differed from it,
    while the attention's bf16 outputs differed in none of 64 rows in 4 draws of 5. A probe of the outputs
    alone let that order through in about one process in five.
    """
    lib = _library()
    assert lib is not None
    n_kv = 96
    scale = head_dim**-0.5
    for rows, (q_exp, kv_exp, p_exp) in itertools.product(rows_checked, _PRODUCT_VALUES):
        q = _wide(g, 1, rows, heads, head_dim, low=q_exp[0], high=q_exp[1]) if q_exp else None
        kv = _wide(g, 1, n_kv, head_dim, low=kv_exp[0], high=kv_exp[1])
        ids = torch.randint(-1, n_kv, (1, rows, width), generator=g, dtype=torch.int32)
        valid = ids.long() != -1
        # as the reference: a masked slot gathers row 0 and is zeroed by the multiply
        kv_blk = kv[0, ids.long().clamp_min(0)].float() * valid.unsqueeze(-1)  # [1, rows, width, D]
        shape = (width, rows, rows, n_kv, heads, head_dim, width)
        if q is not None:
            scores = torch.einsum("bmhd,bmkd->bmhk", q.float(), kv_blk)
            want = torch.where(valid.unsqueeze(2), scores, -torch.inf) * torch.tensor(scale)
            got = torch.empty(1, rows, heads, width)
            if lib.sparse_scores(q.data_ptr(), kv.data_ptr(), ids.data_ptr(), *shape, scale, order,
                                 got.data_ptr()):  # fmt: skip
                return False
            if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
                return False
        if p_exp is not None:
            # probabilities as the loop rounds them (a masked slot's is +0), rescales in (0, 1]
            p = _wide(g, 1, rows, heads, width, low=p_exp[0], high=p_exp[1]).abs() * valid.unsqueeze(2)
            rescale = torch.rand(1, rows, heads, generator=g)
            # of the values' magnitude, so that tiny products are not lost beside it
            acc = torch.randn(1, rows, heads, head_dim, generator=g) * 2.0 ** kv_exp[1]
            want = acc * rescale.unsqueeze(-1) + torch.einsum("bmhk,bmkd->bmhd", p.float(), kv_blk)
            got = acc.clone()
            if lib.sparse_accumulate(p.data_ptr(), rescale.data_ptr(), kv.data_ptr(), ids.data_ptr(), *shape,
                                     order, got.data_ptr()):  # fmt: skip
                return False
            if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
                return False
    return True


def _probe(heads: int, head_dim: int, width: int, order: int) -> bool:
    """Whether the compiled loop, its products in `order`, equals the reference on this shape here: its two
    products bit for bit (`_products_agree`), then the whole attention on `_PROBE_CASES` over 96 KV rows,
    `width` ids a row (one block) with masked ones."""
    g = torch.Generator().manual_seed(_PROBE_SEED)
    if not _products_agree(g, heads, head_dim, width, order):
        return False
    n_kv = 96
    for rows, ((q_low, q_high), (kv_low, kv_high)) in _PROBE_CASES:
        q = _wide(g, 1, rows, heads, head_dim, low=q_low, high=q_high)
        kv = _wide(g, 1, n_kv, head_dim, low=kv_low, high=kv_high)
        ids = torch.randint(-1, n_kv, (1, rows, width), generator=g, dtype=torch.int32)
        sink = torch.randn(heads, generator=g)
        want = sparse_attn_reference(q, kv, sink, ids, head_dim**-0.5)
        got = _compiled(q, kv, sink, ids, head_dim**-0.5, torch.exp, lambda blk: order)
        if got is None or not torch.equal(got.isnan(), want.isnan()):
            return False
        finite = ~want.isnan()
        if not torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16)):
            return False
    return True


@cache
def _takes_block(heads: int, head_dim: int, block: int) -> int | None:
    """The products' order that gives the reference's bits for blocks of `block` ids, or None (neither)."""
    with torch.inference_mode():
        return next((order for order in _ORDERS if _probe(heads, head_dim, block, order)), None)


def takes(heads: int, head_dim: int, width: int) -> bool:
    """Whether `sparse_attn_compiled` runs for H heads of D dims over `width` ids a row: the library
    builds, the shape is covered, and the probe found every bit of the reference for each block width the
    loop takes (checked once a block width, head shape and process: MKL's order may change with the
    width)."""
    if not _shape_covered(heads, head_dim) or width <= 0 or _library() is None:
        return False
    widths = {min(SPARSE_ATTN_BLOCK, width - s) for s in range(0, width, SPARSE_ATTN_BLOCK)}
    return all(_takes_block(heads, head_dim, w) is not None for w in sorted(widths))


def prepare(heads: int, head_dim: int, widths: Iterable[int]) -> bool:
    """Probe these widths of ids a row for this head shape now (a model's: its window, and its window plus
    its selection), so that no served pass pays a probe (about 17 ms a width on the 2-core VMs) in the
    middle of serving; whether the compiled loop runs for all of them."""
    return all([takes(heads, head_dim, w) for w in widths])  # a list: every width probed, none skipped


def _check(code: int, ids: torch.Tensor, n_kv: int) -> None:
    if code:
        flat = ids.reshape(-1, ids.size(-1))
        row, col = divmod(code - 1, flat.size(-1))
        raise IndexError(f"sparse attention id {int(flat[row, col])} out of range [-1, {n_kv}) "
                         f"(row {row}, slot {col})")  # fmt: skip


def _compiled(
    q: torch.Tensor,
    kv: torch.Tensor,
    attn_sink: torch.Tensor,
    topk_idxs: torch.Tensor,
    softmax_scale: float,
    exp: Callable[[torch.Tensor], torch.Tensor],
    order_of: Callable[[int], int | None],
) -> torch.Tensor | None:
    """The loop, each block's products in the order `order_of(block width)` gives (never None here)."""
    lib = _library()
    if lib is None:
        return None
    b, t, h, d = q.shape
    n_kv, k = kv.size(1), topk_idxs.size(-1)
    rows = b * t
    qc, kvc = q.contiguous(), kv.contiguous()
    ids = topk_idxs.to(torch.int32).contiguous()
    device = q.device
    acc_o = torch.zeros(b, t, h, d, dtype=torch.float32, device=device)
    sum_exp = torch.zeros(b, t, h, dtype=torch.float32, device=device)
    running_max = torch.full((b, t, h), RUNNING_MAX_INIT, dtype=torch.float32, device=device)
    for start in range(0, k, SPARSE_ATTN_BLOCK):
        blk = min(SPARSE_ATTN_BLOCK, k - start)
        at = ids.data_ptr() + start * ids.element_size()
        shape = (k, rows, t, n_kv, h, d, blk)  # ids_stride, rows, rows_per_batch, n_kv, H, D, blk
        order = order_of(blk)
        scores = torch.empty(b, t, h, blk, dtype=torch.float32, device=device)
        _check(lib.sparse_scores(qc.data_ptr(), kvc.data_ptr(), at, *shape, softmax_scale, order,
                                 scores.data_ptr()), ids, n_kv)  # fmt: skip
        # the reference's ops from here to the products, on the same shapes
        prev_max = running_max
        running_max = torch.maximum(prev_max, scores.amax(dim=-1))
        rescale = exp(prev_max - running_max)
        p = exp(scores - running_max.unsqueeze(-1))
        sum_exp = sum_exp * rescale + p.sum(dim=-1)
        p_bf16 = p.to(torch.bfloat16).contiguous()
        rescale = rescale.contiguous()
        _check(lib.sparse_accumulate(p_bf16.data_ptr(), rescale.data_ptr(), kvc.data_ptr(), at, *shape,
                                     order, acc_o.data_ptr()), ids, n_kv)  # fmt: skip
    sum_exp = sum_exp + exp(attn_sink.float() - running_max)
    return (acc_o / sum_exp.unsqueeze(-1)).to(torch.bfloat16)


def sparse_attn_compiled(
    q: torch.Tensor,
    kv: torch.Tensor,
    attn_sink: torch.Tensor,
    topk_idxs: torch.Tensor,
    softmax_scale: float,
    exp: Callable[[torch.Tensor], torch.Tensor] = torch.exp,
) -> torch.Tensor | None:
    """`sparse_attn_reference(q, kv, attn_sink, topk_idxs, softmax_scale)` bit for bit (NaN payloads
    aside), its exponentials taken by `exp` (the reference's `torch.exp`, or a row-apart variant, applied
    to the same tensors), or None where the compiled loop does not run (`takes`): the caller then runs the
    reference's ops.

    q [B, T, H, D] bf16, kv [B, N, D] bf16, attn_sink [H] fp32, topk_idxs [B, T, K] int ids in [-1, N), all
    CPU (the caller validates shapes and dtypes).

    Raises:
        IndexError: an id outside [-1, N), as the reference's gather raises (nothing read past kv).
    """
    if q.device.type != "cpu" or kv.device.type != "cpu" or topk_idxs.size(-1) == 0:
        return None
    if torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad):
        return None
    heads, head_dim = q.size(2), q.size(3)
    if not takes(heads, head_dim, topk_idxs.size(-1)):
        return None
    return _compiled(q, kv, attn_sink, topk_idxs, softmax_scale, exp,
                     lambda blk: _takes_block(heads, head_dim, blk))  # fmt: skip
