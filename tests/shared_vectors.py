"""Where the tests find the project's shared design data (`shared/` beside the repository, or the folder
named by KVRESUME_SHARED_DIR for a clone elsewhere), and one rule for its absence: CI fails, elsewhere the
test skips."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    return Path(os.environ.get("KVRESUME_SHARED_DIR") or REPO.parent / "shared")


def conformance_vectors(name: str = "v41-tiny") -> Path:
    """The official-reference vectors folder; fails under CI=true and skips otherwise when it is missing."""
    path = shared_dir() / "conformance" / name
    if not path.is_dir():
        if os.environ.get("CI") == "true":
            pytest.fail(f"conformance vectors missing at {path} (required in CI; set KVRESUME_SHARED_DIR "
                        "for a clone that is not beside shared/)")
        pytest.skip(f"conformance vectors not found at {path} (shared/ beside the repository)")
    return path
