"""One intra-op thread for the engine tests (small passes on a shared 2-core machine run far faster), and a
seeded v41-tiny served model for the tests that run its passes."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def served():
    """A served v41-tiny, random weights from seed 3 (ratios 2 and 1: open compression groups occur)."""
    from orchestrator.engine import ModelRegistry, ServedModelSpec

    torch.set_num_threads(1)
    reg = ModelRegistry({"a": ServedModelSpec(name="a", config="v41-tiny", seed=3)})
    s = reg.get("a")
    assert s is not None
    return s
