"""Inference entry points over `Transformer.run`: prefill (from scratch, extend, chunked, with encoder bounded
replay), and decode.

Knows nothing of storage or turn policy; it decides only which rows each layer half runs on (V41_SPEC §7,
REPLAY_NOTES §7):
- `reference` mode: every layer over every new row, as the official code does (conformance).
- `ced` mode: the encoder over every new row, the decoder over the last W rows of the whole prompt
  [N - W, N) with its window floored at N - W (decoder bounded replay; the paper's serving mode). Under
  chunked prefill each chunk runs the decoder on its rows inside [N - W, N) (one floor across chunks);
  rows of that tail that lie before the first new row take their encoder output from the state.
- When the state has global KV but not the encoder windows of its last W positions, the encoder replays
  the stored tokens [s, P), s = max(0, P - W) rounded down to a multiple of every compression ratio, with
  its windows floored at s and no global entry below P rewritten (encoder bounded replay).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from model.state import ModelState
from model.transformer import PassOutput, Transformer

PREFILL_MODES = ("reference", "ced")


def _replay_start(model: Transformer, n_cached: int) -> int:
    cfg = model.cfg
    align = math.lcm(*[r for r in cfg.compress_ratios[: cfg.n_layers] if r > 0] or [1])
    return max(0, n_cached - cfg.window_size) // align * align


def prefill(
    model: Transformer,
    tokens: torch.Tensor,
    state: ModelState | None = None,
    *,
    mode: str = "ced",
    prompt_end: int | None = None,
    tie_break: str = "deterministic",
    reference_slots: bool = False,
    all_logits: bool = False,
) -> PassOutput:
    """Run new prompt tokens: a prefill from position 0 (state None or empty) or an extend of `state`.

    Args:
        model: the transformer.
        tokens: [B, T] int64 new prompt tokens (T >= 1), on the model's device.
        state: the cache state to extend (updated and returned), or None for a fresh one.
        mode: "reference" or "ced" (see module docstring).
        prompt_end: position just after the whole prompt when `tokens` is one chunk of it (chunked
            prefill); default: the end of `tokens`. Only `ced` mode uses it.
        tie_break: top-k rule, "deterministic" (service) or "reference" (conformance).
        reference_slots: reproduce the official shared index-key slot (conformance only).
        all_logits: logits of every decoder row instead of the last.

    Returns:
        PassOutput: logits [B, vocab] fp32 (None when a `ced` chunk ends before the decoder tail), the
        state, and stats (start < the old length when the encoder replayed stored tokens).

    Raises:
        ValueError: unknown mode, empty tokens, a prompt_end before the chunk's end, or a batch mismatch.
    """
    if mode not in PREFILL_MODES:
        raise ValueError(f"mode must be one of {PREFILL_MODES}, got {mode!r}")
    if tokens.dim() != 2 or tokens.size(1) == 0:
        raise ValueError(f"tokens must be [B, T] with T >= 1, got {tuple(tokens.shape)}")
    if state is None:
        state = model.new_state(tokens.size(0), device=tokens.device)
    plan = plan_prefill(model, tokens, state, mode=mode, prompt_end=prompt_end)
    plan.mark(state)
    return model.run(
        plan.tokens, state, start=plan.start, enc_floor=plan.enc_floor, dec_from=plan.dec_from,
        dec_floor=plan.dec_floor, tie_break=tie_break, reference_slots=reference_slots, all_logits=all_logits,
    )


@dataclass(frozen=True, kw_only=True)
class PrefillPlan:
    """Which rows one prefill pass runs (`Transformer.run`'s arguments), decided before the state changes.

    Attributes:
        tokens: [B, T'] the rows the encoder runs: the new tokens, after the stored tokens [start, n_cached)
            on an encoder bounded replay.
        start, enc_floor, dec_from, dec_floor: as `Transformer.run` takes them.
        decoder_floor: the chunked-prefill decoder floor the state records (None: removed).
    """

    tokens: torch.Tensor
    start: int
    enc_floor: int
    dec_from: int
    dec_floor: int
    decoder_floor: int | None

    @property
    def end(self) -> int:
        return self.start + self.tokens.size(1)

    def mark(self, state: ModelState) -> None:
        """Record the decoder floor in the state (the one change `prefill` makes before its pass)."""
        if self.decoder_floor is None:
            state.extra.pop("decoder_floor", None)
        else:
            state.extra["decoder_floor"] = self.decoder_floor


def plan_prefill(
    model: Transformer, tokens: torch.Tensor, state: ModelState, *, mode: str, prompt_end: int | None
) -> PrefillPlan:
    """The pass `prefill` runs for new tokens [B, T] (T >= 1) onto `state` (not changed here); shared with
    the batched prefill (model/batched_prefill.py) so that both decide the same rows.

    Raises:
        ValueError: a prompt_end before the chunk's end.
    """
    cfg = model.cfg
    n_cached = state.n_tokens
    end = n_cached + tokens.size(1)
    prompt_end = end if prompt_end is None else prompt_end
    if prompt_end < end:
        raise ValueError(f"prompt_end {prompt_end} is before the end of this chunk ({end})")
    w = cfg.window_size
    encoder = range(model.split if model.split is not None else cfg.n_layers)
    floor = max(0, prompt_end - w)
    start, enc_floor, run_tokens = n_cached, 0, tokens
    needs_ring = mode == "ced" and model.split is not None and floor < n_cached
    if not state.windows_complete(encoder) or (needs_ring and state.enc_from > floor):
        start = enc_floor = _replay_start(model, n_cached)
        run_tokens = torch.cat([state.tokens[:, start:n_cached], tokens], dim=1)
    if mode == "reference" or model.split is None:
        return PrefillPlan(tokens=run_tokens, start=start, enc_floor=enc_floor, dec_from=start,
                           dec_floor=enc_floor, decoder_floor=None)  # fmt: skip
    continuing = state.extra.get("decoder_floor") == floor and start == n_cached
    dec_from = max(floor, start) if continuing else floor
    dec_from = min(dec_from, end)
    return PrefillPlan(tokens=run_tokens, start=start, enc_floor=enc_floor, dec_from=dec_from,
                       dec_floor=floor, decoder_floor=floor)  # fmt: skip


def decode(
    model: Transformer,
    tokens: torch.Tensor,
    state: ModelState,
    *,
    tie_break: str = "deterministic",
    reference_slots: bool = False,
) -> PassOutput:
    """One decode step for B sequences sharing a position: every layer over one new row each.

    Args:
        tokens: [B] int64, the token at position state.n_tokens of each sequence.
        state: a state of batch B (updated and returned).

    Returns:
        PassOutput with logits [B, vocab] fp32.
    """
    if tokens.dim() != 1 or tokens.size(0) != state.batch:
        raise ValueError(f"tokens must be [B={state.batch}], got {tuple(tokens.shape)}")
    state.extra.pop("decoder_floor", None)
    return model.run(tokens.view(-1, 1), state, start=state.n_tokens, tie_break=tie_break,
                     reference_slots=reference_slots)


@torch.inference_mode()
def greedy(model: Transformer, prompt: torch.Tensor, n: int, *, mode: str = "ced") -> list[int]:
    """The n greedy tokens after a cold prefill of `prompt` ([1, T] int64) followed by decode steps: the
    uninterrupted computation that a resumed turn must reproduce bit for bit.

    Raises:
        ValueError: n < 1 (and what `prefill` / `decode` raise).
    """
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    out = prefill(model, prompt, mode=mode)
    state, token = out.state, int(out.logits.argmax(-1))
    tokens = [token]
    while len(tokens) < n:
        step = decode(model, torch.tensor([token], device=prompt.device), state)
        state, token = step.state, int(step.logits.argmax(-1))
        tokens.append(token)
    return tokens


def decode_batch(
    model: Transformer, tokens: torch.Tensor, states: list[ModelState], *, tie_break: str = "deterministic"
) -> torch.Tensor:
    """One decode step for independent sequences (each its own state and position), one sequence at a time.

    Each sequence runs as its own batch-1 step: the slow reference twin of `batched.decode_many`, which
    runs the same step over the stacked rows and must equal this bit for bit.

    Args:
        tokens: [B] int64, one token per state.
        states: B states of batch 1 (each updated).

    Returns:
        [B, vocab] fp32 logits.
    """
    if tokens.dim() != 1 or tokens.size(0) != len(states):
        raise ValueError(f"tokens must be [B={len(states)}], got {tuple(tokens.shape)}")
    rows = [decode(model, tokens[i : i + 1], s, tie_break=tie_break).logits for i, s in enumerate(states)]
    return torch.cat(rows, dim=0)
