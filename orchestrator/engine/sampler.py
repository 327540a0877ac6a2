"""Next-token choice from logits: greedy at temperature 0, else temperature / top-k / top-p sampling
with a per-turn seeded generator (the same seed and logits give the same tokens).

Knows nothing of the model or the session.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orchestrator.api import GenerationSpec

__all__ = ["ChosenToken", "Sampler", "greedy_token"]


def greedy_token(logits: torch.Tensor) -> int:
    """The greedy choice of [1, vocab] (or [vocab]) fp32 CPU logits: the first maximal index, NaN counting
    as the maximum. The one function both processes use, so that a choice the model process makes
    (`ChosenToken`) is the one this process would make."""
    # numpy's argmax is vectorised where torch's CPU argmax is not: 3 us against 42 us over a 32K
    # vocabulary (measured, Intel Xeon, torch 2.13), and it keeps the GIL, where torch's op lets go of it
    # and the turn's thread then waits for the service's other threads to get it back (about 34 us a call
    # at 512 ids under cProfile, one no-op session). Both give the first maximal index and count NaN as
    # the maximum (test_sampler.py compares them). The flattening too is numpy's: torch's reshape is a
    # dispatched op, which lets go of the GIL.
    return int(logits.numpy().reshape(-1).argmax())


@dataclass(frozen=True, slots=True)
class ChosenToken:
    """A pass's logits as the model process hands them over for a turn that samples greedily: only their
    greedy choice (`greedy_token`, computed there on the very logits), not the vocabulary-wide row (16 KB
    at 4K ids: a 46-sequence decode pass's reply was 816 KB, session 34). Only a greedy Sampler reads it."""

    token: int


class Sampler:
    """Samples one token per call for one turn."""

    def __init__(self, spec: GenerationSpec) -> None:
        self._spec = spec
        self._gen: torch.Generator | None = None
        if spec.temperature > 0:
            self._gen = torch.Generator()
            if spec.seed is not None:
                self._gen.manual_seed(spec.seed)
            else:
                self._gen.seed()

    @property
    def greedy(self) -> bool:
        """Whether a token is the logits' greedy choice (temperature 0): then a `ChosenToken` will do."""
        return self._gen is None

    def __call__(self, logits: torch.Tensor | ChosenToken) -> int:
        """logits: [1, vocab] (or [vocab]) fp32, any device, or their greedy choice made where they were
        computed (`ChosenToken`, for a greedy sampler only) -> the chosen token id.

        Raises:
            ValueError: a ChosenToken given to a sampler that draws at a temperature (a wiring bug: the
                scheduler asks for a choice only for greedy chains).
        """
        spec = self._spec
        if isinstance(logits, ChosenToken):
            if self._gen is not None:
                raise ValueError(
                    f"a sampler at temperature {spec.temperature} needs the logits, got only their greedy "
                    f"choice {logits.token}"
                )
            return logits.token
        if self._gen is None:
            if logits.device.type == "cpu" and logits.dtype == torch.float32:
                return greedy_token(logits)
            # argmax of the logits where they are: the same index as of their flat fp32 CPU copy (the
            # cast to fp32 is exact and the flat order is the logical order), one dispatch instead of four
            return int(logits.argmax())
        # the generator lives on the CPU; one row of logits is cheap to move
        row = logits.reshape(-1).float().cpu()
        # Shift by the max before dividing: every scaled logit is then <= 0, so a tiny temperature
        # (1e-38) sends the others to -inf instead of overflowing to inf - inf = NaN in the softmax.
        row = (row - row.max()) / spec.temperature
        if spec.top_k > 0 and spec.top_k < row.numel():
            kth = torch.topk(row, spec.top_k).values[-1]
            row = row.masked_fill(row < kth, -torch.inf)
        probs = torch.softmax(row, dim=-1)
        if spec.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = sorted_p.cumsum(0) - sorted_p >= spec.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
            probs = probs / probs.sum()
        return int(torch.multinomial(probs, 1, generator=self._gen))
