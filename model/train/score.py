"""Scoring answers: teacher-forced exact match of each answer span, and recall by distance bucket. Knows
the coordinate conventions of `TaskExample` and `Batch`, nothing of the model that made the predictions.

An answer counts as recalled when the prediction at every one of its positions (the argmax given the true
prefix) equals the answer token; one wrong token fails the whole answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from model.train.dataset import Batch
from model.train.tasks import DISTANCE_BUCKETS, AnswerSpan, bucket_of

__all__ = ["AnswerResult", "BucketRecall", "recall_by_bucket", "score_answers", "score_batch"]


@dataclass(frozen=True, kw_only=True)
class AnswerResult:
    kind: str
    distance: int
    correct: bool


@dataclass(frozen=True, kw_only=True)
class BucketRecall:
    """Recall over the answers of one bucket; `recall` is NaN when `n` is 0."""

    bucket: str
    n: int
    correct: int

    @property
    def recall(self) -> float:
        return self.correct / self.n if self.n else float("nan")


def _as_numpy(x: np.ndarray | torch.Tensor) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def score_answers(
    predicted_next: np.ndarray | torch.Tensor,
    ids: np.ndarray | torch.Tensor,
    answers: Sequence[AnswerSpan],
) -> list[AnswerResult]:
    """Exact match of each answer of one sequence.

    Args:
        predicted_next: `[T']` ints, predicted_next[t] the predicted token for ids[t + 1] (T' >= T - 1).
        ids: `[T]` the sequence the answers index into (a `TaskExample.ids`).
        answers: spans into `ids`.

    Raises:
        ValueError: a span that `predicted_next` does not cover, or that starts at position 0.
    """
    pred, seq = _as_numpy(predicted_next), _as_numpy(ids)
    out = []
    for a in answers:
        if a.start < 1 or a.end - 1 > pred.shape[0] or a.end > seq.shape[0]:
            raise ValueError(f"answer span [{a.start}, {a.end}) outside predictions (length {pred.shape[0]})")
        ok = bool(np.array_equal(pred[a.start - 1 : a.end - 1], seq[a.start : a.end]))
        out.append(AnswerResult(kind=a.kind, distance=a.distance, correct=ok))
    return out


def score_batch(predicted_next: torch.Tensor, batch: Batch) -> list[AnswerResult]:
    """Exact match of every answer in `batch`; predicted_next `[B, T]` ints aligned with `batch.targets`.

    Raises:
        ValueError: `predicted_next` is not shaped like `batch.targets`.
    """
    if tuple(predicted_next.shape) != tuple(batch.targets.shape):
        got, want = tuple(predicted_next.shape), tuple(batch.targets.shape)
        raise ValueError(f"predicted_next shape {got} differs from targets shape {want}")
    out: list[AnswerResult] = []
    for b, answers in enumerate(batch.answers):
        # sequence = first input token followed by the targets
        ids = torch.cat([batch.tokens[b, :1], batch.targets[b]])
        out.extend(score_answers(predicted_next[b], ids, answers))
    return out


def recall_by_bucket(results: Iterable[AnswerResult], window: int) -> dict[str, BucketRecall]:
    """Recall per `DISTANCE_BUCKETS` entry for window `window`; answers between buckets are left out."""
    counts = {name: [0, 0] for name, _, _ in DISTANCE_BUCKETS}
    for r in results:
        name = bucket_of(r.distance, window)
        if name is not None:
            counts[name][0] += 1
            counts[name][1] += int(r.correct)
    return {name: BucketRecall(bucket=name, n=n, correct=c) for name, (n, c) in counts.items()}
