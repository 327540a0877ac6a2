"""Rotary position embedding: interleaved-pair rotation tables (optionally YaRN) and their application.

Knows nothing of attention; it builds complex rotation tables and rotates the last channels of a tensor.
Follows the official V4.1 `precompute_freqs_cis` / `apply_rotary_emb` op for op, so that results are
bitwise equal on CPU (V41_SPEC §3, §11.4; conformance README §9).
"""

from __future__ import annotations

import math

import torch


def rope_table(
    rope_dim: int,
    n_positions: int,
    *,
    base: float,
    original_seq_len: int = 0,
    factor: float = 1.0,
    beta_fast: int = 32,
    beta_slow: int = 1,
) -> torch.Tensor:
    """Complex rotations, one row per position.

    With original_seq_len > 0, YaRN: frequencies whose wavelength fits the training context are kept,
    those far beyond are divided by `factor`, and the band between beta_fast and beta_slow is ramped.
    The value at a position does not depend on n_positions.

    Returns:
        [n_positions, rope_dim // 2] complex64.
    """
    if rope_dim % 2:
        raise ValueError(f"rope_dim must be even, got {rope_dim}")
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if original_seq_len > 0:

        def corrected_dim(rotations: float) -> float:
            return rope_dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corrected_dim(beta_fast)), 0)
        high = min(math.ceil(corrected_dim(beta_slow)), rope_dim - 1)
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    angles = torch.outer(torch.arange(n_positions), freqs)  # [P, rope_dim/2]
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor, rope_dim: int, *, inverse: bool = False) -> torch.Tensor:
    """Rotate the last `rope_dim` channels of x as adjacent (even, odd) complex pairs, out of place.

    The rotation runs in fp32 and is rounded back to x's dtype, as the reference's in-place copy does.

    Args:
        x: [B, T, D] or [B, T, H, D].
        freqs: [T, rope_dim // 2] complex64, the rows for x's T positions, or [B, T, rope_dim // 2] when
            each sequence of the batch has its own positions (a batched decode).
        rope_dim: how many trailing channels rotate.
        inverse: rotate by the conjugate (strips a rotation carried by attention values).

    Returns:
        Same shape and dtype as x.
    """
    head, tail = x[..., :-rope_dim], x[..., -rope_dim:]
    z = torch.view_as_complex(tail.float().unflatten(-1, (-1, 2)))  # [..., rope_dim/2]
    if inverse:
        freqs = freqs.conj()
    lead = freqs.size(0) if freqs.ndim == 3 else 1
    if z.ndim == 3:
        freqs = freqs.view(lead, z.size(1), z.size(-1))
    else:
        freqs = freqs.view(lead, z.size(1), 1, z.size(-1))
    rotated = torch.view_as_real(z * freqs).flatten(-2).to(x.dtype)
    return torch.cat([head, rotated], dim=-1)
