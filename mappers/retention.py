"""Task retention with statistics: recall episodes at several evidence distances, scored with the
receiver's own cache and the mapped one on the same episodes, and a 95% paired-bootstrap interval of the
retention ratio per distance bucket (issue 12 item 2).

Knows nothing of artifacts' files. Per bucket, retention = Σ mapped / Σ own over the episodes; a bootstrap
replicate resamples episodes with replacement (the same draw for both paths: paired) and recomputes the
ratio; the interval is the replicates' 2.5% and 97.5% percentiles. `bootstrap_ratio_ci` is the batched
path, `bootstrap_ratio_ci_loop` its slow twin (the same draws, one replicate at a time in Python).

Task seeds: bucket i of task seed N draws its episodes with `family_recall_episodes(seed=N * 16 + i)`, so
two task seeds never share an episode set, and an artifact's recorded fit task seeds can be refused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mappers.artifact import KVMapper
from mappers.evaluate import TaskRetention, evaluate_task_retention
from model import Transformer

__all__ = [
    "BUCKETS_PER_SEED",
    "RetentionBucket",
    "RetentionReport",
    "bootstrap_ratio_ci",
    "bootstrap_ratio_ci_loop",
    "bucket_seed",
    "default_buckets",
    "measure_retention",
]

BUCKETS_PER_SEED = 16


def bucket_seed(task_seed: int, bucket: int) -> int:
    """The episode seed of bucket `bucket` (0-based, < 16) of task seed `task_seed`."""
    if not 0 <= bucket < BUCKETS_PER_SEED:
        raise ValueError(f"bucket {bucket} must be in [0, {BUCKETS_PER_SEED})")
    if task_seed < 0:
        raise ValueError(f"task seed {task_seed} must be >= 0")
    return task_seed * BUCKETS_PER_SEED + bucket


def _draws(n: int, n_boot: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(n_boot, n))


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def bootstrap_ratio_ci(
    num: Sequence[int], den: Sequence[int], *, n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float, float]:
    """(Σnum/Σden, lower, upper): the paired-bootstrap percentile interval of the ratio of sums.

    Raises:
        ValueError: unequal lengths, no episodes, n_boot < 1 or a level outside (0, 1).
    """
    a, b = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    _check(a, b, n_boot, level)
    idx = _draws(a.size, n_boot, seed)
    sa, sb = a[idx].sum(1), b[idx].sum(1)
    reps = np.divide(sa, sb, out=np.zeros_like(sa), where=sb > 0)
    lo, hi = np.quantile(reps, [(1 - level) / 2, (1 + level) / 2])
    return _ratio(float(a.sum()), float(b.sum())), float(lo), float(hi)


def bootstrap_ratio_ci_loop(
    num: Sequence[int], den: Sequence[int], *, n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float, float]:
    """The slow twin of `bootstrap_ratio_ci`: the same draws, each replicate summed in a Python loop and
    the percentiles by numpy's default (linear) rule written out."""
    a, b = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    _check(a, b, n_boot, level)
    idx = _draws(a.size, n_boot, seed)
    reps = []
    for row in idx.tolist():
        sa = sum(float(a[i]) for i in row)
        sb = sum(float(b[i]) for i in row)
        reps.append(_ratio(sa, sb))
    reps.sort()

    def quantile(q: float) -> float:
        pos = q * (len(reps) - 1)
        low = math.floor(pos)
        high = min(low + 1, len(reps) - 1)
        return reps[low] + (reps[high] - reps[low]) * (pos - low)

    return (_ratio(float(a.sum()), float(b.sum())), quantile((1 - level) / 2), quantile((1 + level) / 2))


def _check(a: np.ndarray, b: np.ndarray, n_boot: int, level: float) -> None:
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"num and den must be equal-length 1-D sequences, got {a.shape} and {b.shape}")
    if a.size == 0:
        raise ValueError("no episodes to bootstrap")
    if n_boot < 1 or not 0 < level < 1:
        raise ValueError(f"n_boot={n_boot} must be >= 1 and level={level} in (0, 1)")


@dataclass(frozen=True, kw_only=True)
class RetentionBucket:
    """One distance bucket: the task result and its retention interval."""

    name: str
    distance: int
    seed: int
    task: TaskRetention
    ci_lower: float
    ci_upper: float

    @property
    def retention(self) -> float:
        return self.task.retention

    @property
    def gap_vs_source(self) -> float | None:
        """(mapped - sender alone) / (receiver - sender alone): the share of the source-to-target gap the
        mapping recovers; None when the receiver is not better than the sender alone (no gap)."""
        t = self.task
        gap = t.receiver_acc - t.sender_acc
        return (t.mapped_acc - t.sender_acc) / gap if gap > 0 else None

    def figures(self) -> dict[str, float]:
        t, b = self.task, self.name
        out = {
            f"retention_{b}": t.retention,
            f"retention_{b}_ci_lower": self.ci_lower,
            f"retention_{b}_ci_upper": self.ci_upper,
            f"task_{b}_episodes": float(t.n),
            f"task_{b}_distance": float(self.distance),
            f"task_{b}_seed": float(self.seed),
            f"task_{b}_sender_acc": t.sender_acc,
            f"task_{b}_receiver_acc": t.receiver_acc,
            f"task_{b}_mapped_acc": t.mapped_acc,
            f"task_{b}_replay_acc": t.replay_acc,
            f"task_{b}_floor_acc": t.floor_acc,
            f"task_{b}_gap_recovered_vs_floor": t.gap_recovered,
        }
        if self.gap_vs_source is not None:
            out[f"task_{b}_gap_recovered_vs_source"] = self.gap_vs_source
        return out


@dataclass(frozen=True, kw_only=True)
class RetentionReport:
    """Every bucket, and the pooled figures the gate reads: `retention` (Σ mapped / Σ own over all
    episodes), `retention_ci_lower` (the smallest bucket lower bound: each distance must pass) and the
    pooled interval."""

    task_seed: int
    buckets: tuple[RetentionBucket, ...]
    pooled_ci: tuple[float, float]

    @property
    def retention(self) -> float:
        own = sum(sum(b.task.outcomes["receiver"]) for b in self.buckets)
        mapped = sum(sum(b.task.outcomes["mapped"]) for b in self.buckets)
        return _ratio(mapped, own)

    def pooled(self, key: str) -> float:
        n = sum(b.task.n for b in self.buckets)
        return sum(sum(b.task.outcomes[key]) for b in self.buckets) / n

    def figures(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for b in self.buckets:
            out |= b.figures()
        floor, own, mapped = self.pooled("floor"), self.pooled("receiver"), self.pooled("mapped")
        out |= {
            "retention": self.retention,
            "retention_ci_lower": min(b.ci_lower for b in self.buckets),
            "retention_pooled_ci_lower": self.pooled_ci[0],
            "retention_pooled_ci_upper": self.pooled_ci[1],
            "task_seed": float(self.task_seed),
            "task_episodes": float(sum(b.task.n for b in self.buckets)),
            "task_sender_acc": self.pooled("sender"),
            "task_receiver_acc": own,
            "task_mapped_acc": mapped,
            "task_replay_acc": self.pooled("replay"),
            "task_floor_acc": floor,
            "task_gap_recovered": (mapped - floor) / (own - floor) if own > floor else 0.0,
        }
        return out

    def table(self) -> str:
        head = (f"{'bucket':<8}{'dist':>6}{'n':>6}{'sender':>8}{'own':>8}{'replay':>8}{'mapped':>8}"
                f"{'floor':>8}{'retention [95% CI]':>26}{'gap vs floor':>14}")
        lines = [head]
        for b in self.buckets:
            t = b.task
            lines.append(
                f"{b.name:<8}{b.distance:>6}{t.n:>6}{t.sender_acc:>8.3f}{t.receiver_acc:>8.3f}"
                f"{t.replay_acc:>8.3f}{t.mapped_acc:>8.3f}{t.floor_acc:>8.3f}"
                f"{t.retention:>10.3f} [{b.ci_lower:.3f}, {b.ci_upper:.3f}]{t.gap_recovered:>14.3f}"
            )
        lo, hi = self.pooled_ci
        lines.append(f"pooled retention {self.retention:.3f} [{lo:.3f}, {hi:.3f}]")
        return "\n".join(lines)


def default_buckets(window: int) -> dict[str, int]:
    """The harness's distance buckets the gate measures: 8 and 32 windows."""
    return {"8W": 8 * window, "32W": 32 * window}


@torch.no_grad()
def measure_retention(
    mapper: KVMapper,
    sender_model: Transformer,
    receiver_model: Transformer,
    *,
    episodes: int,
    task_seed: int,
    buckets: Mapping[str, int] | None = None,
    n_boot: int = 2000,
    device: torch.device | str = "cpu",
) -> RetentionReport:
    """Retention of `mapper` on `episodes` held-out recall episodes per bucket (default 8W and 32W of the
    receiver's window), each with a 95% paired-bootstrap interval.

    Raises:
        ValueError: episodes < 1, a bad task seed, or more than 16 buckets.
    """
    from model import family_recall_episodes

    if episodes < 1:
        raise ValueError(f"episodes={episodes} must be >= 1")
    w = receiver_model.cfg.window_size
    buckets = dict(buckets or default_buckets(w))
    out = []
    for i, (name, distance) in enumerate(buckets.items()):
        seed = bucket_seed(task_seed, i)
        eps = family_recall_episodes(distance, episodes, seed=seed)
        task = evaluate_task_retention(
            mapper, sender_model, receiver_model, eps.tokens.to(device),
            [(a.start, a.end) for a in eps.answers], suffix_tokens=w,
        )
        _, lo, hi = bootstrap_ratio_ci(task.outcomes["mapped"], task.outcomes["receiver"], n_boot=n_boot,
                                       seed=seed)
        out.append(
            RetentionBucket(name=name, distance=distance, seed=seed, task=task, ci_lower=lo, ci_upper=hi)
        )
    mapped = [v for b in out for v in b.task.outcomes["mapped"]]
    own = [v for b in out for v in b.task.outcomes["receiver"]]
    _, lo, hi = bootstrap_ratio_ci(mapped, own, n_boot=n_boot, seed=task_seed)
    return RetentionReport(task_seed=task_seed, buckets=tuple(out), pooled_ci=(lo, hi))
