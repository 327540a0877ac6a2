"""Retention statistics: the paired bootstrap against its slow twin, task seeds, and `mapper eval`
refusing a task seed the fit used."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mappers import FitSpec, bootstrap_ratio_ci, bootstrap_ratio_ci_loop, bucket_seed, fit_mapper, save_mapper
from model import Transformer, init_random, load_preset
from orchestrator.cli import main as cli_main


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_bootstrap_matches_its_slow_twin_on_fresh_inputs(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(5, 60))
    own = rng.random(n) < 0.9
    mapped = own & (rng.random(n) < 0.8)
    fast = bootstrap_ratio_ci(mapped.astype(int), own.astype(int), n_boot=300, seed=seed)
    slow = bootstrap_ratio_ci_loop(mapped.astype(int), own.astype(int), n_boot=300, seed=seed)
    assert fast == pytest.approx(slow, rel=1e-12, abs=1e-12)
    point, lo, hi = fast
    assert lo <= point <= hi and point == pytest.approx(mapped.sum() / own.sum())


def test_bootstrap_interval_narrows_with_more_episodes_and_is_paired() -> None:
    rng = np.random.default_rng(7)
    own = np.ones(2000, dtype=int)
    mapped = (rng.random(2000) < 0.9).astype(int)
    _, lo_small, hi_small = bootstrap_ratio_ci(mapped[:100], own[:100], seed=1)
    _, lo_big, hi_big = bootstrap_ratio_ci(mapped, own, seed=1)
    assert hi_big - lo_big < (hi_small - lo_small) / 2
    # identical paths: every paired replicate is exactly 1
    assert bootstrap_ratio_ci(own, own, n_boot=50)[1:] == (1.0, 1.0)
    with pytest.raises(ValueError, match="equal-length"):
        bootstrap_ratio_ci([1, 0], [1])
    with pytest.raises(ValueError, match="no episodes"):
        bootstrap_ratio_ci([], [])


def test_bucket_seeds_of_different_task_seeds_never_collide() -> None:
    seen = {bucket_seed(t, b) for t in range(50) for b in range(16)}
    assert len(seen) == 50 * 16
    with pytest.raises(ValueError, match="bucket"):
        bucket_seed(1, 16)


def test_mapper_eval_refuses_a_task_seed_used_in_fitting(tmp_path: Path, capsys) -> None:
    cfg = load_preset("v41-tiny")
    sender = init_random(Transformer(cfg), seed=0).eval()
    receiver = init_random(Transformer(cfg), seed=1).eval()
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        mapper = fit_mapper(sender, receiver, [torch.randint(0, 512, (2, 64), generator=g)],
                            spec=FitSpec(alphas=(1e-2,)), calibration={"task_seeds": [2007]})
    out = save_mapper(mapper, tmp_path / "m")
    models = ["--sender-preset", "v41-tiny", "--receiver-preset", "v41-tiny", "--threads", "1"]
    code = cli_main(["mapper", "eval", str(out), "--task-seed", "2007", "--task-episodes", "4", *models])
    assert code == 1
    assert "task seed 2007 was used in fitting" in capsys.readouterr().err
    # --seed 7 without --task-seed means task seed 2007 too
    assert cli_main(["mapper", "eval", str(out), "--seed", "7", "--task-episodes", "4", *models]) == 1
    assert "task seed 2007" in capsys.readouterr().err


def test_mapper_eval_without_models_needs_the_artifacts_checkpoints(tmp_path: Path, capsys) -> None:
    cfg = load_preset("v41-tiny")
    model = init_random(Transformer(cfg), seed=0).eval()
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        mapper = fit_mapper(model, model, [torch.randint(0, 512, (2, 64), generator=g)],
                            spec=FitSpec(alphas=(1e-2,)), sender_name="no-such-sibling",
                            receiver_name="no-such-sibling")
    out = save_mapper(mapper, tmp_path / "m")
    assert cli_main(["mapper", "eval", str(out), "--threads", "1"]) == 1
    err = capsys.readouterr().err
    assert "'no-such-sibling' has no checkpoint here" in err and "--sender-checkpoint" in err
