"""Reporting of the quality harness: checkpoint resolution, the text table, the recall-vs-distance plot,
the JSON document, and the command-line options shared by `kvresume eval` and
`python -m benchmarks.bench_quality`. Knows nothing of how paths are run (`model.train.quality`).

The JSON's top-level `recall_{cold,replay,fp4,unquantized}_8w` keys are those of the larger sibling (by
parameter count); `models` holds every model's full result. The run refuses to report success (exit 1)
when the full-hit path is not bit-identical to the uninterrupted computation: every other figure
assumes it.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from model.train import CorpusManifest, load_tokenizer, read_split, shipped_tokenizer_dir, tokenize_corpus
from model.train.family import SIBLING_NAMES
from model.train.quality import PATHS, QualitySpec, evaluate_quality
from model.train.tasks import CorpusFiller
from model.weights import load_model

__all__ = [
    "PATH_LABELS", "add_eval_arguments", "checkpoint_dir", "eval_from_args", "family_recall_episodes",
    "heldout_filler", "plot", "run", "table",
]

REPO = Path(__file__).resolve().parents[2]
PATH_LABELS = {
    "cold": "cold prefill (FP4 global KV)",
    "full_hit": "full hit (bytes round trip)",
    "replay": "global-only + encoder replay",
    "unquantized": "cold, unquantized global KV",
    "reference": "cold, reference mode",
}


def checkpoint_dir(name_or_path: str) -> Path:
    """`checkpoints/<name>/` for a sibling name, else the path itself."""
    if name_or_path in SIBLING_NAMES:
        return REPO / "checkpoints" / name_or_path
    return Path(name_or_path)


def heldout_filler():
    """The shipped tokenizer and a filler over the test split of its corpus (held-out episodes)."""
    tok, ids = _test_split()
    return tok, CorpusFiller(ids)


def family_recall_episodes(distance: int, n: int, *, seed: int):
    """n held-out episodes of the family's recall task (`FAMILY_RECALL_TASK`) at `distance`, with the
    shipped tokenizer over test-split filler: an `EpisodeSet` (tokens [n, L], one answer span per row)."""
    from model.train.family import FAMILY_RECALL_TASK
    from model.train.quality import recall_episodes

    tok, filler = heldout_filler()
    return recall_episodes(tok, filler, distance, n, seed=seed, kv=FAMILY_RECALL_TASK)


def _test_split():
    tok_dir = shipped_tokenizer_dir()
    manifest = CorpusManifest.load(tok_dir / "manifest.json")
    tok = load_tokenizer(tok_dir)
    ids = tokenize_corpus(tok, [t for _, t in read_split(manifest, "test")]).astype("int64")
    return tok, ids


def table(name: str, result: dict[str, Any]) -> str:
    """Recall (n) per path and bucket, and KL vs cold at each bucket."""
    buckets = list(result["distances"])
    head = f"{'path':<32}" + "".join(f"{b + ' (d=' + str(result['distances'][b]) + ')':>20}" for b in buckets)
    loss = result.get("heldout_loss", float("nan"))
    same, checked = result["full_hit_identical"], result["full_hit_checked"]
    lines = [
        f"{name}: held-out loss {loss:.3f} nats/token, full hit bit-identical: {same} ({checked} episodes)",
        head,
    ]
    for path in PATHS:
        cells = "".join(
            f"{r['recall']:>8.3f} ({r['n']:>3}) {abs(r['kl']):>6.3f}"
            for r in (result["paths"][path][b] for b in buckets)
        )
        lines.append(f"{PATH_LABELS[path]:<32}{cells}")
    full_hit = result["paths"]["full_hit"]
    same = ", ".join(f"{b} {full_hit[b].get('cold_recall_same_episodes', float('nan')):.3f}" for b in buckets)
    lines.append("cells: recall (episodes) mean KL(cold || path) in nats")
    lines.append(f"cold recall on the full-hit episodes: {same}")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], out: Path) -> None:
    """One panel per model: recall against distance (log x), one line per path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2), squeeze=False)
    for ax, (name, res) in zip(axes[0], results.items(), strict=True):
        buckets = list(res["distances"])
        xs = [res["distances"][b] for b in buckets]
        # full hit runs on a few episodes and equals the uninterrupted run bit for bit: a note, not a line
        for path, marker in zip([p for p in PATHS if p != "full_hit"], "ox^d", strict=True):
            ys = [res["paths"][path][b]["recall"] for b in buckets]
            ax.plot(xs, ys, marker=marker, label=PATH_LABELS[path], alpha=0.8)
        same = "bit-identical" if res["full_hit_identical"] else "NOT identical"
        ax.text(0.02, 0.97, f"full hit: {same} to the uninterrupted run ({res['full_hit_checked']} episodes)",
                transform=ax.transAxes, fontsize=8, va="top")
        ax.axvline(res["window"], color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{b}\n{x}" for b, x in zip(buckets, xs, strict=True)])
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("evidence -> answer distance (tokens); dotted: window W")
        ax.set_ylabel("recall (exact answer)")
        ax.set_title(f"{name} (W={res['window']})")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def run(models: list[str], spec: QualitySpec, *, write_eval: bool, progress=print) -> dict[str, Any]:
    """Evaluate each model; returns the JSON document (see the module docstring)."""
    tok, ids = _test_split()
    filler = CorpusFiller(ids)
    results: dict[str, dict[str, Any]] = {}
    sizes: dict[str, int] = {}
    for m in models:
        path = checkpoint_dir(m)
        model = load_model(path)
        name = path.name
        sizes[name] = sum(p.numel() for p in model.parameters())
        progress(f"== {name} ({sizes[name]:,} parameters)")
        res = evaluate_quality(model, tok, filler, ids, spec, progress=progress)
        res["parameters"] = sizes[name]
        results[name] = res
        if write_eval:
            (path / "eval.json").write_text(json.dumps(res, indent=1) + "\n")
    doc: dict[str, Any] = {
        "hardware": {"machine": platform.machine(), "processor": platform.processor(),
                     "threads": torch.get_num_threads(), "torch": torch.__version__},
        "models": results,
    }
    larger = max(sizes, key=sizes.get)
    doc["larger_sibling"] = larger
    for key in ("recall_cold_8w", "recall_replay_8w", "recall_fp4_8w", "recall_unquantized_8w"):
        if key in results[larger]:
            doc[key] = results[larger][key]
    return doc


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    """The harness's options."""
    p.add_argument("--models", nargs="+", default=list(SIBLING_NAMES), help="sibling names or checkpoint dir")
    p.add_argument("--episodes", type=int, default=QualitySpec().episodes, help="episodes per distance")
    p.add_argument("--batch", type=int, default=QualitySpec().batch)
    p.add_argument("--full-hit-episodes", type=int, default=QualitySpec().full_hit_episodes)
    p.add_argument("--lm-windows", type=int, default=QualitySpec().lm_windows)
    p.add_argument("--seed", type=int, default=QualitySpec().seed)
    p.add_argument("--json", default=None, metavar="PATH|-",
                   help="write the JSON document to PATH, or '-' for stdout (the tables then go to stderr)")
    p.add_argument("--png", type=Path, default=None, help="write the recall-vs-distance plot here")
    p.add_argument("--write-eval", action="store_true", help="write eval.json into each checkpoint dir")
    p.add_argument("--threads", type=int, default=None)


def eval_from_args(args: argparse.Namespace, *, numerics: Mapping[str, object] | None = None) -> int:
    """Run the harness from parsed options: tables on stdout, progress on stderr. Returns the exit code.

    Args:
        numerics: the numerics profile the run computes under, recorded in the JSON document.
    """
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = QualitySpec(
        episodes=args.episodes,
        batch=args.batch,
        full_hit_episodes=min(args.full_hit_episodes, args.episodes),
        lm_windows=args.lm_windows,
        seed=args.seed,
    )
    doc = run(args.models, spec, write_eval=args.write_eval, progress=lambda s: print(s, file=sys.stderr))
    if numerics is not None:
        doc["numerics"] = dict(numerics)
    out = sys.stderr if args.json == "-" else sys.stdout
    for name, res in doc["models"].items():
        print(table(name, res), file=out)
        print(file=out)
    if args.json == "-":
        print(json.dumps(doc, indent=1))
    elif args.json is not None:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    if args.png is not None:
        plot(doc["models"], args.png)
    if not all(r["full_hit_identical"] for r in doc["models"].values()):
        print("full hit is NOT bit-identical to the uninterrupted computation", file=sys.stderr)
        return 1
    return 0
