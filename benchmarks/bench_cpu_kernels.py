"""The compiled CPU kernels of the model's hot small ops against their torch twins, side by side in one
process: the bf16 linear (kernels/bf16_gemm) at the served models' widths, the mHC Sinkhorn normalization
(kernels/mhc) at 1, 64 and 240 combs, the sparse attention (kernels/sparse_attn, where its probe takes
v41-sib-s's shape) at a chunk's, a decode step's and a 36-chunk step's rows, then v41-sib-s's passes with
every compiled path on and off on the same states (a lone `decode`, `prefill_many` of ragged 16-32-token
chunks, `decode_many` of many sequences).

Run: `python -m benchmarks.bench_cpu_kernels [--checkpoint checkpoints/v41-sib-s] [--sequences 64]
[--chunks 10] [--repeats 30] [--json PATH|-]`. Before timing, every result is checked bit for bit against
torch's and every pass's logits against the torch run's; the benchmark refuses to report otherwise.
Reported: median wall time (us or ms), the ratio torch / compiled, 1 thread. FLOP model: none (the
compiled paths change how the same arithmetic is scheduled, not how much there is).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from benchmarks.hardware import cpu_model, enter_numerics, numerics_record
from benchmarks.report import add_json_flag, table_stream, write_json

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / "v41-sib-s"
# (rows, K, N): a 10-chunk prefill step's projections and MoE of v41-sib-s, a 64-sequence decode step's,
# and its vocabulary head over a chunk
SHAPES = ((240, 96, 96), (240, 96, 192), (240, 64, 128), (64, 96, 96), (64, 64, 64), (32, 96, 4096))


def _median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def products(repeats: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from kernels import bf16_linear, pack_bf16_weight

    gen = torch.Generator().manual_seed(0)
    rows = []
    for m, k, n in SHAPES:
        x = torch.randn(m, k, generator=gen).bfloat16()
        w = torch.randn(n, k, generator=gen).bfloat16()
        packed = pack_bf16_weight(w)
        if not torch.equal(bf16_linear(x, w, packed).view(torch.int16), F.linear(x, w).view(torch.int16)):
            raise SystemExit(f"the compiled product differs from F.linear at {(m, k, n)}: not timing")
        t_torch = _median_s(lambda: F.linear(x, w), repeats)  # noqa: B023 - called at once
        t_ours = _median_s(lambda: bf16_linear(x, w, packed), repeats)  # noqa: B023
        rows.append({"rows": m, "k": k, "n": n, "torch_us": t_torch * 1e6, "compiled_us": t_ours * 1e6,
                     "speedup": t_torch / t_ours})  # fmt: skip
    return rows


def sinkhorns(repeats: int) -> list[dict]:
    import torch

    from kernels import sinkhorn, sinkhorn_reference

    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in (1, 64, 240):
        comb = torch.exp(torch.randn(1, n, 4, 4, generator=gen) * 3)
        if not torch.equal(sinkhorn(comb, 20, 1e-6), sinkhorn_reference(comb, 20, 1e-6)):
            raise SystemExit(f"the compiled Sinkhorn differs from the reference at {n} combs: not timing")
        t_torch = _median_s(lambda: sinkhorn_reference(comb, 20, 1e-6), repeats)  # noqa: B023
        t_ours = _median_s(lambda: sinkhorn(comb, 20, 1e-6), repeats)  # noqa: B023
        rows.append({"combs": n, "torch_us": t_torch * 1e6, "compiled_us": t_ours * 1e6,
                     "speedup": t_torch / t_ours})  # fmt: skip
    return rows


# (rows, ids a row) of the sparse attention, H = 2, D = 64 (v41-sib-s): a 24-token chunk, a 48-sequence
# decode step, a 36-chunk prefill step's stack
ATTENTION_SHAPES = ((24, 32), (48, 32), (852, 32))


def sparse_attentions(repeats: int) -> list[dict]:
    import torch

    from kernels import sparse_attn_compiled
    from kernels.sparse_attn.reference import sparse_attn_reference

    gen = torch.Generator().manual_seed(0)
    rows = []
    for t, k in ATTENTION_SHAPES:
        q = torch.randn(1, t, 2, 64, generator=gen).bfloat16()
        kv = torch.randn(1, 13 * t, 64, generator=gen).bfloat16()
        ids = torch.randint(-1, kv.size(1), (1, t, k), generator=gen, dtype=torch.int32)
        sink = torch.randn(2, generator=gen)
        got = sparse_attn_compiled(q, kv, sink, ids, 0.125)
        if got is None:
            return []  # the probe refused this profile's products here: nothing compiled to time
        want = sparse_attn_reference(q, kv, sink, ids, 0.125)
        if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            raise SystemExit(f"the compiled sparse attention differs from the reference at {(t, k)}")
        t_torch = _median_s(lambda: sparse_attn_reference(q, kv, sink, ids, 0.125), repeats)  # noqa: B023
        t_ours = _median_s(lambda: sparse_attn_compiled(q, kv, sink, ids, 0.125), repeats)  # noqa: B023
        rows.append({"rows": t, "ids": k, "torch_us": t_torch * 1e6, "compiled_us": t_ours * 1e6,
                     "speedup": t_torch / t_ours})  # fmt: skip
    return rows


# the dispatchers' checks, by module and name: switching them off runs every torch twin
_SWITCHES = (
    ("kernels.bf16_gemm", "usable"),
    ("kernels.mhc", "usable"),
    ("kernels.mhc", "lanes_usable"),
    ("kernels.sparse_attn.cpu", "takes"),
)


def _never(*args: object, **kwargs: object) -> bool:
    return False


def _compiled(on: bool, usable: dict) -> None:
    """Switch every compiled path on or off."""
    for name, attr in _SWITCHES:
        setattr(sys.modules[name], attr, usable[(name, attr)] if on else _never)


def passes(checkpoint: Path, sequences: int, chunks: int, steps: int) -> dict:
    """Each step run twice on twin states, compiled paths on and off (interleaved, so load changes hit
    both alike)."""
    import torch

    import kernels.bf16_gemm  # noqa: F401 - registers the modules _SWITCHES names
    import kernels.mhc  # noqa: F401
    import kernels.sparse_attn.cpu  # noqa: F401
    from benchmarks.bench_decode_step import _states
    from model import decode, decode_many, load_model, prefill_many

    model = load_model(checkpoint).eval()
    rng = random.Random(1)
    vocab = model.cfg.vocab_size
    usable = {(name, attr): getattr(sys.modules[name], attr) for name, attr in _SWITCHES}
    out = {}
    with torch.inference_mode():
        for kind, n in (("decode", 1), ("prefill_many", chunks), ("decode_many", sequences)):
            base = _states(model, n, 0)
            on, off = [s.clone() for s in base], [s.clone() for s in base]
            t_on, t_off = [], []
            try:
                for _ in range(steps):
                    if kind == "decode":
                        tok = torch.tensor([rng.randrange(16, vocab)])
                        run = lambda states, tok=tok: [decode(model, tok, states[0])]  # noqa: E731
                    elif kind == "decode_many":
                        toks = [rng.randrange(16, vocab) for _ in base]
                        run = lambda states, toks=toks: decode_many(model, toks, states)  # noqa: E731
                    else:
                        lengths = [rng.randint(16, 32) for _ in base]
                        chunk = [
                            torch.tensor([[rng.randrange(16, vocab) for _ in range(t)]]) for t in lengths
                        ]
                        run = lambda states, chunk=chunk: prefill_many(model, chunk, states)  # noqa: E731
                    _compiled(True, usable)
                    t0 = time.perf_counter()
                    got = run(on)
                    t_on.append(time.perf_counter() - t0)
                    _compiled(False, usable)
                    t0 = time.perf_counter()
                    want = run(off)
                    t_off.append(time.perf_counter() - t0)
                    if not all(torch.equal(a.logits, b.logits) for a, b in zip(got, want, strict=True)):
                        raise SystemExit(f"{kind} with the compiled kernels differs from torch's: not timing")
            finally:
                _compiled(True, usable)
            on_s, off_s = statistics.median(t_on), statistics.median(t_off)
            out[kind] = {"sequences": n, "compiled_ms": on_s * 1e3, "torch_ms": off_s * 1e3,
                         "speedup": off_s / on_s}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=30)
    add_json_flag(parser)
    args = parser.parse_args(argv)
    enter_numerics("auto", "benchmarks.bench_cpu_kernels", argv)
    import torch

    from kernels.bf16_gemm import cpu

    torch.set_num_threads(1)
    if not cpu.usable():
        raise SystemExit("the compiled bf16 linear is not usable here (kernels/README.md): nothing to time")
    out = table_stream(args.json)
    passes_doc = passes(args.checkpoint, args.sequences, args.chunks, args.steps)
    doc = {"products": products(args.repeats), "sinkhorn": sinkhorns(args.repeats),
           "sparse_attention": sparse_attentions(args.repeats), "passes": passes_doc,
           "threads": 1, "cpu": cpu_model(), "numerics": numerics_record()}  # fmt: skip
    print(f"bench_cpu_kernels: 1 thread, {doc['cpu']}", file=out)
    print("bf16 linear (kernels/bf16_gemm)", file=out)
    print(f"{'rows':>5} {'K':>5} {'N':>5} {'torch us':>9} {'compiled us':>12} {'speedup':>8}", file=out)
    for r in doc["products"]:
        print(f"{r['rows']:>5} {r['k']:>5} {r['n']:>5} {r['torch_us']:>9.0f} {r['compiled_us']:>12.0f} "
              f"{r['speedup']:>7.2f}x", file=out)  # fmt: skip
    print("Sinkhorn normalization, 4 lanes, 20 rounds (kernels/mhc)", file=out)
    for r in doc["sinkhorn"]:
        print(f"{r['combs']:>5} combs: torch {r['torch_us']:.0f} us, compiled {r['compiled_us']:.0f} us: "
              f"{r['speedup']:.1f}x", file=out)  # fmt: skip
    if doc["sparse_attention"]:
        print("sparse attention, 2 heads of 64 (kernels/sparse_attn)", file=out)
    else:
        print("sparse attention: its probe refused this profile's products (the reference serves)", file=out)
    for r in doc["sparse_attention"]:
        print(f"{r['rows']:>5} rows x {r['ids']} ids: torch {r['torch_us']:.0f} us, compiled "
              f"{r['compiled_us']:.0f} us: {r['speedup']:.1f}x", file=out)  # fmt: skip
    for kind, r in doc["passes"].items():
        print(f"{kind} of {r['sequences']} sequences (v41-sib-s): torch {r['torch_ms']:.1f} ms, compiled "
              f"{r['compiled_ms']:.1f} ms: {r['speedup']:.2f}x", file=out)  # fmt: skip
    write_json(doc, args.json)


if __name__ == "__main__":
    sys.exit(main())
