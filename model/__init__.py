"""The DeepSeek-V4.1-Flash-style transformer: config, layers, prefill/extend/decode/replay, cache state.

Knows nothing of storage, SQL or gRPC; returns statistics instead of logging.
"""

from model.config import LayerRole, LayerRow, ModelConfig
from model.errors import ModelError
from model.kv_bytes import (
    INDEX_K_SCALE_GROUP,
    MAIN_KV_SCALE_GROUP,
    WINDOW_KV_SCALE_GROUP,
    KVBytes,
    SourceBytes,
    index_k_entry_bytes,
    kv_bytes,
    main_kv_entry_bytes,
    window_kv_entry_bytes,
)
from model.presets import PRESET_NAMES, load_preset

__all__ = [
    "index_k_entry_bytes",
    "INDEX_K_SCALE_GROUP",
    "kv_bytes",
    "KVBytes",
    "LayerRole",
    "LayerRow",
    "load_preset",
    "main_kv_entry_bytes",
    "MAIN_KV_SCALE_GROUP",
    "ModelConfig",
    "ModelError",
    "PRESET_NAMES",
    "SourceBytes",
    "window_kv_entry_bytes",
    "WINDOW_KV_SCALE_GROUP",
]
