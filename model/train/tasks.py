"""Shared pieces of the long-range tasks: the example record, filler sources, the placement of questions at
requested distances from their evidence, and the distance buckets of the quality harness. Knows nothing of
the particular tasks (see `kv_recall.py`, `agent_transcript.py`) or of models.

Distance is measured in tokens: `answer.start - answer.evidence_start`, where `evidence_start` is the
first token of the span that holds the answer earlier in the sequence (a defined value, a name in a file
that a tool read). A generator asks `place_queries` for a distance per question; the question lands
exactly there unless it would overlap the previous one, in which case it moves right by the overlap and
the larger, measured distance is what the example records (or, under a max distance or an end limit
that the move would break, the question is dropped).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from model.train.tokenizer import SpecialTokens

__all__ = [
    "DISTANCE_BUCKETS",
    "AnswerSpan",
    "CorpusFiller",
    "Filler",
    "Query",
    "RandomFiller",
    "TaskExample",
    "bucket_of",
    "bucket_targets",
    "place_queries",
]

# Harness buckets as (name, low, high) multiples of the window W: a distance d falls in a bucket when
# low * W <= d < high * W. The named multiple (2W, 8W, 32W) sits inside its bucket.
DISTANCE_BUCKETS: tuple[tuple[str, float, float], ...] = (
    ("in_window", 0.0, 1.0),
    ("2W", 1.5, 3.0),
    ("8W", 6.0, 12.0),
    ("32W", 24.0, 48.0),
)


def bucket_of(distance: int, window: int) -> str | None:
    """The `DISTANCE_BUCKETS` name of `distance` for window `window`, or None between buckets."""
    if window <= 0:
        raise ValueError(f"window={window} must be positive")
    for name, lo, hi in DISTANCE_BUCKETS:
        if lo * window <= distance < hi * window:
            return name
    return None


def bucket_targets(window: int) -> dict[str, int]:
    """A representative distance per bucket: W/2 inside the window, then 2W, 8W, 32W."""
    if window <= 1:
        raise ValueError(f"window={window} must be > 1")
    return {"in_window": window // 2, "2W": 2 * window, "8W": 8 * window, "32W": 32 * window}


@dataclass(frozen=True, kw_only=True)
class AnswerSpan:
    """One checkable answer: ids[start:end] are its tokens, ids[evidence_start:evidence_end] the evidence.

    `text` is the expected answer string (without the leading space the tokens encode); `kind` names the
    question type ("kv_recall", "def_at_line", "class_at_line", "first_import").
    """

    start: int
    end: int
    evidence_start: int
    evidence_end: int
    text: str
    kind: str

    @property
    def distance(self) -> int:
        """Tokens from the first evidence token to the first answer token."""
        return self.start - self.evidence_start


@dataclass(frozen=True, kw_only=True, eq=False)
class TaskExample:
    """A generated sequence.

    ids `[T]` int64 token ids; loss_mask `[T]` bool, True exactly on the answer tokens (a position is
    supervised when its token is to be predicted from the ones before it); answers sorted by start.
    """

    ids: np.ndarray
    loss_mask: np.ndarray
    answers: tuple[AnswerSpan, ...]
    kind: str

    def __post_init__(self) -> None:
        assert self.ids.ndim == 1 and self.ids.shape == self.loss_mask.shape
        assert self.ids.dtype == np.int64 and self.loss_mask.dtype == np.bool_

    @property
    def distances(self) -> list[int]:
        return [a.distance for a in self.answers]


# A filler returns exactly n token ids of background text, drawn with the given generator.
Filler = Callable[[np.random.Generator, int], list[int]]


class RandomFiller:
    """Uniform random non-special tokens."""

    def __init__(self, vocab_size: int, specials: SpecialTokens | None = None) -> None:
        self._low = (specials or SpecialTokens()).count
        if vocab_size <= self._low:
            raise ValueError(f"vocab_size={vocab_size} leaves no non-special token (first is {self._low})")
        self._high = vocab_size

    def __call__(self, rng: np.random.Generator, n: int) -> list[int]:
        return rng.integers(self._low, self._high, size=n).tolist()


class CorpusFiller:
    """Contiguous slices of a tokenized corpus split (ids `[N]`, any integer dtype)."""

    def __init__(self, ids: np.ndarray) -> None:
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"corpus ids must be a non-empty 1-D array, got shape {ids.shape}")
        self._ids = ids

    def __call__(self, rng: np.random.Generator, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            take = min(n - len(out), self._ids.size)
            start = int(rng.integers(0, self._ids.size - take + 1))
            out.extend(self._ids[start : start + take].tolist())
        return out


@dataclass(frozen=True, kw_only=True)
class Query:
    """A question block waiting to be placed.

    tokens: the whole block; answer tokens are tokens[answer_offset:answer_offset + answer_len].
    evidence: absolute [start, end) of the evidence span, already placed earlier in the sequence.
    distance: requested tokens from evidence start to answer start.
    """

    tokens: tuple[int, ...]
    answer_offset: int
    answer_len: int
    evidence: tuple[int, int]
    distance: int
    text: str
    kind: str

    @property
    def earliest_distance(self) -> int:
        """Smallest distance at which this query does not overlap its own evidence."""
        return self.evidence[1] - self.evidence[0] + self.answer_offset

    @property
    def desired_start(self) -> int:
        return self.evidence[0] + self.distance - self.answer_offset


def place_queries(
    ids: list[int],
    queries: Sequence[Query],
    gap: Callable[[int], list[int]],
    *,
    max_distance: int | None = None,
    end_limit: int | None = None,
) -> list[AnswerSpan]:
    """Append `queries` to `ids` in order of desired position, filling the space before each with gap(n).

    `gap(n)` must return exactly n tokens. A query that collides with the previous one moves right; it is
    dropped if that takes it beyond `max_distance`, or if it would end after `end_limit` tokens. Mutates
    `ids`; returns the answer spans of the placed queries in absolute positions.

    Raises:
        ValueError: a query asks for a distance that would start it inside the text before it (the
            generator must never ask for that).
    """
    answers: list[AnswerSpan] = []
    context_end = len(ids)
    for q in sorted(queries, key=lambda q: (q.desired_start, q.evidence[0])):
        start = q.desired_start
        if start < context_end:
            raise ValueError(
                f"distance={q.distance} puts the question at {start}, inside the context (ends {context_end})"
            )
        # a query that would overlap its predecessor moves right; its distance is measured below
        start = max(start, len(ids))
        a0 = start + q.answer_offset
        if max_distance is not None and a0 - q.evidence[0] > max_distance:
            continue
        if end_limit is not None and start + len(q.tokens) > end_limit:
            continue
        filler = gap(start - len(ids))
        assert len(filler) == start - len(ids)
        ids.extend(filler)
        ids.extend(q.tokens)
        answers.append(
            AnswerSpan(
                start=a0,
                end=a0 + q.answer_len,
                evidence_start=q.evidence[0],
                evidence_end=q.evidence[1],
                text=q.text,
                kind=q.kind,
            )
        )
    return answers


def to_example(ids: list[int], answers: list[AnswerSpan], kind: str) -> TaskExample:
    """Freeze a built sequence: int64 ids and a loss mask over exactly the answer tokens."""
    arr = np.asarray(ids, dtype=np.int64)
    mask = np.zeros(arr.shape, dtype=np.bool_)
    for a in answers:
        mask[a.start : a.end] = True
    ordered = tuple(sorted(answers, key=lambda a: a.start))
    return TaskExample(ids=arr, loss_mask=mask, answers=ordered, kind=kind)


def sample_distances(rng: np.random.Generator, n: int, low: int, high: int) -> list[int]:
    """n distances, log-uniform in [low, high] (short ones as common per octave as long ones)."""
    assert 1 <= low <= high
    u = rng.uniform(np.log(low), np.log(high + 1), size=n)
    return [min(high, max(low, int(np.exp(x)))) for x in u]
