"""What crosses the boundary between the service process and its model process: one pickled request and
one pickled reply per call on a `multiprocessing.connection` (AF_UNIX, authenticated), and the forms a
forward pass's output and an error take on the way.

Logits cross as numpy arrays (pickle protocol 5 copies their bytes once; torch's own tensor pickling goes
through `torch.save`, several times slower per call); a float32 array and the tensor rebuilt from it are
the same bytes, so what the sampler sees is bit for bit what the model computed. A pass over many
sequences sends all its logits rows as one array (`WireOutputs`): pickling costs about 13 us an array
whatever its size, so a 46-sequence decode pass's reply took 0.65 ms to pickle and 0.19 ms to unpickle as
46 arrays, and 0.03 ms each as one (AMD EPYC Zen 4, measured), time the model process idled between
passes. A batched pass sends back only what the service reads of each row (session 34: `WireOutputs.pack`'s
`wanted`): a greedy chain's sampler reads only the row's greedy choice, which crosses as an int made there
with the sampler's own function (`engine.sampler.greedy_token`), and a pass without a chain has its logits
read by nobody. Errors cross as the
exception object when it pickles and unpickles, else as a RuntimeError naming its type and message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from orchestrator.child_process import Reply, dumps, loads, pack_error
from orchestrator.engine.sampler import greedy_token
from orchestrator.scheduler.work import LOGITS_WANTED

__all__ = [
    "Reply",
    "WireOutput",
    "WireOutputs",
    "check_wanted",
    "dumps",
    "loads",
    "pack_error",
    "pack_logits",
    "unpack_logits",
]


def pack_logits(logits: torch.Tensor | None) -> np.ndarray | None:
    if logits is None:
        return None
    # contiguous so the array is one buffer; detach: inference tensors have no grad anyway
    return logits.detach().contiguous().numpy()


def check_wanted(wanted: Sequence[str] | None, n: int) -> None:
    """Refuse what of n outputs' logits to send (`WireOutputs.pack`'s `wanted`) unless it is None or one of
    `scheduler.work.LOGITS_WANTED` per output (the model process asks before it runs the pass, so that a
    pass that ran never fails at packing).

    Raises:
        ValueError: naming what was given.
    """
    if wanted is not None and (len(wanted) != n or any(w not in LOGITS_WANTED for w in wanted)):
        raise ValueError(f"logits must give one of {LOGITS_WANTED} per sequence ({n}), got {list(wanted)!r}")


def unpack_logits(packed: np.ndarray | None) -> torch.Tensor | None:
    if packed is None:
        return None
    return torch.from_numpy(packed)


@dataclass(frozen=True, slots=True)
class WireOutput:
    """A forward pass's output as it crosses: the state by its id in the model process, its length, the
    logits array and the pass statistics (a small dataclass of ints); `choice`: the logits' greedy choice
    instead of the array, where only that was asked for (`WireOutputs.pack`)."""

    state_id: int
    n_tokens: int
    logits: np.ndarray | None
    stats: Any
    choice: int | None = None


@dataclass(frozen=True, slots=True)
class WireOutputs:
    """The outputs of a pass over many sequences, in order: each one's state id, length and statistics,
    and the logits rows of those that have logits, stacked into one array (a prompt chunk that ends before
    its prompt has none)."""

    state_ids: list[int]
    n_tokens: list[int]
    stats: list[Any]
    has_logits: list[bool]
    logits: np.ndarray | None  # [rows with logits, vocab]
    # each output's greedy choice where only that was asked for (else None)
    choices: list[int | None] | None = None

    @classmethod
    def pack(cls, outs: list[Any], state_ids: list[int], wanted: Sequence[str] | None = None) -> WireOutputs:
        """`outs`: PassOutputs with logits [1, vocab] or None; `state_ids`: the id each output's state has;
        `wanted`: what of each output's logits to send (`scheduler.work.LOGITS_WANTED`: the row, its
        greedy choice, or nothing; None: every row). Measured (AMD EPYC Zen 4, session 34): a 46-sequence
        decode pass's 816 KB reply took the model process 0.85 ms to pickle and send and the service
        about 0.8 ms to receive and unpickle, between two passes; the chains of that load read only greedy
        choices.

        Raises:
            ValueError: `wanted` not one of those per output.
        """
        check_wanted(wanted, len(outs))
        if wanted is None:
            wanted = ["full"] * len(outs)
        full = [o.logits is not None and w == "full" for o, w in zip(outs, wanted, strict=True)]
        rows = [o.logits for o, f in zip(outs, full, strict=True) if f]
        choices = [greedy_token(o.logits) if o.logits is not None and w == "argmax" else None
                   for o, w in zip(outs, wanted, strict=True)]  # fmt: skip
        return cls(
            state_ids=list(state_ids),
            n_tokens=[o.state.n_tokens for o in outs],
            stats=[o.stats for o in outs],
            has_logits=full,
            logits=pack_logits(torch.cat(rows)) if rows else None,
            choices=choices if any(c is not None for c in choices) else None,
        )

    def unpack(self) -> list[WireOutput]:
        """One WireOutput per output; a row's logits [1, vocab] is a view of the reply's one array."""
        out: list[WireOutput] = []
        at = 0
        choices = self.choices if self.choices is not None else [None] * len(self.state_ids)
        rows = zip(self.state_ids, self.n_tokens, self.stats, self.has_logits, choices, strict=True)
        for sid, n, stats, has, choice in rows:
            row = None
            if has:
                assert self.logits is not None
                row = self.logits[at : at + 1]
                at += 1
            out.append(WireOutput(state_id=sid, n_tokens=n, logits=row, stats=stats, choice=choice))
        return out
