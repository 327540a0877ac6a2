"""Training stream: fixed shapes, shifted targets, masks that match the answers, curriculum, seeded and
resumable from a small state dict."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model.train import (
    AgentSpec,
    BpeTokenizer,
    CorpusManifest,
    KvRecallSpec,
    MixtureSpec,
    TrainStream,
    index_files,
    read_split,
    shipped_tokenizer_dir,
    tokenize_corpus,
)

SPEC = MixtureSpec(batch_size=6, seq_len=256, seed=11, curriculum=((0, 48), (3, 200)))


@pytest.fixture(scope="module")
def parts() -> tuple[BpeTokenizer, np.ndarray, list]:
    tok = BpeTokenizer.load(shipped_tokenizer_dir())
    files = read_split(CorpusManifest.load(shipped_tokenizer_dir() / "manifest.json"), "validation")
    return tok, tokenize_corpus(tok, [t for _, t in files]), index_files(files)


def _stream(parts: tuple, spec: MixtureSpec = SPEC) -> TrainStream:
    tok, ids, files = parts
    return TrainStream(spec, tok, ids, files)


def _same(a, b) -> bool:
    return all(
        torch.equal(getattr(a, k), getattr(b, k)) for k in ("tokens", "targets", "loss_mask", "answer_mask")
    ) and (a.kinds, a.answers) == (b.kinds, b.answers)


def test_train_stream_batches_have_fixed_shapes_and_consistent_masks(parts: tuple) -> None:
    tok = parts[0]
    stream = _stream(parts)
    kinds = set()
    for _ in range(4):
        b = next(stream)
        assert b.tokens.shape == b.targets.shape == (6, 256) and b.tokens.dtype == torch.int64
        assert b.loss_mask.dtype == b.answer_mask.dtype == torch.bool
        assert torch.equal(b.tokens[:, 1:], b.targets[:, :-1])
        for r, kind in enumerate(b.kinds):
            kinds.add(kind)
            if kind == "lm":
                assert bool(b.loss_mask[r].all()) and not bool(b.answer_mask[r].any())
                continue
            assert torch.equal(b.loss_mask[r], b.answer_mask[r])
            expected = torch.zeros(256, dtype=torch.bool)
            for a in b.answers[r]:
                # the answer token at sequence index i is the target of position i - 1
                expected[a.start - 1 : a.end - 1] = True
                assert b.targets[r, a.start - 1 : a.end - 1].tolist() == tok.encode(" " + a.text)
                assert a.distance <= b.max_distance
            assert torch.equal(b.answer_mask[r], expected) and b.answers[r]
    assert kinds == {"lm", "kv_recall", "agent"}


def test_train_stream_is_seeded_and_resumable(parts: tuple) -> None:
    a = _stream(parts)
    first = [next(a) for _ in range(3)]
    state = a.state_dict()
    assert state == {"version": 1, "seed": 11, "step": 3}
    fourth = next(a)
    b = _stream(parts)
    b.load_state_dict(state)
    assert _same(next(b), fourth)
    assert _same(b.batch(1), first[1])
    other = _stream(parts, MixtureSpec(batch_size=6, seq_len=256, seed=12, curriculum=SPEC.curriculum))
    assert not torch.equal(next(other).tokens, first[0].tokens)
    with pytest.raises(ValueError, match="seed=12"):
        _stream(parts).load_state_dict({"version": 1, "seed": 12, "step": 0})


def test_train_stream_follows_the_curriculum(parts: tuple) -> None:
    spec = MixtureSpec(batch_size=8, seq_len=256, lm_weight=0.0, curriculum=((0, 40), (2, 220)))
    stream = _stream(parts, spec)
    assert [stream.spec.max_distance_at(s) for s in (0, 1, 2, 50)] == [40, 40, 220, 220]
    early = [a.distance for row in stream.batch(0).answers for a in row]
    late = [a.distance for row in stream.batch(2).answers for a in row]
    assert early and max(early) <= 40
    assert max(late) > 40 and max(late) <= 220


def test_task_context_loss_supervises_whole_task_rows(parts: tuple) -> None:
    spec = MixtureSpec(batch_size=4, seq_len=128, lm_weight=0.0, task_context_loss=True, filler="random")
    b = _stream(parts, spec).batch(0)
    assert bool(b.loss_mask.all()) and 0 < int(b.answer_mask.sum()) < b.answer_mask.numel()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"batch_size": 0}, "batch_size=0"),
        ({"seq_len": 8}, "seq_len=8"),
        ({"lm_weight": -1.0}, "weights"),
        ({"curriculum": ((5, 64),)}, "curriculum"),
        ({"curriculum": ((0, 64), (0, 128))}, "curriculum"),
        ({"kv": KvRecallSpec(length=100)}, "kv 100"),
        ({"agent": AgentSpec(length=100)}, "agent 100"),
        ({"filler": "zeros"}, "zeros"),
    ],
)
def test_mixture_spec_rejects_bad_values(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        MixtureSpec(**kwargs)


def test_train_stream_rejects_short_corpus(parts: tuple) -> None:
    tok, ids, files = parts
    with pytest.raises(ValueError, match="10 tokens"):
        TrainStream(SPEC, tok, ids[:10], files)
    with pytest.raises(ValueError, match="agent_files is empty"):
        TrainStream(SPEC, tok, ids, [])
    with pytest.raises(ValueError, match="step=-1"):
        _stream(parts).batch(-1)
