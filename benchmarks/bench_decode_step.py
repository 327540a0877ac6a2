"""One decode step of many sessions on a served model: `decode_many` over the stacked rows vs each sequence
decoded alone (`decode`), on the same states, in the same process.

Run: `python -m benchmarks.bench_decode_step [--checkpoint checkpoints/v41-sib-s] [--sequences 64]
[--threads 1] [--steps 8] [--json PATH|-]`. The states are fresh `ced` prefills of unequal lengths (a first
turn of 64 tokens plus 0-6 turns of 16-32, as the service's model-load run builds them), so the step mixes
sequences whose compression groups close and not, and histories below and above the indexer's top-k.
Before timing it checks, on a copy of the states, that every batched step's logits equal the lone
decodes' bit for bit, and refuses to report otherwise.

Reported: median wall time of a step (ms) and tokens/s, batched and one by one, and their ratio; also the
step with only the row-wise ops batched (`decode_many(batched_attention=False)`: each sequence's attention
stage alone, what decode_many did before the batched attention stage), and the step that gives every
state fresh ring tensors (`decode_many(in_place=False)`, what it did before session 33: model/owned_rows.py).
FLOP model: none (the step of a small model is dominated by per-op overhead, which is what batching
removes).

`--prefill T` times a step's prefill chunks instead: every sequence extends its state by a chunk of T new
tokens (the turn's whole prompt), `prefill_many` over all of them vs each `prefill` alone, after the same
bitwise check (logits and stats); also `prefill_many(batched_attention=False)` (each sequence's attention
stage alone, what prefill_many did before its batched attention stage). `--prefill-max T2` draws each
chunk's length from [T, T2] instead (ragged chunks: fewer sequences share a chunk length, so fewer share
the blocked mixes and the sparse attention's calls).

`--profile N` then runs the batched pass `--steps` times more under cProfile (on the timed states, which
go on growing) and reports the N functions with the most own time, each in ms a step and as a share of
the profiled total (`profile_top`; `profile_ms_per_step`, which includes the profiler's own cost): where
a batched pass's time goes, the table of orchestrator/README.md, session 36.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.hardware import cpu_model, enter_numerics, numerics_record
from benchmarks.report import add_json_flag, table_stream, write_json

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / "v41-sib-s"


def _states(model, n: int, seed: int) -> list:
    import torch

    from model import prefill

    rng = random.Random(seed)
    vocab = model.cfg.vocab_size
    states = []
    for _ in range(n):
        length = 64 + sum(rng.randrange(16, 33) + 4 for _ in range(rng.randrange(0, 7)))
        prompt = torch.tensor([[rng.randrange(16, vocab) for _ in range(length)]])
        states.append(prefill(model, prompt, mode="ced").state)
    return states


def _profile_top(step: Callable[[int], None], steps: int, top: int) -> dict:
    """`step(i)` for i in range(steps) under cProfile: the `top` functions by own time, in ms a step and
    as a share of the profiled total."""
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(steps):
        step(i)
    profiler.disable()
    stats = pstats.Stats(profiler)
    total = stats.total_tt  # type: ignore[attr-defined]
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]  # type: ignore[attr-defined]
    return {
        "profile_ms_per_step": total / steps * 1e3,
        "profile_top": [
            {
                # the file's folder too: several kernels have a cpu.py
                "function": f"{Path(file).parent.name}/{Path(file).name}:{line}({name})" if line else name,
                "own_ms_per_step": own / steps * 1e3,
                "share": own / total if total else 0.0,
            }
            for (file, line, name), (_, _, own, _, _) in rows
        ],
    }


def _print_profile(doc: dict, out) -> None:
    if "profile_top" not in doc:
        return
    print(f"  cProfile of the batched pass: {doc['profile_ms_per_step']:.1f} ms a step (profiled)", file=out)
    for row in doc["profile_top"]:
        print(f"    {row['own_ms_per_step']:7.2f} ms {row['share'] * 100:5.1f}%  {row['function']}", file=out)


def run(checkpoint: Path, sequences: int, steps: int, seed: int, profile: int = 0) -> dict:
    import torch

    from model import decode, decode_many, load_model

    model = load_model(checkpoint).eval()
    rng = random.Random(seed + 1)
    with torch.inference_mode():
        base = _states(model, sequences, seed)
        tokens = [[rng.randrange(16, model.cfg.vocab_size) for _ in base] for _ in range(steps)]
        check_a, check_b = [s.clone() for s in base], [s.clone() for s in base]
        for step in tokens[:2]:
            got = decode_many(model, step, check_a)
            for j, (t, s) in enumerate(zip(step, check_b, strict=True)):
                if not torch.equal(decode(model, torch.tensor([t]), s).logits, got[j].logits):
                    raise SystemExit(f"decode_many differs from decode at sequence {j}: not timing")
        batched, twin, alone = [s.clone() for s in base], [s.clone() for s in base], [s.clone() for s in base]
        fresh = [s.clone() for s in base]
        t_batched, t_twin, t_alone, t_fresh = [], [], [], []
        # interleaved, so load changes hit all sides alike
        for step in tokens:
            t0 = time.perf_counter()
            decode_many(model, step, batched)
            t_batched.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            decode_many(model, step, fresh, in_place=False)
            t_fresh.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            decode_many(model, step, twin, batched_attention=False)
            t_twin.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for t, s in zip(step, alone, strict=True):
                decode(model, torch.tensor([t]), s)
            t_alone.append(time.perf_counter() - t0)
        profiled = {}
        if profile:
            profiled = _profile_top(lambda i: decode_many(model, tokens[i], batched), steps, profile)
    # (the first step of the in-place side makes the rings it then writes into: its later steps are the
    # serving case, a state's decodes after its prompt)
    mb, mt, ma = statistics.median(t_batched[1:]), statistics.median(t_twin), statistics.median(t_alone)
    mf = statistics.median(t_fresh[1:])
    lengths = [s.n_tokens for s in base]
    return {
        **profiled,
        "checkpoint": str(checkpoint),
        "sequences": sequences,
        "steps": steps,
        "threads": torch.get_num_threads(),
        "history_min": min(lengths),
        "history_max": max(lengths),
        "step_ms_batched": mb * 1e3,
        "step_ms_attention_alone": mt * 1e3,
        "step_ms_alone": ma * 1e3,
        "step_ms_fresh_rings": mf * 1e3,
        "tokens_per_s_batched": sequences / mb,
        "tokens_per_s_alone": sequences / ma,
        "batched_vs_alone": ma / mb,
        "batched_vs_attention_alone": mt / mb,
        "batched_vs_fresh_rings": mf / mb,
        "cpu": cpu_model(),
        "numerics": numerics_record(),
    }


def run_prefill(
    checkpoint: Path, sequences: int, steps: int, seed: int, chunk: int, chunk_max: int, profile: int = 0
) -> dict:
    import torch

    from model import load_model, prefill, prefill_many

    model = load_model(checkpoint).eval()
    rng = random.Random(seed + 2)
    vocab = model.cfg.vocab_size
    with torch.inference_mode():
        base = _states(model, sequences, seed)
        chunks = [[torch.tensor([[rng.randrange(16, vocab) for _ in range(rng.randint(chunk, chunk_max))]])
                   for _ in base] for _ in range(steps)]  # fmt: skip
        check_a, check_b = [s.clone() for s in base], [s.clone() for s in base]
        for step in chunks[:2]:
            got = prefill_many(model, step, check_a)
            for j, (c, s) in enumerate(zip(step, check_b, strict=True)):
                ref = prefill(model, c, s, mode="ced")
                if not torch.equal(ref.logits, got[j].logits) or ref.stats != got[j].stats:
                    raise SystemExit(f"prefill_many differs from prefill at sequence {j}: not timing")
        batched, twin, alone = [s.clone() for s in base], [s.clone() for s in base], [s.clone() for s in base]
        t_batched, t_twin, t_alone = [], [], []
        for step in chunks:  # interleaved, so load changes hit all sides alike
            t0 = time.perf_counter()
            prefill_many(model, step, batched)
            t_batched.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            prefill_many(model, step, twin, batched_attention=False)
            t_twin.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for c, s in zip(step, alone, strict=True):
                prefill(model, c, s, mode="ced")
            t_alone.append(time.perf_counter() - t0)
        profiled = {}
        if profile:
            profiled = _profile_top(lambda i: prefill_many(model, chunks[i], batched), steps, profile)
    mb, mt, ma = statistics.median(t_batched), statistics.median(t_twin), statistics.median(t_alone)
    lengths = [s.n_tokens for s in base]
    tokens = statistics.mean(sum(c.size(1) for c in step) for step in chunks)
    return {
        **profiled,
        "checkpoint": str(checkpoint),
        "sequences": sequences,
        "chunk_tokens": chunk,
        "chunk_tokens_max": chunk_max,
        "steps": steps,
        "threads": torch.get_num_threads(),
        "history_min": min(lengths),
        "history_max": max(lengths),
        "step_ms_batched": mb * 1e3,
        "step_ms_attention_alone": mt * 1e3,
        "step_ms_alone": ma * 1e3,
        "tokens_per_s_batched": tokens / mb,
        "tokens_per_s_alone": tokens / ma,
        "batched_vs_alone": ma / mb,
        "batched_vs_attention_alone": mt / mb,
        "cpu": cpu_model(),
        "numerics": numerics_record(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill", type=int, default=0, metavar="T",
                        help="time prefill chunks of T tokens per sequence instead of a decode step")
    parser.add_argument("--prefill-max", type=int, default=0, metavar="T2",
                        help="with --prefill T: chunk lengths drawn from [T, T2] (ragged)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="then profile the batched pass: its N functions with the most own time")
    parser.add_argument("--numerics", choices=("auto", "portable", "strict", "native"), default="auto")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.profile < 0:
        parser.error(f"--profile must be 0 (none) or a number of functions, got {args.profile}")
    enter_numerics(args.numerics, "benchmarks.bench_decode_step", argv)
    import torch

    torch.set_num_threads(args.threads)
    out = table_stream(args.json)
    if args.prefill > 0:
        chunk_max = max(args.prefill, args.prefill_max)
        doc = run_prefill(
            args.checkpoint, args.sequences, args.steps, args.seed, args.prefill, chunk_max, args.profile
        )
        print(f"bench_decode_step --prefill {args.prefill}-{chunk_max}: {doc['sequences']} sequences, "
              f"histories {doc['history_min']}-{doc['history_max']}, {doc['threads']} thread(s), "
              f"{doc['cpu']}", file=out)
        print(f"  prefill_many {doc['step_ms_batched']:.1f} ms/step "
              f"({doc['tokens_per_s_batched']:.0f} tok/s), "
              f"alone {doc['step_ms_alone']:.1f} ms/step ({doc['tokens_per_s_alone']:.0f} tok/s): "
              f"{doc['batched_vs_alone']:.2f}x; attention alone {doc['step_ms_attention_alone']:.1f} ms/step "
              f"({doc['batched_vs_attention_alone']:.2f}x)", file=out)
        _print_profile(doc, out)
        print(json.dumps({k: v for k, v in doc.items() if k != "numerics"}),
              file=sys.stderr if args.json == "-" else out)
        write_json(doc, args.json)
        return
    doc = run(args.checkpoint, args.sequences, args.steps, args.seed, args.profile)
    print(f"bench_decode_step: {doc['sequences']} sequences, histories {doc['history_min']}-"
          f"{doc['history_max']}, {doc['threads']} thread(s), {doc['cpu']}", file=out)
    print(f"  batched {doc['step_ms_batched']:.1f} ms/step ({doc['tokens_per_s_batched']:.0f} tok/s), "
          f"alone {doc['step_ms_alone']:.1f} ms/step ({doc['tokens_per_s_alone']:.0f} tok/s): "
          f"{doc['batched_vs_alone']:.2f}x; attention alone {doc['step_ms_attention_alone']:.1f} ms/step "
          f"({doc['batched_vs_attention_alone']:.2f}x); fresh rings every step (in_place=False) "
          f"{doc['step_ms_fresh_rings']:.1f} ms/step ({doc['batched_vs_fresh_rings']:.2f}x)", file=out)
    _print_profile(doc, out)
    print(json.dumps({k: v for k, v in doc.items() if k != "numerics"}), file=sys.stderr if args.json == "-"
          else out)
    write_json(doc, args.json)


if __name__ == "__main__":
    main()
