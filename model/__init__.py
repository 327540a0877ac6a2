"""The DeepSeek-V4.1-Flash-style transformer: config, layers, prefill/extend/decode/replay, cache state.

Knows nothing of storage, SQL or gRPC; returns statistics instead of logging.
"""

from model.errors import ModelError

__all__ = ["ModelError"]
