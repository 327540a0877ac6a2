"""Multi-turn drift of MODEL_SWAP: a session switching between two siblings every turn for 10 turns, its
global KV mapped at each switch by the shipped artifacts of both directions, scored after every turn on a
recall probe whose evidence lies in the first turn (mappers/drift.py). Per turn: retention (mapped / the
turn's model on its own uninterrupted cache) with a 95% paired-bootstrap interval; the slope of retention
per turn with an episode-resampled interval.

Run: python -m benchmarks.bench_swap_drift [--pair v41-sib-s v41-sib-m] [--episodes 64] [--json PATH|-]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch

from benchmarks.hardware import cpu_model, enter_numerics, numerics_record
from benchmarks.report import add_json_flag, table_stream, write_json

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", nargs=2, default=["v41-sib-s", "v41-sib-m"], metavar=("A", "B"),
                        help="model of even turns, model of odd turns")
    parser.add_argument("--mappers", type=Path, default=ROOT / "checkpoints" / "mappers",
                        help="folder holding the artifacts <A>--<B> and <B>--<A>")
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--task-seed", type=int, default=7, help="episode seed (use one no fit used)")
    parser.add_argument("--threads", type=int, default=1)
    add_json_flag(parser)
    args = parser.parse_args()
    enter_numerics("auto", "benchmarks.bench_swap_drift", None)
    torch.set_num_threads(args.threads)
    from mappers import bucket_seed, load_mapper
    from mappers.drift import measure_drift
    from model import family_recall_episodes, load_model

    a, b = args.pair
    mappers = {(s, r): load_mapper(args.mappers / f"{s}--{r}") for s, r in ((a, b), (b, a))}
    for m in mappers.values():
        if args.task_seed in m.fit_task_seeds:
            pair = f"{m.sender.name} -> {m.receiver.name}"
            raise SystemExit(f"task seed {args.task_seed} was used in fitting {pair}")
    models = {n: load_model(ROOT / "checkpoints" / n).eval() for n in (a, b)}
    w = models[a].cfg.window_size
    # the evidence must lie in the first turn: distance > the later turns' tokens + the probe
    distance = (args.turns - 1) * args.turn_tokens + 6 * w
    eps = family_recall_episodes(distance, args.episodes, seed=bucket_seed(args.task_seed, 15))
    started = time.perf_counter()
    report = measure_drift(mappers, models, (a, b), eps.tokens, [(x.start, x.end) for x in eps.answers],
                           suffix_tokens=w, turns=args.turns, turn_tokens=args.turn_tokens)
    seconds = time.perf_counter() - started
    rows = report.per_turn()
    slope, lo, hi = report.slope()
    slope1, lo1, hi1 = report.slope(from_turn=1)
    out = table_stream(args.json)
    print(f"drift {a} <-> {b}, {args.episodes} episodes, evidence {distance} tokens before the last probe, "
          f"{args.turns} turns of {args.turn_tokens} tokens after a first turn of {report.first_tokens}",
          file=out)
    print(f"{'turn':>4} {'model':<10}{'own':>7}{'mapped':>8}{'retention [95% CI]':>26}", file=out)
    for r in rows:
        print(f"{r['turn']:>4} {r['model']:<10}{r['own_acc']:>7.3f}{r['mapped_acc']:>8.3f}"
              f"{r['retention']:>10.3f} [{r['ci_lower']:.3f}, {r['ci_upper']:.3f}]", file=out)
    print(f"slope of retention per turn {slope:+.4f} [{lo:+.4f}, {hi:+.4f}] over turns 0-{args.turns - 1}, "
          f"{slope1:+.4f} [{lo1:+.4f}, {hi1:+.4f}] over the mapped turns 1-{args.turns - 1}", file=out)
    write_json({
        "pair": [a, b], "episodes": args.episodes, "distance": distance, "turns": rows,
        "slope_per_turn": slope, "slope_ci": [lo, hi], "slope_per_turn_mapped_turns": slope1,
        "slope_ci_mapped_turns": [lo1, hi1], "seconds": seconds, "threads": args.threads,
        "numerics": numerics_record(),
        "hardware": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()},
    }, args.json)


if __name__ == "__main__":
    main()
