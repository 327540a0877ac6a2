"""Throughput of the block-format quantizers and dequantizers beside the same machine's copy bandwidth.

Run: `python -m benchmarks.bench_formats [--json PATH|-] [--size-mb 64] [--cuda-size-mb 1024] [--runs 5]`.
On CPU the torch reference is timed (the Triton interpreter is a correctness tool, not a speed one); on
CUDA, when present, both backends are timed against a device-to-device `copy_`. Before timing, each
timed backend must match the torch reference bitwise on a fresh input (and QDQ must equal
dequantize(quantize)); otherwise the run stops with exit code 1.

Byte model: GB/s counts the bytes of the bf16 tensor x [N, 512] (the quantizer's input, the
dequantizer's output), 2 bytes per value, over the median wall time of `--runs` runs (after one warm-up).
A copy moves the same bytes once in and once out; `vs copy` = op GB/s / copy GB/s on the same tensor.
The packed side adds 0.5625 (FP4-E4M3), 0.53125 (MXFP4) or 1.03125 (FP8) bytes per value of traffic.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

import kernels
from benchmarks.hardware import numerics_record
from benchmarks.report import add_json_flag, table_stream, write_json

D = 512
FORMATS: dict[str, tuple[Callable, Callable, Callable]] = {
    "fp4_e4m3": (kernels.quantize_fp4_e4m3, kernels.dequantize_fp4_e4m3, kernels.qdq_fp4_e4m3),
    "mxfp4": (kernels.quantize_mxfp4, kernels.dequantize_mxfp4, kernels.qdq_mxfp4),
    "fp8_ue8m0": (kernels.quantize_fp8_ue8m0, kernels.dequantize_fp8_ue8m0, kernels.qdq_fp8_ue8m0),
}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median_s(fn: Callable[[], object], device: str, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.uint8)


def _check(device: str, backend: str) -> list[str]:
    """Names of the formats whose `backend` disagrees with the torch reference on a fresh input."""
    g = torch.Generator().manual_seed(int(time.time()))
    x = (torch.randn(257, D, generator=g) * torch.logspace(-6, 4, 257)[:, None]).bfloat16().to(device)
    failed = []
    for name, (quantize, dequantize, qdq) in FORMATS.items():
        expected = quantize(x)
        actual = quantize(x, backend=backend)
        same = all(torch.equal(_bits(a), _bits(e)) for a, e in zip(actual, expected, strict=True))
        same &= torch.equal(_bits(qdq(x, backend=backend)), _bits(dequantize(*expected, torch.bfloat16)))
        same &= torch.equal(_bits(dequantize(*expected, torch.bfloat16, backend=backend)), _bits(qdq(x)))
        if not same:
            failed.append(f"{name}/{backend}/{device}")
    return failed


def _measure(device: str, backends: list[str], size_mb: int, runs: int) -> list[dict]:
    rows_n = size_mb * 2**20 // (2 * D)
    x = torch.randn(rows_n, D, device=device).bfloat16()
    nbytes = x.numel() * x.element_size()
    out = torch.empty_like(x)
    copy_s = _median_s(lambda: out.copy_(x), device, runs)
    copy_gbs = nbytes / copy_s / 1e9
    results = [
        {"device": device, "format": "-", "op": "copy_", "backend": "torch", "mb": nbytes / 2**20,
         "median_ms": copy_s * 1e3, "gb_per_s": copy_gbs, "vs_copy": 1.0}
    ]  # fmt: skip
    for name, (quantize, dequantize, qdq) in FORMATS.items():
        for backend in backends:
            stored = quantize(x, backend=backend)
            ops = {
                "quantize": lambda q=quantize, b=backend: q(x, backend=b),
                "dequantize": lambda d=dequantize, s=stored, b=backend: d(*s, torch.bfloat16, backend=b),
                "qdq": lambda f=qdq, b=backend: f(x, backend=b),
            }
            for op, fn in ops.items():
                seconds = _median_s(fn, device, runs)
                gbs = nbytes / seconds / 1e9
                results.append(
                    {"device": device, "format": name, "op": op, "backend": backend, "mb": nbytes / 2**20,
                     "median_ms": seconds * 1e3, "gb_per_s": gbs, "vs_copy": gbs / copy_gbs}
                )  # fmt: skip
            del stored
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_json_flag(parser)
    parser.add_argument("--size-mb", type=int, default=64, help="bf16 tensor size on CPU (>= 64)")
    parser.add_argument("--cuda-size-mb", type=int, default=1024, help="bf16 tensor size on CUDA")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per op; the median is reported")
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU measurements")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    plans = [] if args.no_cpu else [("cpu", ["torch"], args.size_mb)]
    if torch.cuda.is_available():
        plans.append(("cuda", ["torch", "triton"], args.cuda_size_mb))
    failed = [f for device, backends, _ in plans for b in backends for f in _check(device, b)]
    if failed:
        print(f"refusing to benchmark: results differ from the torch reference for {failed}", file=sys.stderr)
        return 1

    results = []
    for device, backends, size_mb in plans:
        results += _measure(device, backends, size_mb, args.runs)
    meta = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "runs": args.runs,
        "shape": ["N", D],
        "gb_per_s_counts": "bytes of the bf16 tensor (quantize input / dequantize output)",
        "numerics": numerics_record(),
    }
    out = table_stream(args.json)
    print(f"# torch {meta['torch']}, {meta['threads']} threads, cuda {meta['cuda_device']}, runs {args.runs}",
          file=out)
    header = ("device", "format", "op", "backend", "MB", "ms", "GB/s", "vs copy")
    print("{:6} {:10} {:10} {:7} {:>6} {:>9} {:>8} {:>8}".format(*header), file=out)
    for r in results:
        print(
            f"{r['device']:6} {r['format']:10} {r['op']:10} {r['backend']:7} {r['mb']:6.0f} "
            f"{r['median_ms']:9.3f} {r['gb_per_s']:8.2f} {r['vs_copy']:8.3f}",
            file=out,
        )
    write_json({"meta": meta, "results": results}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
