"""Answer scoring: exact match under the sequence/target coordinate conventions, recall by bucket."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from model.train import (
    AnswerResult,
    ByteTokenizer,
    KvRecallSpec,
    MixtureSpec,
    RandomFiller,
    TrainStream,
    kv_recall,
    recall_by_bucket,
    score_answers,
    score_batch,
)


def test_score_answers_exact_match_per_span() -> None:
    tok = ByteTokenizer()
    ex = kv_recall(tok, np.random.default_rng(1), KvRecallSpec(n_pairs=3, n_queries=3), RandomFiller(272),
                   distances=[40, 300, 1200])
    perfect = ex.ids[1:]
    assert [r.correct for r in score_answers(perfect, ex.ids, ex.answers)] == [True] * 3
    wrong = perfect.copy()
    second = ex.answers[1]
    # corrupt the last token of the second answer only
    wrong[second.end - 2] = (wrong[second.end - 2] + 1) % 272
    got = score_answers(torch.from_numpy(wrong), ex.ids, ex.answers)
    assert [r.correct for r in got] == [True, False, True]
    assert [r.distance for r in got] == ex.distances
    with pytest.raises(ValueError, match="outside predictions"):
        score_answers(perfect[:10], ex.ids, ex.answers)


def test_score_batch_uses_target_coordinates() -> None:
    tok = ByteTokenizer()
    corpus = np.asarray(tok.encode("def f(x):\n    return x\n" * 200), dtype=np.int32)
    spec = MixtureSpec(batch_size=4, seq_len=200, lm_weight=0.0, agent_weight=0.0, curriculum=((0, 120),))
    batch = TrainStream(spec, tok, corpus, []).batch(0)
    results = score_batch(batch.targets.clone(), batch)
    assert len(results) == sum(len(a) for a in batch.answers) > 0 and all(r.correct for r in results)
    # predictions that copy the inputs (off by one position) miss every answer
    assert not any(r.correct for r in score_batch(batch.tokens.clone(), batch))
    with pytest.raises(ValueError, match="shape"):
        score_batch(batch.targets[:, :10], batch)


def test_recall_by_bucket_counts_each_bucket() -> None:
    results = [
        AnswerResult(kind="kv_recall", distance=10, correct=True),
        AnswerResult(kind="kv_recall", distance=60, correct=False),
        AnswerResult(kind="kv_recall", distance=256, correct=True),
        AnswerResult(kind="kv_recall", distance=100, correct=True),  # between in_window and 2W: left out
    ]
    got = recall_by_bucket(results, window=64)
    assert (got["in_window"].n, got["in_window"].correct, got["in_window"].recall) == (2, 1, 0.5)
    assert got["2W"].recall == 1.0 and got["8W"].n == 0 and math.isnan(got["32W"].recall)
