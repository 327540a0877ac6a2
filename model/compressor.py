"""Sequence compressor of a kv-source layer: gated softmax pooling of m tokens (m > 1) or a plain
projection (m = 1).

Knows nothing of caches beyond the open-group carry it is handed; returns pre-RoPE latents for the groups
that complete in the given rows (V41_SPEC §3). Follows the official V4.1 `Compressor` op for op: fp32
weights and math for m > 1 (per-channel softmax over the m tokens, weighted sum, cast to bf16, RMSNorm),
bf16 `norm(wkv(x))` for m = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from model.linear import Linear
from model.norm import RMSNorm


@dataclass(frozen=True, kw_only=True)
class CompressorOutput:
    """latent: [B, G, D] bf16 pre-RoPE entries first_entry .. first_entry + G - 1 (G may be 0);
    carry_kv / carry_score: the new [B, m, D] fp32 open-group buffers (None for m = 1)."""

    latent: torch.Tensor
    first_entry: int
    carry_kv: torch.Tensor | None
    carry_score: torch.Tensor | None


class Compressor(nn.Module):
    """Args: dim (model width), head_dim (latent D), ratio (m >= 1), norm_eps."""

    def __init__(self, dim: int, head_dim: int, ratio: int, norm_eps: float):
        super().__init__()
        if ratio < 1:
            raise ValueError(f"compress ratio must be >= 1 for a kv source, got {ratio}")
        self.ratio = ratio
        self.head_dim = head_dim
        self.norm = RMSNorm(head_dim, norm_eps)
        self.wkv = Linear(dim, head_dim, "fp32" if ratio > 1 else "bf16")
        self.wgate = Linear(dim, head_dim, "fp32") if ratio > 1 else None

    def forward(
        self,
        x: torch.Tensor,
        start: int,
        carry_kv: torch.Tensor | None,
        carry_score: torch.Tensor | None,
    ) -> CompressorOutput:
        """Compress rows at positions [start, start + T).

        Args:
            x: [B, T, dim] bf16 attention inputs of the layer.
            start: position of the first row. For m > 1 the carry must hold positions
                [start - start % m, start) in slots 0 .. start % m - 1.
            carry_kv, carry_score: [B, m, D] fp32 (m > 1) or None.

        Returns:
            The latents of every group that completes inside [start, start + T).
        """
        b, t, _ = x.shape
        m = self.ratio
        if m == 1:
            return CompressorOutput(
                latent=self.norm(self.wkv(x)), first_entry=start, carry_kv=None, carry_score=None
            )
        assert carry_kv is not None and carry_score is not None and self.wgate is not None
        dtype = x.dtype
        xf = x.float()
        kv, score = self.wkv(xf), self.wgate(xf)  # [B, T, D] fp32 each
        end = start + t
        lead = start % m
        if t == 1:
            # one token: fill its slot and pool the buffers when the group just completed (decode path)
            slot = start % m
            new_kv, new_score = carry_kv.clone(), carry_score.clone()
            new_kv[:, slot] = kv[:, 0]
            new_score[:, slot] = score[:, 0]
            if (start + 1) % m:
                empty = kv.new_zeros(b, 0, self.head_dim).to(dtype)
                return CompressorOutput(
                    latent=empty, first_entry=end // m, carry_kv=new_kv, carry_score=new_score
                )
            pooled = (new_kv * new_score.softmax(dim=1)).sum(dim=1, keepdim=True)  # [B, 1, D]
            return CompressorOutput(
                latent=self.norm(pooled.to(dtype)),
                first_entry=start // m,
                carry_kv=new_kv,
                carry_score=new_score,
            )
        if lead:
            kv = torch.cat([carry_kv[:, :lead], kv], dim=1)
            score = torch.cat([carry_score[:, :lead], score], dim=1)
        rem = end % m
        cutoff = kv.size(1) - rem
        new_kv, new_score = carry_kv, carry_score
        if rem:
            # the trailing open group waits in the carry, in slots 0 .. rem - 1
            new_kv, new_score = carry_kv.clone(), carry_score.clone()
            new_kv[:, :rem] = kv[:, cutoff:]
            new_score[:, :rem] = score[:, cutoff:]
        kv = kv[:, :cutoff].unflatten(1, (-1, m))  # [B, G, m, D]
        score = score[:, :cutoff].unflatten(1, (-1, m))
        pooled = (kv * score.softmax(dim=2)).sum(dim=2)  # [B, G, D]
        return CompressorOutput(
            latent=self.norm(pooled.to(dtype)),
            first_entry=(start - lead) // m,
            carry_kv=new_kv,
            carry_score=new_score,
        )
