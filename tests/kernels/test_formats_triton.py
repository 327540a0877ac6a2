"""backend="triton" wiring: refused on CPU without the interpreter; the interpreter-mode comparison with
the torch reference (test_formats_triton_backend.py) runs in the interpreter's child process with the
other kernels' (test_triton_interpreter.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter is on in this process")
def test_triton_backend_refused_on_cpu_without_interpreter() -> None:
    x = torch.randn(2, 32)
    with pytest.raises(kernels.KernelError, match="TRITON_INTERPRET=1"):
        kernels.quantize_mxfp4(x, backend="triton")
    with pytest.raises(kernels.KernelError, match="TRITON_INTERPRET=1"):
        kernels.qdq_fp8_ue8m0(x, backend="triton")


def test_importing_kernels_does_not_import_triton() -> None:
    code = (
        "import sys, torch, kernels; kernels.qdq_mxfp4(torch.zeros(1, 32)); print('triton' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
