"""Cross-model KV mappers: fit, evaluate and apply closed-form ridge maps between sibling models.

Knows nothing of storage, SQL or gRPC: it reads model caches (through model/'s public API) and writes
artifacts (safetensors arrays + JSON). See mappers/README.md for the procedure and the ridge closed form.
"""

from mappers.apply import Applicability, MappedGlobal, applicability, apply_mapper, map_sources
from mappers.artifact import (
    MAPPER_FORMAT,
    MAPPER_FORMATS,
    GateSpec,
    KVMapper,
    LayerMap,
    ModelRef,
    PartMap,
    load_mapper,
    read_metadata,
    save_mapper,
)
from mappers.capture import ContentKV, capture_content, content_of
from mappers.errors import FitError, MapperError, MapperMismatch
from mappers.evaluate import (
    MapperEval,
    TaskRetention,
    evaluate_mapper,
    evaluate_task_retention,
    gate_failures,
    gate_mapper,
)
from mappers.fit import FitSpec, fit_mapper
from mappers.identity import identity_mapper
from mappers.mlp import MlpFeatures, build_features, mlp_predict, mlp_predict_rows
from mappers.retention import (
    RetentionBucket,
    RetentionReport,
    bootstrap_ratio_ci,
    bootstrap_ratio_ci_loop,
    bucket_seed,
    default_buckets,
    measure_retention,
)
from mappers.ridge import LinearMap, MomentStats, RidgeMapper, SklearnRidgeMapper, r2_from_stats, solve_ridge

__all__ = [
    "MAPPER_FORMAT",
    "MAPPER_FORMATS",
    "MlpFeatures",
    "RetentionBucket",
    "RetentionReport",
    "bootstrap_ratio_ci",
    "bootstrap_ratio_ci_loop",
    "bucket_seed",
    "build_features",
    "default_buckets",
    "measure_retention",
    "mlp_predict",
    "mlp_predict_rows",
    "Applicability",
    "ContentKV",
    "FitError",
    "FitSpec",
    "GateSpec",
    "KVMapper",
    "LinearMap",
    "MomentStats",
    "RidgeMapper",
    "SklearnRidgeMapper",
    "TaskRetention",
    "r2_from_stats",
    "solve_ridge",
    "LayerMap",
    "MappedGlobal",
    "MapperEval",
    "MapperError",
    "MapperMismatch",
    "ModelRef",
    "PartMap",
    "applicability",
    "apply_mapper",
    "capture_content",
    "content_of",
    "evaluate_mapper",
    "evaluate_task_retention",
    "fit_mapper",
    "gate_failures",
    "gate_mapper",
    "identity_mapper",
    "load_mapper",
    "map_sources",
    "read_metadata",
    "save_mapper",
]
