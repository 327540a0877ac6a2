"""The DeepSeek-V4.1-Flash-style transformer: config, layers, prefill/extend/decode/replay, cache state.

Knows nothing of storage, SQL or gRPC; returns statistics instead of logging.
"""

from model.batched import decode_many
from model.batched_prefill import prefill_many
from model.cache_format import (
    CACHE_FORMAT_VERSION,
    HEADER_BYTES,
    ChunkImport,
    export_global,
    export_windows,
    import_global,
    import_global_chunks,
    import_windows,
    model_fingerprint,
    state_from_global,
)
from model.checkpoint import (
    SAVEABLE_DTYPES,
    checkpoint_metadata,
    load_state_dict,
    save_state_dict,
    weights_fingerprint,
)
from model.config import LayerRole, LayerRow, ModelConfig
from model.conformance import LOGITS_REL_TOL, PromptReport, TensorDiff, cache_tensors, check_conformance
from model.errors import CacheFormatError, CheckpointMismatch, ModelError, UnsupportedConfigError
from model.inference import PREFILL_MODES, decode, decode_batch, greedy, prefill
from model.invariant import fp32_linear, fp32_rows_free, rowwise_linear
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
from model.linear import set_linear_math
from model.numerics import (
    MATH_MODES,
    NumericsProfile,
    configure_torch,
    torch_cpu_problems,
    torch_cpu_state,
)
from model.presets import PRESET_NAMES, load_preset
from model.rope import apply_rope, rope_table
from model.state import ModelState, SourceCache
from model.transformer import KERNEL_BACKENDS, PassOutput, PassStats, Transformer
from model.weights import init_random, load_model, save_plain

__all__ = [
    "KERNEL_BACKENDS",
    "apply_rope",
    "rope_table",
    "CACHE_FORMAT_VERSION",
    "CacheFormatError",
    "ChunkImport",
    "export_global",
    "export_windows",
    "HEADER_BYTES",
    "import_global",
    "import_global_chunks",
    "import_windows",
    "model_fingerprint",
    "state_from_global",
    "cache_tensors",
    "check_conformance",
    "decode",
    "decode_batch",
    "decode_many",
    "prefill_many",
    "greedy",
    "init_random",
    "load_model",
    "set_linear_math",
    "MATH_MODES",
    "LOGITS_REL_TOL",
    "ModelState",
    "PassOutput",
    "PassStats",
    "prefill",
    "PREFILL_MODES",
    "PromptReport",
    "save_plain",
    "SourceCache",
    "TensorDiff",
    "Transformer",
    "UnsupportedConfigError",
    "checkpoint_metadata",
    "CheckpointMismatch",
    "index_k_entry_bytes",
    "INDEX_K_SCALE_GROUP",
    "kv_bytes",
    "KVBytes",
    "LayerRole",
    "LayerRow",
    "load_preset",
    "load_state_dict",
    "main_kv_entry_bytes",
    "MAIN_KV_SCALE_GROUP",
    "ModelConfig",
    "ModelError",
    "NumericsProfile",
    "configure_torch",
    "fp32_linear",
    "fp32_rows_free",
    "rowwise_linear",
    "torch_cpu_problems",
    "torch_cpu_state",
    "PRESET_NAMES",
    "save_state_dict",
    "SAVEABLE_DTYPES",
    "SourceBytes",
    "weights_fingerprint",
    "window_kv_entry_bytes",
    "WINDOW_KV_SCALE_GROUP",
]

# The training and quality-harness command lines (kvresume train / eval); imported last because
# model.train builds on the modules above.
from model.train.quality_report import add_eval_arguments, eval_from_args, family_recall_episodes  # noqa: E402
from model.train.train_pass import attention_mass  # noqa: E402
from model.train.trainer import add_train_arguments, train_from_args  # noqa: E402

__all__ += [
    "add_eval_arguments",
    "add_train_arguments",
    "attention_mass",
    "eval_from_args",
    "family_recall_episodes",
    "train_from_args",
]
