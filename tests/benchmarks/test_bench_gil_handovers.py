"""benchmarks.bench_gil_handovers: its reading of `perf script` output (switches of the child's process, the
waits for the GIL, who let go), its arguments, and, where perf can record here, one tiny run (slow)."""

from __future__ import annotations

import json

import pytest

import benchmarks.bench_gil_handovers as bench

_LIB = "(/usr/lib/libpython3.11.so.1.0)"


def _block(head: str, *frames: str) -> str:
    return head + "\n" + "".join(f"\t    7f00 {f}\n" for f in frames) + "\n"


def test_switches_of_the_process_waits_for_the_gil_and_who_let_go() -> None:
    kernel = ("__schedule ([kernel.kallsyms])", "futex_wait ([kernel.kallsyms])")
    text = (
        # an RLock's acquire: acquire_timed under rlock_acquire
        _block("python 42/43 ", *kernel, f"take_gil {_LIB}", f"PyEval_RestoreThread {_LIB}",
               f"acquire_timed {_LIB}", f"rlock_acquire {_LIB}")
        # a plain lock's
        + _block("python 42/44 ", *kernel, f"take_gil {_LIB}", f"PyEval_RestoreThread {_LIB}",
                 f"acquire_timed {_LIB}", f"lock_PyThread_acquire_lock {_LIB}")
        # sqlite3's step, under a frame perf could not name
        + _block("python 42/45 ", *kernel, f"take_gil {_LIB}", f"PyEval_RestoreThread {_LIB}",
                 "[unknown] ([unknown])", "stmt_step (/usr/lib/python3.11/lib-dynload/_sqlite3.so)")
        # gRPC's Cython, known by its library only
        + _block("python 42/46 ", *kernel, f"take_gil {_LIB}", f"PyEval_RestoreThread {_LIB}",
                 "[unknown] (/site-packages/grpc/_cython/cygrpc.cpython-311-x86_64-linux-gnu.so)")
        # a switch that is no wait for the GIL (an epoll wait)
        + _block("python 42/47 ", *kernel, "epoll_wait (/usr/lib/libc.so.6)")
        # another process's wait for its GIL: not counted
        + _block("python 7/7 ", *kernel, f"take_gil {_LIB}", f"PyEval_RestoreThread {_LIB}",
                 f"acquire_timed {_LIB}")
        # the last block without a blank line after it
        + _block("python 42/48 ", *kernel, f"take_gil {_LIB}", f"PyEval_RestoreThread {_LIB}",
                 "mystery (/opt/x.so)").rstrip("\n")
    )  # fmt: skip
    got = bench.parse_switches(text.splitlines(keepends=True), 42)
    assert got == {
        "switches": 6,
        "gil_waits": 5,
        "by": {"rlock": 1, "lock": 1, "sqlite3": 1, "grpc": 1, "other": 1},
    }


def test_an_rlock_is_told_from_a_lock() -> None:
    assert bench.category("acquire_timed (lib) < rlock_acquire (lib)") == "rlock"
    assert bench.category("acquire_timed (lib) < lock_PyThread_acquire_lock (lib)") == "lock"
    assert bench.category("anything else (lib)") == "other"


@pytest.mark.parametrize(
    "argv", [["--rounds", "0"], ["--sessions", "0"], ["--turns", "0"], ["--seconds", "0"]]
)
def test_main_refuses_bad_arguments(argv) -> None:
    with pytest.raises(SystemExit):
        bench.main(argv)


@pytest.mark.slow
def test_a_tiny_run_counts_this_trees_handovers(tmp_path) -> None:
    why = bench.perf_usable()
    if why is not None:
        pytest.skip(why)
    path = tmp_path / "gil.json"
    argv = ["--sessions", "4", "--turns", "40", "--seconds", "0.5", "--rounds", "1", "--json", str(path)]
    assert bench.main(argv) == 0
    (run,) = json.loads(path.read_text())["runs"]
    assert run["arm"] == "this" and run["turns_per_s"] > 0 and run["switches_per_turn"] > 0
    assert run["gil_waits_per_turn"] == pytest.approx(sum(run["gil_waits_by"].values()))
