"""Key-value recall: random key -> value facts defined early, filler, then "key -> ?" questions asked at
controlled token distances from the definitions. Knows nothing of models; see `tasks.py` for distances.

Layout of one episode (ids; " k" is the encoded text with its leading space):

    <key> " kobiru" <val> " 4821" <end>  [filler to the definition stride]   ... one per pair
    [filler]  <q> <key> " kobiru" <a> " 4821" <end>  [filler]  <q> ...

The evidence of a question is the value span of its definition; the answer is the value span after <a>.
Each key is asked at most once per episode, so no earlier answer is a closer copy than the definition.
Definitions are spaced at least one question block apart so that questions asked at equal distances never
collide. With `length` set, episodes (fresh keys each) are packed back to back, questions that would end
past the end or beyond `max_distance` are dropped, and filler completes the sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from model.train.tasks import Filler, Query, TaskExample, place_queries, sample_distances, to_example
from model.train.tokenizer import TextTokenizer

__all__ = ["KvRecallSpec", "kv_recall"]

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
KIND = "kv_recall"


@dataclass(frozen=True, kw_only=True)
class KvRecallSpec:
    """Shape of the key-value recall task.

    n_pairs: facts defined per episode. n_queries: questions per episode (<= n_pairs; each key once).
    key_syllables: consonant-vowel syllables per key. value_digits: decimal digits per value.
    min_distance, max_distance: the sampled range of evidence->answer distances (the curriculum knob).
    length: total tokens of an example (episodes packed), or None for one episode of natural length.
    """

    n_pairs: int = 8
    n_queries: int = 8
    key_syllables: int = 3
    value_digits: int = 4
    min_distance: int = 1
    max_distance: int = 256
    length: int | None = None
    markers: bool = True

    def __post_init__(self) -> None:
        for name in ("n_pairs", "n_queries", "key_syllables", "value_digits", "min_distance", "max_distance"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.n_queries > self.n_pairs:
            raise ValueError(f"n_queries={self.n_queries} must be <= n_pairs={self.n_pairs}")
        if self.max_distance < self.min_distance:
            raise ValueError(f"max_distance={self.max_distance} must be >= min_distance={self.min_distance}")
        if self.length is not None and self.length < 2:
            raise ValueError(f"length={self.length} must be >= 2 or None")


def _random_keys(rng: np.random.Generator, n: int, syllables: int, taken: set[str]) -> list[str]:
    keys: list[str] = []
    while len(keys) < n:
        c = rng.integers(0, len(_CONSONANTS), size=syllables)
        v = rng.integers(0, len(_VOWELS), size=syllables)
        key = "".join(_CONSONANTS[i] + _VOWELS[j] for i, j in zip(c, v, strict=True))
        if key not in taken:
            taken.add(key)
            keys.append(key)
    return keys


def _random_values(rng: np.random.Generator, n: int, digits: int) -> list[str]:
    values: list[str] = []
    seen: set[str] = set()
    # a small digit count cannot hold n distinct values; repeats are then allowed rather than looping
    distinct = 10**digits >= 4 * n
    while len(values) < n:
        value = "".join(str(d) for d in rng.integers(0, 10, size=digits))
        if distinct and value in seen:
            continue
        seen.add(value)
        values.append(value)
    return values


def _episode(
    tok: TextTokenizer,
    rng: np.random.Generator,
    spec: KvRecallSpec,
    filler: Filler,
    ids: list[int],
    taken: set[str],
    distances: Sequence[int] | None,
    end_limit: int | None,
) -> list:
    """Append one episode to `ids`; returns its answer spans (empty if nothing fit)."""
    sp = tok.specials
    keys = _random_keys(rng, spec.n_pairs, spec.key_syllables, taken)
    values = _random_values(rng, spec.n_pairs, spec.value_digits)
    key_ids = [tok.encode(" " + k) for k in keys]
    val_ids = [tok.encode(" " + v) for v in values]
    # markers=False drops <val> / <a>: the value follows its key directly (a plain induction pattern)
    mark_a = [sp.a] if spec.markers else []
    mark_v = [sp.val] if spec.markers else []
    blocks = [[sp.q, sp.key, *k, *mark_a, *v, sp.end] for k, v in zip(key_ids, val_ids, strict=True)]
    stride = max(len(b) for b in blocks)
    evidence: list[tuple[int, int]] = []
    for k, v in zip(key_ids, val_ids, strict=True):
        block = [sp.key, *k, *mark_v, *v, sp.end]
        v0 = len(ids) + 1 + len(k) + len(mark_v)
        evidence.append((v0, v0 + len(v)))
        ids.extend(block)
        ids.extend(filler(rng, max(0, stride - len(block))))
    context_end = len(ids)
    # each question's smallest distance: its block must start after every definition
    floors = [context_end - ev[0] + 2 + len(mark_a) + len(k) for ev, k in zip(evidence, key_ids, strict=True)]
    order = list(rng.permutation(spec.n_pairs))
    if distances is not None:
        if len(distances) > spec.n_pairs:
            raise ValueError(f"{len(distances)} distances for n_pairs={spec.n_pairs}: at most one per key")
        # the smallest distances go to the latest definitions, whose floors are lowest
        order = sorted(range(spec.n_pairs), key=lambda p: -evidence[p][0])[: len(distances)]
        wanted = sorted(int(d) for d in distances)
        for p, d in zip(order, wanted, strict=True):
            if d < floors[p]:
                raise ValueError(f"distance={d} is shorter than the definitions block allows ({floors[p]})")
    else:
        order = order[: spec.n_queries]
        wanted = []
        for p in order:
            hi = spec.max_distance
            if end_limit is not None:
                hi = min(hi, end_limit - evidence[p][0] - len(blocks[p]))
            lo = max(spec.min_distance, floors[p])
            wanted.append(sample_distances(rng, 1, lo, hi)[0] if lo <= hi else -1)
    queries = [
        Query(
            tokens=tuple(blocks[p]),
            answer_offset=2 + len(key_ids[p]) + len(mark_a),
            answer_len=len(val_ids[p]),
            evidence=evidence[p],
            distance=d,
            text=values[p],
            kind=KIND,
        )
        for p, d in zip(order, wanted, strict=True)
        if d >= 0
    ]
    limit = None if distances is not None else spec.max_distance
    return place_queries(ids, queries, lambda n: filler(rng, n), max_distance=limit, end_limit=end_limit)


def kv_recall(
    tok: TextTokenizer,
    rng: np.random.Generator,
    spec: KvRecallSpec,
    filler: Filler,
    *,
    distances: Sequence[int] | None = None,
) -> TaskExample:
    """Generate one key-value recall example.

    Args:
        tok: encodes keys and values; its special ids frame the blocks.
        rng: the only source of randomness (same generator state -> same example).
        spec: task shape; `spec.length` fixes the total length (episodes packed, tail filled).
        filler: background tokens between definitions and questions.
        distances: explicit evidence->answer distances for a single episode (harness use), at most
            `n_pairs`; None samples them from [min_distance, max_distance].

    Returns:
        A `TaskExample` whose loss mask covers exactly the answer (value) tokens.

    Raises:
        ValueError: more distances than `n_pairs`, a requested distance shorter than the definitions
            block allows, an example longer than `spec.length`, or no question fitting in it.
    """
    sp = tok.specials
    ids: list[int] = [sp.bos]
    taken: set[str] = set()
    if distances is not None or spec.length is None:
        answers = _episode(tok, rng, spec, filler, ids, taken, distances, None)
        if spec.length is not None:
            if len(ids) > spec.length:
                raise ValueError(f"example needs {len(ids)} tokens, more than length={spec.length}")
            ids.extend(filler(rng, spec.length - len(ids)))
        return to_example(ids, answers, KIND)
    answers = []
    while True:
        mark = len(ids)
        got = _episode(tok, rng, spec, filler, ids, taken, None, spec.length)
        if not got or len(ids) > spec.length:
            # the episode did not fit: drop it and complete the sequence with filler
            del ids[mark:]
            break
        answers.extend(got)
    if not answers:
        raise ValueError(f"no question fits in length={spec.length} with spec {spec}")
    ids.extend(filler(rng, spec.length - len(ids)))
    return to_example(ids, answers, KIND)
