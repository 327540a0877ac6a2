"""The GEMM probe of a pinned CPU path, run as `python -m orchestrator.numerics_probe` in a child process
that starts under the path's environment (orchestrator/numerics_env.py starts it and reads its one line of
JSON on stdout: {"ok": true} or {"ok": false, "reason": "..."}).

Why it exists: the pinned paths promise that a row's fp32 product does not depend on how many rows share the
call, nor on the thread count. The model's exactness rests on that (a chunked prefill equals the one-shot
prefill, a session decoded among others equals the session alone, model/invariant.py), and the conformance
vectors were generated on a machine where it held. MKL does not keep it everywhere: on an Intel Xeon with
AVX-512 (2026-12), MKL_CBWR=AVX2 gives products of 2, 3, 7 or 8 rows that differ in the last bit from the
same rows of a 40-row product, while MKL_CBWR=AVX2,STRICT gives identical rows for every row count; on an
AMD EPYC Zen 4 both give 2- and 3-row products of their own, which the model's `fp32_linear` runs inside
4-row ones (model/README.md, "The numerics profile"). So a path is used only where this probe, run on the
model's own products, passes.

One row (M = 1) is probed against the stack only under strict mode: elsewhere a lone row keeps MKL's
matrix-vector kernel on purpose, and the probe checks that a batched decode's `rowwise_linear` reproduces
it; under strict, the model stacks lone rows into one product instead.
"""

from __future__ import annotations

import json
import os
import sys

# (K, N) of the model's fp32 products: the compressor (K = dim, small N), the 32-wide K blocks of the
# block-scaled GEMMs, and the mHC mixes (K = hc * dim).
_SHAPES = ((64, 32), (32, 128), (256, 128), (1024, 24), (96, 2), (96, 4096))
# Row counts up to what a step stacks: a batched decode up to max_batch_sequences (64 by default) rows in
# one product under strict, against a whole of 128 (it was 1-16 against 40, which left 17-64 unchecked).
_ROWS = 128
_ROW_COUNTS = (2, 3, 4, 5, 7, 8, 16, 17, 31, 33, 48, 64, 65, 96)


def probe() -> str | None:
    """Why this process's fp32 products are not row- and thread-invariant, or None when they are."""
    import torch
    import torch.nn.functional as F

    torch.backends.mkldnn.enabled = False
    torch.set_num_threads(1)
    from model import fp32_linear, fp32_rows_free, rowwise_linear

    # where model.invariant stacks lone rows into one product (strict mode), one row must agree too
    rows_free = fp32_rows_free()
    row_counts = (1, *_ROW_COUNTS) if rows_free else _ROW_COUNTS
    gen = torch.Generator().manual_seed(20261201)
    for k, n in _SHAPES:
        # bf16-representable inputs, as the model's activations and weights are
        x = torch.randn(_ROWS, k, generator=gen).bfloat16().float()
        w = torch.randn(n, k, generator=gen).bfloat16().float()
        whole = F.linear(x, w)
        for m in row_counts:
            for start in range(0, _ROWS - m + 1, m):
                if not torch.equal(fp32_linear(x[start : start + m], w), whole[start : start + m]):
                    return (
                        f"an fp32 product of {m} rows (K={k}, N={n}) differs from the same rows of a "
                        f"{_ROWS}-row product"
                    )
        if not rows_free:
            lone = torch.cat([fp32_linear(x[i : i + 1], w) for i in range(_ROWS)])
            if not torch.equal(rowwise_linear(x, w), lone):
                return f"a batched decode's one-row products (K={k}, N={n}) differ from lone one-row products"
        torch.set_num_threads(2)
        try:
            if not torch.equal(F.linear(x, w), whole):
                return f"an fp32 product of {_ROWS} rows (K={k}, N={n}) differs at 2 threads from 1 thread"
        finally:
            torch.set_num_threads(1)
    return None


def main() -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        print(json.dumps({"ok": None, "reason": "torch is not installed"}))
        return 0
    reason = probe()
    env = {k: os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "OMP_NUM_THREADS")}
    print(json.dumps({"ok": reason is None, "reason": reason, "env": env}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
