"""Which CPUs the model process computes on and which the service's own process keeps (the
`model_process_cpus` setting), and pinning a process's threads to a CPU set. Applied by the entry points
(`kvresume serve`, the benchmarks), like the torch thread count: CPU affinity belongs to a whole process,
so a library call (build_node in a test) never changes it.

Why: with the model in a process of its own, the service's threads (gRPC, turns, SQL, store) woke on
whichever core was free, the model process's core included, and its forward passes then waited for a
core as well as ran. Measured (session 17, Intel Xeon with AMX, 2 vCPUs, v41-sib-s, 64 sessions x 20
turns of `benchmarks.service_model_load`, paired runs): unpinned 82-85 turns/s; the model process alone
pinned to CPU 1, 92.4-92.6; the model process on CPU 1 and the service on CPU 0, 101.7-106.6 (its
prefill passes' wall over CPU time 1.42 -> 1.17-1.21). The serial baseline gained too (18.8 -> 21.6) and
one session alone did not move (18.5 -> 17.7, noise). orchestrator/README.md, "The model process", has
the table.

Knows nothing of torch or the model: CPU ids and the operating system's affinity calls only (Linux;
elsewhere "auto" splits nothing and an explicit list is refused).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["CpuSplit", "check_cpu_spec", "enter_cpu_split", "parse_cpu_list", "pin_process", "plan_cpu_split"]

_LIST_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")
# Above any CPU id Linux numbers (its NR_CPUS is at most 8192): a typo like "0-4000000000" is refused, not
# expanded into billions of ids.
_MAX_CPU_ID = 65535


@dataclass(frozen=True)
class CpuSplit:
    """The model process's CPUs and the service process's (disjoint, neither empty)."""

    model: frozenset[int]
    service: frozenset[int]


def parse_cpu_list(text: str) -> frozenset[int]:
    """CPU ids written as Linux writes them: "3", "2-3", "0,2-3".

    Raises:
        ValueError: naming the text, when it is not such a list.
    """
    cpus: set[int] = set()
    for item in text.split(","):
        m = _LIST_ITEM.match(item.strip())
        if m is None:
            raise ValueError(f"model_process_cpus={text!r}: {item.strip()!r} is not a CPU id or range a-b")
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) is not None else first
        if last < first:
            raise ValueError(f"model_process_cpus={text!r}: range {item.strip()!r} runs backwards")
        if last > _MAX_CPU_ID:
            raise ValueError(f"model_process_cpus={text!r}: CPU id {last} is beyond {_MAX_CPU_ID}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def check_cpu_spec(spec: str) -> None:
    """Settings validation: "auto", "none" or a CPU list (whether those CPUs exist is checked where the
    split is planned, on the machine that applies it).

    Raises:
        ValueError: naming the value.
    """
    if spec not in ("auto", "none"):
        parse_cpu_list(spec)


def _affinity_supported() -> bool:
    return hasattr(os, "sched_getaffinity") and hasattr(os, "sched_setaffinity")


def plan_cpu_split(
    spec: str, *, model_threads: int, allowed: Iterable[int] | None = None, device: str = "cpu"
) -> CpuSplit | None:
    """The split `spec` asks for on this machine, or None for no pinning.

    Args:
        spec: "none"; "auto": for models computing on the CPU with two or more CPUs allowed to this
            process, the service keeps the first quarter of them (at least one) and the model process
            takes the rest, or only the last `model_threads` of the rest when that is fewer (measured on
            2 CPUs only, where this is one each); else a CPU list for the model process, the service
            keeping the other allowed CPUs.
        model_threads: the model's intra-op threads (0: as many as it may have; the model process gets at
            most one CPU per thread).
        allowed: the CPUs this process may run on (default: its current affinity).
        device: where the models compute; on an accelerator "auto" splits nothing (the model process
            there mostly launches kernels, and no measurement says what its share should be).

    Raises:
        ValueError: naming the value, for a list on an OS without CPU affinity, CPUs this process may not
            use, or a list that leaves the service no CPU.
    """
    check_cpu_spec(spec)
    if spec == "none":
        return None
    if not _affinity_supported():
        if spec == "auto":
            return None
        raise ValueError(f"model_process_cpus={spec!r}: this operating system offers no CPU affinity")
    usable = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    if spec == "auto":
        if len(usable) < 2 or device != "cpu":
            return None
        rest = len(usable) - max(1, -(-len(usable) // 4))
        take = min(model_threads, rest) if model_threads > 0 else rest
        model = frozenset(usable[-take:])
    else:
        model = parse_cpu_list(spec)
        outside = sorted(model - set(usable))
        if outside:
            raise ValueError(
                f"model_process_cpus={spec!r}: CPUs {outside} are not among this process's CPUs {usable}"
            )
    service = frozenset(usable) - model
    if not service:
        raise ValueError(f"model_process_cpus={spec!r} leaves the service process no CPU of {usable}")
    return CpuSplit(model=model, service=service)


def _thread_ids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]  # no /proc: the calling thread only


def pin_process(cpus: Iterable[int]) -> Callable[[], None]:
    """Pin every thread of this process to `cpus` (Linux affinity is per thread, and a thread started later
    inherits its creator's); returns the function that puts each thread's previous set back.

    Raises:
        OSError: from the first affinity call (a CPU the process may not use); nothing is left changed.
    """
    target = frozenset(cpus)
    previous: dict[int, set[int]] = {}

    def restore() -> None:
        for tid, mask in previous.items():
            try:
                os.sched_setaffinity(tid, mask)
            except OSError:
                pass  # the thread ended meanwhile

    try:
        # twice: a thread started by one not yet pinned, while the first pass ran, is caught by the second
        for _ in range(2):
            for tid in _thread_ids():
                if tid in previous:
                    continue
                try:
                    mask = os.sched_getaffinity(tid)
                    os.sched_setaffinity(tid, target)
                except ProcessLookupError:
                    continue  # the thread ended meanwhile
                previous[tid] = mask
    except OSError:
        restore()
        raise
    return restore


def enter_cpu_split(
    spec: str, *, model_process: str, model_threads: int, device: str = "cpu"
) -> tuple[CpuSplit | None, Callable[[], None]]:
    """For an entry point: plan the split and pin this process's threads to the service's CPUs, when the
    models compute in a model process ("separate"; inline there is nothing to split). Returns the split
    (None: no pinning), whose `model` CPUs go to `build_node(model_cpus=...)`, and the undo.

    Raises:
        ValueError: an explicit list this machine cannot honour (`plan_cpu_split`).
    """
    if model_process != "separate":
        return None, lambda: None
    split = plan_cpu_split(spec, model_threads=model_threads, device=device)
    if split is None:
        return None, lambda: None
    return split, pin_process(split.service)
