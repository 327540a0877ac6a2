"""Mixture of experts: sqrt-softplus gate with bias-corrected top-k, routed SwiGLU experts and one shared
expert.

Knows nothing of attention or the residual stream. Follows the official V4.1 `Gate` / `Expert` / `MoE`
op for op: the bias only picks experts, weights come from the raw scores (normalized with +1e-20, times
route_scale), each routed expert multiplies its fp32 SwiGLU by its weight before the down projection,
and routed outputs are summed in fp32 in expert order before the shared expert is added.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.invariant import fp32_linear, rows_apart, rowwise_linear
from model.linear import Linear


class Gate(nn.Module):
    """Router. weight [E, dim] bf16, bias [E] fp32 (selection only)."""

    def __init__(
        self,
        dim: int,
        n_experts: int,
        topk: int,
        score_func: str,
        gate_temp: float,
        norm_topk_prob: bool,
        route_scale: float,
    ):
        super().__init__()
        if score_func not in ("softmax", "sigmoid", "sqrtsoftplus"):
            raise ValueError(f"score_func must be softmax, sigmoid or sqrtsoftplus, got {score_func!r}")
        self.topk = topk
        self.score_func = score_func
        self.gate_temp = gate_temp
        self.norm_topk_prob = norm_topk_prob
        self.route_scale = route_scale
        self.weight = nn.Parameter(torch.zeros(n_experts, dim, dtype=torch.bfloat16))
        self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, *, rowwise: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, dim] bf16 -> weights [N, topk] fp32, expert ids [N, topk] int64.

        rowwise: score each row as a one-row pass would (a batched decode of many sequences).
        """
        linear = rowwise_linear if rowwise else fp32_linear
        scores = linear(x.float(), self.weight.float()) / self.gate_temp  # [N, E]
        if rowwise:
            # Each row a contiguous run of its own, as in a one-row pass: the score functions are
            # elementwise and transcendental (softplus, sigmoid), and torch computes a run's part past its
            # last full SIMD block with the scalar function, one bit apart; a lone row of 8 experts is all
            # remainder, the same row inside [N, 8] is not (seen: one gate weight, then the whole decode).
            scores = rows_apart(scores)
        if self.score_func == "softmax":
            scores = scores.softmax(dim=-1)
        elif self.score_func == "sigmoid":
            scores = scores.sigmoid()
        else:
            scores = F.softplus(scores).sqrt()
        indices = (scores + self.bias).topk(self.topk, dim=-1)[1]
        weights = scores.gather(1, indices)
        if self.norm_topk_prob and self.topk > 1:
            # +1e-20, not norm_eps: what training used
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, indices


class Expert(nn.Module):
    """SwiGLU FFN: w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L) [* routing weight]).

    L = swiglu_limit (0: no clamp).
    """

    def __init__(self, dim: int, inter_dim: int, dtype: str, swiglu_limit: float):
        super().__init__()
        self.w1 = Linear(dim, inter_dim, dtype)
        self.w2 = Linear(inter_dim, dim, dtype)
        self.w3 = Linear(dim, inter_dim, dtype)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """x: [N, dim] bf16, weights: [N, 1] fp32 or None -> [N, dim] bf16."""
        dtype = x.dtype
        gate = self.w1(x).float()
        up = self.w3(x).float()
        if self.swiglu_limit > 0:
            up = torch.clamp(up, min=-self.swiglu_limit, max=self.swiglu_limit)
            gate = torch.clamp(gate, max=self.swiglu_limit)
        h = F.silu(gate) * up
        if weights is not None:
            h = weights * h
        return self.w2(h.to(dtype))


class MoE(nn.Module):
    """Routed experts (expert_dtype) plus one shared expert (dense dtype)."""

    def __init__(
        self,
        dim: int,
        inter_dim: int,
        n_routed: int,
        n_active: int,
        n_shared: int,
        *,
        dense_dtype: str,
        expert_dtype: str,
        score_func: str,
        gate_temp: float,
        norm_topk_prob: bool,
        route_scale: float,
        swiglu_limit: float,
    ):
        super().__init__()
        if n_shared != 1:
            raise ValueError(f"n_shared_experts must be 1 (as in the reference), got {n_shared}")
        self.dim = dim
        self.n_routed = n_routed
        self.gate = Gate(dim, n_routed, n_active, score_func, gate_temp, norm_topk_prob, route_scale)
        self.experts = nn.ModuleList(
            Expert(dim, inter_dim, expert_dtype, swiglu_limit) for _ in range(n_routed)
        )
        self.shared_experts = Expert(dim, inter_dim, dense_dtype, swiglu_limit)

    def forward(self, x: torch.Tensor, *, rowwise: bool = False) -> torch.Tensor:
        """x: [B, T, dim] bf16 -> [B, T, dim] bf16.

        rowwise: route each row as a one-row pass would (a batched decode; the experts' products are
        row-invariant already, tests/model/test_batched.py checks it).
        """
        shape = x.shape
        x = x.reshape(-1, self.dim)
        weights, indices = self.gate(x, rowwise=rowwise)
        return self.experts_out(x, weights, indices).view(shape)

    def experts_out(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The routed and shared experts over routed rows: x [N, dim] bf16, weights / indices [N, topk] as
        the gate made them -> [N, dim] bf16. Row-invariant, so a batched prefill routes each sequence's
        rows alone (its gate's products depend on the rows in the call) and runs the experts once."""
        y = torch.zeros_like(x, dtype=torch.float32)
        for e in range(self.n_routed):
            rows, slot = torch.where(indices == e)
            if rows.numel() == 0:
                continue
            out = self.experts[e](x[rows], weights[rows, slot, None])
            # index_add in expert order: each token meets an expert at most once, so this is y[rows] += out
            y = y.index_add(0, rows, out.float())
        y = y + self.shared_experts(x)
        return y.type_as(x)
