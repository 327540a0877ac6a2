"""The child's calibration rows: each source gives [n, t] int64 ids inside the vocabulary, seeded sources
repeat under their seed, evaluation rows (seed offset) differ from calibration rows, and a file that
cannot supply the rows is refused naming why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from orchestrator.jobs import FitRequest
from orchestrator.jobs.child import calibration_sequences


def _req(source: dict, budget: int = 512, t: int = 64) -> FitRequest:
    return FitRequest(sender_model="s", receiver_model="r", source=source, budget_tokens=budget,
                      sequence_tokens=t)


def test_random_rows_repeat_under_their_seed_and_evaluation_rows_differ(tmp_path: Path) -> None:
    req = _req({"kind": "corpus", "name": "random", "seed": 4})
    rows = calibration_sequences(req, 512, tmp_path)
    assert rows.shape == (8, 64) and rows.dtype == torch.int64
    assert 0 <= int(rows.min()) < int(rows.max()) < 512
    assert torch.equal(rows, calibration_sequences(req, 512, tmp_path))
    assert not torch.equal(rows, calibration_sequences(_req({"kind": "corpus", "name": "random", "seed": 5}),
                                                       512, tmp_path))
    held = calibration_sequences(req, 512, tmp_path, seed_offset=1000, n=8, t=64)
    assert not torch.equal(rows, held)


def test_recall_rows_are_the_family_episodes_cut_to_the_sequence_length(tmp_path: Path) -> None:
    from model import family_recall_episodes

    req = _req({"kind": "corpus", "name": "recall", "seed": 2}, budget=256, t=128)
    rows = calibration_sequences(req, 4096, tmp_path)
    assert rows.shape == (2, 128)
    assert torch.equal(rows, family_recall_episodes(128, 2, seed=2).tokens[:, :128])


def test_a_tokens_file_gives_windows_in_order_and_evaluation_takes_them_from_the_end(tmp_path: Path) -> None:
    seqs = [list(range(i * 100, i * 100 + 100)) for i in range(4)]  # 4 sequences of 100 ids
    (tmp_path / "cal.json").write_text(json.dumps(seqs))
    req = _req({"kind": "tokens_file", "path": "cal.json"}, budget=160, t=40)  # 4 windows needed
    rows = calibration_sequences(req, 1000, tmp_path)
    assert rows.tolist() == [list(range(0, 40)), list(range(40, 80)), list(range(100, 140)),
                             list(range(140, 180))]
    tail = calibration_sequences(req, 1000, tmp_path, seed_offset=1000, n=2, t=40)
    assert tail.tolist() == [list(range(300, 340)), list(range(340, 380))]
    with pytest.raises(ValueError, match="holds 8 windows of 40 tokens, 9 needed"):
        calibration_sequences(req, 1000, tmp_path, n=9)
    with pytest.raises(ValueError, match=r"must be in \[0, 150\), got \[0, 179\]"):
        calibration_sequences(req, 150, tmp_path)
    (tmp_path / "bad.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(ValueError, match="a JSON list of token-id lists"):
        calibration_sequences(_req({"kind": "tokens_file", "path": "bad.json"}, budget=160, t=40), 1000,
                              tmp_path)
    with pytest.raises(ValueError, match="is not a file on the server"):
        calibration_sequences(_req({"kind": "tokens_file", "path": "nope.json"}), 1000, tmp_path)
