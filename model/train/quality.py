"""Answer quality of a trained model: held-out loss, and key-value recall against distance on every resume
path, with the mean next-token KL of each path against cold prefill.

Knows nothing of storage or serving policy: a resume path is rebuilt here from the model's own entry
points. Every episode is one key-value recall question (4 facts defined, the question at an exact distance
from its evidence, `kv_recall(..., distances=[d])`), cut after the answer and padded with corpus filler
after <bos> so that a bucket's episodes share one length L (distances unchanged). The history is
[0, L - W) and the turn is the last W tokens, which hold the question; the answer is scored teacher-forced
(every answer token must be the argmax). Paths, all in `ced` prefill mode unless named:
- cold: one prefill of the whole sequence (FP4 global KV, the serving numerics);
- full_hit: prefill the history, export its global KV and encoder pool entry to bytes
  (`model.cache_format`), rebuild a state from the bytes, prefill the turn; compared bit for bit with
  continuing the in-memory state (batch 1, per episode, on the first `full_hit_episodes` episodes);
- replay: prefill the history, drop the encoder windows and encoder-output rows (pool entry expired),
  prefill the turn: encoder bounded replay over the stored tokens;
- unquantized: cold with the global KV attended unquantized (`Attention.quantize_global = False`);
- reference: cold in `reference` mode (every layer over every token).
KL is KL(cold || path) per turn row, averaged over rows and episodes.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from model.cache_format import (
    export_global,
    export_windows,
    import_windows,
    model_fingerprint,
    state_from_global,
)
from model.inference import prefill
from model.train.family import FAMILY_RECALL_TASK
from model.train.kv_recall import KvRecallSpec, kv_recall
from model.train.tasks import AnswerSpan, Filler
from model.train.tokenizer import TextTokenizer
from model.transformer import Transformer

__all__ = [
    "PATHS",
    "EpisodeSet",
    "QualitySpec",
    "bucket_distances",
    "evaluate_quality",
    "heldout_loss",
    "recall_episodes",
    "recall_slice",
    "record_slice",
    "slice_heldout_loss",
]

PATHS: tuple[str, ...] = ("cold", "full_hit", "replay", "unquantized", "reference")


def bucket_distances(window: int) -> dict[str, int]:
    """Distance asked per bucket: W - 1 inside the window (the question block alone is about 12 tokens, so
    W/2 is not reachable for W = 16), then exactly 2W, 8W and 32W."""
    return {"in_window": window - 1, "2W": 2 * window, "8W": 8 * window, "32W": 32 * window}


@dataclass(frozen=True, kw_only=True)
class QualitySpec:
    """episodes per bucket; batch rows per forward; full_hit_episodes: episodes per bucket run through the
    byte round trip (batch 1 each); lm_windows x lm_len: held-out LM windows of the test split; seed; kv:
    the episode shape (4 facts: the answer must be told apart from 3 distractor values)."""

    episodes: int = 32
    batch: int = 16
    full_hit_episodes: int = 4
    lm_windows: int = 8
    lm_len: int = 256
    seed: int = 1234
    buckets: tuple[str, ...] = ("in_window", "2W", "8W", "32W")
    kv: KvRecallSpec = FAMILY_RECALL_TASK

    def __post_init__(self) -> None:
        if self.episodes < 1 or self.batch < 1 or self.lm_windows < 0 or self.lm_len < 2:
            raise ValueError(
                f"episodes={self.episodes}, batch={self.batch}, lm_windows={self.lm_windows}, "
                f"lm_len={self.lm_len} out of range"
            )
        if not 0 <= self.full_hit_episodes <= self.episodes:
            raise ValueError(f"full_hit_episodes={self.full_hit_episodes} must be in [0, {self.episodes}]")


@dataclass(frozen=True, kw_only=True, eq=False)
class EpisodeSet:
    """tokens [N, L] int64 (one bucket, one length); answers: one span per row in those coordinates."""

    tokens: torch.Tensor
    answers: tuple[AnswerSpan, ...]
    distance: int


def recall_episodes(
    tok: TextTokenizer, filler: Filler, distance: int, n: int, *, seed: int, kv: KvRecallSpec
) -> EpisodeSet:
    """n single-question episodes at `distance`, cut after the answer, left-padded to a common length.

    Episode i comes from `np.random.default_rng([seed, distance, i, attempt])`; an attempt whose definitions
    block is longer than the distance allows (possible only for short distances) is redrawn.

    Raises:
        ValueError: no attempt of an episode could place its question (distance too short).
    """
    rows: list[list[int]] = []
    spans: list[AnswerSpan] = []
    for i in range(n):
        for attempt in range(50):
            rng = np.random.default_rng([seed, distance, i, attempt])
            try:
                ex = kv_recall(tok, rng, kv, filler, distances=[distance])
            except ValueError:
                continue
            break
        else:
            raise ValueError(f"distance={distance} is too short for the episode layout {kv}")
        (a,) = ex.answers
        rows.append(ex.ids[: a.end].tolist())
        spans.append(a)
    length = max(len(r) for r in rows)
    out, shifted = [], []
    pad_rng = np.random.default_rng([seed, distance, n, 1 << 30])
    for r, a in zip(rows, spans, strict=True):
        pad = length - len(r)
        out.append(r[:1] + list(filler(pad_rng, pad)) + r[1:])
        shifted.append(dataclasses.replace(
            a, start=a.start + pad, end=a.end + pad, evidence_start=a.evidence_start + pad,
            evidence_end=a.evidence_end + pad,
        ))
    return EpisodeSet(tokens=torch.tensor(out, dtype=torch.int64), answers=tuple(shifted), distance=distance)


def _set_global_quantization(model: Transformer, on: bool) -> None:
    for layer in model.layers:
        layer.attn.quantize_global = on


def _turn_logits(model: Transformer, tokens: torch.Tensor, path: str) -> torch.Tensor:
    """Logits of the last W rows, [B, W, vocab] fp32, along `path` (batched paths only)."""
    w = model.cfg.window_size
    p = tokens.size(1) - w
    if path == "cold":
        out = prefill(model, tokens, mode="ced", all_logits=True).logits
    elif path == "reference":
        out = prefill(model, tokens, mode="reference", all_logits=True).logits[:, -w:]
    elif path == "unquantized":
        _set_global_quantization(model, False)
        try:
            out = prefill(model, tokens, mode="ced", all_logits=True).logits
        finally:
            _set_global_quantization(model, True)
    elif path == "replay":
        state = prefill(model, tokens[:, :p], mode="ced").state
        state.drop_windows(range(model.split if model.split is not None else model.cfg.n_layers))
        state.drop_encoder_rows()
        out = prefill(model, tokens[:, p:], state, mode="ced", all_logits=True).logits
    else:
        raise ValueError(f"path must be one of {PATHS[:1] + PATHS[2:]}, got {path!r}")
    assert out is not None and out.size(1) == w, f"{path}: expected {w} decoder rows"
    return out


def _full_hit_logits(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Turn logits of one episode [1, W, vocab] restored from bytes, and whether they equal continuing the
    in-memory state bit for bit."""
    w = model.cfg.window_size
    p = tokens.size(1) - w
    fp = model_fingerprint(model)
    state = prefill(model, tokens[:, :p], mode="ced").state
    blobs = [export_global(state, 0, p, fingerprint=fp)]
    pool = export_windows(model, state, fingerprint=fp)
    kept = prefill(model, tokens[:, p:], state, mode="ced", all_logits=True).logits
    restored = state_from_global(model, tokens[:, :p], blobs, fingerprint=fp)
    import_windows(model, restored, pool, fingerprint=fp)
    got = prefill(model, tokens[:, p:], restored, mode="ced", all_logits=True).logits
    assert kept is not None and got is not None
    return got, bool(torch.equal(kept, got))


def _correct(logits: torch.Tensor, tokens: torch.Tensor, answers: tuple[AnswerSpan, ...]) -> list[bool]:
    """Teacher-forced exact match of each row's answer; logits [B, W, V] are the rows [L - W, L)."""
    length, w = tokens.size(1), logits.size(1)
    pred = logits.argmax(-1)  # [B, W]
    out = []
    for b, a in enumerate(answers):
        rows = torch.arange(a.start - 1, a.end - 1) - (length - w)
        assert rows.min() >= 0, "answer outside the turn"
        out.append(bool(torch.equal(pred[b, rows], tokens[b, a.start : a.end])))
    return out


def _kl(base: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(base || other) per row: [B, W]."""
    lp, lq = F.log_softmax(base.float(), -1), F.log_softmax(other.float(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


@torch.no_grad()
def heldout_loss(
    model: Transformer, corpus_ids: np.ndarray, *, windows: int, length: int, seed: int
) -> float:
    """Mean next-token cross-entropy (nats) over `windows` test-split windows of `length` tokens, each from
    a seeded random start, in `reference` prefill mode (logits of every row)."""
    rng = np.random.default_rng([seed, 7])
    starts = rng.integers(0, corpus_ids.size - length - 1, size=windows)
    total, count = 0.0, 0
    for s in starts:
        ids = torch.from_numpy(corpus_ids[s : s + length + 1].astype(np.int64)).unsqueeze(0)
        logits = prefill(model, ids[:, :-1], mode="reference", all_logits=True).logits
        assert logits is not None
        total += float(F.cross_entropy(logits[0].float(), ids[0, 1:], reduction="sum"))
        count += length
    return total / max(count, 1)


@torch.no_grad()
def recall_slice(model: Transformer, episodes: EpisodeSet, path: str = "cold") -> list[bool]:
    """Per-episode correctness of one batched path over `episodes` in one forward (the recorded slice)."""
    return _correct(_turn_logits(model, episodes.tokens, path), episodes.tokens, episodes.answers)


@torch.no_grad()
def slice_heldout_loss(model: Transformer, tokens: torch.Tensor) -> float:
    """Mean next-token cross-entropy of one [1, T] window in `reference` mode (the recorded slice)."""
    logits = prefill(model, tokens[:, :-1], mode="reference", all_logits=True).logits
    assert logits is not None
    return float(F.cross_entropy(logits[0].float(), tokens[0, 1:]))


def record_slice(
    model: Transformer, tok: TextTokenizer, filler: Filler, corpus_ids: np.ndarray, spec: QualitySpec
) -> dict[str, Any]:
    """A small, self-contained re-checkable piece of the evaluation: 8 episodes of the 8W bucket (their
    ids and answer spans) with the cold path's per-episode correctness, and one 128-token test window with
    its loss. A test reloads the checkpoint and recomputes both without the corpus."""
    k = min(8, spec.episodes)
    eps = recall_episodes(tok, filler, bucket_distances(model.cfg.window_size)["8W"], k, seed=spec.seed,
                          kv=spec.kv)
    start = int(np.random.default_rng([spec.seed, 11]).integers(0, corpus_ids.size - 130))
    window = torch.from_numpy(corpus_ids[start : start + 129].astype(np.int64)).unsqueeze(0)
    return {
        "bucket": "8W",
        "path": "cold",
        "tokens": eps.tokens.tolist(),
        "answers": [[a.start, a.end] for a in eps.answers],
        "correct": recall_slice(model, eps, "cold"),
        "heldout_tokens": window[0].tolist(),
        "heldout_loss": slice_heldout_loss(model, window),
    }


@torch.no_grad()
def evaluate_quality(
    model: Transformer,
    tok: TextTokenizer,
    filler: Filler,
    corpus_ids: np.ndarray,
    spec: QualitySpec,
    *,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the whole harness on one model.

    Args:
        model: a trained model (bf16 weights, CPU or CUDA).
        tok, filler: episode tokenizer and background (test-split corpus filler).
        corpus_ids: [N] test-split ids for the held-out loss.
        spec: sizes and seed.
        progress: called with a short line after each bucket.

    Returns:
        A JSON-able dict: heldout loss, per path and bucket {recall, correct, n, kl}, full-hit identity, the
        four `recall_*_8w` keys, and a recorded slice (`record_slice`).
    """
    t0 = time.perf_counter()
    w = model.cfg.window_size
    distances = bucket_distances(w)
    result: dict[str, Any] = {
        "window": w,
        "distances": {b: distances[b] for b in spec.buckets},
        "spec": dataclasses.asdict(spec),
        "paths": {p: {} for p in PATHS},
    }
    if spec.lm_windows:
        result["heldout_loss"] = heldout_loss(
            model, corpus_ids, windows=spec.lm_windows, length=spec.lm_len, seed=spec.seed
        )
    identical = []
    for bucket in spec.buckets:
        eps = recall_episodes(tok, filler, distances[bucket], spec.episodes, seed=spec.seed, kv=spec.kv)
        flags: dict[str, list[bool]] = {p: [] for p in PATHS}
        cold_subset: list[bool] = []
        kls: dict[str, list[float]] = {p: [] for p in PATHS}
        for lo in range(0, spec.episodes, spec.batch):
            tokens, answers = eps.tokens[lo : lo + spec.batch], eps.answers[lo : lo + spec.batch]
            cold = _turn_logits(model, tokens, "cold")
            flags["cold"] += _correct(cold, tokens, answers)
            kls["cold"] += [0.0] * tokens.size(0)
            for path in ("replay", "unquantized", "reference"):
                logits = _turn_logits(model, tokens, path)
                flags[path] += _correct(logits, tokens, answers)
                kls[path] += _kl(cold, logits).mean(-1).tolist()
            for b in range(tokens.size(0)):
                if lo + b >= spec.full_hit_episodes:
                    break
                logits, same = _full_hit_logits(model, tokens[b : b + 1])
                identical.append(same)
                flags["full_hit"] += _correct(logits, tokens[b : b + 1], answers[b : b + 1])
                cold_subset.append(flags["cold"][lo + b])
                kls["full_hit"] += _kl(cold[b : b + 1], logits).mean(-1).tolist()
        for path in PATHS:
            n, c = len(flags[path]), sum(flags[path])
            result["paths"][path][bucket] = {
                "recall": c / n if n else math.nan,
                "correct": c,
                "n": n,
                "kl": float(np.mean(kls[path])) if kls[path] else math.nan,
            }
        # full hit runs on the first episodes only: the cold recall of those same episodes beside it
        result["paths"]["full_hit"][bucket]["cold_recall_same_episodes"] = (
            sum(cold_subset) / len(cold_subset) if cold_subset else math.nan
        )
        if progress is not None:
            row = " ".join(f"{p}={result['paths'][p][bucket]['recall']:.3f}" for p in PATHS)
            progress(f"{bucket} (d={distances[bucket]}): {row}")
    result["full_hit_identical"] = bool(identical) and all(identical)
    result["full_hit_checked"] = len(identical)
    if "8W" in spec.buckets:
        paths = result["paths"]
        result["recall_cold_8w"] = paths["cold"]["8W"]["recall"]
        result["recall_replay_8w"] = paths["replay"]["8W"]["recall"]
        # the serving cache is FP4: the cold path is the FP4 figure, `unquantized` its baseline
        result["recall_fp4_8w"] = paths["cold"]["8W"]["recall"]
        result["recall_unquantized_8w"] = paths["unquantized"]["8W"]["recall"]
        result["slice"] = record_slice(model, tok, filler, corpus_ids, spec)
    result["seconds"] = time.perf_counter() - t0
    return result
