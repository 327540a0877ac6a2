"""Quality harness: episode layout, every resume path on a random model, and the shipped checkpoints against
their recorded evaluation slice."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from model import Transformer, init_random, load_model
from model.train.family import SIBLING_NAMES, sibling_config
from model.train.kv_recall import KvRecallSpec
from model.train.quality import (
    PATHS,
    QualitySpec,
    bucket_distances,
    evaluate_quality,
    recall_episodes,
    recall_slice,
    slice_heldout_loss,
)
from model.train.ship import SHIPPED_FILES, sha256_of
from model.train.tasks import RandomFiller, bucket_of
from model.train.tokenizer import ByteTokenizer

REPO = Path(__file__).resolve().parents[2]
KV = KvRecallSpec(n_pairs=4, n_queries=4)
# issue 6: every shipped checkpoint directory together stays under this size
MAX_SHIPPED_BYTES = 40 * 1024 * 1024


@pytest.mark.parametrize("bucket", ["in_window", "2W", "8W"])
def test_recall_episodes_share_length_and_put_the_answer_in_the_turn(bucket: str) -> None:
    tok = ByteTokenizer()
    # byte-level keys and values are longer than BPE ones: the question block needs a wider window
    w = 32
    d = bucket_distances(w)[bucket]
    eps = recall_episodes(tok, RandomFiller(256, tok.specials), d, 5, seed=3, kv=KV)
    length = eps.tokens.size(1)
    assert eps.tokens.shape == (5, length)
    for row, a in zip(eps.tokens, eps.answers, strict=True):
        assert a.distance == d and bucket_of(a.distance, w) == bucket
        assert a.end == length and a.start - 1 >= length - w
        assert row[0] == tok.specials.bos
        # the answer repeats the evidence: the value defined earlier
        assert torch.equal(row[a.start : a.end], row[a.evidence_start : a.evidence_end])


def test_evaluate_quality_every_path_on_a_random_model() -> None:
    """Random weights: recall figures are fractions, full hit is bit-identical, KL of cold vs itself is 0,
    and the unquantized path really differs from the FP4 one."""
    torch.manual_seed(0)
    model = init_random(Transformer(sibling_config("v41-sib-s")), seed=5)
    tok = ByteTokenizer()
    filler = RandomFiller(256, tok.specials)
    corpus = np.random.default_rng(0).integers(tok.specials.count, 256, size=4000)
    spec = QualitySpec(episodes=2, batch=2, full_hit_episodes=1, lm_windows=1, lm_len=32, buckets=("8W",),
                       kv=KV)
    res = evaluate_quality(model, tok, filler, corpus, spec)
    assert res["full_hit_identical"] is True and res["full_hit_checked"] == 1
    for path in PATHS:
        for bucket in spec.buckets:
            r = res["paths"][path][bucket]
            assert 0.0 <= r["recall"] <= 1.0 and r["n"] == (1 if path == "full_hit" else 2)
    assert res["paths"]["cold"]["8W"]["kl"] == 0.0
    assert abs(res["paths"]["full_hit"]["8W"]["kl"]) < 1e-6
    assert res["paths"]["unquantized"]["8W"]["kl"] > 0.0
    for key in ("recall_cold_8w", "recall_replay_8w", "recall_fp4_8w", "recall_unquantized_8w"):
        assert 0.0 <= res[key] <= 1.0
    assert res["heldout_loss"] > 0 and len(res["slice"]["correct"]) == 2
    json.dumps(res)


def _shipped(name: str) -> Path:
    path = REPO / "checkpoints" / name
    if not (path / "eval.json").is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(f"shipped checkpoint {path} (with eval.json) is missing")
        pytest.skip(f"no shipped checkpoint at {path}")
    return path


@pytest.mark.parametrize("name", SIBLING_NAMES)
def test_shipped_checkpoint_reproduces_its_recorded_slice(name: str) -> None:
    """Loads through the normal checkpoint path, then recomputes the recorded 8W cold-path slice (8 episodes,
    stored with the eval) and the recorded held-out window loss."""
    path = _shipped(name)
    model = load_model(path)
    ev = json.loads((path / "eval.json").read_text())
    sl = ev["slice"]
    tokens = torch.tensor(sl["tokens"], dtype=torch.int64)
    from model.train.quality import EpisodeSet
    from model.train.tasks import AnswerSpan

    answers = tuple(
        AnswerSpan(start=s, end=e, evidence_start=0, evidence_end=0, text="", kind="kv_recall")
        for s, e in sl["answers"]
    )
    got = recall_slice(model, EpisodeSet(tokens=tokens, answers=answers, distance=0), sl["path"])
    flips = sum(a != b for a, b in zip(got, sl["correct"], strict=True))
    # the same CPU numerics reproduce it exactly; another CPU's summation order may flip a borderline one
    assert flips <= 1, f"{name}: recomputed {got}, recorded {sl['correct']}"
    loss = slice_heldout_loss(model, torch.tensor([sl["heldout_tokens"]], dtype=torch.int64))
    assert loss == pytest.approx(sl["heldout_loss"], abs=2e-2)
    for key in ("recall_cold_8w", "recall_replay_8w", "recall_fp4_8w", "recall_unquantized_8w"):
        assert 0.0 <= ev[key] <= 1.0
    assert ev["full_hit_identical"] is True


@pytest.mark.parametrize("name", SIBLING_NAMES)
def test_shipped_checkpoint_readme_lists_true_digests(name: str) -> None:
    path = _shipped(name)
    readme = (path / "README.md").read_text()
    for f in SHIPPED_FILES:
        assert f"{sha256_of(path / f)}  {f}" in readme, f"{name}/{f}: digest missing or stale in README.md"


def test_shipped_checkpoints_fit_the_size_budget() -> None:
    total = sum(f.stat().st_size for n in SIBLING_NAMES for f in _shipped(n).iterdir())
    assert total < MAX_SHIPPED_BYTES, f"shipped checkpoints take {total} bytes"


def test_family_parameter_ratio_and_shared_geometry() -> None:
    cfgs = {n: sibling_config(n) for n in SIBLING_NAMES}
    sizes = {n: sum(p.numel() for p in Transformer(c).parameters()) for n, c in cfgs.items()}
    # the family's extremes (v41-sib-m, grown from v41-sib-s, sits between them)
    ordered = sorted(sizes, key=sizes.get)
    small, large = ordered[0], ordered[-1]
    assert sizes[large] >= 2 * sizes[small]
    a, b = cfgs[small], cfgs[large]
    assert a.n_layers != b.n_layers and a.dim != b.dim
    for key in ("vocab_size", "window_size", "head_dim", "index_head_dim", "rope_head_dim"):
        assert getattr(a, key) == getattr(b, key), key
    assert sorted(set(a.compress_ratios)) == sorted(set(b.compress_ratios))
