"""`python -m model.train data build|check|sample` on a small corpus."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest

from model.train import BpeTokenizer, CorpusManifest, build_data, shipped_tokenizer_dir
from model.train.__main__ import main

SMALL = ["--max-bytes", "150000", "--vocab-size", "600"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data")
    assert main(["data", "build", "--out", str(out), *SMALL]) == 0
    return out


def test_main_data_build_writes_manifest_tokenizer_summary(built: Path) -> None:
    manifest = CorpusManifest.load(built / "manifest.json")
    tok = BpeTokenizer.load(built)
    summary = json.loads((built / "summary.json").read_text())
    assert tok.vocab_size == summary["vocab_size"] == 600
    assert {s["split"]: s["files"] for s in summary["splits"]} == {
        name: len(manifest.split(name)) for name in ("train", "validation", "test")
    }
    assert sum(s["bytes"] for s in summary["splits"]) == manifest.total_bytes <= 150_000
    assert summary["tokenizer_sha256"] == tok.digest()


def test_main_data_build_is_deterministic(built: Path, tmp_path: Path) -> None:
    assert main(["data", "build", "--out", str(tmp_path), *SMALL]) == 0
    for name in ("manifest.json", "tokenizer.json"):
        assert (tmp_path / name).read_bytes() == (built / name).read_bytes(), name


def test_main_data_check_and_sample(built: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["data", "check", "--manifest", str(built / "manifest.json")]) == 0
    assert "identical" in capsys.readouterr().out
    stale = CorpusManifest.load(built / "manifest.json")
    text = stale.to_json().replace(stale.files[0].sha256, "0" * 64)
    (tmp_path / "manifest.json").write_text(text)
    assert main(["data", "check", "--manifest", str(tmp_path / "manifest.json")]) == 1
    assert "1 changed" in capsys.readouterr().out
    assert main(["data", "sample", "--tokenizer", str(built), "--task", "kv", "--distance", "40", "300"]) == 0
    out = capsys.readouterr().out
    assert "kv_recall      distance     40" in out and "distance    300" in out
    assert main(["data", "sample", "--tokenizer", str(built), "--task", "agent", "--distance", "200"]) == 0
    out = capsys.readouterr().out
    assert "<tool> read_file(" in out and "distance    200" in out


@pytest.mark.slow
def test_build_data_reproduces_shipped_artifacts(tmp_path: Path) -> None:
    shipped = shipped_tokenizer_dir()
    recorded = CorpusManifest.load(shipped / "manifest.json")
    if recorded.python != platform.python_version():
        pytest.skip(f"shipped artifacts were built on python {recorded.python}")
    summary = build_data(tmp_path, spec=recorded.spec, vocab_size=4096)
    for name in ("manifest.json", "tokenizer.json"):
        assert (tmp_path / name).read_bytes() == (shipped / name).read_bytes(), name
    assert summary.vocab_size == 4096
