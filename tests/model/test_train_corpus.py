"""Corpus manifest: deterministic selection, split by file, caps, and detection of a changed stdlib."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from model.train import (
    SPLITS,
    CorpusChangedError,
    CorpusManifest,
    CorpusSpec,
    build_manifest,
    compare_manifests,
    read_split,
    shipped_tokenizer_dir,
)

SMALL = CorpusSpec(max_bytes=300_000)


@pytest.fixture(scope="module")
def small() -> CorpusManifest:
    return build_manifest(SMALL)


def test_build_manifest_is_deterministic(small: CorpusManifest) -> None:
    again = build_manifest(SMALL)
    assert again.to_json() == small.to_json()
    assert CorpusManifest.from_json(small.to_json()).to_json() == small.to_json()


def test_build_manifest_splits_are_disjoint_by_file(small: CorpusManifest) -> None:
    paths = [f.path for f in small.files]
    assert len(paths) == len(set(paths)) and paths == sorted(paths)
    by_split = {name: {f.path for f in small.split(name)} for name in SPLITS}
    for a in SPLITS:
        for b in SPLITS:
            if a < b:
                assert not by_split[a] & by_split[b], (a, b)
    assert set().union(*by_split.values()) == set(paths)
    # the split is a function of the path alone: a larger selection agrees on every shared file
    larger = {f.path: f.split for f in build_manifest(CorpusSpec(max_bytes=600_000)).files}
    shared = [f for f in small.files if f.path in larger]
    assert shared and all(larger[f.path] == f.split for f in shared)


def test_build_manifest_respects_caps_and_exclusions(small: CorpusManifest) -> None:
    assert small.total_bytes <= SMALL.max_bytes
    assert all(SMALL.min_file_bytes <= f.size <= SMALL.max_file_bytes for f in small.files)
    excluded = set(SMALL.exclude_dirs)
    assert not [f.path for f in small.files if excluded & set(f.path.split("/")[:-1])]
    assert small.python == platform.python_version()


def _fake_root(root: Path) -> None:
    bodies = {"a.py": "x = 1\n", "pkg/b.py": "def f():\n    pass\n", "pkg/c.py": "import os\n"}
    for name, body in bodies.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(body * 40)
    (root / "tests").mkdir()
    (root / "tests" / "t.py").write_text("assert True\n" * 40)


def test_compare_manifests_reports_added_removed_changed(tmp_path: Path) -> None:
    _fake_root(tmp_path)
    spec = CorpusSpec(max_bytes=10_000, min_file_bytes=1)
    recorded = build_manifest(spec, tmp_path)
    assert [f.path for f in recorded.files] == ["a.py", "pkg/b.py", "pkg/c.py"]
    assert compare_manifests(recorded, build_manifest(spec, tmp_path)).identical
    (tmp_path / "a.py").write_text("x = 2\n" * 40)
    (tmp_path / "pkg" / "c.py").unlink()
    (tmp_path / "d.py").write_text("y = 3\n" * 40)
    diff = compare_manifests(recorded, build_manifest(spec, tmp_path))
    assert (diff.added, diff.removed, diff.changed) == (("d.py",), ("pkg/c.py",), ("a.py",))
    assert not diff.identical and "1 added" in diff.summary()


def test_read_split_refuses_changed_files(tmp_path: Path) -> None:
    _fake_root(tmp_path)
    spec = CorpusSpec(max_bytes=10_000, min_file_bytes=1, split_fractions=(1.0, 0.0, 0.0))
    recorded = build_manifest(spec, tmp_path)
    assert [p for p, _ in read_split(recorded, "train", tmp_path)] == ["a.py", "pkg/b.py", "pkg/c.py"]
    (tmp_path / "pkg" / "b.py").write_text("def g():\n    pass\n" * 40)
    with pytest.raises(CorpusChangedError, match="pkg/b.py"):
        read_split(recorded, "train", tmp_path)


def test_shipped_manifest_matches_running_stdlib() -> None:
    path = shipped_tokenizer_dir() / "manifest.json"
    shipped = CorpusManifest.load(path)
    if shipped.python != platform.python_version():
        pytest.skip(f"manifest recorded on python {shipped.python}, running {platform.python_version()}")
    diff = compare_manifests(shipped, build_manifest(shipped.spec))
    assert diff.identical, diff.summary()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_bytes": 0}, "max_bytes"),
        ({"min_file_bytes": 10, "max_file_bytes": 5}, "min_file_bytes"),
        ({"split_fractions": (0.5, 0.2, 0.2)}, "split_fractions"),
    ],
)
def test_corpus_spec_rejects_bad_values(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        CorpusSpec(**kwargs)


def test_split_and_root_reject_bad_values(small: CorpusManifest, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'dev'"):
        small.split("dev")
    with pytest.raises(ValueError, match="missing"):
        build_manifest(SMALL, tmp_path / "missing")
