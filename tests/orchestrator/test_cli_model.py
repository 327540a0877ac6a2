"""`kvresume model bytes`: table and JSON output, errors on stderr with exit code 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model import load_preset
from orchestrator.cli import main


@pytest.mark.parametrize(("preset", "expected"), [("v41-flash", 890), ("v41-tiny", 212)])
def test_model_bytes_json_preset(preset: str, expected: int, capsys: pytest.CaptureFixture[str]):
    assert main(["model", "bytes", "--preset", preset, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["global_bytes_per_token"] == expected and isinstance(out["global_bytes_per_token"], int)
    assert out["config"] == preset


def test_model_bytes_table_preset(capsys: pytest.CaptureFixture[str]):
    assert main(["model", "bytes", "--preset", "v41-flash"]) == 0
    out = capsys.readouterr().out
    assert "global KV per token        890 B" in out
    assert "2,703,360" in out and "engram" in out


def test_model_bytes_config_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    data = load_preset("v41-tiny").to_dict() | {"head_dim": 256}  # main 144 + index 34 = 178; x 2
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    assert main(["model", "bytes", "--config", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["global_bytes_per_token"] == 356


def test_model_bytes_malformed_config_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(load_preset("v41-tiny").to_dict() | {"hidden_size": 4}))
    assert main(["model", "bytes", "--config", str(path)]) == 1
    captured = capsys.readouterr()
    assert "hidden_size" in captured.err and captured.out == ""
    assert main(["model", "bytes", "--config", str(tmp_path / "absent.json")]) == 1
    assert "absent.json" in capsys.readouterr().err


def test_model_bytes_unknown_preset_exit_1(capsys: pytest.CaptureFixture[str]):
    assert main(["model", "bytes", "--preset", "v41-huge"]) == 1
    assert "v41-huge" in capsys.readouterr().err
    assert main(["model", "bytes"]) == 1
    assert "--preset" in capsys.readouterr().err
