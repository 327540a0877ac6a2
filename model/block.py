"""One transformer layer on the 4-lane mHC residual stream: attention sub-block then MoE sub-block.

Knows nothing of other layers or of caches beyond the `AttnIO` it passes to its attention. The pre-mix
lags one sub-block (V41_SPEC §8): attention collapses the lanes with the pre-mix made by the previous
layer's FFN mixer, the FFN with the one this layer's attention mixer made; the FFN mixer's pre is returned
for the next layer. Follows the official V4.1 `Block.forward` op for op.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from model.attention import Attention, AttnIO
from model.invariant import fp32_linear
from model.mhc import collapse, expand, split_sinkhorn
from model.moe import MoE
from model.norm import RMSNorm


class Block(nn.Module):
    """Layer `layer` of a model built from `cfg` (model.ModelConfig)."""

    def __init__(self, layer: int, cfg) -> None:
        super().__init__()
        dense = "fp8" if cfg.dtype == "fp8" else "bf16"
        experts = "fp4" if cfg.expert_dtype == "fp4" else dense
        self.layer = layer
        self.hc = cfg.hc_mult
        self.sinkhorn_iters = cfg.hc_sinkhorn_iters
        self.hc_eps = cfg.hc_eps
        self.norm_eps = cfg.norm_eps
        self.attn = Attention(layer, cfg)
        self.ffn = MoE(
            cfg.dim,
            cfg.moe_inter_dim,
            cfg.n_routed_experts,
            cfg.n_activated_experts,
            cfg.n_shared_experts,
            dense_dtype=dense,
            expert_dtype=experts,
            score_func=cfg.score_func,
            gate_temp=cfg.gate_temp,
            norm_topk_prob=cfg.norm_topk_prob,
            route_scale=cfg.route_scale,
            swiglu_limit=cfg.swiglu_limit,
        )
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        mix = (2 + self.hc) * self.hc
        width = self.hc * cfg.dim
        self.hc_attn_fn = nn.Parameter(torch.zeros(mix, width, dtype=torch.float32))
        self.hc_ffn_fn = nn.Parameter(torch.zeros(mix, width, dtype=torch.float32))
        self.hc_attn_base = nn.Parameter(torch.zeros(mix, dtype=torch.float32))
        self.hc_ffn_base = nn.Parameter(torch.zeros(mix, dtype=torch.float32))
        self.hc_attn_scale = nn.Parameter(torch.zeros(3, dtype=torch.float32))
        self.hc_ffn_scale = nn.Parameter(torch.zeros(3, dtype=torch.float32))

    def _mixes(
        self,
        x: torch.Tensor,
        fn: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        *,
        linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = fp32_linear,
        rowwise: bool = False,
    ):
        """x: [B, T, hc, d] -> pre [B, T, hc], post [B, T, hc], comb [B, T, hc, hc], fp32.

        linear: the fp32 product (a batched decode passes `rowwise_linear`, which makes each row's sums
        those of a one-row pass); rowwise: the same for the Sinkhorn split's elementwise ops.
        """
        flat = x.flatten(2).float()  # [B, T, hc*d]
        rsqrt = torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        raw = linear(flat, fn) * rsqrt
        return split_sinkhorn(raw, scale, base, self.hc, self.sinkhorn_iters, self.hc_eps, rowwise=rowwise)

    def attn_input(self, h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """The attention sub-block's input: attn_norm(collapse(h, pre)). h [B, T, hc, d], pre [B, T, hc]."""
        return self.attn_norm(collapse(h, pre))

    def forward(
        self, h: torch.Tensor, pre: torch.Tensor, io: AttnIO, freqs_table: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [B, T, hc, d] bf16 lanes, pre: [B, T, hc] fp32 pending pre-mix.

        Returns:
            lanes [B, T, hc, d] bf16 and the pre-mix [B, T, hc] fp32 for the next layer.
        """
        attn_pre, attn_post, attn_comb = self._mixes(
            h, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base
        )
        y = self.attn(self.attn_input(h, pre), io, freqs_table)
        h = expand(y, h, attn_post, attn_comb)
        ffn_pre, ffn_post, ffn_comb = self._mixes(h, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base)
        y = self.ffn(self.ffn_norm(collapse(h, attn_pre)))
        return expand(y, h, ffn_post, ffn_comb), ffn_pre
