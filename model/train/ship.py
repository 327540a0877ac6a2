"""Packaging a trained sibling as a shipped checkpoint directory: bf16 weights and config.json (loadable by
`model.load_model`), the tokenizer, the training log, the evaluation JSON and plot, and a README with
the recipe, the quality table and every file's sha256. Knows nothing of how training or evaluation run.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from model.train import shipped_tokenizer_dir
from model.train.quality_report import plot, table
from model.train.trainer import LOG_FILE, TrainSpec, export_checkpoint, phase_at, run_model

__all__ = ["SHIPPED_FILES", "sha256_of", "ship_checkpoint"]

# Files whose sha256 the README lists (README.md itself cannot list its own digest).
SHIPPED_FILES: tuple[str, ...] = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_manifest.json",
    "train_log.jsonl",
    "eval.json",
    "quality.png",
)


def sha256_of(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _train_summary(log: Path) -> dict[str, Any]:
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    start = next(r for r in lines if r["event"] == "train_start")
    resumes = [r["step"] for r in lines if r["event"] == "train_resume"]
    steps = [r for r in lines if r["event"] == "train_step"]
    last = steps[-1] if steps else {}
    return {"start": start, "last": last, "seconds": last.get("seconds", 0.0), "lines": len(lines),
            "resumes": resumes, "first_steps": start["spec"]["steps"]}


def _flags(spec: TrainSpec) -> str:
    """The `kvresume train` options that set this spec's schedule knobs away from their defaults."""
    out = []
    for field, flag in (("sparse_from", "--sparse-from"), ("qdq_from", "--qdq-from"),
                        ("evidence_weight", "--evidence-weight"), ("lr", "--lr")):
        value = getattr(spec, field)
        if value != getattr(TrainSpec, field):
            out.append(f" {flag} {value}")
    return "".join(out)


def _recipe(spec: TrainSpec, summary: dict[str, Any], name: str) -> str:
    mix = spec.mixture
    sparse = next(s for s in range(spec.steps + 1) if s == spec.steps or phase_at(spec, s)[0] != "dense")
    qdq = next(s for s in range(spec.steps + 1) if s == spec.steps or phase_at(spec, s)[0] == "sparse_qdq")
    curriculum = ", ".join(f"step {s}: {d}" for s, d in mix.curriculum)
    seconds = summary["seconds"]
    start = summary["start"]
    return "\n".join([
        "## Recipe",
        "",
        f"Reproduce: `kvresume train --model {name} --steps {spec.steps}{_flags(spec)} --threads "
        f"{summary['start'].get('threads') or 1} --export checkpoints/{name}` (same as "
        "`python -m model.train train ...`), then",
        "`kvresume eval --write-eval`.",
        "Resumable: rerunning the command continues from `runs/<model>/state.pt`. A one-shot run follows",
        "the schedule below from step 0; where Notes describe a resumed history, that is the closest rerun.",
        "",
        f"- data: seq_len {mix.seq_len}, batch {mix.batch_size}, rows {mix.kv_weight:.0%} key-value "
        f"recall ({mix.kv.n_pairs} facts per episode, keys of {mix.kv.key_syllables} syllable(s), values of "
        f"{mix.kv.value_digits} digit(s), {'marked' if mix.kv.markers else 'value right after its key'}; "
        "episodes packed, corpus filler) and "
        f"{mix.lm_weight:.0%} corpus LM (stdlib train split of the shipped tokenizer's manifest); "
        f"seed {mix.seed}",
        f"- curriculum (max question distance): {curriculum}",
        f"- loss: answer-token cross-entropy + {spec.lm_weight} x LM cross-entropy + {spec.distill_weight} x "
        "indexer KL (distillation of the main attention's mass over compressed entries into the index "
        "scores, detached inputs)"
        + (f" + {spec.evidence_weight} x evidence attention (-log of the decoder candidate source's "
           "head-mean attention on the evidence token of each answer token)" if spec.evidence_weight else ""),
        f"- optimizer: AdamW lr {spec.lr}, betas {tuple(spec.betas)}, weight decay {spec.weight_decay} "
        f"(matrices), warmup {spec.warmup} steps then cosine to {spec.min_lr_ratio} x lr; grad-norm clip "
        f"{spec.clip}; fp32 master weights, shipped as the model's bf16/fp32 checkpoint dtypes",
        f"- phases over {spec.steps} steps: dense (every visible compressed entry attended, indexer "
        f"distilled) steps 0-{sparse - 1}; sparse top-{'k'} selection steps {sparse}-{qdq - 1}; sparse with "
        f"FP4 main KV / MXFP4 index / FP8 window QDQ (straight-through) steps {qdq}-{spec.steps - 1}",
        f"- run: {summary['last'].get('step', -1) + 1} steps in {seconds / 60:.1f} min of summed step wall "
        "time on "
        f"{start.get('threads')} CPU thread(s), device {start.get('device')}, sharing a 2-core machine with "
        "other jobs (wall time, not dedicated-core time)",
        *(
            [f"- the run started with a {summary['first_steps']}-step schedule and was resumed at steps "
             f"{summary['resumes']} with the schedule above (the log has a `train_resume` line each time)"]
            if summary["resumes"] else []
        ),
        "",
    ])


def _same_weights(model, out: Path) -> bool:
    """Whether out/ already holds these weights (re-shipping then keeps the file byte for byte: the
    safetensors header's metadata order is not stable across writes)."""
    if not (out / "model.safetensors").is_file() or not (out / "config.json").is_file():
        return False
    from model.weights import load_model

    try:
        shipped = load_model(out)
    except (ValueError, OSError):
        return False
    if shipped.cfg != model.cfg:
        return False
    fresh = dict(shipped.state_dict())
    return all(torch.equal(fresh[k], v.to(fresh[k].dtype)) for k, v in model.state_dict().items())


def ship_checkpoint(
    run_dir: str | Path,
    out_dir: str | Path,
    eval_result: dict[str, Any] | None = None,
    notes: list[str] | None = None,
) -> Path:
    """Write `out_dir` from a finished (or stopped) run: weights, config, tokenizer, log, eval, README.

    Args:
        run_dir: the training run (state.pt, train_log.jsonl).
        out_dir: `checkpoints/<name>/`; created or overwritten file by file.
        eval_result: `evaluate_quality` output to ship as eval.json and plot; None keeps an eval.json
            already in out_dir (and its plot), if any.
        notes: free-text lines for a "Notes" section of the README (how this run differed from the recipe).

    Returns:
        out_dir.
    """
    run_dir, out = Path(run_dir), Path(out_dir)
    model = run_model(run_dir)
    # the spec in force at the end: the last start or resume line of the log
    starts = [r for r in map(json.loads, (run_dir / LOG_FILE).read_text().splitlines())
              if r["event"] in ("train_start", "train_resume")]
    state_spec = TrainSpec.from_dict(starts[-1]["spec"])
    name = state_spec.model
    out.mkdir(parents=True, exist_ok=True)
    if not _same_weights(model, out):
        export_checkpoint(model, out, {"model_name": name, "trained_steps": str(state_spec.steps)})
    tok = shipped_tokenizer_dir()
    shutil.copyfile(tok / "tokenizer.json", out / "tokenizer.json")
    shutil.copyfile(tok / "manifest.json", out / "tokenizer_manifest.json")
    shutil.copyfile(run_dir / LOG_FILE, out / "train_log.jsonl")
    if eval_result is not None:
        (out / "eval.json").write_text(json.dumps(eval_result, indent=1) + "\n")
        plot({name: eval_result}, out / "quality.png")
    summary = _train_summary(out / "train_log.jsonl")
    params = sum(p.numel() for p in model.parameters())
    cfg = model.cfg
    roles = ", ".join(
        f"{r.layer}:{r.role.value}{'(dec)' if r.half == 'dec' else ''}" for r in cfg.layer_table()
    )
    parts = [
        f"# {name}",
        "",
        f"A trained sibling of the kvresume model family (V4.1 structure, {cfg.n_layers} layers, "
        f"dim {cfg.dim}, {cfg.n_heads} heads x {cfg.head_dim}, window {cfg.window_size}, compress ratios "
        f"{list(cfg.compress_ratios)}, index top-{cfg.index_topk}, {cfg.n_routed_experts} routed experts "
        f"top-{cfg.n_activated_experts} + 1 shared, 4-lane mHC; {params:,} parameters; vocab "
        f"{cfg.vocab_size} from `checkpoints/tokenizer/`). Layer roles: {roles}.",
        "",
        "Load: `model.load_model('checkpoints/" + name + "')`. Config keys are the official "
        "`inference/config.json` keys; weights are plain bf16 (head fp32) safetensors.",
        "",
        _recipe(state_spec, summary, name),
    ]
    if (out / "eval.json").is_file():
        ev = json.loads((out / "eval.json").read_text())
        parts += [
            "## Quality (`kvresume eval`, CPU)",
            "",
            "```",
            table(name, ev),
            "```",
            "",
            f"Recall at 8W ({ev['distances'].get('8W')} tokens): cold {ev.get('recall_cold_8w')}, "
            f"global-only + replay {ev.get('recall_replay_8w')}, FP4 {ev.get('recall_fp4_8w')}, unquantized "
            f"{ev.get('recall_unquantized_8w')}.",
            "",
            "![recall against distance per resume path](quality.png)",
            "",
        ]
    if notes:
        parts += ["## Notes", "", *notes, ""]
    parts += ["## Files (sha256)", "", "```"]
    parts += [f"{sha256_of(out / f)}  {f}" for f in SHIPPED_FILES if (out / f).is_file()]
    parts += ["```", ""]
    (out / "README.md").write_text("\n".join(parts))
    for f in out.iterdir():
        f.chmod(0o644)
    return out
