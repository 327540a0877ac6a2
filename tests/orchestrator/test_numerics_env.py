"""orchestrator.numerics_env: reading the CPU's flags, refusing the portable path on a CPU that cannot
run it (naming what is missing), the environment check, and entering a path."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator import numerics_env
from orchestrator.cli import main

_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse2 {extra} ssse3
processor\t: 1
"""


def test_cpu_flags_reads_the_first_processor(tmp_path: Path) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(_CPUINFO.format(extra="avx2 fma"))
    assert numerics_env.cpu_flags(path) == frozenset({"fpu", "sse2", "avx2", "fma", "ssse3"})
    assert numerics_env.cpu_flags(tmp_path / "absent") is None
    (tmp_path / "noflags").write_text("processor\t: 0\n")
    assert numerics_env.cpu_flags(tmp_path / "noflags") is None


@pytest.mark.parametrize(
    ("flags", "machine", "named"),
    [
        (frozenset({"sse2", "fma"}), "x86_64", "lacks avx2:"),
        (frozenset({"sse2"}), "x86_64", "lacks avx2, fma:"),
        (frozenset({"avx2"}), "x86_64", "lacks fma:"),
        (None, "x86_64", "could not be read"),
        (frozenset({"avx2", "fma"}), "aarch64", "this machine is aarch64"),
    ],
)
def test_portable_refusal_names_what_is_missing(flags, machine: str, named: str) -> None:
    why = numerics_env.portable_refusal(flags, machine)
    assert why is not None and named in why and "--numerics native" in why


def test_portable_accepted_with_avx2_and_fma() -> None:
    assert numerics_env.portable_refusal(frozenset({"avx2", "fma", "sse2"}), "x86_64") is None


def test_env_mismatches_names_each_variable() -> None:
    assert numerics_env.env_mismatches(dict(numerics_env.PORTABLE_ENV)) == {}
    got = numerics_env.env_mismatches({"MKL_CBWR": "AUTO", "OMP_NUM_THREADS": "1"})
    assert got == {"ATEN_CPU_CAPABILITY": None, "MKL_CBWR": "AUTO"}


def test_enter_native_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MKL_CBWR")
    assert numerics_env.enter_cpu_path("native", ["x"]) is None
    assert numerics_env.in_force_problems("native") == []
    with pytest.raises(ValueError, match="'avx512'"):
        numerics_env.enter_cpu_path("avx512", ["x"])


def test_model_check_refuses_portable_on_a_cpu_without_avx2(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(numerics_env, "cpu_flags", lambda: frozenset({"sse2", "sse4_2"}))
    rc = main(["model", "check", "--checkpoint", str(tmp_path), "--vectors", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1
    assert "needs avx2 and fma; this CPU lacks avx2, fma" in err


def test_served_model_refuses_a_portable_profile_not_in_force(monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.engine import ServedModelSpec, load_served

    monkeypatch.setenv("MKL_CBWR", "AUTO")
    spec = ServedModelSpec(name="x", config="v41-tiny", seed=3)
    pinned = numerics_env.resolve_cpu_path("auto")  # the suite's path: portable, or strict on some CPUs
    with pytest.raises(ValueError, match=f"{pinned} numerics profile is not in force.*MKL_CBWR='AUTO'"):
        load_served(spec)
    assert load_served(spec, cpu_path="native").numerics.cpu_path == "native"


@pytest.mark.parametrize(
    ("portable", "strict", "picked"),
    [("ok", "ok", "portable"), ("rows differ", "ok", "strict"), ("rows differ", "rows differ", "native")],
)
def test_auto_picks_the_first_pinned_path_whose_gemm_probe_passes(
    monkeypatch: pytest.MonkeyPatch, portable: str, strict: str, picked: str
) -> None:
    # the probes' outcomes as a parent process passes them on (no child runs here)
    monkeypatch.setenv("KVRESUME_GEMM_PROBE_PORTABLE", portable)
    monkeypatch.setenv("KVRESUME_GEMM_PROBE_STRICT", strict)
    monkeypatch.setattr(numerics_env, "cpu_flags", lambda *a: frozenset({"avx2", "fma"}))
    assert numerics_env.resolve_cpu_path("auto") == picked
    assert numerics_env.resolve_cpu_path("native") == "native"
    assert numerics_env.resolve_cpu_path("portable") == "portable"  # a named path is checked on entry
    with pytest.raises(ValueError, match="'avx512'"):
        numerics_env.resolve_cpu_path("avx512")


def test_entering_a_path_whose_gemm_probe_failed_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVRESUME_GEMM_PROBE_PORTABLE", "an fp32 product of 2 rows differs")
    monkeypatch.setattr(numerics_env, "cpu_flags", lambda *a: frozenset({"avx2", "fma"}))
    with pytest.raises(ValueError, match="portable numerics profile is not exact on this CPU.*2 rows"):
        numerics_env.enter_cpu_path("portable", ["x"])


def test_the_gemm_probe_of_the_suites_path_passes_and_catches_a_row_dependent_product(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import subprocess
    import sys

    import torch
    import torch.nn.functional as F

    from orchestrator import numerics_probe

    # a fresh process under the pinned path the suite resolved (tests/conftest.py): exact on this CPU
    suite_path = numerics_env.resolve_cpu_path("auto")
    if suite_path in numerics_env.PINNED_ENVS:
        env = {**numerics_env.os.environ, **numerics_env.PINNED_ENVS[suite_path]}
        done = subprocess.run([sys.executable, "-m", "orchestrator.numerics_probe"], env=env,
                              capture_output=True, text=True, timeout=300, check=True)
        assert '"ok": true' in done.stdout, done.stdout

    # in this process, a product whose rows never depend on the call (an elementwise sum), with a batched
    # decode's one-row products made of it; then products off by one ulp at some row counts
    import model

    def rows_alone(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x[:, None, :] * w[None]).sum(-1)

    monkeypatch.setattr(F, "linear", rows_alone)
    monkeypatch.setattr(model, "rowwise_linear", lambda x, w: torch.cat([F.linear(r[None], w) for r in x]))
    assert numerics_probe.probe() is None

    def off_at(rows: int):
        def row_dependent(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            out = rows_alone(x, w)
            return out if x.shape[0] != rows else torch.nextafter(out, torch.full_like(out, float("inf")))

        return row_dependent

    # 3 rows: the model's fp32_linear runs them inside a 4-row product, so the probe passes
    monkeypatch.setattr(F, "linear", off_at(3))
    assert numerics_probe.probe() is None
    monkeypatch.setattr(F, "linear", off_at(5))
    assert "an fp32 product of 5 rows" in str(numerics_probe.probe())
