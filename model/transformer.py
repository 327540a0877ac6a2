"""The DeepSeek-V4.1-style transformer: embedding, mHC layers, head, and the one forward pass behind
prefill, chunked extend, bounded replays and decode.

Knows nothing of storage or serving policy: callers hand it a `ModelState` and rows to run, and get logits,
the new state and per-layer row counts back (no logging). The pass runs the encoder layers (those below
the CED split) over rows [start, end) and the decoder layers over rows [dec_from, end), where rows below
`start` come from the state's encoder-output ring (V41_SPEC §7.4, REPLAY_NOTES §7). The split layer's
compressor and index keys always cover every new row, so decoder global KV exists for every position.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from model.append_buffer import append_rows
from model.attention import AttnIO
from model.block import Block
from model.errors import UnsupportedConfigError
from model.invariant import fp32_linear
from model.mhc import collapse, identity_pre
from model.norm import RMSNorm
from model.owned_rows import mark_owned
from model.rope import rope_table
from model.state import ModelState, SourceCache

KERNEL_BACKENDS = ("torch", "triton")


@dataclass(frozen=True, kw_only=True)
class PassStats:
    """What one forward pass did.

    Attributes:
        start, end: positions of the new rows [start, end) (start < state length for a replay).
        decoder_from: first position the decoder layers ran on (== end when they did not run).
        rows_per_layer: rows each backbone layer's attention and FFN processed.
        compressed_rows: kv-source layer -> rows its compressor consumed.
    """

    start: int
    end: int
    decoder_from: int
    rows_per_layer: tuple[int, ...]
    compressed_rows: dict[int, int]


@dataclass(frozen=True, kw_only=True)
class PassOutput:
    """logits: [B, vocab] fp32 of the last row, [B, R, vocab] for every decoder row when asked, or None when
    no decoder row ran; state: the state after the pass (the input state object, updated); stats."""

    logits: torch.Tensor | None
    state: ModelState
    stats: PassStats


class Transformer(nn.Module):
    """Model built from a `model.ModelConfig`; parameter names and dtypes follow the reference state_dict.

    Args:
        cfg: the config.
        kernel_backend: "torch" (default; the bitwise reference ops, any device) or "triton" (the Triton
            kernels of sparse attention, indexer scores and the KV formats' quantization, for CUDA
            tensors; equal to "torch" up to summation order). Top-k selection and the linears always run
            in torch. Chosen here, never at import; the device comes with the tensors of each pass.

    Raises:
        UnsupportedConfigError: the config enables Engram, MTP/DSpark or vision (not in v1).
        ValueError: an unknown kernel_backend.
    """

    def __init__(self, cfg, *, kernel_backend: str = "torch") -> None:
        super().__init__()
        unsupported = cfg.unsupported_features()
        if unsupported:
            raise UnsupportedConfigError(
                f"this model does not implement: {', '.join(unsupported)}; disable them in the config"
            )
        self.cfg = cfg
        self.kernel_backend = kernel_backend
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, dtype=torch.bfloat16)
        self.layers = nn.ModuleList(Block(i, cfg) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False, dtype=torch.float32)
        self.split = cfg.ced_split if cfg.supports_ced else None
        self._tables: dict[tuple[str, str], torch.Tensor] = {}

    @property
    def kernel_backend(self) -> str:
        """Kernels backend of every later pass; assignable (e.g. after `load_model`), validated."""
        return self._kernel_backend

    @kernel_backend.setter
    def kernel_backend(self, backend: str) -> None:
        if backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {backend!r}")
        self._kernel_backend = backend

    def rope_for(self, layer: int, n_positions: int, device: torch.device) -> torch.Tensor:
        """Rotation table of `layer` covering at least n_positions: [P, rope/2] complex64.

        Compressed layers use compress_rope_theta with YaRN; SWA-only layers rope_theta without.
        """
        cfg = self.cfg
        kind = "compress" if cfg.compress_ratios[layer] else "base"
        key = (kind, str(device))
        table = self._tables.get(key)
        if table is None or table.size(0) < n_positions:
            size = max(cfg.max_seq_len, 1 << max(n_positions - 1, 1).bit_length())
            if kind == "compress":
                table = rope_table(
                    cfg.rope_head_dim,
                    size,
                    base=cfg.compress_rope_theta,
                    original_seq_len=cfg.original_seq_len,
                    factor=cfg.rope_factor,
                    beta_fast=cfg.beta_fast,
                    beta_slow=cfg.beta_slow,
                )
            else:
                table = rope_table(cfg.rope_head_dim, size, base=cfg.rope_theta)
            table = table.to(device)
            self._tables[key] = table
        return table

    def new_state(self, batch: int = 1, device: torch.device | str | None = None) -> ModelState:
        """An empty state for `batch` sequences on `device` (the parameters' device by default)."""
        cfg = self.cfg
        dev = torch.device(device) if device is not None else self.head.weight.device
        sources = {}
        for s in cfg.kv_source_layers:
            m = cfg.compress_ratios[s]
            carry_kv = carry_score = None
            if m > 1:
                carry_kv = torch.zeros(batch, m, cfg.head_dim, dtype=torch.float32, device=dev)
                carry_score = torch.full(
                    (batch, m, cfg.head_dim), -torch.inf, dtype=torch.float32, device=dev
                )
            d, di = cfg.head_dim, cfg.index_head_dim
            sources[s] = SourceCache(
                ratio=m,
                kv=torch.zeros(batch, 0, d, dtype=torch.bfloat16, device=dev),
                index_k=torch.zeros(batch, 0, di, dtype=torch.bfloat16, device=dev),
                kv_packed=torch.zeros(batch, 0, d // 2, dtype=torch.uint8, device=dev),
                kv_scales=torch.zeros(batch, 0, d // 16, dtype=torch.uint8, device=dev),
                index_packed=torch.zeros(batch, 0, di // 2, dtype=torch.uint8, device=dev),
                index_scales=torch.zeros(batch, 0, di // 32, dtype=torch.uint8, device=dev),
                carry_kv=carry_kv,
                carry_score=carry_score,
            )
        w = cfg.window_size
        layers = range(cfg.n_layers)
        return ModelState(
            tokens=torch.zeros(batch, 0, dtype=torch.int64, device=dev),
            sources=sources,
            windows=[torch.zeros(batch, w, cfg.head_dim, dtype=torch.bfloat16, device=dev) for _ in layers],
            window_codes=[
                torch.zeros(batch, w, cfg.head_dim, dtype=torch.float8_e4m3fn, device=dev) for _ in layers
            ],
            window_scales=[
                torch.zeros(batch, w, cfg.head_dim // 32, dtype=torch.uint8, device=dev) for _ in layers
            ],
            window_from=[0] * cfg.n_layers,
            enc_lanes=torch.zeros(batch, w, cfg.hc_mult, cfg.dim, dtype=torch.bfloat16, device=dev),
            enc_pre=torch.zeros(batch, w, cfg.hc_mult, dtype=torch.float32, device=dev),
            enc_from=0,
        )

    def _run_layer(
        self,
        i: int,
        h: torch.Tensor,
        pre: torch.Tensor,
        state: ModelState,
        shared: dict,
        start: int,
        floor: int,
        tie_break: str,
        end: int,
        compress_x: torch.Tensor | None = None,
        compress_start: int = 0,
        reference_slots: bool = False,
    ):
        cfg = self.cfg
        src_layer = cfg.kv_source_of(i)
        stale = None
        slot = state.extra.get("index_k_slot")
        if reference_slots and slot is not None and cfg.index_source_of(i) == i:
            stale = state.sources[slot].index_k
        io = AttnIO(
            start=start,
            floor=floor,
            window=state.windows[i],
            window_codes=state.window_codes[i],
            window_scales=state.window_scales[i],
            window_from=state.window_from[i],
            source=state.sources[src_layer] if src_layer is not None else None,
            compress_x=compress_x,
            compress_start=compress_start,
            shared=shared,
            tie_break=tie_break,
            backend=self.kernel_backend,
            stale_slot=stale,
        )
        h, pre = self.layers[i](h, pre, io, self.rope_for(i, end, h.device))
        self.keep_layer_io(i, io, state)
        return h, pre

    def keep_layer_io(self, i: int, io: AttnIO, state: ModelState) -> None:
        """Store what layer i's attention wrote in a pass (its ring, its global KV, a published index-key
        slot) into `state` (also used by the batched decode's per-sequence slow twin, model/batched.py)."""
        state.windows[i] = io.new_window
        state.window_codes[i] = io.new_window_codes
        state.window_scales[i] = io.new_window_scales
        state.window_from[i] = io.new_window_from
        if i in self.cfg.kv_source_layers:
            state.sources[i] = io.source
        if io.published:
            state.extra["index_k_slot"] = i

    def _compress_only(self, i: int, x: torch.Tensor, start: int, state: ModelState) -> None:
        """Write layer i's global KV for rows [start, start + T) without running the rest of the layer."""
        io = AttnIO(
            start=start,
            floor=0,
            window=state.windows[i],
            window_codes=state.window_codes[i],
            window_scales=state.window_scales[i],
            window_from=state.window_from[i],
            source=state.sources[i],
            compress_x=x,
            compress_start=start,
            backend=self.kernel_backend,
        )
        self.layers[i].attn._write_global(io, x, self.rope_for(i, start + x.size(1), x.device))
        state.sources[i] = io.source
        if io.published:
            state.extra["index_k_slot"] = i

    def run(
        self,
        tokens: torch.Tensor,
        state: ModelState,
        *,
        start: int,
        enc_floor: int = 0,
        dec_from: int | None = None,
        dec_floor: int | None = None,
        tie_break: str = "deterministic",
        reference_slots: bool = False,
        all_logits: bool = False,
    ) -> PassOutput:
        """One forward pass (the single code path of prefill, extend, replay and decode).

        Args:
            tokens: [B, T] int64 ids of positions [start, start + T).
            state: cache state holding positions [0, start) (global KV at least up to `start` entries'
                groups; for a replay start < state.n_tokens and stored global entries are kept).
            start: position of the first row.
            enc_floor: lowest window position the encoder layers may read.
            dec_from: first position the decoder layers run on (default start); rows in [dec_from, start)
                take their encoder output from state.enc_lanes / enc_pre. dec_from == end skips them.
            dec_floor: lowest window position the decoder layers may read (default enc_floor).
            tie_break: top-k rule, "reference" (conformance) or "deterministic".
            reference_slots: reproduce the official code's shared index-key slot: an index source reads
                the keys of the kv source that last published some, in this pass or an earlier one, so a
                ratio > 1 source whose group is still open scores against another layer's keys. Needed
                for bitwise conformance of decode steps; the correct per-source keys otherwise.
            all_logits: return logits of every decoder row instead of the last.

        Returns:
            PassOutput; state is updated in place (its tensors are replaced, never mutated).

        Raises:
            ValueError: rows that do not continue the state, a dec_from the encoder ring cannot serve, or
                kernel_backend "triton" on tensors it cannot run on (CPU without TRITON_INTERPRET=1).
        """
        cfg = self.cfg
        if tokens.dim() != 2 or tokens.size(0) != state.batch:
            raise ValueError(f"tokens must be [B={state.batch}, T], got {tuple(tokens.shape)}")
        self._check_backend_device(tokens.device)
        b, t = tokens.shape
        end = start + t
        if not 0 <= start <= state.n_tokens:
            raise ValueError(f"start {start} must be in [0, n_tokens={state.n_tokens}]")
        dec_from = start if dec_from is None else dec_from
        dec_floor = enc_floor if dec_floor is None else dec_floor
        w = cfg.window_size
        if not start - w <= dec_from <= end or (dec_from < start and self.split is None):
            raise ValueError(f"dec_from {dec_from} must be in [start - W, end] = [{start - w}, {end}]")
        if dec_from < start and state.enc_from > dec_from:
            raise ValueError(
                f"encoder outputs from position {dec_from} are not in the state "
                f"(valid from {state.enc_from}); replay the encoder instead"
            )
        split = self.split if self.split is not None else cfg.n_layers
        rows = [0] * cfg.n_layers
        compressed: dict[int, int] = {}

        h = self.embed(tokens).unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)  # [B, T, hc, d]
        pre = identity_pre(b, t, cfg.hc_mult, tokens.device)
        shared: dict = {}
        for i in range(split):
            h, pre = self._run_layer(
                i, h, pre, state, shared, start, enc_floor, tie_break, end, reference_slots=reference_slots
            )
            rows[i] = t
            if i in cfg.kv_source_layers:
                compressed[i] = t

        if self.split is not None:
            h_new, pre_new = h, pre
            if dec_from < start:
                # read the ring before this pass's rows overwrite its slots
                slots = torch.arange(dec_from, start, device=h.device) % w
                h = torch.cat([state.enc_lanes[:, slots], h_new], dim=1)
                pre = torch.cat([state.enc_pre[:, slots], pre_new], dim=1)
            else:
                h, pre = h_new[:, dec_from - start :], pre_new[:, dec_from - start :]
            self._save_encoder_rows(state, h_new, pre_new, start)
            # the split layer's global KV covers every new row even when the decoder runs on fewer
            compress_x = None if dec_from == start else self.layers[split].attn_input(h_new, pre_new)
            compressed[split] = t
            if dec_from == end:
                self._compress_only(split, compress_x, start, state)
            else:
                shared = {}
                for i in range(split, cfg.n_layers):
                    h, pre = self._run_layer(
                        i,
                        h,
                        pre,
                        state,
                        shared,
                        dec_from,
                        dec_floor,
                        tie_break,
                        end,
                        compress_x=compress_x if i == split else None,
                        compress_start=start,
                        reference_slots=reference_slots,
                    )
                    rows[i] = end - dec_from
        # the history grows by appends (amortised O(1)); a replay from below the end rewrites its tail
        kept = state.tokens if start == state.tokens.size(1) else state.tokens[:, :start]
        state.tokens = append_rows(kept, tokens)

        logits = None
        if dec_from < end or self.split is None:
            x = self.norm(collapse(h, pre))  # [B, R, d]
            if all_logits:
                logits = torch.stack(
                    [fp32_linear(x[:, r].float(), self.head.weight) for r in range(x.size(1))], 1
                )
            else:
                logits = fp32_linear(x[:, -1].float(), self.head.weight)
        stats = PassStats(
            start=start,
            end=end,
            decoder_from=dec_from if self.split is not None else end,
            rows_per_layer=tuple(rows),
            compressed_rows=compressed,
        )
        return PassOutput(logits=logits, state=state, stats=stats)

    def _check_backend_device(self, device: torch.device) -> None:
        if self.kernel_backend != "triton":
            return
        # the interpreter flag only counts if it was set before triton was imported; checking the
        # environment here is the same rule the kernels apply
        interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
        if device.type != "cuda" and not interpreted:
            raise ValueError(
                f'kernel_backend="triton" runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1 set '
                f'before triton is imported), got tensors on {device}; build the model with '
                f'kernel_backend="torch" for this device'
            )

    def _save_encoder_rows(self, state: ModelState, h: torch.Tensor, pre: torch.Tensor, start: int) -> None:
        """Keep the encoder output (lanes and pending pre-mix) of the last W new rows in the state's ring."""
        w = self.cfg.window_size
        t = h.size(1)
        keep = min(t, w)
        slots = torch.arange(start + t - keep, start + t, device=h.device) % w
        lanes, pres = state.enc_lanes.clone(), state.enc_pre.clone()
        lanes[:, slots] = h[:, t - keep :].detach()
        pres[:, slots] = pre[:, t - keep :].detach()
        state.enc_lanes, state.enc_pre = lanes, pres
        if torch.is_inference_mode_enabled() and state.batch == 1:
            # fresh rings this state alone holds: a batched decode step writes into them (owned_rows.py)
            mark_owned(state.owner, (lanes, pres))
        state.enc_from = min(state.enc_from, start)
