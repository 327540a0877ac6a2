"""What a mapper fitting job is asked to do, validated: the pair, the calibration source, the token budget
and the gate settings; and how the budget becomes calibration sequences.

Torch-free (the service validates requests before any child process starts). The same plain-JSON form
is stored in `fit_jobs.source` / `fit_jobs.gate` and handed to the child process.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "CORPORA",
    "DEFAULT_EVAL_PROMPTS",
    "DEFAULT_SEQUENCE_TOKENS",
    "FALLBACKS",
    "GATE_OPTIONS",
    "GATE_THRESHOLDS",
    "MAX_SEQUENCE_TOKENS",
    "CalibrationPlan",
    "FitRequest",
    "plan_calibration",
    "resolve_tokens_file",
]

# Named corpora the child generates from a seed: uniform random ids over the vocabulary, or the family's
# key-value recall episodes over the shipped tokenizer's test-split text.
CORPORA = ("random", "recall")
DEFAULT_SEQUENCE_TOKENS = 128
MAX_SEQUENCE_TOKENS = 8192
DEFAULT_EVAL_PROMPTS = 2
# mappers.FitSpec.fallback's values (spelled out: this module stays free of torch).
FALLBACKS = ("none", "mlp")
# mappers.GateSpec's threshold fields (spelled out: this module stays free of torch).
GATE_THRESHOLDS = (
    "min_attn_cosine", "max_next_token_kl", "min_index_recall", "min_retention", "min_retention_lower"
)
# Gate settings that are not thresholds.
GATE_OPTIONS = ("task_episodes", "eval_prompts", "disabled", "task_seed")
# Calibration sequences per captured batch (both models prefill one batch at a time).
BATCH_SEQUENCES = 2
MAX_TASK_EPISODES = 4096
MAX_EVAL_PROMPTS = 256


@dataclass(frozen=True, kw_only=True)
class CalibrationPlan:
    """The budget as sequences: `train` fitting sequences then `heldout` ones (layer ranking, alpha), each
    of `sequence_tokens`; `rows_total` calibration tokens in all (the budget rounded down)."""

    sequence_tokens: int
    train: int
    heldout: int

    @property
    def rows_total(self) -> int:
        return (self.train + self.heldout) * self.sequence_tokens


def plan_calibration(budget_tokens: int, sequence_tokens: int) -> CalibrationPlan:
    """A quarter of the sequences (at least one) are held out.

    Raises:
        ValueError: a budget that holds fewer than two sequences.
    """
    n = budget_tokens // sequence_tokens
    if n < 2:
        raise ValueError(
            f"budget_tokens={budget_tokens} holds {n} sequence(s) of {sequence_tokens} tokens; at least 2 "
            f"(one to fit, one held out) = {2 * sequence_tokens} tokens are needed"
        )
    heldout = max(1, n // 4)
    return CalibrationPlan(sequence_tokens=sequence_tokens, train=n - heldout, heldout=heldout)


def _source(raw: Mapping[str, Any]) -> dict[str, Any]:
    kind = raw.get("kind")
    if kind == "corpus":
        name = raw.get("name")
        if name not in CORPORA:
            raise ValueError(f"calibration corpus {name!r} is not one of {list(CORPORA)}")
        seed = raw.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"calibration seed {seed!r} must be an integer in [0, 2^63)")
        return {"kind": "corpus", "name": name, "seed": seed}
    if kind == "tokens_file":
        path = raw.get("path")
        if not isinstance(path, str) or not path:
            raise ValueError("calibration tokens_file must name a file")
        return {"kind": "tokens_file", "path": path}
    raise ValueError(f"calibration source kind {kind!r} must be 'corpus' or 'tokens_file'")


def _gate(raw: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(raw) - set(GATE_THRESHOLDS) - set(GATE_OPTIONS))
    if unknown:
        raise ValueError(f"unknown gate settings {unknown}")
    out: dict[str, Any] = {}
    for name in GATE_THRESHOLDS:
        value = raw.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"gate {name}={value!r} must be a finite number")
        out[name] = float(value)
    episodes = int(raw.get("task_episodes", 0))
    if not 0 <= episodes <= MAX_TASK_EPISODES:
        raise ValueError(f"gate task_episodes={episodes} must be in [0, {MAX_TASK_EPISODES}]")
    prompts = int(raw.get("eval_prompts", 0)) or DEFAULT_EVAL_PROMPTS
    if not 1 <= prompts <= MAX_EVAL_PROMPTS:
        raise ValueError(f"gate eval_prompts={prompts} must be in [1, {MAX_EVAL_PROMPTS}]")
    disabled = sorted({str(d) for d in raw.get("disabled", ())})
    bad = [d for d in disabled if d not in GATE_THRESHOLDS]
    if bad:
        raise ValueError(f"gate disabled names {bad} are not thresholds ({list(GATE_THRESHOLDS)})")
    both = sorted(set(disabled) & set(out))
    if both:
        raise ValueError(f"gate {both} are both set and disabled")
    for name in ("min_retention", "min_retention_lower"):
        if name in out and not episodes:
            raise ValueError(f"gate {name} needs task_episodes > 0 (retention must be measured)")
    task_seed = raw.get("task_seed")
    if task_seed is not None:
        if isinstance(task_seed, bool) or not isinstance(task_seed, int) or not 0 <= task_seed < 2**63:
            raise ValueError(f"gate task_seed={task_seed!r} must be an integer in [0, 2^63)")
        out["task_seed"] = task_seed
    out["task_episodes"] = episodes
    out["eval_prompts"] = prompts
    out["disabled"] = disabled
    return out


@dataclass(frozen=True, kw_only=True)
class FitRequest:
    """A validated fitting request.

    Attributes:
        source: {"kind": "corpus", "name": one of CORPORA, "seed": int} or
            {"kind": "tokens_file", "path": str} (a JSON list of token-id lists on the server).
        budget_tokens: calibration tokens, fitting plus held-out rows.
        sequence_tokens: tokens per calibration sequence.
        gate: GateSpec thresholds that are set, `disabled` (thresholds turned off), task_episodes,
            eval_prompts and an optional task_seed.
        fallback: mappers.FitSpec.fallback ("none" or "mlp").
        attention_weighted: mappers.FitSpec.attention_weighted (rows weighted by the receiver's attention).
    """

    sender_model: str
    receiver_model: str
    source: Mapping[str, Any]
    budget_tokens: int
    sequence_tokens: int = DEFAULT_SEQUENCE_TOKENS
    gate: Mapping[str, Any] = field(default_factory=dict)
    fallback: str = "none"
    attention_weighted: bool = False

    def __post_init__(self) -> None:
        if not self.sender_model:
            raise ValueError("sender_model is required")
        if not self.receiver_model:
            raise ValueError("receiver_model is required")
        if self.sender_model == self.receiver_model:
            raise ValueError(f"sender and receiver are both {self.sender_model!r}: a mapper needs two models")
        if self.budget_tokens <= 0:
            raise ValueError(f"budget_tokens={self.budget_tokens} must be positive")
        if not 1 <= self.sequence_tokens <= MAX_SEQUENCE_TOKENS:
            raise ValueError(f"sequence_tokens={self.sequence_tokens} must be in [1, {MAX_SEQUENCE_TOKENS}]")
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback {self.fallback!r} must be one of {list(FALLBACKS)}")
        object.__setattr__(self, "source", _source(self.source))
        object.__setattr__(self, "gate", _gate(self.gate))
        plan_calibration(self.budget_tokens, self.sequence_tokens)

    @property
    def plan(self) -> CalibrationPlan:
        return plan_calibration(self.budget_tokens, self.sequence_tokens)

    def stored_source(self) -> dict[str, Any]:
        """`fit_jobs.source`: the source with how its rows become a map (sequence length, fallback)."""
        return dict(self.source) | {
            "sequence_tokens": self.sequence_tokens,
            "fallback": self.fallback,
            "attention_weighted": self.attention_weighted,
        }

    @classmethod
    def from_stored(
        cls, *, sender_model: str, receiver_model: str, source: Mapping[str, Any], budget_tokens: int,
        gate: Mapping[str, Any],
    ) -> FitRequest:
        """The request a stored job was made from (a resubmission runs it again)."""
        src = dict(source)
        seq = int(src.pop("sequence_tokens", DEFAULT_SEQUENCE_TOKENS))
        fallback = str(src.pop("fallback", "none"))
        weighted = bool(src.pop("attention_weighted", False))
        return cls(sender_model=sender_model, receiver_model=receiver_model, source=src,
                   budget_tokens=budget_tokens, sequence_tokens=seq, gate=gate, fallback=fallback,
                   attention_weighted=weighted)

    def to_json(self) -> dict[str, Any]:
        return {
            "sender_model": self.sender_model,
            "receiver_model": self.receiver_model,
            "source": dict(self.source),
            "budget_tokens": self.budget_tokens,
            "sequence_tokens": self.sequence_tokens,
            "gate": dict(self.gate),
            "fallback": self.fallback,
            "attention_weighted": self.attention_weighted,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> FitRequest:
        return cls(**dict(doc))


def resolve_tokens_file(path: str, data_dir: Path) -> Path:
    """A tokens_file source's path on the server: relative paths are under `data_dir`.

    Raises:
        ValueError: the file does not exist.
    """
    p = Path(path)
    p = p if p.is_absolute() else data_dir / p
    if not p.is_file():
        raise ValueError(f"calibration tokens_file {path!r} is not a file on the server ({p})")
    return p
