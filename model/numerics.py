"""Numerics profiles: one schema naming the arithmetic that produced a cache (part of the model
fingerprint), and the in-process half of the pinned CPU path (threads, oneDNN, the dispatch check).

Knows nothing of processes: the environment the pinned path needs before torch loads is set by the entry
point (orchestrator/numerics_env.py). Why the profile exists and what was measured: model/README.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.invariant import mkl_strict_mode, set_fp32_rows_free

__all__ = [
    "BATCHING_MODES",
    "CPU_PATHS",
    "DEVICE_CLASSES",
    "MATH_MODES",
    "NUMERICS_SCHEMA",
    "NumericsProfile",
    "PORTABLE_TORCH_CAPABILITY",
    "configure_torch",
    "torch_cpu_problems",
    "torch_cpu_state",
]

# Bumped when a field is added or a label changes meaning, so old and new labels never collide.
NUMERICS_SCHEMA = 1
# portable: the pinned AVX2 path of the conformance vectors; strict: the same with MKL's strict CNR mode
# (exact where portable's GEMMs depend on the row count); native: the caller's environment.
CPU_PATHS = ("portable", "strict", "native")
DEVICE_CLASSES = ("cpu", "cuda")
DTYPES = ("bf16",)
# exact: the reference's block-scaled GEMMs; fast: quantized linears with folded scales and one GEMM
# (model.set_linear_math). Room for a fast batching mode (kernels whose reduction order depends on the batch).
MATH_MODES = ("exact", "fast")
BATCHING_MODES = ("invariant",)
# What torch.backends.cpu.get_cpu_capability() reports under ATEN_CPU_CAPABILITY=avx2.
PORTABLE_TORCH_CAPABILITY = "AVX2"


@dataclass(frozen=True, kw_only=True)
class NumericsProfile:
    """The arithmetic a served model computes with. Two nodes whose profiles differ may not share
    caches: the model is chaotic enough (near-tied top-k scores, FP8 rounding before every quantized
    GEMM) that another kernel dispatch changes its outputs, so such a cache is a miss, never a hit.

    Thread count is not a field: exports were measured byte-identical at 1 and 2 threads under the
    portable path (model/README.md). `native_host` names what a `native` path ran on (torch's CPU
    capability, the CPU model, the dispatch variables as found), so two native nodes share caches only
    when those agree; the portable path needs none (that is its point).
    """

    device: str = "cpu"
    dtype: str = "bf16"
    kernel_backend: str = "torch"
    cpu_path: str = "portable"
    math: str = "exact"
    batching: str = "invariant"
    native_host: str = ""

    def __post_init__(self) -> None:
        allowed = {
            "device": DEVICE_CLASSES,
            "dtype": DTYPES,
            "kernel_backend": ("torch", "triton"),
            "cpu_path": CPU_PATHS,
            "math": MATH_MODES,
            "batching": BATCHING_MODES,
        }
        for name, values in allowed.items():
            if getattr(self, name) not in values:
                raise ValueError(f"numerics {name} must be one of {values}, got {getattr(self, name)!r}")
        if self.cpu_path != "native" and self.native_host:
            raise ValueError(f"numerics native_host={self.native_host!r} is only for the native cpu path")

    @property
    def label(self) -> str:
        """Canonical text of the profile (what the fingerprint hashes and the registry records)."""
        cpu = f"native[{self.native_host}]" if self.native_host else self.cpu_path
        return (
            f"numerics.v{NUMERICS_SCHEMA} device={self.device} dtype={self.dtype} "
            f"kernels={self.kernel_backend} cpu={cpu} math={self.math} batching={self.batching}"
        )

    @classmethod
    def for_device(cls, device: str | torch.device, **fields: str) -> NumericsProfile:
        """The profile of a model placed on `device` ("cpu", "cuda:1": the class counts, not the index)."""
        return cls(device=torch.device(device).type, **fields)


def torch_cpu_state() -> dict[str, object]:
    """What torch reports about its CPU arithmetic: capability, oneDNN, intra-op threads."""
    return {
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn_enabled": bool(torch.backends.mkldnn.enabled),
        "threads": torch.get_num_threads(),
    }


def torch_cpu_problems(cpu_path: str) -> list[str]:
    """What torch reports that contradicts `cpu_path` (empty when consistent; `native` always is)."""
    if cpu_path not in CPU_PATHS:
        raise ValueError(f"cpu path must be one of {CPU_PATHS}, got {cpu_path!r}")
    if cpu_path == "native":
        return []
    problems = []
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != PORTABLE_TORCH_CAPABILITY:
        problems.append(f"torch CPU capability {capability} (profile: {PORTABLE_TORCH_CAPABILITY})")
    if torch.backends.mkldnn.enabled:
        problems.append("torch.backends.mkldnn.enabled is True (profile: False)")
    return problems


def configure_torch(cpu_path: str, *, threads: int | None = None) -> None:
    """Apply the in-process half of `cpu_path`: intra-op threads and, for the pinned paths (`portable`,
    `strict`), oneDNN off (on AVX-512 CPUs torch may send bf16 matmuls to oneDNN, a code path the vectors
    never took).

    Args:
        threads: intra-op threads (None or 0: leave torch's choice).

    Raises:
        ValueError: an unknown cpu path or a negative thread count.
    """
    if cpu_path not in CPU_PATHS:
        raise ValueError(f"cpu path must be one of {CPU_PATHS}, got {cpu_path!r}")
    if threads is not None and threads < 0:
        raise ValueError(f"threads={threads} must be >= 0")
    if threads:
        torch.set_num_threads(threads)
    if cpu_path != "native":
        torch.backends.mkldnn.enabled = False
    # Under MKL's strict mode (the strict path's MKL_CBWR) products are row- and thread-invariant (probed),
    # so the batched paths stack rows freely. It is what MKL computes in that counts, not the path's name:
    # `native` in a process whose MKL runs strict stacks rows too (its one-row kernels differ there).
    set_fp32_rows_free(mkl_strict_mode())
