"""The training stream: a seeded, resumable mixture of corpus language-model windows and long-range tasks,
as fixed-length batches. Knows nothing of the model; the trainer consumes `Batch` tensors.

Row r of step s is generated from `np.random.default_rng([seed, s, r])` alone, so any step can be rebuilt
from the spec and the step number: the resumable state is `{"version", "seed", "step"}`. A curriculum
maps steps to the tasks' max distance (short distances first; the recall plateau is long otherwise).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from model.train.agent_transcript import AgentFile, AgentSpec, agent_transcript, index_files
from model.train.corpus import CorpusManifest, read_split
from model.train.kv_recall import KvRecallSpec, kv_recall
from model.train.tasks import AnswerSpan, CorpusFiller, Filler, RandomFiller
from model.train.tokenizer import TextTokenizer

__all__ = ["ROW_KINDS", "Batch", "MixtureSpec", "Row", "TrainStream", "tokenize_corpus"]

ROW_KINDS: tuple[str, ...] = ("lm", "kv_recall", "agent")
_STATE_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class MixtureSpec:
    """What the stream yields.

    batch_size B and seq_len T shape every batch; rows are drawn as lm / kv_recall / agent with the given
    weights. curriculum: (from_step, max_distance) stages, first at step 0, overriding both task specs'
    max_distance. task_context_loss: also supervise the non-answer tokens of task rows (the answer mask
    is unaffected). filler: background of the tasks, corpus slices or uniform random tokens.
    """

    batch_size: int = 8
    seq_len: int = 512
    seed: int = 0
    lm_weight: float = 0.3
    kv_weight: float = 0.5
    agent_weight: float = 0.2
    curriculum: tuple[tuple[int, int], ...] = ((0, 64), (2000, 256), (6000, 1024))
    kv: KvRecallSpec = dataclasses.field(default_factory=KvRecallSpec)
    agent: AgentSpec = dataclasses.field(default_factory=AgentSpec)
    task_context_loss: bool = False
    filler: Literal["corpus", "random"] = "corpus"

    def __post_init__(self) -> None:
        object.__setattr__(self, "curriculum", tuple((int(s), int(d)) for s, d in self.curriculum))
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be >= 1")
        if self.seq_len < 16:
            raise ValueError(f"seq_len={self.seq_len} must be >= 16")
        weights = self.weights
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"weights (lm, kv, agent)={weights} must be non-negative with a positive sum")
        steps = [s for s, _ in self.curriculum]
        if not steps or steps[0] != 0 or any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
            raise ValueError(f"curriculum={self.curriculum} must start at step 0 with increasing steps")
        if any(d < 1 for _, d in self.curriculum):
            raise ValueError(f"curriculum={self.curriculum} distances must be >= 1")
        if self.kv.length is not None or self.agent.length is not None:
            raise ValueError(
                f"task lengths (kv {self.kv.length}, agent {self.agent.length}) must be None"
            )
        if self.filler not in ("corpus", "random"):
            raise ValueError(f"filler={self.filler!r} must be 'corpus' or 'random'")

    @property
    def weights(self) -> tuple[float, float, float]:
        """Row-kind weights in `ROW_KINDS` order."""
        return (self.lm_weight, self.kv_weight, self.agent_weight)

    def max_distance_at(self, step: int) -> int:
        """The curriculum's max distance at `step`."""
        return [d for s, d in self.curriculum if s <= step][-1]


@dataclass(frozen=True, kw_only=True, eq=False)
class Batch:
    """One training batch.

    tokens `[B, T]` int64 inputs; targets `[B, T]` int64 (tokens shifted by one: targets[b, t] is the
    token after tokens[b, t]); loss_mask `[B, T]` bool, where the loss applies; answer_mask `[B, T]` bool,
    True where targets[b, t] is an answer token (the recall metric's positions). kinds: row kinds;
    answers: per row, spans in sequence coordinates (the answer token at sequence index i is
    targets[b, i - 1]).
    """

    tokens: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    answer_mask: torch.Tensor
    kinds: tuple[str, ...]
    answers: tuple[tuple[AnswerSpan, ...], ...]
    step: int
    max_distance: int


@dataclass(frozen=True, kw_only=True, eq=False)
class Row:
    """One sequence of T+1 tokens: ids `[T+1]` int64; loss_mask and answer_mask `[T+1]` bool over sequence
    positions (True where that token is supervised / is an answer token); answers as in `TaskExample`."""

    kind: str
    ids: np.ndarray
    loss_mask: np.ndarray
    answer_mask: np.ndarray
    answers: tuple[AnswerSpan, ...] = ()


def tokenize_corpus(tok: TextTokenizer, texts: Sequence[str]) -> np.ndarray:
    """Concatenate the encoded texts, each followed by `<eos>`: ids `[N]` int32."""
    pieces: list[np.ndarray] = []
    eos = np.asarray([tok.specials.eos], dtype=np.int32)
    batch_encode = getattr(tok, "encode_batch", None)
    encoded = batch_encode(list(texts)) if batch_encode is not None else [tok.encode(t) for t in texts]
    for ids in encoded:
        pieces.append(np.asarray(ids, dtype=np.int32))
        pieces.append(eos)
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


class TrainStream(Iterator[Batch]):
    """Deterministic, resumable batches of `MixtureSpec` rows.

    Args:
        spec: the mixture.
        tok: the tokenizer the ids come from.
        corpus_ids: `[N]` ids of the split (`tokenize_corpus`), for LM rows and corpus filler.
        agent_files: `index_files` of the same split, for agent rows.

    Raises:
        ValueError: the corpus is shorter than one LM row, or agent rows are weighted without files.
    """

    def __init__(
        self,
        spec: MixtureSpec,
        tok: TextTokenizer,
        corpus_ids: np.ndarray,
        agent_files: Sequence[AgentFile],
    ) -> None:
        if spec.lm_weight > 0 and corpus_ids.size < spec.seq_len + 1:
            raise ValueError(f"corpus has {corpus_ids.size} tokens, fewer than seq_len+1={spec.seq_len + 1}")
        if spec.agent_weight > 0 and not agent_files:
            raise ValueError(f"agent_weight={spec.agent_weight} but agent_files is empty")
        self.spec = spec
        self._tok = tok
        self._ids = corpus_ids.astype(np.int64, copy=False)
        self._files = list(agent_files)
        self._filler: Filler = (
            CorpusFiller(self._ids) if spec.filler == "corpus" else RandomFiller(tok.vocab_size, tok.specials)
        )
        p = np.asarray(spec.weights, dtype=np.float64)
        self._p = p / p.sum()
        self._step = 0
        # agent_transcript's per-file measurements; a function of tokenizer and files, not of the step
        self._memo: dict[tuple[str, int], int] = {}

    @classmethod
    def from_manifest(
        cls,
        spec: MixtureSpec,
        tok: TextTokenizer,
        manifest: CorpusManifest,
        split: str = "train",
        root: str | Path | None = None,
    ) -> TrainStream:
        """Read, check, tokenize and index one split of the corpus, then build the stream."""
        files = read_split(manifest, split, root)
        return cls(spec, tok, tokenize_corpus(tok, [t for _, t in files]), index_files(files))

    def row(self, step: int, index: int) -> Row:
        """Row `index` of step `step` (a function of seed, step and index only)."""
        spec = self.spec
        rng = np.random.default_rng([spec.seed, step, index])
        kind = ROW_KINDS[int(rng.choice(len(ROW_KINDS), p=self._p))]
        n = spec.seq_len + 1
        if kind == "lm":
            start = int(rng.integers(0, self._ids.size - n + 1))
            ids = self._ids[start : start + n].copy()
            return Row(kind=kind, ids=ids, loss_mask=np.ones(n, np.bool_), answer_mask=np.zeros(n, np.bool_))
        cap = spec.max_distance_at(step)
        if kind == "kv_recall":
            task = dataclasses.replace(spec.kv, length=n, max_distance=max(spec.kv.min_distance, cap))
            ex = kv_recall(self._tok, rng, task, self._filler)
        else:
            task = dataclasses.replace(spec.agent, length=n, max_distance=max(spec.agent.min_distance, cap))
            ex = agent_transcript(self._tok, rng, task, self._files, self._filler, memo=self._memo)
        loss = np.ones(n, dtype=np.bool_) if spec.task_context_loss else ex.loss_mask.copy()
        return Row(kind=kind, ids=ex.ids, loss_mask=loss, answer_mask=ex.loss_mask.copy(), answers=ex.answers)

    def batch(self, step: int) -> Batch:
        """The batch of `step` (random access; does not move the stream)."""
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        rows = [self.row(step, b) for b in range(self.spec.batch_size)]
        ids = torch.from_numpy(np.stack([r.ids for r in rows]))
        loss = torch.from_numpy(np.stack([r.loss_mask for r in rows]))
        ans = torch.from_numpy(np.stack([r.answer_mask for r in rows]))
        return Batch(
            tokens=ids[:, :-1].contiguous(),
            targets=ids[:, 1:].contiguous(),
            loss_mask=loss[:, 1:].contiguous(),
            answer_mask=ans[:, 1:].contiguous(),
            kinds=tuple(r.kind for r in rows),
            answers=tuple(r.answers for r in rows),
            step=step,
            max_distance=self.spec.max_distance_at(step),
        )

    def __next__(self) -> Batch:
        out = self.batch(self._step)
        self._step += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        """The whole resumable state: a small JSON-able dict."""
        return {"version": _STATE_VERSION, "seed": self.spec.seed, "step": self._step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()` output.

        Raises:
            ValueError: unknown version, a seed other than this spec's, or a negative step.
        """
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"state version={state.get('version')!r}, expected {_STATE_VERSION}")
        if state.get("seed") != self.spec.seed:
            raise ValueError(f"state seed={state.get('seed')!r} differs from spec seed={self.spec.seed}")
        step = int(state["step"])
        if step < 0:
            raise ValueError(f"state step={step} must be >= 0")
        self._step = step
