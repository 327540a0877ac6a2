"""ArtifactMappers binds a mapper fitted under one pinned CPU path to the same models served under the
other (portable <-> strict: the caches differ only in rounding), and to nothing else."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from mappers import load_mapper, read_metadata, save_mapper
from model import export_global, model_fingerprint, prefill
from orchestrator.engine import ServedModelSpec, load_served
from orchestrator.engine.swap import ArtifactMappers, MapperArtifact

SHIPPED = Path(__file__).resolve().parents[3] / "checkpoints"
PAIR = "v41-sib-s--v41-sib-m2"


def _artifact(directory: Path) -> MapperArtifact:
    digest = str(read_metadata(directory)["weights_sha256"])
    return MapperArtifact(mapper_id="m", sender_model="v41-sib-s", receiver_model="v41-sib-m2",
                          artifact_uri=str(directory), artifact_sha256=digest, kind="ridge+mlp")  # fmt: skip


def _rebound(mapper, sender, receiver, cpu_path: str):
    """The mapper with both sides' fingerprints taken under `cpu_path`."""
    with torch.inference_mode():
        fps = [model_fingerprint(m.model, numerics=dataclasses.replace(m.numerics, cpu_path=cpu_path)).hex()
               for m in (sender, receiver)]  # fmt: skip
    return dataclasses.replace(
        mapper,
        sender=dataclasses.replace(mapper.sender, fingerprint=fps[0]),
        receiver=dataclasses.replace(mapper.receiver, fingerprint=fps[1]),
    )


def test_a_mapper_of_the_other_pinned_path_is_bound_to_the_served_pair(tmp_path: Path) -> None:
    sender = load_served(ServedModelSpec(name="v41-sib-s", checkpoint=SHIPPED / "v41-sib-s"))
    receiver = load_served(ServedModelSpec(name="v41-sib-m2", checkpoint=SHIPPED / "v41-sib-m2"))
    shipped = load_mapper(SHIPPED / "mappers" / PAIR)
    here = sender.numerics.cpu_path
    other = {"portable": "strict", "strict": "portable"}[here]
    for cpu_path, usable in ((here, True), (other, True)):
        directory = save_mapper(_rebound(shipped, sender, receiver, cpu_path), tmp_path / cpu_path)
        assert ArtifactMappers().usable(_artifact(directory), sender, receiver) is usable, cpu_path
    # the same config under other weights is another model: never bound
    config = str(SHIPPED / "v41-sib-m2" / "config.json")
    stranger = load_served(ServedModelSpec(name="v41-sib-m2", config=config, seed=5))
    directory = save_mapper(_rebound(shipped, sender, stranger, other), tmp_path / "stranger")
    assert ArtifactMappers().usable(_artifact(directory), sender, receiver) is False


def test_a_receiver_whose_weights_were_released_maps_as_one_that_holds_them() -> None:
    """A node whose models compute in a model process keeps no weights here: the shipped ridge+mlp mapper
    (whose mlp parts read the receiver's token embeddings) loads them again for its application and maps
    the same bytes as with the weights held; the receiver state is built where `build_state` says."""
    sender = load_served(ServedModelSpec(name="v41-sib-s", checkpoint=SHIPPED / "v41-sib-s"))
    spec = ServedModelSpec(name="v41-sib-m2", checkpoint=SHIPPED / "v41-sib-m2")
    held, released = load_served(spec), load_served(spec, hold_weights=False)
    directory = SHIPPED / "mappers" / PAIR
    assert load_mapper(directory).needs_receiver_weights
    history = [int(t) for t in torch.randint(16, 4000, (64,))]
    with torch.inference_mode():
        state = prefill(sender.model, torch.tensor([history]), mode="ced", prompt_end=64).state
    blobs = [export_global(state, 0, 64, fingerprint=sender.fingerprint)]
    built: list[tuple[ServedModelSpec, list[bytes]]] = []

    def build_state(receiver, tokens, mapped_blobs):
        built.append((receiver.spec, list(mapped_blobs)))
        return None

    mappers = ArtifactMappers(build_state=build_state)
    for receiver in (held, released):
        assert mappers.usable(_artifact(directory), sender, receiver)
        mappers.apply(
            _artifact(directory),
            sender=sender,
            receiver=receiver,
            history=history,
            sender_blobs=blobs,
            n_tokens=64,
        )
    assert [spec for spec, _ in built] == [spec, spec] and built[0][1] == built[1][1]
    assert released._reloaded is not None and not released.weights_held  # noqa: SLF001 - loaded again once
