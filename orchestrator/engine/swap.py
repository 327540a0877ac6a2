"""MODEL_SWAP's plug point: turn a sender's verified global KV into a receiver state through a registered
mapper artifact. Knows nothing of plans or the registry's SQL; the turn engine asks `usable` before
planning (so a plan never names a mapper that cannot run here) and `apply` after.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from model import ModelState
from orchestrator.engine.served_models import ServedModel

__all__ = ["MapperArtifact", "KVMapperApplier", "NoMappers"]


@dataclass(frozen=True, kw_only=True)
class MapperArtifact:
    """A registered mapper as the engine sees it (from the registry row)."""

    mapper_id: str
    sender_model: str
    receiver_model: str
    artifact_uri: str
    artifact_sha256: str
    kind: str


class KVMapperApplier(Protocol):
    """Applies mapper artifacts to a sender's global KV chunks."""

    def usable(self, artifact: MapperArtifact, sender: ServedModel, receiver: ServedModel) -> bool:
        """Whether this artifact can run for this loaded pair (file present, geometry matches)."""
        ...

    def apply(
        self,
        artifact: MapperArtifact,
        *,
        sender: ServedModel,
        receiver: ServedModel,
        history: Sequence[int],
        sender_blobs: Sequence[bytes],
        n_tokens: int,
    ) -> ModelState:
        """A batch-1 receiver state holding mapped global KV of history[:n_tokens], windows absent.

        Args:
            sender_blobs: the sender's verified global chunks covering [0, n_tokens), in order.
        """
        ...


class NoMappers:
    """No mapper can run: every model switch falls back to a cold prefill on the receiver."""

    def usable(self, artifact: MapperArtifact, sender: ServedModel, receiver: ServedModel) -> bool:
        return False

    def apply(self, artifact: MapperArtifact, **_: object) -> ModelState:
        raise AssertionError(f"NoMappers.apply called for {artifact.mapper_id}: usable() said no")
