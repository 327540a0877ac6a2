"""The turn engine and the assembly of a serving node: served models, text codecs, global KV persistence,
pool entries, sampling, the model-swap plug point.

Knows nothing of protobuf: it implements `orchestrator.api.TurnHandler` over domain types.

Its names are imported from their modules on first use (PEP 562), so a process that needs one
module of the package (the model process: served_models and model_compute) does not import the
others (the registry's SQLAlchemy and Alembic, the store): about 0.7 s of every model process's
start on the 2-vCPU VMs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from orchestrator.engine.global_kv import PersistOutcome, StoredPrefix, chunk_ranges, read_prefix
    from orchestrator.engine.model_compute import ModelCompute, TorchCompute
    from orchestrator.engine.pool_entry import (
        PoolEntry,
        chunks_digest,
        chunks_digest_of,
        history_digest,
        pack_pool_entry,
        unpack_pool_entry,
    )
    from orchestrator.engine.prefix_reuse import ContentReuse, find_reuse
    from orchestrator.engine.sampler import Sampler
    from orchestrator.engine.served_models import (
        DEFAULT_SIBLINGS,
        ModelRegistry,
        ServedModel,
        ServedModelSpec,
        default_model_specs,
        load_served,
        repo_root,
    )
    from orchestrator.engine.service import NodeService, PurgeFanout, build_node
    from orchestrator.engine.swap import (
        ArtifactMappers,
        KVMapperApplier,
        MapperArtifact,
        NoMappers,
        registration_of,
    )
    from orchestrator.engine.text_codec import BpeCodec, ByteCodec, TextCodec, choose_codec
    from orchestrator.engine.turn_engine import TurnEngine, actual_counts
    from orchestrator.engine.turn_facts import TurnFacts, TurnPreparation

# name -> the module that defines it
_HOMES: dict[str, str] = {
    "PersistOutcome": "orchestrator.engine.global_kv",
    "StoredPrefix": "orchestrator.engine.global_kv",
    "chunk_ranges": "orchestrator.engine.global_kv",
    "read_prefix": "orchestrator.engine.global_kv",
    "ModelCompute": "orchestrator.engine.model_compute",
    "TorchCompute": "orchestrator.engine.model_compute",
    "PoolEntry": "orchestrator.engine.pool_entry",
    "chunks_digest": "orchestrator.engine.pool_entry",
    "chunks_digest_of": "orchestrator.engine.pool_entry",
    "history_digest": "orchestrator.engine.pool_entry",
    "pack_pool_entry": "orchestrator.engine.pool_entry",
    "unpack_pool_entry": "orchestrator.engine.pool_entry",
    "ContentReuse": "orchestrator.engine.prefix_reuse",
    "find_reuse": "orchestrator.engine.prefix_reuse",
    "Sampler": "orchestrator.engine.sampler",
    "DEFAULT_SIBLINGS": "orchestrator.engine.served_models",
    "ModelRegistry": "orchestrator.engine.served_models",
    "ServedModel": "orchestrator.engine.served_models",
    "ServedModelSpec": "orchestrator.engine.served_models",
    "default_model_specs": "orchestrator.engine.served_models",
    "load_served": "orchestrator.engine.served_models",
    "repo_root": "orchestrator.engine.served_models",
    "NodeService": "orchestrator.engine.service",
    "PurgeFanout": "orchestrator.engine.service",
    "build_node": "orchestrator.engine.service",
    "ArtifactMappers": "orchestrator.engine.swap",
    "KVMapperApplier": "orchestrator.engine.swap",
    "MapperArtifact": "orchestrator.engine.swap",
    "NoMappers": "orchestrator.engine.swap",
    "registration_of": "orchestrator.engine.swap",
    "BpeCodec": "orchestrator.engine.text_codec",
    "ByteCodec": "orchestrator.engine.text_codec",
    "TextCodec": "orchestrator.engine.text_codec",
    "choose_codec": "orchestrator.engine.text_codec",
    "TurnEngine": "orchestrator.engine.turn_engine",
    "actual_counts": "orchestrator.engine.turn_engine",
    "TurnFacts": "orchestrator.engine.turn_facts",
    "TurnPreparation": "orchestrator.engine.turn_facts",
}

__all__ = [
    "DEFAULT_SIBLINGS",
    "ArtifactMappers",
    "BpeCodec",
    "ByteCodec",
    "ContentReuse",
    "KVMapperApplier",
    "MapperArtifact",
    "ModelCompute",
    "ModelRegistry",
    "NoMappers",
    "NodeService",
    "PersistOutcome",
    "PoolEntry",
    "PurgeFanout",
    "Sampler",
    "ServedModel",
    "ServedModelSpec",
    "StoredPrefix",
    "TextCodec",
    "TorchCompute",
    "TurnEngine",
    "TurnFacts",
    "TurnPreparation",
    "actual_counts",
    "build_node",
    "choose_codec",
    "chunk_ranges",
    "chunks_digest",
    "chunks_digest_of",
    "default_model_specs",
    "find_reuse",
    "history_digest",
    "load_served",
    "pack_pool_entry",
    "read_prefix",
    "registration_of",
    "repo_root",
    "unpack_pool_entry",
]


__getattr__, __dir__ = lazy_exports(globals(), _HOMES)
