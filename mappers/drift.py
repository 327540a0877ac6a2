"""Multi-turn drift: a session that switches back and forth between two models every turn, its global KV
mapped at each switch, scored per turn against the turn's model on its own uninterrupted cache.

Knows nothing of storage or serving. Per episode (a family recall episode whose evidence lies in the
first turn's tokens): turn 0 is the history up to `first_tokens`, each later turn adds `turn_tokens` of
it. Turn k runs on model A for even k and model B for odd k; at each switch the previous model's whole
global KV goes through the mapper of that direction (`apply_mapper`) and the turn's model continues from
it (`state_from_global`: encoder bounded replay, then its new tokens). After every turn a probe (the
episode's question and answer, not kept in the history) runs on a copy of the state; the turn's model
also runs the same history uninterrupted (its own cache) and the same probe. Early entries have been
mapped k times by turn k, so a falling per-turn retention is the drift.

Per turn: retention = Σ mapped right / Σ own right over episodes, with a 95% paired-bootstrap interval.
Slope: least-squares retention against turn; its interval resamples episodes (every turn of an
episode together) and refits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mappers.apply import apply_mapper
from mappers.artifact import KVMapper
from mappers.retention import bootstrap_ratio_ci
from model import Transformer, model_fingerprint, prefill, state_from_global

__all__ = ["DriftReport", "measure_drift"]


@dataclass(frozen=True, kw_only=True)
class DriftReport:
    """right[path][episode][turn] (1/0), path "mapped" or "own"; models[turn] the turn's model name."""

    models: tuple[str, ...]
    mapped: np.ndarray
    own: np.ndarray
    turn_tokens: int
    first_tokens: int

    def per_turn(self, n_boot: int = 2000, seed: int = 0) -> list[dict[str, float]]:
        rows = []
        for k in range(self.mapped.shape[1]):
            point, lo, hi = bootstrap_ratio_ci(self.mapped[:, k], self.own[:, k], n_boot=n_boot,
                                               seed=seed + k)
            rows.append({"turn": k, "model": self.models[k], "mapped_acc": float(self.mapped[:, k].mean()),
                         "own_acc": float(self.own[:, k].mean()), "retention": point, "ci_lower": lo,
                         "ci_upper": hi})
        return rows

    @staticmethod
    def _slope(mapped: np.ndarray, own: np.ndarray, turns: np.ndarray) -> float:
        den = own.sum(0)
        ret = np.divide(mapped.sum(0), den, out=np.zeros(len(turns)), where=den > 0)
        return float(np.polyfit(turns, ret, 1)[0])

    def slope(
        self, n_boot: int = 2000, seed: int = 0, level: float = 0.95, *, from_turn: int = 0
    ) -> tuple[float, float, float]:
        """(slope of retention per turn, lower, upper) over turns `from_turn`.. (turn 0 is unmapped: 1 to
        skip it): episode-resampled percentile interval."""
        mapped, own = self.mapped[:, from_turn:], self.own[:, from_turn:]
        turns = np.arange(from_turn, self.mapped.shape[1], dtype=np.float64)
        if turns.size < 2:
            raise ValueError(f"a slope needs two turns from turn {from_turn}")
        point = self._slope(mapped, own, turns)
        rng = np.random.default_rng(seed)
        reps = []
        for _ in range(n_boot):
            idx = rng.integers(0, mapped.shape[0], mapped.shape[0])
            reps.append(self._slope(mapped[idx], own[idx], turns))
        lo, hi = np.quantile(reps, [(1 - level) / 2, (1 + level) / 2])
        return point, float(lo), float(hi)


def _probe_right(model: Transformer, state, probe: torch.Tensor, answer: tuple[int, int]) -> int:
    """Whether the model answers the probe (question + answer tokens) from `state` (not modified)."""
    out = prefill(model, probe, state.clone(), all_logits=True)
    logits = out.logits if out.logits.dim() == 3 else out.logits.unsqueeze(1)
    start, end = answer  # positions inside the probe
    pred = logits[0, start - 1 : end - 1].argmax(-1)
    return int(torch.equal(pred.cpu(), probe[0, start:end].cpu()))


@torch.no_grad()
def measure_drift(
    mappers: dict[tuple[str, str], KVMapper],
    models: dict[str, Transformer],
    order: tuple[str, str],
    tokens: torch.Tensor,
    answers: list[tuple[int, int]],
    *,
    suffix_tokens: int,
    turns: int = 10,
    turn_tokens: int = 32,
) -> DriftReport:
    """Run the switching session on every episode.

    Args:
        mappers: (sender name, receiver name) -> mapper, both directions of `order`.
        models: name -> model.
        order: (model of even turns, model of odd turns).
        tokens: [N, L] episodes ending with their question and answer (the last `suffix_tokens`).
        answers: per episode, the answer span in sequence coordinates (inside the suffix).

    Raises:
        ValueError: a history too short for the turns, or a missing mapper.
    """
    a, b = order
    for pair in ((a, b), (b, a)):
        if pair not in mappers:
            raise ValueError(f"no mapper for {pair[0]} -> {pair[1]}")
    n, length = tokens.shape
    history = length - suffix_tokens
    first = history - (turns - 1) * turn_tokens
    if first < 1:
        raise ValueError(f"a history of {history} tokens cannot hold {turns} turns of {turn_tokens} tokens")
    fps = {name: model_fingerprint(m) for name, m in models.items()}
    names = tuple(a if k % 2 == 0 else b for k in range(turns))
    mapped_right = np.zeros((n, turns), dtype=np.int64)
    own_right = np.zeros((n, turns), dtype=np.int64)
    for e in range(n):
        row = tokens[e : e + 1]
        probe = row[:, history:]
        span = (answers[e][0] - history, answers[e][1] - history)
        own_states: dict[str, object] = {}
        state = None
        end = 0
        for k in range(turns):
            name, model = names[k], models[names[k]]
            new_end = first if k == 0 else end + turn_tokens
            seg = row[:, end:new_end]
            if k == 0:
                state = prefill(model, seg).state
            else:
                prev = names[k - 1]
                mapper = mappers[(prev, name)]
                kwargs = {"receiver_model": model} if mapper.needs_receiver_weights else {}
                mapped = apply_mapper(mapper, state, sender_fingerprint=fps[prev],
                                      receiver_fingerprint=fps[name], **kwargs)
                state = state_from_global(model, row[:, :end], list(mapped.blobs), fingerprint=fps[name])
                state = prefill(model, seg, state).state
            # the turn's model on its own uninterrupted cache of the same history
            if name in own_states:
                own = prefill(model, row[:, own_states[name][0] : new_end], own_states[name][1]).state
            else:
                own = prefill(model, row[:, :new_end]).state
            own_states[name] = (new_end, own)
            end = new_end
            mapped_right[e, k] = _probe_right(model, state, probe, span)
            own_right[e, k] = _probe_right(model, own, probe, span)
    return DriftReport(models=names, mapped=mapped_right, own=own_right, turn_tokens=turn_tokens,
                       first_tokens=first)

