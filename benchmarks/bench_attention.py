"""Latency of the sparse attention and indexer-score ops, torch reference vs Triton, as JSON.

Run: `python -m benchmarks.bench_attention [--device cuda|cpu] [--json PATH|-]`. On CPU only the torch
reference is timed (the Triton interpreter is a correctness tool, not a speed one). Triton is timed only
after it matches the reference on a fresh input within the test tolerance; otherwise the run stops.

FLOP/byte model (bf16 inputs):
- sparse_attn: 4·B·T·H·K·D FLOPs (q·k and p·v); bytes = q and o (2·B·T·H·D·2) + every gathered KV row
  once per query (B·T·K·D·2) + ids (B·T·K·4).
- index_score: 2·B·T·H·N·D FLOPs; bytes = q (B·T·H·D·2) + k (B·N·D·2) + weights + scores (B·T·N·2).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import torch

from benchmarks.hardware import numerics_record
from benchmarks.report import add_json_flag, table_stream, write_json
from kernels import index_score, sparse_attn

# (name, B, T, H, D, N, K): v41-tiny prefill/decode, then released-config prefill chunk and decode.
ATTN_SHAPES = [
    ("tiny-prefill", 1, 300, 4, 128, 450, 48),
    ("tiny-decode", 1, 1, 4, 128, 182, 48),
    ("released-prefill-chunk", 1, 512, 64, 512, 8704, 640),
    ("released-decode-B8", 8, 1, 64, 512, 8320, 640),
]
# (name, B, T, H, D, N)
INDEX_SHAPES = [
    ("tiny-prefill", 1, 300, 4, 64, 300),
    ("tiny-decode", 1, 1, 4, 64, 301),
    ("released-prefill-chunk", 1, 512, 32, 128, 8192),
    ("released-decode-B8", 8, 1, 32, 128, 32768),
]


def _median_ms(fn: Callable[[], torch.Tensor], device: str, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _attn_inputs(b: int, t: int, h: int, d: int, n: int, k: int, device: str) -> tuple:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, t, h, d, generator=g).bfloat16()
    kv = torch.randn(b, n, d, generator=g).bfloat16()
    sink = torch.randn(h, generator=g)
    idx = torch.randint(-1, n, (b, t, k), generator=g, dtype=torch.int32)
    return tuple(x.to(device) for x in (q, kv, sink, idx))


def _index_inputs(b: int, t: int, h: int, d: int, n: int, device: str) -> tuple:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, t, h, d, generator=g).bfloat16()
    k = torch.randn(b, n, d, generator=g).bfloat16()
    w = (torch.randn(b, t, h, generator=g) * (d * h) ** -0.5).bfloat16()
    return tuple(x.to(device) for x in (q, k, w))


def _check_triton(device: str) -> None:
    """Refuse to time a kernel that disagrees with the reference (same bounds as the tests)."""
    q, kv, sink, idx = _attn_inputs(2, 33, 8, 128, 300, 130, device)
    want = sparse_attn(q.cpu(), kv.cpu(), sink.cpu(), idx.cpu(), 128**-0.5).double()
    got = sparse_attn(q, kv, sink, idx, 128**-0.5, backend="triton").cpu().double()
    err = ((got - want).norm() / want.norm()).item()
    if not err <= 1e-3:
        sys.exit(f"sparse_attn triton disagrees with the reference: relative L2 {err:.3e}")
    q, k, w = _index_inputs(2, 33, 8, 64, 300, device)
    want = index_score(q.cpu(), k.cpu(), w.cpu()).double()
    got = index_score(q, k, w, backend="triton").cpu().double()
    err = ((got - want).norm() / want.norm()).item()
    if not err <= 1e-2:
        sys.exit(f"index_score triton disagrees with the reference: relative L2 {err:.3e}")


def run(device: str, reps: int) -> list[dict]:
    backends = ["torch", "triton"] if device == "cuda" else ["torch"]
    if "triton" in backends:
        _check_triton(device)
    rows = []
    for name, b, t, h, d, n, k in ATTN_SHAPES:
        if device == "cpu" and name.startswith("released"):
            continue
        q, kv, sink, idx = _attn_inputs(b, t, h, d, n, k, device)
        flops = 4 * b * t * h * k * d
        nbytes = 2 * b * t * h * d * 2 + b * t * k * d * 2 + b * t * k * 4
        for backend in backends:
            op = partial(sparse_attn, q, kv, sink, idx, d**-0.5, backend=backend)
            ms = _median_ms(op, device, reps)
            rows.append(_row("sparse_attn", name, backend, device, ms, flops, nbytes, (b, t, h, d, n, k)))
    for name, b, t, h, d, n in INDEX_SHAPES:
        if device == "cpu" and name.startswith("released"):
            continue
        q, k, w = _index_inputs(b, t, h, d, n, device)
        flops = 2 * b * t * h * n * d
        nbytes = b * t * h * d * 2 + b * n * d * 2 + b * t * h * 2 + b * t * n * 2
        for backend in backends:
            op = partial(index_score, q, k, w, backend=backend)
            ms = _median_ms(op, device, reps)
            rows.append(_row("index_score", name, backend, device, ms, flops, nbytes, (b, t, h, d, n)))
    return rows


def _row(
    op: str, shape_name: str, backend: str, device: str, ms: float, flops: int, nbytes: int, dims: tuple
) -> dict:
    return {
        "op": op,
        "shape": shape_name,
        "dims": list(dims),
        "backend": backend,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "median_ms": round(ms, 4),
        "tflops": round(flops / ms / 1e9, 4),
        "gb_per_s": round(nbytes / ms / 1e6, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=10)
    add_json_flag(parser)
    args = parser.parse_args()
    rows = run(args.device, args.reps)
    out = table_stream(args.json)
    for r in rows:
        print(f"{r['op']:12s} {r['shape']:24s} {r['backend']:7s} {r['median_ms']:10.3f} ms "
              f"{r['tflops']:8.3f} TFLOPS {r['gb_per_s']:9.2f} GB/s", file=out)
    write_json({"numerics": numerics_record(), "rows": rows}, args.json)


if __name__ == "__main__":
    main()
