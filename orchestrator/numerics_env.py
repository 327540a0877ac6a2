"""The process half of the pinned CPU numerics profile: the environment torch must find when it loads.

Knows nothing of models and never imports torch at module level (it runs before torch loads); the
in-process half (threads, oneDNN, the dispatch check) and the fingerprint schema are `model.numerics`.
Why the profile exists and how it was measured: model/README.md, "The numerics profile".

The `portable` CPU path is the one the official-reference conformance vectors were generated under
(shared/conformance/*/manifest.json, `numerics_profile`): ATen's vectorised kernels at the AVX2 level, MKL's
AVX2 code branch, OpenMP started with one thread. `strict` is the same with MKL's strict CNR mode
(MKL_CBWR=AVX2,STRICT): on CPUs where MKL's plain AVX2 branch makes a row's fp32 product depend on the row
count (an Intel Xeon with AVX-512, measured 2026-12), the portable path is neither exact nor the vectors'
arithmetic, and strict is exact there, though not the vectors' bits. `native` is whatever the caller's
environment gives. `auto` (the default) picks portable where its GEMM probe passes
(orchestrator/numerics_probe.py), else strict, else native.
ATEN_CPU_CAPABILITY and MKL_CBWR are read when torch and MKL initialise, so they must be in the
environment before `import torch`: a process that has already loaded torch re-runs its command in a
process that starts under the profile.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = [
    "CPU_PATHS",
    "CPU_PATH_CHOICES",
    "PINNED_ENVS",
    "PORTABLE_ENV",
    "STRICT_ENV",
    "gemm_refusal",
    "resolve_cpu_path",
    "PORTABLE_CPU_FLAGS",
    "cpu_flags",
    "portable_refusal",
    "env_mismatches",
    "enter_cpu_path",
    "in_force_problems",
    "native_host_id",
    "cpu_model_name",
    "profile_report",
    "describe",
]

# Spelled out here (and checked against model.numerics.CPU_PATHS by a test): this module stays free of torch.
CPU_PATHS = ("portable", "strict", "native")
# What a setting or a --numerics flag may say: a cpu path, or "auto" (resolve_cpu_path picks one).
CPU_PATH_CHOICES = ("auto", *CPU_PATHS)

# Exactly the variables of the vectors' manifest; the in-process settings (torch.set_num_threads,
# torch.backends.mkldnn.enabled = False) are model.numerics.configure_torch.
PORTABLE_ENV: Mapping[str, str] = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "OMP_NUM_THREADS": "1"}
# The same with MKL's strict CNR mode: rows and threads never change a product's sums (probed, not assumed).
STRICT_ENV: Mapping[str, str] = {**PORTABLE_ENV, "MKL_CBWR": "AVX2,STRICT"}
PINNED_ENVS: Mapping[str, Mapping[str, str]] = {"portable": PORTABLE_ENV, "strict": STRICT_ENV}

# What the AVX2 code paths execute. torch trusts ATEN_CPU_CAPABILITY=avx2 without checking the CPU, so a
# CPU without these would die of an illegal instruction instead of being refused.
PORTABLE_CPU_FLAGS = ("avx2", "fma")

# Marks a child started by `enter_cpu_path`, so a child that still finds the profile wrong fails
# instead of starting another child.
_CHILD_MARK = "KVRESUME_NUMERICS_CHILD"
# Carries each pinned path's probe outcome to child processes ("ok" or the reason), so it runs once per tree.
_PROBE_MARK = "KVRESUME_GEMM_PROBE_"


def _cpuinfo_field(name: str, cpuinfo: Path) -> str | None:
    """The first processor's `name` field in a /proc/cpuinfo-style file, or None when absent/unreadable."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str] | None:
    """The CPU feature flags of the first processor in `cpuinfo` (Linux), or None when unreadable."""
    flags = _cpuinfo_field("flags", cpuinfo)
    return None if flags is None else frozenset(flags.split())


def portable_refusal(flags: frozenset[str] | None, machine: str | None = None) -> str | None:
    """Why this CPU cannot run the `portable` path, or None when it can.

    Args:
        flags: the CPU's feature flags (`cpu_flags()`); None when they could not be read.
        machine: `platform.machine()` (default: this machine's).
    """
    machine = machine if machine is not None else platform.machine()
    if machine.lower() not in ("x86_64", "amd64"):
        return (
            f"the portable numerics profile needs an x86-64 CPU with {' and '.join(PORTABLE_CPU_FLAGS)}; "
            f"this machine is {machine}: use --numerics native (no bitwise conformance)"
        )
    if flags is None:
        return (
            "the portable numerics profile needs AVX2 and FMA, and this CPU's flags could not be read "
            "from /proc/cpuinfo: use --numerics native (no bitwise conformance)"
        )
    missing = [f for f in PORTABLE_CPU_FLAGS if f not in flags]
    if missing:
        return (
            f"the portable numerics profile needs {' and '.join(PORTABLE_CPU_FLAGS)}; this CPU lacks "
            f"{', '.join(missing)}: use --numerics native (no bitwise conformance)"
        )
    return None


def env_mismatches(
    environ: Mapping[str, str] | None = None, cpu_path: str = "portable"
) -> dict[str, str | None]:
    """The variables of pinned path `cpu_path` that `environ` (default: this process's) does not set as
    required, with the value found (None: unset)."""
    environ = os.environ if environ is None else environ
    return {k: environ.get(k) for k, v in PINNED_ENVS[cpu_path].items() if environ.get(k) != v}


def gemm_refusal(cpu_path: str) -> str | None:
    """Why pinned path `cpu_path` is not exact on this machine (its GEMM probe failed), or None.

    The probe (orchestrator/numerics_probe.py) runs once in a child process started under the path's
    environment; its outcome is passed on to child processes in the environment. None also when torch is
    not installed (nothing computes then).
    """
    mark = _PROBE_MARK + cpu_path.upper()
    known = os.environ.get(mark)
    if known is None:
        env = {**os.environ, **PINNED_ENVS[cpu_path]}
        done = subprocess.run(
            [sys.executable, "-m", "orchestrator.numerics_probe"],
            env=env, capture_output=True, text=True, timeout=300, check=False,
            cwd=Path(__file__).resolve().parent.parent,
        )  # fmt: skip
        try:
            outcome = json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            outcome = {"ok": False, "reason": f"the GEMM probe failed to run: {done.stderr.strip()[-300:]}"}
        known = "ok" if outcome["ok"] is not False else str(outcome["reason"])
        os.environ[mark] = known
    if known == "ok":
        return None
    return (
        f"the {cpu_path} numerics profile is not exact on this CPU ({cpu_model_name()}): {known} "
        f"under {' '.join(f'{k}={v}' for k, v in PINNED_ENVS[cpu_path].items())}"
    )


def resolve_cpu_path(choice: str) -> str:
    """The cpu path `choice` ("auto" or a cpu path) stands for on this machine.

    "auto": portable where its GEMM probe passes, else strict where its probe passes, else native (a CPU
    without AVX2 and FMA runs neither pinned path). A named path is returned as it is; entering it checks it.
    """
    if choice not in CPU_PATH_CHOICES:
        raise ValueError(f"numerics cpu path must be one of {CPU_PATH_CHOICES}, got {choice!r}")
    if choice != "auto":
        return choice
    if portable_refusal(cpu_flags()) is not None:
        return "native"
    for cpu_path in ("portable", "strict"):
        if gemm_refusal(cpu_path) is None:
            return cpu_path
    return "native"


def cpu_model_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The first processor's model name (Linux), else what `platform` knows."""
    return _cpuinfo_field("model name", cpuinfo) or platform.processor() or platform.machine()


def native_host_id() -> str:
    """What a `native` path computes on, for its fingerprint (imports torch): torch's CPU capability,
    the CPU model and the dispatch variables as found. Nodes whose ids differ do not share caches."""
    from model import torch_cpu_state

    env = ",".join(f"{k}={os.environ.get(k, '')}" for k in PORTABLE_ENV if k != "OMP_NUM_THREADS")
    return f"{torch_cpu_state()['torch_cpu_capability']};{cpu_model_name()};{env}"


def in_force_problems(cpu_path: str) -> list[str]:
    """What keeps `cpu_path` from being what this process computes with (empty: it is in force).

    `native` is always in force. For a pinned path (`portable`, `strict`): the environment variables, and
    what torch reports (its CPU capability and oneDNN; imports torch).
    """
    if cpu_path not in CPU_PATHS:
        raise ValueError(f"cpu path must be one of {CPU_PATHS}, got {cpu_path!r}")
    if cpu_path == "native":
        return []
    wanted = PINNED_ENVS[cpu_path]
    problems = [f"{k}={v!r} (profile: {wanted[k]!r})" for k, v in env_mismatches(None, cpu_path).items()]
    from model import torch_cpu_problems

    return problems + torch_cpu_problems(cpu_path)


def enter_cpu_path(
    cpu_path: str, argv: Sequence[str] | None, *, module: str = "orchestrator.cli"
) -> int | None:
    """Make `cpu_path`'s environment hold for the command `argv` before torch computes anything.

    Args:
        cpu_path: "portable", "strict" or "native" (native changes nothing); resolve "auto" first.
        argv: the command's arguments (without the program name), or None when this process is the
            command line itself (`sys.argv`): then a re-run replaces this process (same PID and signals).
        module: what a re-run runs, as `python -m <module> <argv>`.

    Returns:
        None when the caller may go on in this process: the profile was in force already, or torch had
        not loaded and the variables were set now. Otherwise the exit code of a child process that ran the
        same command under the profile (its output is this process's stdout and stderr).

    Raises:
        ValueError: the CPU cannot run the path (naming what is missing, or what its GEMM probe found), or
            a child started for the profile still does not have it in force.
    """
    if cpu_path not in CPU_PATHS:
        raise ValueError(f"numerics cpu path must be one of {CPU_PATHS}, got {cpu_path!r}")
    if cpu_path == "native":
        return None
    refusal = portable_refusal(cpu_flags()) or gemm_refusal(cpu_path)
    if refusal is not None:
        raise ValueError(f"{refusal}; --numerics auto (the default) runs what this CPU computes exactly")
    wanted = PINNED_ENVS[cpu_path]
    if not env_mismatches(None, cpu_path):
        return None
    if os.environ.get(_CHILD_MARK):
        raise ValueError(
            f"the {cpu_path} numerics profile is still not in force: {env_mismatches(None, cpu_path)}"
        )
    if "torch" not in sys.modules:
        os.environ.update(wanted)
        return None
    env = {**os.environ, **wanted, _CHILD_MARK: "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    if argv is None:
        command = [sys.executable, "-m", module, *sys.argv[1:]]
        os.execve(command[0], command, env)
    command = [sys.executable, "-m", module, *argv]
    return subprocess.run(command, env=env, check=False).returncode


def profile_report(cpu_path: str) -> dict[str, object]:
    """What this process computes with, for reports and benchmark JSON: the cpu path, whether it is in
    force, the profile's environment variables as found, and what torch reports (imports torch)."""
    from model import torch_cpu_state

    problems = in_force_problems(cpu_path)
    return {
        "cpu_path": cpu_path,
        "in_force": not problems,
        "problems": problems,
        "env": {k: os.environ.get(k) for k in PORTABLE_ENV},  # the pinned paths set the same variables
        **torch_cpu_state(),
    }


def describe(report: Mapping[str, object]) -> str:
    """One line for a `profile_report`."""
    env = report["env"]
    assert isinstance(env, Mapping)
    env_text = " ".join(f"{k}={v if v is not None else '(unset)'}" for k, v in env.items())
    mkldnn = "on" if report["mkldnn_enabled"] else "off"
    return (
        f"numerics {report['cpu_path']}: {env_text}; torch {report['torch']} capability "
        f"{report['torch_cpu_capability']}, oneDNN {mkldnn}, {report['threads']} thread(s)"
    )
