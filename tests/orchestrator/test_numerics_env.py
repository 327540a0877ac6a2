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
    with pytest.raises(ValueError, match="portable numerics profile is not in force.*MKL_CBWR='AUTO'"):
        load_served(spec)
    assert load_served(spec, cpu_path="native").numerics.cpu_path == "native"
