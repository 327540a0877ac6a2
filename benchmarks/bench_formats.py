"""Throughput of the block-format quantizers and dequantizers beside the same machine's copy bandwidth.

Run: `python -m benchmarks.bench_formats [--json PATH|-] [--size-mb 64] [--cuda-size-mb 1024] [--runs 5]
[--threads 1] [--reference]`.
On CPU the torch backend is timed: the compiled CPU path (kernels/formats/cpu.py) when it builds, and
with `--reference` also its slow twin reference.py (the Triton interpreter is a correctness tool, not a
speed one); on CUDA, when present, both backends are timed against a device-to-device `copy_`. Before
timing, each timed backend must match reference.py bitwise on a fresh input (and QDQ must equal
dequantize(quantize)); otherwise the run stops with exit code 1.

Byte model: GB/s counts the bytes of the bf16 tensor x [N, 512] (the quantizer's input, the
dequantizer's output), 2 bytes per value, over the median time of `--runs` runs (after one warm-up): on
CPU the thread's CPU time (one thread by default), on CUDA wall time.
A copy moves the same bytes once in and once out; `vs copy` = op GB/s / `copy_` GB/s on the same tensor
(into a preallocated output). The ops allocate their outputs, so `vs clone` also compares against
`clone()`, a copy that allocates (fresh pages fault in on first write, which is most of a dequantizer's
time at 64 MB on CPU).
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
from kernels.formats import cpu, reference

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
    # CPU: this thread's CPU time (user + system, so page faults count), which a machine shared with
    # other jobs inflates far less than wall time; CUDA: wall time around a synchronize
    clock = time.perf_counter if device == "cuda" else time.thread_time
    fn()
    times = []
    for _ in range(runs):
        _sync(device)
        start = clock()
        fn()
        _sync(device)
        times.append(clock() - start)
    return statistics.median(times)


REFERENCE: dict[str, tuple[Callable, Callable, Callable]] = {
    "fp4_e4m3": (
        reference.quantize_fp4_e4m3,
        lambda p, s, d: reference.dequantize_fp4_e4m3(p, s.view(torch.float8_e4m3fn), d),
        reference.qdq_fp4_e4m3,
    ),
    "mxfp4": (reference.quantize_mxfp4, reference.dequantize_mxfp4, reference.qdq_mxfp4),
    "fp8_ue8m0": (reference.quantize_fp8_ue8m0, reference.dequantize_fp8_ue8m0, reference.qdq_fp8_ue8m0),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.uint8)


def _check(device: str, backend: str) -> list[str]:
    """Names of the formats whose `backend` disagrees with the torch reference on a fresh input."""
    g = torch.Generator().manual_seed(int(time.time()))
    x = (torch.randn(257, D, generator=g) * torch.logspace(-6, 4, 257)[:, None]).bfloat16().to(device)
    failed = []
    for name, (quantize, dequantize, qdq) in FORMATS.items():
        ref_quantize, ref_dequantize, ref_qdq = REFERENCE[name]
        expected = ref_quantize(x)
        actual = quantize(x, backend=backend)
        same = all(torch.equal(_bits(a), _bits(e)) for a, e in zip(actual, expected, strict=True))
        same &= torch.equal(_bits(qdq(x, backend=backend)), _bits(ref_dequantize(*expected, torch.bfloat16)))
        same &= torch.equal(_bits(dequantize(*expected, torch.bfloat16, backend=backend)), _bits(ref_qdq(x)))
        if not same:
            failed.append(f"{name}/{backend}/{device}")
    return failed


def _measure(
    device: str, backends: list[str], size_mb: int, runs: int, with_reference: bool = False
) -> list[dict]:
    rows_n = size_mb * 2**20 // (2 * D)
    x = torch.randn(rows_n, D, device=device).bfloat16()
    nbytes = x.numel() * x.element_size()
    out = torch.empty_like(x)
    copy_s = _median_s(lambda: out.copy_(x), device, runs)
    clone_s = _median_s(lambda: x.clone(), device, runs)
    copy_gbs, clone_gbs = nbytes / copy_s / 1e9, nbytes / clone_s / 1e9
    results = [
        {"device": device, "format": "-", "op": op, "backend": "torch", "mb": nbytes / 2**20,
         "median_ms": s * 1e3, "gb_per_s": nbytes / s / 1e9, "vs_copy": copy_s / s, "vs_clone": clone_s / s}
        for op, s in (("copy_", copy_s), ("clone", clone_s))
    ]  # fmt: skip
    arms = [(b, FORMATS) for b in backends] + ([("reference", REFERENCE)] if with_reference else [])
    for name in FORMATS:
        for backend, table in arms:
            quantize, dequantize, qdq = table[name]
            kw = {} if backend == "reference" else {"backend": backend}
            stored = quantize(x, **kw)
            ops = {
                "quantize": lambda q=quantize, k=kw: q(x, **k),
                "dequantize": lambda d=dequantize, s=stored, k=kw: d(*s, torch.bfloat16, **k),
                "qdq": lambda f=qdq, k=kw: f(x, **k),
            }
            for op, fn in ops.items():
                seconds = _median_s(fn, device, runs if backend != "reference" else 1)
                gbs = nbytes / seconds / 1e9
                results.append(
                    {"device": device, "format": name, "op": op, "backend": backend, "mb": nbytes / 2**20,
                     "median_ms": seconds * 1e3, "gb_per_s": gbs, "vs_copy": gbs / copy_gbs,
                     "vs_clone": gbs / clone_gbs}
                )  # fmt: skip
            del stored
    return results


def slowest_vs_copy(results: list[dict], op: str, backend: str = "torch") -> float:
    """The slowest format's `vs_copy` for `op` (what the issue's targets read)."""
    return min(r["vs_copy"] for r in results if r["op"] == op and r["backend"] == backend)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_json_flag(parser)
    parser.add_argument("--size-mb", type=int, default=64, help="bf16 tensor size on CPU (>= 64)")
    parser.add_argument("--cuda-size-mb", type=int, default=1024, help="bf16 tensor size on CUDA")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per op; the median is reported")
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU measurements")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--reference", action="store_true",
                        help="also time reference.py, the slow twin (one run per op: seconds each)")
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
        results += _measure(device, backends, size_mb, args.runs, args.reference and device == "cpu")
    meta = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "runs": args.runs,
        "shape": ["N", D],
        "gb_per_s_counts": "bytes of the bf16 tensor (quantize input / dequantize output)",
        "numerics": numerics_record(),
        "cpu_compiled_path": cpu.available(),
    }
    out = table_stream(args.json)
    print(f"# torch {meta['torch']}, {meta['threads']} threads, cuda {meta['cuda_device']}, runs {args.runs}",
          file=out)
    header = ("device", "format", "op", "backend", "MB", "ms", "GB/s", "vs copy", "vs clone")
    print("{:6} {:10} {:10} {:9} {:>6} {:>9} {:>8} {:>8} {:>8}".format(*header), file=out)
    for r in results:
        print(
            f"{r['device']:6} {r['format']:10} {r['op']:10} {r['backend']:9} {r['mb']:6.0f} "
            f"{r['median_ms']:9.3f} {r['gb_per_s']:8.2f} {r['vs_copy']:8.3f} {r['vs_clone']:8.3f}",
            file=out,
        )
    write_json({"meta": meta, "results": results}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
