"""`kvresume mapper fit|eval|list` in-process on tiny random-init models (the mapper command group alone,
so the test does not depend on other command groups)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mappers import load_mapper
from orchestrator.cli import mapper_cmd
from orchestrator.cli.command_parser import CommandParser


def _run(argv: list[str]) -> int:
    parser = CommandParser(prog="kvresume")
    mapper_cmd.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.handler(args)


MODELS = ["--sender-preset", "v41-tiny", "--receiver-preset", "v41-tiny", "--receiver-set", "dim=128",
          "--threads", "1"]  # fmt: skip


def test_mapper_fit_eval_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "maps" / "a"
    fit = ["mapper", "fit", "--out", str(out), "--batches", "1", "--tokens", "64", "--eval-prompts", "1",
           "--eval-prefix", "32", "--gate-attn-cosine", "0.0", "--gate-next-token-kl", "100",
           "--gate-index-recall", "0", "--json", *MODELS]  # fmt: skip
    # the retention interval is the gate: without task episodes nothing can pass it
    assert _run([*fit, "--require-gate"]) == 1
    summary = json.loads(capsys.readouterr().out)
    assert summary["passed_gate"] is False
    assert summary["gate_failures"] == ["retention_ci_lower not measured (gate min_retention_lower=0.8)"]
    # with it switched off explicitly (a negative threshold), the screens alone decide
    fit += ["--gate-retention-lower", "-1"]
    assert _run(fit) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["passed_gate"] is True and summary["gate_failures"] == []
    assert [lm["receiver_layer"] for lm in summary["layers"]] == [2, 4, 6]
    mapper = load_mapper(out)
    assert mapper.passed_gate and "attn_cosine_mean" in mapper.quality
    assert mapper.receiver.config.dim == 128

    assert _run(["mapper", "list", str(tmp_path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [row["dir"] for row in listed] == [str(out)] and listed[0]["passed_gate"] is True

    # the default gate is far above what two unrelated random models reach: eval says so and exits 1
    strict = ["mapper", "eval", str(out), "--eval-prompts", "1", "--eval-prefix", "32", "--require-gate",
              "--write", *MODELS]  # fmt: skip
    assert _run(strict) == 1
    assert "gate: NOT PASSED" in capsys.readouterr().out
    assert not load_mapper(out).passed_gate

    # another receiver than the one the mapper was fitted for is refused
    with pytest.raises(ValueError, match="receiver_fingerprint_mismatch"):
        _run(["mapper", "eval", str(out), *MODELS[:4], "--receiver-seed", "7", "--receiver-set", "dim=128"])


def test_mapper_fit_tokens_file_sets_are_disjoint_and_retention_needs_episodes(tmp_path: Path) -> None:
    """Calibration and held-out windows come from the front of --tokens-file, evaluation prompts from its
    end; a file too short to keep them apart is refused, as is a retention gate with nothing measured."""
    rows = [[(7 * r + i) % 500 + 16 for i in range(64)] for r in range(3)]
    short = tmp_path / "short.json"
    short.write_text(json.dumps(rows))
    base = ["mapper", "fit", "--out", str(tmp_path / "m"), "--batches", "1", "--heldout", "1", "--batch-size",
            "1", "--tokens", "64", "--eval-prefix", "32", "--eval-prompts", "1", *MODELS]  # fmt: skip
    with pytest.raises(ValueError, match="would overlap"):
        _run([*base, "--tokens-file", str(short), "--eval-prompts", "4"])
    with pytest.raises(ValueError, match="--gate-retention needs --task-episodes"):
        _run([*base, "--tokens-file", str(short), "--gate-retention", "0.5"])
    assert mapper_cmd._sequences_for(rows, 64, 2) == 2
    assert mapper_cmd._sequences_for(rows, 32, 3) == 2
    assert mapper_cmd._sequences_for(rows, 64, 4) == 4  # more than the file holds


def test_mapper_fit_force_mlp_part(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--force-mlp-part tries the MLP on a part whose ridge passes the part gate; it needs --fallback mlp."""
    base = ["mapper", "fit", "--out", str(tmp_path / "m"), "--batches", "1", "--tokens", "64",
            "--eval-prompts", "0", "--part-gate-r2=-1e9", "--force-mlp-part", "6.kv", "--json", *MODELS]
    with pytest.raises(ValueError, match="needs fallback='mlp'"):
        _run(base)
    assert _run([*base, "--fallback", "mlp", "--mlp-epochs", "1", "--mlp-hidden", "8"]) == 0
    layers = {lm["receiver_layer"]: lm for lm in json.loads(capsys.readouterr().out)["layers"]}
    assert "forced (6.kv)" in layers[6]["kv_reason"]
    assert all("forced" not in lm[f"{p}_reason"] for r, lm in layers.items() for p in ("kv", "index")
               if (r, p) != (6, "kv"))
