"""The served models as the Models service sees them: `RegistryCatalog` describes the registry's models.

Knows nothing of protobuf; describing a model loads it (its fingerprint needs the weights).
"""

from __future__ import annotations

from collections.abc import Sequence

from model import kv_bytes
from orchestrator.api import ModelDescription, model_not_served
from orchestrator.engine.served_models import ModelRegistry, ServedModel

__all__ = ["RegistryCatalog", "served_or_not_found"]


def served_or_not_found(registry: ModelRegistry, name: str) -> ServedModel:
    """The loaded model `name`.

    Raises:
        NotFoundError: reason MODEL_NOT_SERVED, naming the models this node serves.
    """
    served = registry.get(name)
    if served is None:
        raise model_not_served(name, registry.names)
    return served


class RegistryCatalog:
    """`ModelCatalog` over a `ModelRegistry`."""

    def __init__(self, registry: ModelRegistry) -> None:
        self._registry = registry

    @property
    def names(self) -> tuple[str, ...]:
        return self._registry.names

    def _served(self, name: str) -> ServedModel:
        return served_or_not_found(self._registry, name)

    def describe(self, name: str) -> ModelDescription | None:
        if name not in self._registry.names:
            return None
        served = self._served(name)
        cfg = served.model.cfg
        spec = served.spec
        return ModelDescription(
            name=name,
            fingerprint=served.fingerprint_hex,
            numerics_profile=served.numerics.label,
            vocab_size=cfg.vocab_size,
            window=cfg.window_size,
            max_context_tokens=cfg.max_seq_len,
            kv_bytes_per_token=float(kv_bytes(cfg).global_bytes_per_token),
            tokenizer=served.codec.name,
            source=spec.source,
            config_name=spec.config or (spec.checkpoint.name if spec.checkpoint is not None else ""),
        )

    def tokenize(self, name: str, text: str) -> list[int]:
        return list(self._served(name).codec.encode(text))

    def detokenize(self, name: str, ids: Sequence[int]) -> str:
        return self._served(name).codec.decode(list(ids))
