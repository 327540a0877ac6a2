"""model.numerics (the profile schema in the fingerprint, the in-process settings) and caches across
processes: a fresh process under the same profile gets a full hit bit-identical to the uninterrupted run,
one under another profile a miss; exports do not depend on the thread count. The processes start with
no profile variables (tests/model/numerics_child.py enters the profile itself, as `kvresume` does)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model import (
    NumericsProfile,
    Transformer,
    configure_torch,
    fp32_rows_free,
    init_random,
    load_preset,
    model_fingerprint,
)
from model.invariant import mkl_strict_mode
from model.numerics import CPU_PATHS, torch_cpu_problems
from orchestrator import numerics_env
from tests.shared_vectors import REPO

# The pinned path the suite runs under (tests/conftest.py): portable, or strict where portable's GEMM
# probe fails (orchestrator/numerics_probe.py).
PINNED = numerics_env.resolve_cpu_path("auto")


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in numerics_env.PORTABLE_ENV}


def _child(mode: str, folder: Path, cpu_path: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "tests.model.numerics_child", mode, str(folder), cpu_path],
        cwd=REPO, env=_plain_env(), capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_profile_label_names_every_field() -> None:
    assert NumericsProfile().label == (
        "numerics.v1 device=cpu dtype=bf16 kernels=torch cpu=portable math=exact batching=invariant"
    )
    assert NumericsProfile.for_device("cuda:1", kernel_backend="triton").device == "cuda"
    native = NumericsProfile(cpu_path="native", native_host="AVX2;AMD EPYC;MKL_CBWR=")
    assert "cpu=native[AVX2;AMD EPYC;MKL_CBWR=] math=exact" in native.label
    with pytest.raises(ValueError, match="only for the native cpu path"):
        NumericsProfile(native_host="AVX2;AMD EPYC")
    assert CPU_PATHS == numerics_env.CPU_PATHS


@pytest.mark.parametrize(
    ("field", "bad"),
    [("device", "tpu"), ("dtype", "fp16"), ("kernel_backend", "cuda-graphs"), ("cpu_path", "avx512"),
     ("math", "approximate"), ("batching", "fast")],
)
def test_profile_rejects_unknown_values(field: str, bad: str) -> None:
    with pytest.raises(ValueError, match=f"numerics {field} must be one of .*{bad!r}"):
        NumericsProfile(**{field: bad})


@torch.inference_mode()
def test_fingerprint_differs_for_every_profile_field() -> None:
    model = init_random(Transformer(load_preset("v41-tiny")), seed=0).eval()
    base = NumericsProfile()
    others = [
        dataclasses.replace(base, cpu_path="native"),
        dataclasses.replace(base, cpu_path="strict"),
        dataclasses.replace(base, device="cuda"),
        dataclasses.replace(base, kernel_backend="triton"),
        dataclasses.replace(base, cpu_path="native", native_host="AVX512;Intel Xeon;MKL_CBWR="),
        dataclasses.replace(base, math="fast"),
    ]
    prints = {model_fingerprint(model, numerics=p) for p in [base, *others]}
    assert len(prints) == 7
    assert "math=fast" in dataclasses.replace(base, math="fast").label
    assert model_fingerprint(model) == model_fingerprint(model, numerics=base)


def test_configure_torch_turns_onednn_off_for_the_pinned_paths_only() -> None:
    before = torch.backends.mkldnn.enabled
    try:
        torch.backends.mkldnn.enabled = True
        configure_torch("native")
        assert torch.backends.mkldnn.enabled
        assert torch_cpu_problems(PINNED) == ["torch.backends.mkldnn.enabled is True (profile: False)"]
        configure_torch(PINNED)
        assert not torch.backends.mkldnn.enabled
        # the suite runs under the profile (tests/conftest.py), so torch reports nothing against it
        assert torch_cpu_problems(PINNED) == []
        assert numerics_env.in_force_problems(PINNED) == []
    finally:
        torch.backends.mkldnn.enabled = before
    with pytest.raises(ValueError, match="'avx512'"):
        configure_torch("avx512")
    with pytest.raises(ValueError, match="threads=-1"):
        configure_torch(PINNED, threads=-1)


def test_configure_torch_stacks_rows_by_the_mode_mkl_computes_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether batched passes stack one-row products follows MKL's mode, not the cpu path's name: under
    strict MKL the one-row kernels (bmm of one-row problems) do not give a lone row's sums, so a `native`
    command run in such a process (an in-process CLI call) once made batched decodes leave serial ones."""
    assert mkl_strict_mode({"MKL_CBWR": "AVX2,STRICT"}) and mkl_strict_mode({"MKL_CBWR": "avx2, strict"})
    assert not mkl_strict_mode({"MKL_CBWR": "AVX2"}) and not mkl_strict_mode({})
    for mkl_cbwr in ("AVX2,STRICT", "AVX2"):
        monkeypatch.setenv("MKL_CBWR", mkl_cbwr)
        try:
            configure_torch("native")
            assert fp32_rows_free() is mkl_strict_mode()
        finally:
            monkeypatch.undo()
            configure_torch(PINNED)
    assert fp32_rows_free() is (PINNED == "strict")


def test_cache_from_a_fresh_process_is_a_bitwise_full_hit(tmp_path: Path) -> None:
    wrote = _child("write", tmp_path, PINNED)
    assert wrote["numerics"]["in_force"]
    assert wrote["numerics"]["env"] == dict(numerics_env.PINNED_ENVS[PINNED])
    read = _child("read", tmp_path, PINNED)
    assert read == {"numerics": read["numerics"], "bitwise": True}


def test_cache_written_under_one_profile_is_a_miss_under_another(tmp_path: Path) -> None:
    _child("write", tmp_path, PINNED)
    read = _child("read", tmp_path, "native")
    assert read["numerics"]["cpu_path"] == "native"
    assert read["miss"] == "cache blob was written by another model fingerprint"


def test_exports_are_identical_at_one_and_two_threads(tmp_path: Path) -> None:
    assert _child("threads", tmp_path, PINNED)["identical"] is True
