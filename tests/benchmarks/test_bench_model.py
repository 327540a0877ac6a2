"""benchmarks.bench_model: a tiny end-to-end run of its code path, its FLOP sums against loops, its gate."""

from __future__ import annotations

import json
import random

import pytest
import torch

import benchmarks.bench_model as bench
from model import HEADER_BYTES, Transformer, init_random, load_preset, prefill

W = 32  # v41-tiny window


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_main_runs_every_arm_and_writes_json(tmp_path, capsys) -> None:
    path = tmp_path / "model.json"
    bench.main(["--lengths", "64", "--repeats", "1", "--new-tokens", "16", "--decode-steps", "2",
                "--json", str(path)])
    table = capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert doc["correctness"]["ok"] and doc["kernel_backend"] == "torch" and doc["device"] == "cpu"
    (row,) = doc["rows"]
    assert row["prompt_tokens"] == 80 and str(row["history_tokens"]) in table
    rows = row["rows_per_layer"]
    assert rows["cold_reference"] == [80] * 12
    assert rows["cold_ced"] == [80] * 6 + [W] * 6
    # the resume replays the encoder over the last W stored tokens, then the 16 new ones
    assert rows["resume"] == [W + 16] * 6 + [W] * 6
    assert row["global_bytes"] == HEADER_BYTES + 64 * 212
    m = row["median_s"]
    assert row["ced_ratio"] == pytest.approx(m["cold_reference"] / m["cold_ced"], rel=1e-2)
    gflop = row["model_gflop"]
    assert gflop["cold_reference"] > gflop["cold_ced"] > gflop["resume"]
    assert row["decode_tokens_per_s"] > 0 and row["resume_kl_vs_cold_ced"] >= 0


def test_pass_flops_sums_match_loops() -> None:
    rng = random.Random(0)
    for _ in range(200):
        lo = rng.randrange(0, 300)
        hi = lo + rng.randrange(0, 300)
        m, cap = rng.choice([1, 2, 4, 128]), rng.randrange(1, 80)
        assert bench._sum_floor_div(lo, hi, m) == sum((p + 1) // m for p in range(lo, hi))
        assert bench._sum_min(lo, hi, cap, m) == sum(min(cap, (p + 1) // m) for p in range(lo, hi))


@torch.inference_mode()
def test_pass_flops_counts_reference_above_ced() -> None:
    model = init_random(Transformer(load_preset("v41-tiny")), seed=0).eval()
    toks = torch.randint(0, 512, (1, 96), generator=torch.Generator().manual_seed(0))
    ced = bench.pass_flops(model, prefill(model, toks, mode="ced").stats)
    ref = bench.pass_flops(model, prefill(model, toks, mode="reference").stats)
    active, _ = bench.layer_weights(model)
    # the decoder half runs 96 - W fewer rows in ced mode; attention and scores add to that
    assert ref - ced > 2 * sum(active[6:]) * (96 - W)


def test_run_refuses_when_chunked_prefill_differs(monkeypatch) -> None:
    real = bench.prefill

    def drifting(model, tokens, state=None, **kw):
        out = real(model, tokens, state, **kw)
        if kw.get("prompt_end") is not None and out.logits is not None:
            out.logits.add_(1e-3)
        return out

    monkeypatch.setattr(bench, "prefill", drifting)
    with pytest.raises(SystemExit, match="chunked_ced_equals_one_shot"):
        bench.run(lengths=(64,), repeats=1, new_tokens=16, decode_steps=0)
