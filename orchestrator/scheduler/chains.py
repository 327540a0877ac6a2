"""A turn's generation as a chain of passes the scheduler continues by itself, as continuous-batching
engines do (vLLM v1's scheduler samples and schedules the next token; the API server only streams).

After each pass of a chain the scheduler samples the turn's next token from the pass's logits and, when
that token's decode is wanted, queues it at once: the next step takes it without waiting for the turn's
thread to wake up, sample and ask (measured before chains, 64 sessions of v41-sib-s with a model
process: the steps waited for those follow-ups about 3.5% of the run, and the model process idled
meanwhile). The turn's thread streams the tokens and checks cancellation between them; it halts the
chain when it stops early.

Exactness: the chain calls the turn's own sampler once per token, in the order the turn would have, on
the same logits, so a chained turn samples the tokens an unchained one does (tests compare them).

Knows nothing of models or sessions: a sampler maps logits to a token id.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

__all__ = ["Continued", "DecodeChain", "continue_chain"]


class DecodeChain:
    """One turn's generation rules, and how many tokens it has sampled.

    A decode is wanted for a sampled token when the turn goes on after it (not a stop token, fewer than
    `max_new_tokens` sampled) or when the turn persists its state (the stored history ends with the
    last token, so that one runs through the model too). Sampling goes on after a decode only when
    the turn goes on after its token.

    Args:
        sample: the turn's sampler (logits -> token id), called once per token, in order.
        stops: token ids that end the turn.
        max_new_tokens: most tokens the turn generates (>= 1).
        persist: the turn keeps its state (every sampled token is decoded).

    `greedy`: the sampler says it reads only the logits' greedy choice (its `greedy` attribute, as a
    greedy `engine.sampler.Sampler` has), so a compute may hand over that choice instead of the logits
    (`engine.sampler.ChosenToken`); a sampler that does not say so gets the logits.
    """

    def __init__(self, sample: Callable[[Any], int], *, stops: Collection[int], max_new_tokens: int,
                 persist: bool) -> None:  # fmt: skip
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        self.greedy = getattr(sample, "greedy", False) is True
        self._sample = sample
        self._stops = frozenset(stops)
        self._max_new_tokens = max_new_tokens
        self._persist = persist
        self._lock = threading.Lock()
        self._halted = False
        self.sampled = 0

    def halt(self) -> None:
        """Sample nothing more: a pass of the chain that ends after this returns its output alone (its
        Continued has no token), so the turn's state covers what the turn has seen."""
        with self._lock:
            self._halted = True

    def after(self, logits: Any) -> tuple[int, bool, bool] | None:
        """The next token from a chain pass's logits: (token, its decode is wanted, sampling goes on after
        that decode), or None when the chain was halted."""
        with self._lock:
            if self._halted:
                return None
            token = self._sample(logits)
            self.sampled += 1
            goes_on = token not in self._stops and self.sampled < self._max_new_tokens
            return token, goes_on or self._persist, goes_on


@dataclass(frozen=True, slots=True)
class Continued:
    """What a chain pass's future holds.

    output: the pass's own output (the compute's PassOutput).
    token: sampled from its logits; None when the chain was halted before it ended.
    decode: the token's decode is wanted.
    then: the chain that continues after that decode (None: the turn ends with the token).
    next: that decode, already queued by the scheduler; None when the caller is to submit it (a
        scheduler without a queue) or when it is not wanted.
    """

    output: Any
    token: int | None
    decode: bool
    then: DecodeChain | None
    next: Future | None


def continue_chain(chain: DecodeChain, output: Any, queue: Callable[[int, DecodeChain | None], Future] | None
                   ) -> Continued:  # fmt: skip
    """Apply the chain to a pass's output: sample the next token and, when its decode is wanted and
    `queue` is given, queue that decode (queue(token, chain to continue after it or None) -> its
    future)."""
    step = chain.after(output.logits)
    if step is None:
        return Continued(output=output, token=None, decode=False, then=None, next=None)
    token, decode, goes_on = step
    then = chain if goes_on else None
    queued = queue(token, then) if decode and queue is not None else None
    return Continued(output=output, token=token, decode=decode, then=then, next=queued)
