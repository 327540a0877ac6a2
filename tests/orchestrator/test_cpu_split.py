"""The CPU split of the model process and the service (`model_process_cpus`): the CPU-list syntax and its
errors, the plan on given CPU sets, the setting's validation, pinning this process's threads for real
(and putting them back), and a node whose model process pins itself while the caller's process is left
as it was (a library call never pins; the entry points do).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.cpu_split import CpuSplit, enter_cpu_split, parse_cpu_list, pin_process, plan_cpu_split
from orchestrator.engine import ModelRegistry, ServedModelSpec
from orchestrator.settings import Settings, load_settings
from tests.orchestrator.engine.node_harness import start_node
from tests.processes import children_of, cmdline_of, descendants_of, parent_of

REPO = Path(__file__).resolve().parents[2]

affinity = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"),
    reason="needs Linux CPU affinity",
)


def _masks(pid: int | str = "self") -> dict[int, set[int]]:
    """Each live thread of a process and its CPUs (a thread that ends meanwhile is left out)."""
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(t)] = os.sched_getaffinity(int(t))
        except ProcessLookupError:
            pass
    return out


def test_cpu_lists_parse_as_linux_writes_them() -> None:
    assert parse_cpu_list("3") == {3}
    assert parse_cpu_list("2-3") == {2, 3}
    assert parse_cpu_list("0, 2-4,7") == {0, 2, 3, 4, 7}
    for bad, what in (("", "''"), ("a", "'a'"), ("1-", "'1-'"), ("-1", "'-1'"), ("1,,2", "''")):
        with pytest.raises(ValueError, match=f"model_process_cpus={bad!r}: {what} is not a CPU id"):
            parse_cpu_list(bad)
    with pytest.raises(ValueError, match="range '3-1' runs backwards"):
        parse_cpu_list("3-1")
    # refused at once, not expanded into billions of ids
    with pytest.raises(ValueError, match="CPU id 4000000000 is beyond 65535"):
        parse_cpu_list("0-4000000000")


def test_the_plan_gives_the_model_process_its_threads_worth_of_cpus_never_all() -> None:
    two = {0, 1}
    assert plan_cpu_split("auto", model_threads=1, allowed=two) == CpuSplit(frozenset({1}), frozenset({0}))
    # 0 threads: every core the model may have, which is all but the service's one
    assert plan_cpu_split("auto", model_threads=0, allowed=two) == CpuSplit(frozenset({1}), frozenset({0}))
    # the service keeps the first quarter (at least one CPU), the model process the rest or fewer
    eight = set(range(8))
    assert plan_cpu_split("auto", model_threads=0, allowed=eight) == CpuSplit(
        frozenset(range(2, 8)), frozenset({0, 1})
    )
    assert plan_cpu_split("auto", model_threads=2, allowed=eight) == CpuSplit(
        frozenset({6, 7}), frozenset(range(6))
    )
    assert plan_cpu_split("auto", model_threads=8, allowed=eight) == CpuSplit(
        frozenset(range(2, 8)), frozenset({0, 1})
    )
    assert plan_cpu_split("auto", model_threads=0, allowed={0, 1, 2}) == CpuSplit(
        frozenset({1, 2}), frozenset({0})
    )
    # models on an accelerator: "auto" pins nothing, an explicit list still applies
    assert plan_cpu_split("auto", model_threads=1, allowed=eight, device="cuda") is None
    assert plan_cpu_split("7", model_threads=1, allowed=eight, device="cuda") == CpuSplit(
        frozenset({7}), frozenset(range(7))
    )
    # the allowed set need not start at 0 nor be contiguous (a container's cpuset)
    assert plan_cpu_split("auto", model_threads=1, allowed={4, 9}) == CpuSplit(frozenset({9}), frozenset({4}))
    assert plan_cpu_split("auto", model_threads=1, allowed={3}) is None  # one CPU: nothing to split
    assert plan_cpu_split("none", model_threads=1, allowed=eight) is None
    assert plan_cpu_split("5-7", model_threads=1, allowed=eight) == CpuSplit(
        frozenset({5, 6, 7}), frozenset(range(5))
    )
    with pytest.raises(ValueError, match=r"model_process_cpus='9': CPUs \[9\] are not among .* \[0, 1\]"):
        plan_cpu_split("9", model_threads=1, allowed=two)
    with pytest.raises(ValueError, match=r"model_process_cpus='0-1' leaves the service process no CPU"):
        plan_cpu_split("0-1", model_threads=1, allowed=two)
    with pytest.raises(ValueError, match=r"model_process_cpus='x'"):
        plan_cpu_split("x", model_threads=1, allowed=two)


def test_the_setting_is_checked_and_read_from_the_environment() -> None:
    assert Settings().model_process_cpus == "auto"
    with pytest.raises(ValueError, match=r"model_process_cpus='one': 'one' is not a CPU id"):
        Settings(model_process_cpus="one")
    got = load_settings(environ={"KVRESUME_MODEL_PROCESS_CPUS": "1-2"})
    assert got.model_process_cpus == "1-2"
    # inline models leave nothing to split, whatever the setting says
    assert enter_cpu_split("auto", model_process="inline", model_threads=1)[0] is None


@affinity
def test_pinning_moves_every_thread_and_the_undo_puts_each_back() -> None:
    target = {min(os.sched_getaffinity(0))}
    started, stop = threading.Event(), threading.Event()

    def idle() -> None:
        started.set()
        stop.wait(10)

    t = threading.Thread(target=idle, daemon=True)
    t.start()
    started.wait(5)
    before = _masks()
    undo = pin_process(target)
    try:
        during = _masks()
        assert during and all(mask == target for mask in during.values()), during
        # a thread started now inherits its creator's CPUs
        seen: list[set[int]] = []
        late = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        late.start()
        late.join()
        assert seen == [target]
    finally:
        undo()
        stop.set()
        t.join(5)
    after = _masks()
    assert {tid: after[tid] for tid in before if tid in after} == {
        tid: mask for tid, mask in before.items() if tid in after
    }


@affinity
def test_a_node_s_model_process_pins_itself_and_leaves_the_caller_alone(tmp_path: Path) -> None:
    cpu = max(os.sched_getaffinity(0))
    mine = _masks()
    models = ModelRegistry({"a": ServedModelSpec(name="a", config="v41-tiny", seed=1)})
    node = start_node(tmp_path, models, model_process="separate", model_cpus={cpu}, preload=True)
    try:
        proc = node.service.engine.compute._proc  # noqa: SLF001 - the test reads the child's pid
        assert proc is not None
        theirs = _masks(proc.proc.pid)
        assert theirs and all(mask == {cpu} for mask in theirs.values()), theirs
        # build_node is a library call: this process's threads keep their CPUs
        now = _masks()
        assert {tid: now[tid] for tid in mine if tid in now} == {t: m for t, m in mine.items() if t in now}
    finally:
        node.stop()


def _serve(data_dir: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "serve", "--insecure-dev", "--data-dir", str(data_dir),
         "--port", "0", "--metrics-port", "0", "--models", "a=random:v41-tiny@1",
         "--json", str(data_dir / "ready.json")],  # fmt: skip
        cwd=REPO,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=open(data_dir / "serve.log", "wb"),  # noqa: SIM115 - the child owns it
    )


@affinity
@pytest.mark.skipif(len(getattr(os, "sched_getaffinity", lambda _: ())(0)) < 2, reason="needs 2 CPUs")
def test_serve_splits_the_cpus_between_its_model_process_and_itself(tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    # torch_threads left at 0 (every CPU): serve counts them after the split, so neither process runs more
    # torch threads than it has CPUs
    proc = _serve(tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready.json").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.1)
        json.loads((tmp_path / "ready.json").read_text())  # written whole
        # serve may run itself again under the pinned numerics environment (the server is then its
        # child), and its model process may be forked by a launcher (orchestrator/child_launcher.py)
        tree = descendants_of(proc.pid)
        model = [c for c in tree if _is_model_process(c)]
        assert len(model) == 1, {pid: cmdline_of(pid) for pid in tree}
        servers = [pid for pid in [proc.pid, *tree] if "orchestrator.cli" in cmdline_of(pid)]
        server = next(pid for pid in servers if not set(children_of(pid)) & set(servers))
        # one model thread: the last CPU for the model process, the others for the service
        assert set(map(frozenset, _masks(model[0]).values())) == {frozenset({cpus[-1]})}
        assert set(map(frozenset, _masks(server).values())) == {frozenset(cpus[:-1])}
        log = (tmp_path / "serve.log").read_text()
        assert "cpu_split" in log
        profile = next(json.loads(line) for line in log.splitlines() if '"numerics_profile"' in line)
        assert profile["threads"] == len(cpus) - 1, profile
        # ready, it tuned its collector (orchestrator/heap.py): the start-up heap frozen
        tuned = next(json.loads(line) for line in log.splitlines() if '"gc_tuned_for_serving"' in line)
        assert tuned["frozen_objects"] > 10_000, tuned
    finally:
        proc.terminate()
        proc.wait(30)


def _is_model_process(pid: int) -> bool:
    """Runs orchestrator.model_process: started with `python -m`, or forked by its launcher (whose command
    line the fork keeps; the launcher itself is not the model process)."""
    cmdline = cmdline_of(pid)
    if "orchestrator.child_launcher" in cmdline:
        launcher = cmdline_of(parent_of(pid))
        return "orchestrator.model_process" in cmdline and "orchestrator.child_launcher" in launcher
    return "orchestrator.model_process" in cmdline


def test_serve_refuses_cpus_it_cannot_use_naming_them(tmp_path: Path) -> None:
    proc = _serve(tmp_path, KVRESUME_MODEL_PROCESS_CPUS="4096")
    assert proc.wait(120) == 1
    assert "model_process_cpus='4096'" in (tmp_path / "serve.log").read_text()
