"""Training loop of one sibling: AdamW with warmup and cosine decay, gradient clipping, the three indexer
phases (dense + distillation, sparse top-k, sparse with cache QDQ), seeded and resumable, JSON log lines.

Knows nothing of serving. Weights train as fp32 masters (the model is cast to fp32) and are written back in
the checkpoint dtypes (bf16 / fp32 as `Transformer` declares them) by `export_checkpoint`. Resume state
(`state.pt` in the run directory) holds the fp32 weights, the optimizer, the data stream position and the
torch RNG, so a resumed run continues the same schedule from the saved step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from model.train.corpus import CorpusManifest
from model.train.dataset import Batch, MixtureSpec, TrainStream
from model.train.family import FAMILY_RECALL_TASK, SIBLING_NAMES, sibling_config
from model.train.grow import grown_from, grown_sibling
from model.train.kv_recall import KvRecallSpec
from model.train.score import recall_by_bucket, score_batch
from model.train.tokenizer import load_tokenizer
from model.train.train_pass import PassMode, head_logits, train_pass
from model.transformer import Transformer
from model.weights import init_random, save_plain

__all__ = [
    "TrainSpec",
    "Trainer",
    "add_train_arguments",
    "default_mixture",
    "export_checkpoint",
    "phase_at",
    "run_model",
    "train_from_args",
]

STATE_FILE = "state.pt"
LOG_FILE = "train_log.jsonl"
_STATE_VERSION = 1


def default_mixture(seed: int = 0, batch_size: int = 6, seq_len: int = 256) -> MixtureSpec:
    """The shipped recipe's data: 85% key-value recall rows (`FAMILY_RECALL_TASK`: 4 facts per episode,
    episodes packed, so about a dozen questions per row), 15% corpus LM rows; the question distance cap
    grows 32 -> 64 -> 128 -> 256 tokens at steps 100, 250 and 450 (short distances first)."""
    return MixtureSpec(
        batch_size=batch_size,
        seq_len=seq_len,
        seed=seed,
        lm_weight=0.15,
        kv_weight=0.85,
        agent_weight=0.0,
        curriculum=((0, 32), (100, 64), (250, 128), (450, 256)),
        kv=dataclasses.replace(FAMILY_RECALL_TASK, max_distance=256),
        filler="corpus",
    )


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """One training run.

    model: a sibling name (`model.train.family`). steps: optimizer steps. lr: peak AdamW rate, reached after
    `warmup` steps, then cosine to lr * min_lr_ratio at `steps`. sparse_from / qdq_from: fractions of
    `steps` where top-k selection and then cache QDQ switch on (1.0: never). distill_weight: weight of the
    indexer KL. evidence_weight: weight of the evidence-attention loss (`evidence_hints`; without it the
    recall task sat on its ~25% plateau for thousands of steps). lm_weight: weight of the corpus-LM loss
    beside the answer loss. clip: max grad norm.
    log_every / save_every: steps between log lines and resume checkpoints.
    """

    model: str
    steps: int = 1200
    mixture: MixtureSpec = field(default_factory=default_mixture)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 60
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    clip: float = 1.0
    sparse_from: float = 0.6
    qdq_from: float = 0.85
    distill_weight: float = 1.0
    evidence_weight: float = 1.0
    lm_weight: float = 0.2
    seed: int = 0
    log_every: int = 10
    save_every: int = 50

    def __post_init__(self) -> None:
        sibling_config(self.model)
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be >= 1")
        if not 0 < self.lr < 1 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"lr={self.lr} must be in (0, 1) and min_lr_ratio={self.min_lr_ratio} in [0, 1]")
        if not 0 <= self.sparse_from <= self.qdq_from <= 1:
            raise ValueError(f"need 0 <= sparse_from={self.sparse_from} <= qdq_from={self.qdq_from} <= 1")
        if self.warmup < 0 or self.clip <= 0 or self.log_every < 1 or self.save_every < 1:
            raise ValueError(
                f"warmup={self.warmup}, clip={self.clip}, log_every={self.log_every}, "
                f"save_every={self.save_every} out of range"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainSpec:
        """Inverse of `to_dict` (nested mixture and task specs included)."""
        data = dict(data)
        mix = dict(data.pop("mixture"))
        mix["kv"] = KvRecallSpec(**mix["kv"])
        from model.train.agent_transcript import AgentSpec

        agent = dict(mix["agent"])
        agent["kinds"] = tuple(agent["kinds"])
        mix["agent"] = AgentSpec(**agent)
        data["betas"] = tuple(data["betas"])
        return cls(mixture=MixtureSpec(**mix), **data)

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step `step` (0-based)."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        span = max(1, self.steps - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)


def phase_at(spec: TrainSpec, step: int) -> tuple[str, PassMode]:
    """The indexer phase of `step`: ("dense", ...), ("sparse", ...) or ("sparse_qdq", ...)."""
    if step >= spec.qdq_from * spec.steps:
        return "sparse_qdq", PassMode(sparse=True, qdq=True, distill=spec.distill_weight > 0)
    if step >= spec.sparse_from * spec.steps:
        return "sparse", PassMode(sparse=True, qdq=False, distill=spec.distill_weight > 0)
    return "dense", PassMode(sparse=False, qdq=False, distill=spec.distill_weight > 0)


def evidence_hints(batch: Batch, kinds: tuple[str, ...] = ("kv_recall",)) -> torch.Tensor:
    """[N, 3] int64 (row, query position, entry) for every answer token of the given kinds whose evidence
    token is the token to copy: the row predicting answer token j (position start + j - 1) should find
    evidence token j (position evidence_start + j), which the ratio-1 decoder source holds as entry
    evidence_start + j. Key-value answers repeat their evidence exactly, so this is where the answer is."""
    t = batch.tokens.size(1)
    out = []
    for b, spans in enumerate(batch.answers):
        for a in spans:
            if a.kind not in kinds:
                continue
            for j in range(min(a.end - a.start, a.evidence_end - a.evidence_start)):
                q, e = a.start + j - 1, a.evidence_start + j
                if 0 <= e <= q < t:
                    out.append((b, q, e))
    return torch.tensor(out, dtype=torch.int64).view(-1, 3)


def _losses(
    model: Transformer, hidden: torch.Tensor, batch: Batch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean CE over answer tokens and over LM-row tokens (each 0 when there are none), and the predicted
    next token [B, T] (-1 where no loss applies). The head runs only on supervised rows."""
    dev = hidden.device
    lm_rows = torch.tensor([k == "lm" for k in batch.kinds], device=dev).unsqueeze(1)
    answer = batch.answer_mask.to(dev)
    lm = batch.loss_mask.to(dev) & lm_rows
    used = answer | lm
    targets = batch.targets.to(dev)
    logits = head_logits(model, hidden[used])  # [N, vocab]
    ce = F.cross_entropy(logits, targets[used], reduction="none")
    zero = hidden.new_zeros((), dtype=torch.float32)
    ans, lm_sel = answer[used], lm[used]
    ans_loss = ce[ans].mean() if ans.any() else zero
    lm_loss = ce[lm_sel].mean() if lm_sel.any() else zero
    predicted = torch.full_like(targets, -1)
    predicted[used] = logits.detach().argmax(-1)
    return ans_loss, lm_loss, predicted


class Trainer:
    """Runs a `TrainSpec` into `run_dir` (state.pt, train_log.jsonl).

    Args:
        spec: the run.
        run_dir: created if missing; an existing state.pt there is resumed when `resume` is True.
        device: "cpu" or "cuda" (chosen by the caller).
        stream: the data stream (default: the shipped tokenizer and its corpus manifest, train split).

    Raises:
        ValueError: resuming a state written by another spec.
    """

    def __init__(
        self,
        spec: TrainSpec,
        run_dir: str | Path,
        *,
        device: str = "cpu",
        stream: TrainStream | None = None,
        resume: bool = True,
    ) -> None:
        self.spec = spec
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.device = torch.device(device)
        torch.manual_seed(spec.seed)
        # a grown sibling starts from its base's trained weights, deepened (model/train/grow.py)
        if grown_from(spec.model) is not None:
            model = grown_sibling(spec.model, seed=spec.seed)
        else:
            model = init_random(Transformer(sibling_config(spec.model)), seed=spec.seed)
        self.model = model.float().to(self.device)
        decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=spec.lr, betas=spec.betas,
        )
        if stream is None:
            from model.train import shipped_tokenizer_dir

            tok_dir = shipped_tokenizer_dir()
            manifest = CorpusManifest.load(tok_dir / "manifest.json")
            stream = TrainStream.from_manifest(spec.mixture, load_tokenizer(tok_dir), manifest, "train")
        self.stream = stream
        self.step = 0
        self.elapsed = 0.0
        if resume and (self.run_dir / STATE_FILE).is_file():
            self._load()

    # ---- persistence -----------------------------------------------------------------------------

    def save(self) -> None:
        """Write the resume state atomically (a crash leaves the previous state.pt)."""
        state = {
            "version": _STATE_VERSION,
            "spec": self.spec.to_dict(),
            "step": self.step,
            "elapsed": self.elapsed,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "stream": self.stream.state_dict(),
            "rng": torch.get_rng_state(),
        }
        tmp = self.run_dir / (STATE_FILE + ".tmp")
        torch.save(state, tmp)
        tmp.replace(self.run_dir / STATE_FILE)

    def _load(self) -> None:
        state = torch.load(self.run_dir / STATE_FILE, map_location=self.device, weights_only=False)
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"resume state version {state.get('version')!r}, expected {_STATE_VERSION}")
        saved = TrainSpec.from_dict(state["spec"])
        spec = self.spec
        if saved.model != spec.model or saved.seed != spec.seed or saved.mixture != spec.mixture:
            raise ValueError(f"{self.run_dir / STATE_FILE} was written by another spec: {saved}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.stream.load_state_dict(state["stream"])
        torch.set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.elapsed = float(state["elapsed"])

    def _log(self, record: dict[str, Any]) -> None:
        with (self.run_dir / LOG_FILE).open("a") as f:
            f.write(json.dumps(record) + "\n")

    # ---- the loop --------------------------------------------------------------------------------

    def train_step(self) -> dict[str, Any]:
        """One optimizer step on the stream's next batch; returns its log record."""
        spec = self.spec
        t0 = time.perf_counter()
        step = self.step
        batch = self.stream.batch(step)
        self.stream.load_state_dict(self.stream.state_dict() | {"step": step + 1})
        phase, mode = phase_at(spec, step)
        lr = spec.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        tokens = batch.tokens.to(self.device)
        hints = evidence_hints(batch).to(self.device) if spec.evidence_weight > 0 else None
        out = train_pass(self.model, tokens, mode, hints)
        ans_loss, lm_loss, predicted = _losses(self.model, out.hidden, batch)
        loss = (ans_loss + spec.lm_weight * lm_loss + spec.distill_weight * out.distill
                + spec.evidence_weight * out.evidence)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), spec.clip)
        self.optimizer.step()
        results = score_batch(predicted.cpu(), batch)
        buckets = recall_by_bucket(results, self.model.cfg.window_size)
        self.step += 1
        self.elapsed += time.perf_counter() - t0
        return {
            "event": "train_step",
            "step": step,
            "phase": phase,
            "lr": lr,
            "max_distance": batch.max_distance,
            "loss": float(loss.detach()),
            "answer_loss": float(ans_loss.detach()),
            "lm_loss": float(lm_loss.detach()),
            "distill_kl": float(out.distill.detach()),
            "evidence_loss": float(out.evidence.detach()),
            "grad_norm": float(grad_norm),
            "answer_acc": sum(r.correct for r in results) / max(1, len(results)),
            "answers": len(results),
            "recall": {k: [v.correct, v.n] for k, v in buckets.items()},
            "index_agreement": {str(k): round(v, 4) for k, v in out.index_agreement.items()},
            "seconds": self.elapsed,
        }

    def run(self, *, max_seconds: float | None = None, until: int | None = None) -> int:
        """Train to `until` (default spec.steps) or until max_seconds of this call pass; saves state at
        every save_every steps and at the end. Returns the step reached."""
        until = self.spec.steps if until is None else min(until, self.spec.steps)
        started = time.perf_counter()
        # a resumed run may carry a changed step count (schedule and phases stretch): log the spec in force
        self._log({
            "event": "train_start" if self.step == 0 else "train_resume",
            "step": self.step,
            "spec": self.spec.to_dict(),
            "device": str(self.device),
            "threads": torch.get_num_threads(),
            "parameters": sum(p.numel() for p in self.model.parameters()),
        })
        window: list[dict[str, Any]] = []
        while self.step < until:
            if max_seconds is not None and time.perf_counter() - started > max_seconds:
                self._log({"event": "time_budget_reached", "step": self.step, "seconds": self.elapsed})
                break
            record = self.train_step()
            window.append(record)
            if self.step % self.spec.log_every == 0 or self.step == until:
                self._log(_summarize(window))
                window = []
            if self.step % self.spec.save_every == 0:
                self.save()
        self.save()
        return self.step


def _summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One log line for several steps: means of the scalars, summed recall counts, the last step's rest."""
    last = dict(records[-1])
    for key in ("loss", "answer_loss", "lm_loss", "distill_kl", "evidence_loss", "grad_norm", "answer_acc"):
        last[key] = round(sum(r[key] for r in records) / len(records), 5)
    recall: dict[str, list[int]] = {}
    for r in records:
        for k, (c, n) in r["recall"].items():
            acc = recall.setdefault(k, [0, 0])
            acc[0] += c
            acc[1] += n
    last["recall"] = recall
    last["steps_in_line"] = len(records)
    return last


def run_model(run_dir: str | Path) -> Transformer:
    """The fp32 model saved in a run directory's resume state (for export or evaluation mid-run)."""
    state = torch.load(Path(run_dir) / STATE_FILE, map_location="cpu", weights_only=False)
    spec = TrainSpec.from_dict(state["spec"])
    model = Transformer(sibling_config(spec.model)).float()
    model.load_state_dict(state["model"])
    return model


def export_checkpoint(
    model: Transformer, directory: str | Path, metadata: dict[str, str] | None = None
) -> Path:
    """Write config.json and model.safetensors of a trained (fp32) model in the checkpoint dtypes (bf16 /
    fp32 as a fresh `Transformer` of the config declares them), loadable with `model.load_model`.
    Returns the directory."""
    target = Transformer(model.cfg)
    trained = model.state_dict()
    with torch.no_grad():
        for name, p in target.state_dict().items():
            p.copy_(trained[name].to(p.dtype).cpu())
    save_plain(target, directory, metadata)
    return Path(directory)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The training command's options (shared by `kvresume train` and `python -m model.train train`)."""
    p.add_argument("--model", required=True, choices=SIBLING_NAMES)
    p.add_argument("--run-dir", type=Path, default=None, help="resume state and log (default runs/<model>)")
    p.add_argument("--steps", type=int, default=TrainSpec.steps)
    p.add_argument("--batch-size", type=int, default=default_mixture().batch_size)
    p.add_argument("--seq-len", type=int, default=default_mixture().seq_len)
    p.add_argument("--lr", type=float, default=TrainSpec.lr)
    p.add_argument("--sparse-from", type=float, default=TrainSpec.sparse_from,
                   help="fraction of --steps where sparse top-k selection starts")
    p.add_argument("--qdq-from", type=float, default=TrainSpec.qdq_from,
                   help="fraction of --steps where the cache QDQ (FP4 / MXFP4 / FP8) starts")
    p.add_argument("--evidence-weight", type=float, default=TrainSpec.evidence_weight,
                   help="weight of the evidence-attention loss on key-value answers (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA if present")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--max-seconds", type=float, default=None, help="stop (resumably) after this long")
    p.add_argument("--export", type=Path, default=None, help="write a bf16 checkpoint here at the end")
    p.add_argument("--fresh", action="store_true", help="ignore an existing resume state")


def train_from_args(args: argparse.Namespace) -> int:
    """Run (or resume) a training run from parsed options; prints one JSON summary line. Returns 0."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    mixture = default_mixture(seed=args.seed, batch_size=args.batch_size, seq_len=args.seq_len)
    if grown_from(args.model) is not None:
        # its base already went through the distance curriculum: questions at every distance from step 0
        mixture = dataclasses.replace(mixture, curriculum=((0, mixture.kv.max_distance),))
    spec = TrainSpec(
        model=args.model,
        steps=args.steps,
        mixture=mixture,
        lr=args.lr,
        evidence_weight=args.evidence_weight,
        sparse_from=args.sparse_from,
        qdq_from=args.qdq_from,
        seed=args.seed,
    )
    run_dir = args.run_dir or Path("runs") / args.model
    trainer = Trainer(spec, run_dir, device=device, resume=not args.fresh)
    step = trainer.run(max_seconds=args.max_seconds)
    summary = {"event": "train_done", "model": args.model, "step": step, "steps": spec.steps,
               "seconds": round(trainer.elapsed, 1), "run_dir": str(run_dir)}
    if args.export is not None and step >= spec.steps:
        export_checkpoint(trainer.model, args.export)
        summary["exported"] = str(args.export)
    print(json.dumps(summary))
    return 0
