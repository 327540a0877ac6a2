"""benchmarks.bench_cpu_kernels: a tiny end-to-end run of its code path (the bitwise checks before any
timing, the on/off switches restored after), not its figures."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import benchmarks.bench_cpu_kernels as bench
import kernels.bf16_gemm
import kernels.mhc
import kernels.sparse_attn.cpu  # noqa: F401 - the module the switches name
from kernels.bf16_gemm import cpu


@pytest.mark.skipif(not cpu.usable(), reason="the compiled bf16 linear is not usable here")
def test_main_checks_times_and_restores_the_compiled_paths(tmp_path, capsys) -> None:
    before = torch.get_num_threads()
    sparse = sys.modules["kernels.sparse_attn.cpu"]
    switches = [kernels.bf16_gemm.usable, kernels.mhc.usable, kernels.mhc.lanes_usable, sparse.takes]
    path = tmp_path / "kernels.json"
    try:
        bench.main(
            ["--sequences", "2", "--chunks", "2", "--steps", "1", "--repeats", "1", "--json", str(path)]
        )
    finally:
        torch.set_num_threads(before)
    doc = json.loads(path.read_text())
    assert [r["k"] for r in doc["products"]] == [k for _, k, _ in bench.SHAPES]
    assert [r["combs"] for r in doc["sinkhorn"]] == [1, 64, 240]
    assert set(doc["passes"]) == {"decode", "prefill_many", "decode_many"}
    assert all(r["speedup"] > 0 for r in doc["passes"].values())
    assert "decode_many of 2 sequences" in capsys.readouterr().out
    assert [r["rows"] for r in doc["sparse_attention"]] in ([], [t for t, _ in bench.ATTENTION_SHAPES])
    assert [kernels.bf16_gemm.usable, kernels.mhc.usable, kernels.mhc.lanes_usable, sparse.takes] == switches
