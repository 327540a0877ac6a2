"""MODEL_SWAP against the receiver's cold prefill: time to first token of a new turn after a history of
1K, 8K and 32K tokens, with the receiver starting from the sender's stored global KV through a shipped
mapper artifact, against the receiver prefilling the whole conversation itself (the baseline, same process).

Per history length H (random token ids; the cost does not depend on content) and a new turn of T tokens:
- sender: prefill H tokens once and export its global KV (what the store holds; not timed);
- swap: decode the sender's chunks and map them (`apply_mapper`: strip RoPE, ridge or ridge + MLP per
  part, add RoPE, re-quantize), `state_from_global` on the receiver, then the receiver prefills the T new
  tokens from that state (encoder bounded replay included) and picks its first token;
- cold: the receiver prefills H + T tokens from nothing and picks its first token.
`apply_us_per_token` is the mapping step alone (chunk decode + map + chunk encode) per history token.

The family's checkpoints are configured for 2,048 positions; longer histories run on the same weights with
`max_seq_len` raised to fit (the RoPE table grows, nothing is trained at those positions: a speed figure,
not a quality one). The chunks carry the artifact's recorded fingerprints so the mapper accepts them.

Run: python -m benchmarks.bench_swap [--mapper DIR] [--lengths 1024 8192 32768] [--json PATH|-]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from benchmarks.hardware import cpu_model, enter_numerics, numerics_record
from benchmarks.report import add_json_flag, table_stream, write_json

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MAPPER = ROOT / "checkpoints" / "mappers" / "v41-sib-s--v41-sib-m"


def _model(name: str, max_seq_len: int):
    from model import ModelConfig, load_model

    directory = ROOT / "checkpoints" / name
    cfg = ModelConfig.from_json(directory / "config.json")
    if max_seq_len > cfg.max_seq_len:
        cfg = ModelConfig.from_dict(cfg.to_dict() | {"max_seq_len": max_seq_len})
    return load_model(directory, cfg).eval()


def _first_token(out) -> int:
    return int(out.logits[0].argmax(-1))


@torch.inference_mode()
def bench_length(mapper, sender, receiver, history: int, turn: int, reps: int, seed: int) -> dict[str, float]:
    from mappers import apply_mapper
    from model import export_global, prefill, state_from_global

    g = torch.Generator().manual_seed(seed + history)
    tokens = torch.randint(16, sender.cfg.vocab_size, (1, history + turn), generator=g)
    hist, new = tokens[:, :history], tokens[:, history:]
    fp_s = bytes.fromhex(mapper.sender.fingerprint)
    fp_r = bytes.fromhex(mapper.receiver.fingerprint)
    s_state = prefill(sender, hist).state
    chunk = 4096  # the store's chunks: several per long history, decoded one after another
    blobs = [
        export_global(s_state, a, min(a + chunk, history), fingerprint=fp_s) for a in range(0, history, chunk)
    ]
    kwargs = {"receiver_model": receiver, "tokens": hist} if mapper.needs_receiver_weights else {}
    apply_s, swap_s, cold_s = [], [], []
    swap_tok = cold_tok = -1
    for _ in range(reps):
        t0 = time.perf_counter()
        mapped = apply_mapper(mapper, blobs, sender_fingerprint=fp_s, receiver_fingerprint=fp_r, **kwargs)
        t1 = time.perf_counter()
        state = state_from_global(receiver, hist, list(mapped.blobs), fingerprint=fp_r)
        swap_tok = _first_token(prefill(receiver, new, state))
        t2 = time.perf_counter()
        apply_s.append(t1 - t0)
        swap_s.append(t2 - t0)
    for _ in range(reps):
        t0 = time.perf_counter()
        cold_tok = _first_token(prefill(receiver, tokens))
        cold_s.append(time.perf_counter() - t0)
    swap, cold, apply = statistics.median(swap_s), statistics.median(cold_s), statistics.median(apply_s)
    return {
        "history_tokens": history,
        "turn_tokens": turn,
        "reps": reps,
        "swap_ttft_ms": 1e3 * swap,
        "cold_ttft_ms": 1e3 * cold,
        "apply_ms": 1e3 * apply,
        "apply_us_per_token": 1e6 * apply / history,
        "swap_vs_cold": cold / swap,
        "first_token_agrees": float(swap_tok == cold_tok),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mapper", type=Path, default=DEFAULT_MAPPER, help="mapper artifact directory")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--turn", type=int, default=16, help="new tokens of the turn after the history")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per length (median)")
    parser.add_argument("--threads", type=int, default=1)
    add_json_flag(parser)
    args = parser.parse_args()
    enter_numerics("auto", "benchmarks.bench_swap", None)
    torch.set_num_threads(args.threads)
    from mappers import load_mapper

    mapper = load_mapper(args.mapper)
    longest = max(args.lengths) + args.turn
    sender, receiver = _model(mapper.sender.name, longest), _model(mapper.receiver.name, longest)
    rows = [bench_length(mapper, sender, receiver, h, args.turn, args.reps if h <= 8192 else 1, seed=0)
            for h in args.lengths]
    weights = args.mapper / "weights.safetensors"
    artifact_bytes = weights.stat().st_size + (args.mapper / "mapper.json").stat().st_size
    kinds = sorted({lm.part(p).kind for lm in mapper.layers for p in ("kv", "index")})
    out = table_stream(args.json)
    print(f"MODEL_SWAP {mapper.sender.name} -> {mapper.receiver.name} (parts: {', '.join(kinds)}; artifact "
          f"{artifact_bytes / 1e6:.2f} MB), {args.threads} thread(s), {cpu_model()}", file=out)
    print(f"{'history':>8}{'swap ms':>10}{'cold ms':>11}{'apply ms':>10}{'us/token':>10}{'cold/swap':>11}"
          f"{'same 1st':>10}", file=out)
    for r in rows:
        print(f"{r['history_tokens']:>8}{r['swap_ttft_ms']:>10.1f}{r['cold_ttft_ms']:>11.1f}"
              f"{r['apply_ms']:>10.1f}{r['apply_us_per_token']:>10.2f}{r['swap_vs_cold']:>10.1f}x"
              f"{bool(r['first_token_agrees'])!s:>10}", file=out)
    by = {r["history_tokens"]: r for r in rows}
    doc: dict[str, object] = {
        "pair": {"sender": mapper.sender.name, "receiver": mapper.receiver.name, "mapper": str(args.mapper),
                 "part_kinds": kinds},
        "rows": rows,
        "apply_us_per_token": statistics.median(r["apply_us_per_token"] for r in rows),
        "artifact_bytes": artifact_bytes,
        "threads": args.threads,
        "numerics": numerics_record(),
        "hardware": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                     "torch": torch.__version__},
    }
    for h, key in ((1024, "swap_vs_cold_1k"), (8192, "swap_vs_cold_8k"), (32768, "swap_vs_cold_32k")):
        if h in by:
            doc[key] = by[h]["swap_vs_cold"]
    write_json(doc, args.json)


if __name__ == "__main__":
    main()
