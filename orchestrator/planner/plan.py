"""The planner's output: which resume path a turn takes, why, and how many tokens of each kind it touches.

Knows nothing of how a plan is executed; the turn engine runs it and the API streams it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["ResumePath", "PlanReason", "TokenCounts", "Plan"]


class ResumePath(enum.StrEnum):
    """The four resume paths of ARCHITECTURE §1 (values equal the proto enum's names)."""

    FULL_HIT = "FULL_HIT"
    GLOBAL_REPLAY = "GLOBAL_REPLAY"
    COLD_PREFILL = "COLD_PREFILL"
    MODEL_SWAP = "MODEL_SWAP"


class PlanReason(enum.StrEnum):
    """Why the planner chose its path, as a stable code (values equal the proto's PlanReason names
    without their PLAN_REASON_ prefix); `Plan.reason` says the same in words, with figures."""

    NEW_SESSION = "NEW_SESSION"
    WINDOWS_IN_POOL = "WINDOWS_IN_POOL"
    WINDOWS_REBUILT = "WINDOWS_REBUILT"
    NOTHING_USABLE_STORED = "NOTHING_USABLE_STORED"
    COLD_CHEAPER = "COLD_CHEAPER"
    NO_VALIDATED_MAPPER = "NO_VALIDATED_MAPPER"
    NOTHING_STORED_TO_MAP = "NOTHING_STORED_TO_MAP"
    MAPPED_FROM_LAST_MODEL = "MAPPED_FROM_LAST_MODEL"
    WINDOWS_BY_CONTENT = "WINDOWS_BY_CONTENT"
    PREFIX_BY_CONTENT = "PREFIX_BY_CONTENT"
    MAPPED_BY_CONTENT = "MAPPED_BY_CONTENT"


@dataclass(frozen=True, kw_only=True)
class TokenCounts:
    """Tokens of a turn by kind (ARCHITECTURE §1).

    Invariants for a prompt of `total` = history + new tokens:
    `cached + mapped + prefilled == total` (every prompt token's global KV is loaded, mapped, or computed);
    `replayed_encoder <= cached + mapped` (only stored/mapped tokens are re-run to rebuild windows);
    `replayed_decoder` counts history tokens inside the decoder's last-W window (re-run on every path).
    """

    cached: int = 0
    replayed_encoder: int = 0
    replayed_decoder: int = 0
    prefilled: int = 0
    mapped: int = 0

    def __post_init__(self) -> None:
        for name in ("cached", "replayed_encoder", "replayed_decoder", "prefilled", "mapped"):
            if getattr(self, name) < 0:
                raise ValueError(f"token count {name}={getattr(self, name)} must be >= 0")
        if self.replayed_encoder > self.cached + self.mapped:
            raise ValueError(
                f"replayed_encoder={self.replayed_encoder} exceeds the stored tokens "
                f"(cached={self.cached} + mapped={self.mapped})"
            )

    @property
    def prompt_tokens(self) -> int:
        return self.cached + self.mapped + self.prefilled


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A turn's resume plan.

    Attributes:
        path: the resume path.
        model: the model that serves the turn (the receiver on a swap).
        reason: why this path, in words (streamed to the caller and logged).
        reason_code: the same as a stable code.
        counts: token counts by kind.
        resume_from: first position the encoder computes from scratch (== cached + mapped).
        replay_from: first stored position re-run through the encoder to rebuild windows
            (== resume_from when nothing is replayed).
        source_model: the model whose stored KV is read (the sender on a swap; None on a cold prefill).
        mapper_id: the mapper used on a swap, else None.
        persist: whether the turn may store its global KV (False when residency forbids this node).
        persist_note: why KV is not persisted, empty when it is.
        estimated_s: the cost model's estimate of the chosen path.
        alternatives: (path, estimated seconds) of every valid path considered, cheapest first.
    """

    path: ResumePath
    model: str
    reason: str
    reason_code: PlanReason
    counts: TokenCounts
    resume_from: int
    replay_from: int
    source_model: str | None = None
    mapper_id: str | None = None
    persist: bool = True
    persist_note: str = ""
    estimated_s: float = 0.0
    alternatives: tuple[tuple[ResumePath, float], ...] = ()

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("plan model must be non-empty")
        if not 0 <= self.replay_from <= self.resume_from:
            raise ValueError(
                f"replay_from={self.replay_from} must lie in [0, resume_from={self.resume_from}]"
            )
        if self.resume_from != self.counts.cached + self.counts.mapped:
            raise ValueError(
                f"resume_from={self.resume_from} != cached {self.counts.cached} + mapped {self.counts.mapped}"
            )
        if (self.path == ResumePath.MODEL_SWAP) != (self.mapper_id is not None):
            raise ValueError(
                f"path {self.path} with mapper_id={self.mapper_id!r}: only MODEL_SWAP uses a mapper"
            )
        if self.path == ResumePath.COLD_PREFILL and self.resume_from != 0:
            raise ValueError(f"COLD_PREFILL reuses nothing, but resume_from={self.resume_from}")
