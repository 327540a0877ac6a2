"""sparse_attn: the torch reference against a loop twin and an fp64 dense softmax; Triton on CUDA."""

from __future__ import annotations

import pytest
import torch

from kernels import sparse_attn

BLOCK = 64
# (B, T, H, D, N, K): K > 64 spans several softmax blocks; T = 1 is a decode step; odd sizes on purpose.
SHAPES = {
    "decode-T1-H4-K32": (1, 1, 4, 128, 40, 32),
    "T63-H8-K130": (2, 63, 8, 128, 200, 130),
    "T5-H6-D64-K64": (1, 5, 6, 64, 70, 64),
    "T7-H4-K1": (1, 7, 4, 128, 9, 1),
    "T3-N1000-K200": (1, 3, 4, 128, 1000, 200),
}


def make_inputs(
    b: int, t: int, h: int, d: int, n: int, k: int, *, seed: int, device: str = "cpu"
) -> tuple[torch.Tensor, ...]:
    """Random bf16 q/kv, fp32 sinks and index rows with -1 holes, one all -1 row and one duplicate id."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, d, generator=g).bfloat16()
    kv = torch.randn(b, n, d, generator=g).bfloat16()
    sink = torch.randn(h, generator=g)
    idx = torch.randint(0, n, (b, t, k), generator=g, dtype=torch.int32)
    idx[torch.rand(b, t, k, generator=g) < 0.2] = -1
    idx[0, t // 2] = -1
    if k >= 2:
        idx[-1, -1, 1] = idx[-1, -1, 0]
    return tuple(x.to(device) for x in (q, kv, sink, idx))


def sparse_attn_naive(
    q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float
) -> torch.Tensor:
    """Loop twin: one (row, head) at a time, online softmax over blocks of 64, p rounded to bf16 for P·V."""
    b, t, h, d = q.shape
    out = torch.zeros(b, t, h, d)
    for bi in range(b):
        for ti in range(t):
            ids = idx[bi, ti].tolist()
            for hi in range(h):
                qv = q[bi, ti, hi].float()
                m = torch.tensor(-1e30)
                denom = torch.tensor(0.0)
                acc = torch.zeros(d)
                for start in range(0, len(ids), BLOCK):
                    valid = [j for j in ids[start : start + BLOCK] if j != -1]
                    if not valid:
                        continue
                    rows = kv[bi, valid].float()
                    s = (rows @ qv) * scale
                    new_m = torch.maximum(m, s.max())
                    alpha = torch.exp(m - new_m)
                    p = torch.exp(s - new_m)
                    denom = denom * alpha + p.sum()
                    acc = acc * alpha + p.bfloat16().float() @ rows
                    m = new_m
                denom = denom + torch.exp(sink[hi] - m)
                out[bi, ti, hi] = acc / denom
    return out.bfloat16()


def sparse_attn_dense_fp64(
    q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float
) -> torch.Tensor:
    """The exact math in fp64: softmax over the listed rows (duplicates count twice) plus a sink logit."""
    b, t, h, d = q.shape
    valid = idx != -1  # [B, T, K]
    rows = kv.double()[torch.arange(b).view(b, 1, 1), idx.long().clamp_min(0)]  # [B, T, K, D]
    s = torch.einsum("bthd,btkd->bthk", q.double(), rows) * scale
    s = s.masked_fill(~valid.unsqueeze(2), -torch.inf)
    m = torch.maximum(s.amax(-1), sink.double().view(1, 1, h)).unsqueeze(-1)
    p = torch.exp(s - m)
    denom = p.sum(-1) + torch.exp(sink.double().view(1, 1, h) - m.squeeze(-1))
    return torch.einsum("bthk,btkd->bthd", p, rows) / denom.unsqueeze(-1)


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, *, rel_l2: float, max_abs: float) -> None:
    diff = (got.double() - want.double()).abs()
    err = (diff.norm() / want.double().norm().clamp_min(1e-30)).item()
    worst = diff.max().item() if diff.numel() else 0.0
    assert err <= rel_l2 and worst <= max_abs, f"{name}: relative L2 {err:.3e}, max |diff| {worst:.3e}"


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_sparse_attn_torch_matches_loop_twin(shape: tuple[int, ...]) -> None:
    q, kv, sink, idx = make_inputs(*shape, seed=1)
    scale = q.size(-1) ** -0.5
    got = sparse_attn(q, kv, sink, idx, scale)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    want = sparse_attn_naive(q, kv, sink, idx, scale)
    # same rounding points, different fp32 summation order: at most a rare bf16 ulp apart
    assert_close("torch vs loop twin", got, want, rel_l2=2e-3, max_abs=1.6e-2)
    assert (got == want).float().mean().item() > 0.98


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_sparse_attn_torch_matches_dense_fp64(shape: tuple[int, ...]) -> None:
    q, kv, sink, idx = make_inputs(*shape, seed=2)
    scale = q.size(-1) ** -0.5
    got = sparse_attn(q, kv, sink, idx, scale)
    # bf16 probabilities and a bf16 output bound the distance from the exact math
    want = sparse_attn_dense_fp64(q, kv, sink, idx, scale)
    assert_close("torch vs fp64", got, want, rel_l2=1e-2, max_abs=5e-2)


def test_sparse_attn_rows_without_entries_are_zero() -> None:
    q, kv, sink, idx = make_inputs(1, 4, 4, 128, 20, 70, seed=3)
    idx[0, 1] = -1
    out = sparse_attn(q, kv, sink, idx, 0.1)
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))
    assert out[0, 0].abs().sum() > 0
    empty = sparse_attn(q, kv, sink, idx[:, :, :0], 0.1)
    assert torch.equal(empty, torch.zeros_like(empty))


def test_sparse_attn_sink_weighs_only_the_denominator() -> None:
    q, kv, sink, idx = make_inputs(1, 3, 4, 128, 30, 16, seed=4)
    idx[:] = torch.arange(16, dtype=torch.int32)
    scale = 128**-0.5
    no_sink = sparse_attn(q, kv, torch.full((4,), -torch.inf), idx, scale).double()
    # a -inf sink is plain softmax: a convex mix of the rows
    plain = torch.softmax(torch.einsum("bthd,bkd->bthk", q.double(), kv[:, :16].double()) * scale, -1)
    assert_close("sink=-inf", no_sink, plain @ kv[0, :16].double(), rel_l2=1e-2, max_abs=5e-2)
    # a sink equal to log(sum exp(s)) halves the output exactly in exact math
    s = torch.einsum("bthd,bkd->bthk", q.float(), kv[:, :16].float()) * scale
    half = sparse_attn(q[:, :1], kv, torch.logsumexp(s[0, 0], -1), idx[:, :1], scale).double()
    assert_close("sink=logsumexp", half, no_sink[:, :1] / 2, rel_l2=1e-2, max_abs=5e-2)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("h,k", [(2, 32), (4, 33), (3, 65), (64, 130), (4, 1)], ids=str)
def test_sparse_attn_rowwise_equals_each_row_alone(threads: int, h: int, k: int) -> None:
    """rowwise=True: each batch row bit for bit the call on that row alone (a batched decode stacks
    independent sequences), also for rows whose exponentials run past torch's per-thread split."""
    prior = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        b = 40 if h < 64 else 12
        q, kv, sink, idx = make_inputs(b, 1, h, 64, 90, k, seed=k + h)
        scale = 64**-0.5
        out = torch.full(q.shape, torch.nan, dtype=torch.bfloat16)
        out[:] = sparse_attn(q, kv, sink, idx, scale, rowwise=True)
        for i in range(b):
            one = slice(i, i + 1)
            alone = sparse_attn(q[one], kv[one], sink, idx[one], scale)
            assert torch.equal(out[one].view(torch.int16), alone.view(torch.int16)), f"row {i}"
        assert torch.equal(sparse_attn(q[:1], kv[:1], sink, idx[:1], scale, rowwise=True),
                           sparse_attn(q[:1], kv[:1], sink, idx[:1], scale))  # fmt: skip
    finally:
        torch.set_num_threads(prior)


def test_exp_alone_equals_exp_of_each_row() -> None:
    from kernels.sparse_attn.reference import exp_alone

    g = torch.Generator().manual_seed(7)
    for shape in [(5, 3), (9, 1, 2, 33), (3, 20000), (1, 7)]:
        x = torch.randn(*shape, generator=g) * 20
        got = exp_alone(x)
        assert got.shape == x.shape
        for i in range(shape[0]):
            assert torch.equal(got[i : i + 1], torch.exp(x[i : i + 1].contiguous()))


def test_sparse_attn_rejects_bad_inputs() -> None:
    q, kv, sink, idx = make_inputs(1, 2, 4, 128, 10, 8, seed=5)
    with pytest.raises(ValueError, match="backend"):
        sparse_attn(q, kv, sink, idx, 0.1, backend="cuda")
    with pytest.raises(ValueError, match="kv must be"):
        sparse_attn(q, kv[..., :64], sink, idx, 0.1)
    with pytest.raises(ValueError, match="attn_sink"):
        sparse_attn(q, kv, sink[:3], idx, 0.1)
    with pytest.raises(ValueError, match="int32 or int64"):
        sparse_attn(q, kv, sink, idx.float(), 0.1)
    with pytest.raises(ValueError, match="bf16"):
        sparse_attn(q.float(), kv, sink, idx, 0.1)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [*SHAPES.values(), (2, 257, 64, 512, 3000, 640), (1, 33, 8, 128, 500, 544)],
    ids=[*SHAPES.keys(), "released-H64-D512-K640", "T33-K544"],
)
def test_sparse_attn_triton_matches_torch_on_cuda(shape: tuple[int, ...]) -> None:
    from kernels.sparse_attn.triton import sparse_attn_triton

    q, kv, sink, idx = make_inputs(*shape, seed=6)
    scale = q.size(-1) ** -0.5
    want = sparse_attn(q, kv, sink, idx, scale)
    dev = [x.cuda() for x in (q, kv, sink, idx)]
    out = torch.full(q.shape, torch.nan, dtype=torch.bfloat16, device="cuda")
    got = sparse_attn_triton(*dev, scale, out=out).cpu()
    assert not got.isnan().any()
    # exp and summation order differ: rare one-ulp flips, up to 2^-7 of an output value
    one_ulp = 2.0**-7 * want.abs().max().item()
    assert_close("triton(cuda) vs torch(cpu)", got, want, rel_l2=1e-3, max_abs=one_ulp)
    via_api = sparse_attn(*dev, scale, backend="triton").cpu()
    assert torch.equal(via_api, got)
