"""Suite-wide pytest hooks: the suite runs under the pinned numerics profile this CPU computes exactly
(`SUITE_CPU_PATH`: portable, the conformance vectors' profile, where its GEMM probe passes, else strict),
and `gpu` tests skip without CUDA.

The profile's environment (orchestrator/numerics_env.py) is set here, at import, before any test module
imports torch: the conformance vectors match bitwise only under it, and served models refuse to
fingerprint a profile the process does not compute with. A process that loaded torch before this file
cannot be repaired in place, so the suite stops with the reason instead of failing test by test.
"""

from __future__ import annotations

import os
import sys

import pytest

from orchestrator.numerics_env import PINNED_ENVS, env_mismatches, resolve_cpu_path

# What the suite computes under: "auto" as a node resolves it (the GEMM probe runs once, in a child).
SUITE_CPU_PATH = resolve_cpu_path("auto")
_TORCH_PRELOADED = (
    "torch" in sys.modules and SUITE_CPU_PATH in PINNED_ENVS and bool(env_mismatches(None, SUITE_CPU_PATH))
)
if not _TORCH_PRELOADED and SUITE_CPU_PATH in PINNED_ENVS:
    os.environ.update(PINNED_ENVS[SUITE_CPU_PATH])


def pytest_configure(config: pytest.Config) -> None:
    if _TORCH_PRELOADED:
        raise pytest.UsageError(
            f"torch was imported before tests/conftest.py could set the {SUITE_CPU_PATH} numerics profile "
            f"({dict(PINNED_ENVS[SUITE_CPU_PATH])}); run pytest in a fresh interpreter"
        )
    from model import configure_torch

    # The in-process half of the profile: oneDNN off. OMP_NUM_THREADS=1 would also make torch's default
    # one thread; give tests that set none the cores they had before (exports do not depend on threads,
    # tests/model/test_numerics.py), shared among pytest-xdist's workers, and let each module pick its own.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    configure_torch(SUITE_CPU_PATH, threads=max(1, len(os.sched_getaffinity(0)) // workers))


# The default suite's longest modules (12-44 s a test on the 2-core VMs, session 29), run first: pytest-xdist
# hands tests out in collection order, so one of these collected last (tests/test_docs.py sorts last) kept
# one worker busy alone at the end of the run while the other had nothing left.
_LONG_MODULES = (
    "tests/chaos/test_kill_under_load.py",
    "tests/orchestrator/engine/test_finish_on_connection.py",
    "tests/test_docs.py",
    "tests/model/test_batched.py",
    "tests/kernels/test_triton_interpreter.py",
    "tests/orchestrator/test_e2e_batching.py",
    "tests/benchmarks/test_bench_long_session.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # stable: each module's tests keep their order (and their module fixtures one setup)
    items.sort(key=lambda item: item.nodeid.split("::", 1)[0] not in _LONG_MODULES)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _numerics_state() -> dict[str, object]:
    """The process-wide settings a pass's bits depend on (threads aside: exports do not depend on them)."""
    import torch

    from model import fp32_rows_free

    return {
        "torch.backends.mkldnn.enabled": torch.backends.mkldnn.enabled,
        "fp32_rows_free": fp32_rows_free(),
        "default dtype": torch.get_default_dtype(),
    }


@pytest.fixture(autouse=True)
def _numerics_state_is_left_as_found(request: pytest.FixtureRequest):
    """Fail a test that leaves the process's numerics settings changed, and put them back.

    A pytest worker runs hundreds of tests in one process: a test that runs a CLI command in-process
    (`configure_torch` of another cpu path) once left batched decodes on the one-row kernels for every
    later test of its worker, and tests comparing batched with serial passes failed far from the cause.
    """
    before = _numerics_state()
    yield
    after = _numerics_state()
    if after == before:
        return
    import torch

    from model.invariant import set_fp32_rows_free

    torch.backends.mkldnn.enabled = before["torch.backends.mkldnn.enabled"]
    set_fp32_rows_free(bool(before["fp32_rows_free"]))
    torch.set_default_dtype(before["default dtype"])  # type: ignore[arg-type]
    changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    pytest.fail(f"{request.node.nodeid} left the numerics settings changed (before, after): {changed}")
