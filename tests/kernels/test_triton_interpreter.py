"""Runs the Triton kernel tests on CPU: one child pytest process started with TRITON_INTERPRET=1, for the
attention and index-score kernels and the formats backend's interpreter cases (`-k interp` selects those
and every test of the two `_interp` modules): one child, one import of torch and triton.

The flag has to be set before triton is imported, which this process has likely done already.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
INTERPRETER_MODULES = [
    "tests/kernels/test_sparse_attn_interp.py",
    "tests/kernels/test_index_score_interp.py",
    "tests/kernels/test_formats_triton_backend.py",
]


def test_triton_kernels_under_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 already: the interpreter modules run directly in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-k",
        "interp",
        *INTERPRETER_MODULES,
    ]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    report = done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0, report
    assert "skipped" not in done.stdout and " passed" in done.stdout, report
