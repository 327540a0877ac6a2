"""The DeepSeek-V4.1-Flash-style transformer: config, layers, prefill/extend/decode/replay, cache state.

Knows nothing of storage, SQL or gRPC; returns statistics instead of logging.
"""

from model.config import LayerRole, LayerRow, ModelConfig
from model.errors import ModelError
from model.presets import PRESET_NAMES, load_preset

__all__ = [
    "LayerRole",
    "LayerRow",
    "ModelConfig",
    "ModelError",
    "PRESET_NAMES",
    "load_preset",
]
