"""Attention of one layer: sliding-window KV plus (ratio > 0) selected compressed global KV, one softmax
with a sink.

Knows nothing of the residual stream or of other layers: shared per-pass values (published top-k ids and
candidate pool) and the layer's caches come in through `AttnIO` and go back out through it. Follows the
official V4.1 `Attention` (V41_SPEC §5): low-rank Q with RoPE on the last channels, window KV =
FP8-QDQ(RoPE(kv_norm(wkv(x)))), compressed entries RoPE'd at j*m then FP4-QDQ'd, K = V, inverse RoPE on
the output, grouped low-rank output projection.

Window index layout (the column each key lands in decides the 64-wide softmax blocks and the order of the
sums, so it is part of bitwise parity). With tie_break="reference" (conformance): when no position before
the rows is visible, the reference prefill layout (width min(T, W), row r lists the rows max(0, r-W+1)..r,
then -1s); otherwise the ring layout of the reference decode (width W, positions p-W+1..p oldest first, -1
where absent), over [ring ; new rows]. With tie_break="deterministic" (service): one canonical layout for
every pass (width W, the visible positions ascending first, then -1s), so a row's sums do not depend on
how the prompt was chunked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kernels import qdq_fp4_e4m3, qdq_fp8_ue8m0, quantize_fp4_e4m3, quantize_fp8_ue8m0, sparse_attn
from model.append_buffer import append_rows
from model.compressor import Compressor
from model.indexer import Indexer
from model.linear import Linear
from model.norm import RMSNorm
from model.rope import apply_rope
from model.state import SourceCache


def gather_selected(
    source_kv: torch.Tensor, comp: torch.Tensor, offset: int, n_visible: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global rows a pass's sparse attention reads, and its ids into them.

    source_kv: [B, N, D] the source's dequantized entries; comp: [B, T, K] int32 ids of the selected
    entries shifted by `offset` (the window rows ahead of them in the attended rows), -1 for none.
    Returns (rows, ids): rows to append after the window rows and ids into [window ; rows].

    When the selections name fewer rows than are visible (decode: T*K = top-k against N entries), only
    those rows are gathered, once per (row, slot) in order, so attention reads exactly the values it would
    read from the whole source and the result is bitwise the same; otherwise (long prefill passes) the
    visible source itself is cheaper. Concatenating the whole source made decode O(N) in copies.
    """
    b, t, k = comp.shape
    if t * k >= n_visible:
        return source_kv[:, :n_visible], comp
    batch = torch.arange(b, device=comp.device).view(b, 1)
    picked = source_kv[batch, (comp.reshape(b, t * k).long() - offset).clamp_min(0)]  # [B, T*K, D]
    slots = torch.arange(offset, offset + t * k, device=comp.device, dtype=comp.dtype).view(1, t, k)
    return picked, torch.where(comp >= 0, slots, -1).to(comp.dtype)


@dataclass(kw_only=True)
class AttnIO:
    """What one layer's attention reads and writes in a pass.

    Attributes:
        start: position of the first row of x.
        floor: lowest window position any row may read (truncated SWA of a bounded replay).
        window: [B, W, D] bf16 this layer's ring before the pass; window_from: its lowest valid position.
        window_codes, window_scales: the ring's stored form ([B, W, D] e4m3, [B, W, D/32] uint8).
        source: the SourceCache of this layer's kv source (ratio > 0), replaced when this layer writes.
        compress_x: [B, T_c, dim] attention inputs of the rows to compress (kv sources), at positions
            [compress_start, ...); x itself when None.
        topk_ids / candidates: per-pass slots published by index sources / the candidate source.
        tie_break: kernels top-k rule.
        backend: kernels backend of this pass's attention, indexer scores and KV formats ("torch" or
            "triton"; see `Transformer(kernel_backend=...)`).
        stale_slot: index keys of the layer that last published some (conformance mode only; see
            `Transformer.run(reference_slots=...)`), or None for the correct per-source keys.
        published: set True when this layer appended index keys in this pass.
        new_window / new_window_from: the ring after the pass (set by the layer).
    """

    start: int
    floor: int
    window: torch.Tensor
    window_codes: torch.Tensor
    window_scales: torch.Tensor
    window_from: int
    source: SourceCache | None = None
    compress_x: torch.Tensor | None = None
    compress_start: int = 0
    shared: dict[str, torch.Tensor | None] = field(default_factory=dict)
    tie_break: str = "reference"
    backend: str = "torch"
    stale_slot: torch.Tensor | None = None
    published: bool = False
    new_window: torch.Tensor | None = None
    new_window_codes: torch.Tensor | None = None
    new_window_scales: torch.Tensor | None = None
    new_window_from: int = 0


@dataclass(frozen=True, kw_only=True)
class ProjectedRows:
    """`Attention.project`'s output: qr [B, T, q_lora] (the indexer reads it), q [B, T, H, D] roped,
    kv [B, T, D] the window KV as attended (FP8 QDQ), codes / scales its stored FP8 form."""

    qr: torch.Tensor
    q: torch.Tensor
    kv: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor


def window_ids(
    start: int, rows: int, width_w: int, eff_floor: int, device: torch.device, *, canonical: bool = False
) -> tuple[torch.Tensor, bool]:
    """Window index rows and whether the ring is part of the KV buffer.

    Args:
        canonical: the layout of `tie_break="deterministic"`: width W, a row's visible positions ascending
            first, then -1s, whatever the pass's start and length. The sparse attention sums a row in
            column order, so only a layout that puts a position's keys in the same columns in every pass
            makes chunked prefill, decode and replays equal one-shot prefill bit for bit. False: the
            reference's prefill / decode layouts (module docstring), which conformance needs.

    Returns:
        ids [T, width] int64 into [ring ; rows] (when uses_ring) or into rows; uses_ring.
    """
    if canonical:
        uses_ring = eff_floor < start
        # rows of this pass are all visible to later rows; the ring only from the effective floor
        lowest = max(eff_floor, 0) if uses_ring else start
        pos = start + torch.arange(rows, device=device).unsqueeze(1)  # [T, 1]
        keys = (pos - width_w + 1).clamp(min=lowest) + torch.arange(width_w, device=device)  # [T, W]
        ids = torch.where(keys >= start, keys - start + (width_w if uses_ring else 0), keys % width_w)
        return torch.where(keys > pos, -1, ids), uses_ring
    if eff_floor >= start:
        r = torch.arange(rows, device=device).unsqueeze(1)  # [T, 1]
        ids = (r - width_w + 1).clamp(0) + torch.arange(min(rows, width_w), device=device)
        return torch.where(ids > r, -1, ids), False
    pos = start + torch.arange(rows, device=device).unsqueeze(1)  # [T, 1]
    keys = pos - width_w + 1 + torch.arange(width_w, device=device)  # [T, W] ascending positions
    ids = torch.where(keys >= start, width_w + keys - start, keys % width_w)
    absent = (keys < eff_floor) | (keys < 0)
    return torch.where(absent, -1, ids), True


class Attention(nn.Module):
    """One layer's attention. Parameter names follow the reference checkpoint (`layers.{i}.attn.*`)."""

    def __init__(self, layer: int, cfg) -> None:  # cfg: model.ModelConfig
        super().__init__()
        dense = "fp8" if cfg.dtype == "fp8" else "bf16"
        self.layer = layer
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.rope_dim = cfg.rope_head_dim
        self.n_groups = cfg.o_groups
        self.o_lora_rank = cfg.o_lora_rank
        self.window_size = cfg.window_size
        self.ratio = cfg.compress_ratios[layer]
        self.softmax_scale = cfg.head_dim**-0.5
        self.is_kv_source = layer in cfg.kv_source_layers
        # False attends the global KV (main KV and index keys) unquantized: a measurement switch of the
        # quality harness (FP4 cache vs unquantized); serving and conformance keep True
        self.quantize_global = True
        self.is_index_source = layer in cfg.index_source_layers
        self.is_candidate_source = cfg.is_candidate_source(layer)
        self.uses_candidates = cfg.uses_candidates(layer)
        self.candidate_block_size = cfg.candidate_block_size
        self.candidate_topk_blocks = cfg.candidate_topk_blocks

        self.attn_sink = nn.Parameter(torch.zeros(cfg.n_heads, dtype=torch.float32))
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank, dense)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, cfg.n_heads * cfg.head_dim, dense)
        self.wkv = Linear(cfg.dim, cfg.head_dim, dense)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.wo_a = Linear(cfg.n_heads * cfg.head_dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, "bf16")
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, dense)
        self.compressor = (
            Compressor(cfg.dim, cfg.head_dim, self.ratio, cfg.norm_eps) if self.is_kv_source else None
        )
        self.indexer = None
        if self.is_index_source:
            self.indexer = Indexer(
                dim=cfg.dim,
                q_lora_rank=cfg.q_lora_rank,
                head_dim=cfg.head_dim,
                n_heads=cfg.index_n_heads,
                index_head_dim=cfg.index_head_dim,
                rope_dim=cfg.rope_head_dim,
                topk=cfg.index_topk,
                owns_k=self.is_kv_source,
                dense_dtype=dense,
                norm_eps=cfg.norm_eps,
            )

    def _write_global(self, io: AttnIO, x: torch.Tensor, freqs_table: torch.Tensor) -> None:
        """Compress new rows and append entries not yet in the cache (never rewrites stored entries)."""
        assert self.compressor is not None and io.source is not None
        src = io.source
        cx = x if io.compress_x is None else io.compress_x
        cstart = io.start if io.compress_x is None else io.compress_start
        out = self.compressor(cx, cstart, src.carry_kv, src.carry_score)
        n_old = src.n_entries
        g = out.latent.size(1)
        first = out.first_entry
        assert first <= n_old or g == 0, f"layer {self.layer}: entry gap {n_old} .. {first}"
        new = dict(kv=src.kv, index_k=src.index_k, kv_packed=src.kv_packed, kv_scales=src.kv_scales,
                   index_packed=src.index_packed, index_scales=src.index_scales)
        if g and first + g > n_old:
            skip = n_old - first
            pos = torch.arange(first, first + g, device=x.device) * self.ratio
            fields = self.entry_fields(out.latent, freqs_table[pos], backend=io.backend)
            io.published = io.published or "index_k" in fields
            for name, rows in fields.items():
                new[name] = append_rows(new[name], rows[:, skip:])
        io.source = SourceCache(ratio=src.ratio, carry_kv=out.carry_kv, carry_score=out.carry_score, **new)

    def entry_fields(self, latent: torch.Tensor, freqs: torch.Tensor, *, backend) -> dict[str, torch.Tensor]:
        """The stored fields of new global entries (pre-RoPE latents [B, G, D] at rotations `freqs`): the
        attended view and FP4 codes/scales of the main KV, and the index keys with their MXFP4 codes when
        this layer owns them. The one place the lone and the batched paths (model/batched_attention.py,
        model/batched_prefill_attention.py) compute them."""
        fields: dict[str, torch.Tensor] = {}
        if self.indexer is not None and self.indexer.owns_k:
            keys, packed, scales = self.indexer.keys(
                latent, freqs, backend=backend, quantize=self.quantize_global
            )
            fields.update(index_k=keys, index_packed=packed, index_scales=scales)
        latent = apply_rope(latent, freqs, self.rope_dim)
        with torch.no_grad():
            packed, scales = quantize_fp4_e4m3(latent.detach(), backend=backend)
        # quantize_global False (quality harness only) keeps the exact latents as the attended view;
        # the stored codes are FP4 either way
        view = qdq_fp4_e4m3(latent, backend=backend) if self.quantize_global else latent
        fields.update(kv=view, kv_packed=packed, kv_scales=scales.view(torch.uint8))
        return fields

    def forward(self, x: torch.Tensor, io: AttnIO, freqs_table: torch.Tensor) -> torch.Tensor:
        """x: [B, T, dim] bf16 normed inputs at positions [io.start, io.start + T) -> [B, T, dim] bf16.

        freqs_table: [>= end, rope/2] complex64 rotations of this layer (compress or base theta).
        The three stages are separate so that a batched decode (model/batched.py) can run the row-wise
        ones over many sequences at once, and `attend` per sequence where its batched twin
        (model/batched_attention.py) does not apply; this is their one composition.
        """
        freqs = freqs_table[io.start : io.start + x.size(1)]
        rows = self.project(x, freqs, backend=io.backend)
        return self.project_out(self.attend(x, rows, io, freqs_table), freqs)

    def project(self, x: torch.Tensor, freqs: torch.Tensor, *, backend: str) -> ProjectedRows:
        """The row-wise input stage: queries and this pass's window KV (with its stored FP8 form).

        x: [B, T, dim]; freqs: [T, rope/2], or [B, T, rope/2] when each sequence has its own positions.
        """
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))  # [B, T, H, D]
        q = apply_rope(q, freqs, self.rope_dim)

        kv = self.kv_norm(self.wkv(x))
        kv = apply_rope(kv, freqs, self.rope_dim)
        with torch.no_grad():
            # codes [B, T, D] e4m3, scales [B, T, D/32] uint8
            codes, scales = quantize_fp8_ue8m0(kv.detach(), backend=backend)
        kv = qdq_fp8_ue8m0(kv, backend=backend)  # [B, T, D]
        return ProjectedRows(qr=qr, q=q, kv=kv, codes=codes, scales=scales)

    def project_out(self, o: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """The row-wise output stage: o [B, T, H, D] attention values -> [B, T, dim] (freqs as `project`)."""
        b, t = o.shape[:2]
        o = apply_rope(o, freqs, self.rope_dim, inverse=True)
        if self.n_groups == 1:
            # the official einsum of one group is the plain product: torch runs the einsum's bmm of bf16
            # as one mm per batch, the product F.linear runs (bitwise equal, tests/model/test_linear.py),
            # so it takes the compiled bf16 linear (kernels/bf16_gemm; 4x the einsum on v41-sib-s)
            return self.wo_b(self.wo_a(o.flatten(2)))
        o = o.view(b, t, self.n_groups, -1)
        wo_a = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)
        o = torch.einsum("bsgd,grd->bsgr", o, wo_a)
        return self.wo_b(o.flatten(2))

    def attend(
        self, x: torch.Tensor, rows: ProjectedRows, io: AttnIO, freqs_table: torch.Tensor
    ) -> torch.Tensor:
        """The per-sequence stage: window ring, global KV writes, top-k selection and the sparse attention
        of one pass (all rows at positions [io.start, io.start + T)) -> o [B, T, H, D] before `project_out`.
        """
        b, t, _ = x.shape
        start, end, w = io.start, io.start + t, self.window_size
        freqs = freqs_table[start:end]
        qr, q, kv, codes, scales = rows.qr, rows.q, rows.kv, rows.codes, rows.scales
        eff_floor = max(io.floor, io.window_from)
        canonical = io.tie_break == "deterministic"
        ids, uses_ring = window_ids(start, t, w, eff_floor, x.device, canonical=canonical)
        kv_all = torch.cat([io.window, kv], dim=1) if uses_ring else kv
        keep = min(t, w)
        slots = torch.arange(end - keep, end, device=x.device) % w
        ring, ring_codes, ring_scales = io.window.clone(), io.window_codes.clone(), io.window_scales.clone()
        ring[:, slots] = kv[:, t - keep :]
        ring_codes[:, slots] = codes[:, t - keep :]
        ring_scales[:, slots] = scales[:, t - keep :]
        io.new_window, io.new_window_codes, io.new_window_scales = ring, ring_codes, ring_scales
        io.new_window_from = min(eff_floor, start)
        ids = ids.int().unsqueeze(0).expand(b, -1, -1)

        if self.ratio:
            if self.is_kv_source:
                self._write_global(io, x, freqs_table)
            assert io.source is not None
            n_visible = end // self.ratio
            offset = kv_all.size(1)
            if self.is_index_source:
                assert self.indexer is not None
                if n_visible == 0:
                    comp = torch.empty(b, t, 0, dtype=torch.int32, device=x.device)
                else:
                    visible = (torch.arange(start, end, device=x.device) + 1) // self.ratio
                    keys = io.source.index_k
                    if io.stale_slot is not None and not io.published:
                        keys = io.stale_slot
                        if keys.size(1) < n_visible:
                            # the reference's slot is a zero-initialised max-length buffer
                            keys = torch.cat(
                                [keys, keys.new_zeros(b, n_visible - keys.size(1), keys.size(2))], 1
                            )
                    comp, pool = self.indexer.select(
                        x,
                        qr,
                        freqs,
                        keys[:, :n_visible],
                        visible,
                        candidate_source=self.is_candidate_source,
                        candidates=io.shared.get("candidates") if self.uses_candidates else None,
                        block_size=self.candidate_block_size,
                        topk_blocks=self.candidate_topk_blocks,
                        tie_break=io.tie_break,
                        backend=io.backend,
                    )
                    comp = torch.where(comp >= 0, comp + offset, -1).int()
                    if pool is not None:
                        io.shared["candidates"] = pool
                io.shared["topk"] = comp
            comp = io.shared["topk"]
            assert comp is not None
            picked, comp = gather_selected(io.source.kv, comp, offset, n_visible)
            kv_all = torch.cat([kv_all, picked], dim=1)
            ids = torch.cat([ids, comp], dim=-1)

        return sparse_attn(q, kv_all, self.attn_sink, ids, self.softmax_scale, backend=io.backend)
