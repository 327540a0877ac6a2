"""Answer quality of the shipped sibling models: held-out loss, and key-value recall against distance on
every resume path (cold, full hit, global-only + replay, FP4 vs unquantized global KV, `ced` vs
`reference`), with mean next-token KL against cold prefill.

Run: `python -m benchmarks.bench_quality [--models v41-sib-s v41-sib-l | DIR ...] [--episodes 32]
[--json PATH|-] [--png OUT.png] [--write-eval] [--threads N]` (the same run as `kvresume eval`).
Checkpoints load through `model.load_model`; episodes and the held-out loss come from the test split of
the corpus recorded beside the shipped tokenizer (`model.train.quality` says how each path is built and
`model.train.quality_report` what the JSON holds). Exit code 1 when the full-hit path is not
bit-identical to the uninterrupted computation: every other figure assumes it.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.hardware import enter_numerics, numerics_record
from model import add_eval_arguments, eval_from_args


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_quality", description="answer quality")
    add_eval_arguments(p)
    p.add_argument("--numerics", choices=("auto", "portable", "strict", "native"), default="auto",
                   help="CPU code path to compute under (default auto, the served default)")
    args = p.parse_args(argv)
    enter_numerics(args.numerics, "benchmarks.bench_quality", argv)
    return eval_from_args(args, numerics=numerics_record())


if __name__ == "__main__":
    sys.exit(main())
