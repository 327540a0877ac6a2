"""What the Models service needs to know of the served models, as domain types (no protobuf, no torch).

The engine implements `ModelCatalog` over its model registry and wires it into the context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["ModelDescription", "ModelCatalog"]


@dataclass(frozen=True, kw_only=True)
class ModelDescription:
    """One served model with the limits a caller plans around (fields as in models.proto's ModelInfo)."""

    name: str
    fingerprint: str
    numerics_profile: str
    vocab_size: int
    window: int
    max_context_tokens: int
    kv_bytes_per_token: float
    tokenizer: str
    source: str
    config_name: str


class ModelCatalog(Protocol):
    """The served models, loaded on demand (a description needs the weights' fingerprint)."""

    @property
    def names(self) -> tuple[str, ...]: ...

    def describe(self, name: str) -> ModelDescription | None:
        """None when `name` is not served here."""
        ...

    def tokenize(self, name: str, text: str) -> list[int]:
        """Raises: NotFoundError for a model not served here."""
        ...

    def detokenize(self, name: str, ids: Sequence[int]) -> str:
        """Raises: NotFoundError for a model not served here; InvalidRequestError for an id outside the
        vocabulary."""
        ...
