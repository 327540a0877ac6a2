"""MODEL_SWAP's plug point: turn a sender's verified global KV into a receiver state through a registered
mapper artifact. Knows nothing of plans or the registry's SQL; the turn engine asks `usable` before
planning (so a plan never names a mapper that cannot run here) and `apply` after.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import structlog
import torch

from mappers import KVMapper, applicability, apply_mapper, load_mapper, read_metadata
from model import ModelState, state_from_global
from orchestrator.engine.served_models import ServedModel

__all__ = ["MapperArtifact", "KVMapperApplier", "NoMappers", "ArtifactMappers", "registration_of"]

log = structlog.get_logger(__name__)


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


def _artifact_dir(uri: str) -> Path:
    return Path(uri.removeprefix("file://"))


class ArtifactMappers:
    """Applies registered mapper artifacts (`mappers.save_mapper` directories) with `mappers.apply_mapper`.

    An artifact is usable for a loaded pair when its directory loads and validates, its recorded weights
    digest equals the registered `artifact_sha256` (when one was registered), both configs equal the
    loaded models' configs, and `mappers.applicability` accepts the two fingerprints and its gate.
    Loaded artifacts are cached by (uri, digest).
    """

    def __init__(self, build_state: Callable[..., Any] | None = None) -> None:
        """`build_state(receiver, tokens, blobs)`: where the receiver state is built from the mapped
        chunks (default: here, `model.state_from_global`; a model process's `ProcessCompute` builds it
        there, with the same function)."""
        self._build_state = build_state
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, str], KVMapper | None] = {}
        self._alternates: dict[bytes, frozenset[str]] = {}

    def _bound(self, mapper: KVMapper, sender: ServedModel, receiver: ServedModel) -> KVMapper:
        """`mapper` bound to the served pair when a side's recorded fingerprint names the served model
        under the other pinned CPU path (an artifact fitted under portable, served under strict): the
        weights and config are the ones it was fitted and gated on, only the caches' rounding differs,
        and the mapped chunks get the receiver's own fingerprint. Anything else is left to mismatch."""
        sides = {}
        for side, served in (("sender", sender), ("receiver", receiver)):
            ref = getattr(mapper, side)
            if ref.fingerprint is None or ref.fingerprint == served.fingerprint.hex():
                continue
            with self._lock:
                alternates = self._alternates.get(served.fingerprint)
            if alternates is None:
                alternates = served.alternate_fingerprints()
                with self._lock:
                    self._alternates[served.fingerprint] = alternates
            if ref.fingerprint in alternates:
                sides[side] = dataclasses.replace(ref, fingerprint=served.fingerprint.hex())
        return dataclasses.replace(mapper, **sides) if sides else mapper

    def _load(self, artifact: MapperArtifact) -> KVMapper | None:
        key = (artifact.artifact_uri, artifact.artifact_sha256)
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        directory = _artifact_dir(artifact.artifact_uri)
        try:
            doc = read_metadata(directory)
            if artifact.artifact_sha256 and doc.get("weights_sha256") != artifact.artifact_sha256:
                raise ValueError(f"registered digest {artifact.artifact_sha256} differs from the artifact's")
            mapper: KVMapper | None = load_mapper(directory)
        except (OSError, ValueError) as exc:
            log.warning("mapper_artifact_unusable", mapper_id=artifact.mapper_id, error=str(exc))
            mapper = None
        with self._lock:
            self._cache[key] = mapper
        return mapper

    def usable(self, artifact: MapperArtifact, sender: ServedModel, receiver: ServedModel) -> bool:
        mapper = self._load(artifact)
        if mapper is None:
            return False
        if mapper.sender.config.to_dict() != sender.model.cfg.to_dict():
            return False
        if mapper.receiver.config.to_dict() != receiver.model.cfg.to_dict():
            return False
        mapper = self._bound(mapper, sender, receiver)
        verdict = applicability(
            mapper, sender_fingerprint=sender.fingerprint, receiver_fingerprint=receiver.fingerprint
        )
        return verdict.ok

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
        mapper = self._load(artifact)
        assert mapper is not None, "apply() without a usable() artifact"
        mapper = self._bound(mapper, sender, receiver)
        device = torch.device(receiver.device)
        tokens = torch.tensor([list(history[:n_tokens])], dtype=torch.int64, device=device)
        # mlp parts read the history's token embeddings and the receiver's weights (a copy loaded again
        # where this process released them, the model computing in a model process); ridge parts ignore them
        mapped = apply_mapper(
            mapper,
            list(sender_blobs),
            sender_fingerprint=sender.fingerprint,
            receiver_fingerprint=receiver.fingerprint,
            device=device,
            receiver_model=receiver.weights() if mapper.needs_receiver_weights else None,
            tokens=tokens if mapper.needs_tokens else None,
        )
        if mapped.n_tokens != n_tokens:
            raise ValueError(
                f"mapper produced {mapped.n_tokens} tokens of global KV, the plan needs {n_tokens}"
            )
        if self._build_state is not None:
            return self._build_state(receiver, list(history[:n_tokens]), list(mapped.blobs))
        return state_from_global(receiver.model, tokens, list(mapped.blobs), fingerprint=receiver.fingerprint)


# Gates a registry row can state ("figure >= threshold"), in order of preference: (gate knob, figure).
_AT_LEAST_GATES = (
    ("min_retention_lower", "retention_ci_lower"),
    ("min_retention", "retention"),
    ("min_attn_cosine", "attn_cosine_mean"),
    ("min_index_recall", "index_recall"),
)


def registration_of(directory: Path | str) -> dict[str, object]:
    """The registry fields of a saved mapper artifact, from its own metadata: pair names, weights digest,
    measured figures (`quality`) and gate verdict. The registry states a gate as one "figure >= threshold";
    the first such knob of the artifact's gate with a measured figure is used, and an artifact whose gate
    has none of them registers as not passed (it cannot be shown to have passed here).

    Raises:
        FileNotFoundError, ValueError: not a mapper artifact.
    """
    directory = Path(directory)
    doc = read_metadata(directory)
    quality = {str(k): float(v) for k, v in dict(doc.get("quality", {})).items()}
    gate = dict(doc.get("gate", {}))
    metric, threshold = "", None
    for knob, figure in _AT_LEAST_GATES:
        if gate.get(knob) is not None and figure in quality:
            metric, threshold = figure, float(gate[knob])
            break
    kinds = sorted(
        {part["kind"] for layer in doc.get("layers", []) for part in (layer["kv"], layer["index"])}
    )
    sender, receiver = doc["sender"]["name"], doc["receiver"]["name"]
    return {
        "mapper_id": f"{sender}->{receiver}@{str(doc['weights_sha256'])[:12]}",
        "sender_model": sender,
        "receiver_model": receiver,
        "artifact_uri": str(directory.resolve()),
        "artifact_sha256": str(doc["weights_sha256"]),
        "kind": "+".join(kinds) or "ridge",
        "metrics": quality,
        "gate_metric": metric,
        "gate_threshold": threshold,
        "passed_gate": bool(doc.get("passed_gate")) and bool(metric),
    }
