"""The turn engine and the assembly of a serving node: served models, text codecs, global KV persistence,
pool entries, sampling, the model-swap plug point.

Knows nothing of protobuf: it implements `orchestrator.api.TurnHandler` over domain types.
"""

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
