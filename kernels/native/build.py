"""Build a kernel's C source into a shared library on first use, cached by content and host.

Each compiled op (the block formats, the CPU index scores, the bf16 linear, the mHC ops) keeps its C file
beside its `cpu.py`. The library is compiled with the system C compiler (`$CC`, else `cc`) and the flags
below into a cache folder (`$KVRESUME_KERNEL_CACHE`, else `~/.cache/kvresume/kernels`), keyed by the
source's hash (with the local headers it includes, `#include "..."`, such as `bf16.h` here), the flags and
the host's CPU flags. Without a compiler, or when the build fails, `load_library` returns None and the
caller keeps its torch reference.

Why these flags: every compiled kernel here must equal a torch reference bit for bit, so no fast-math and
no FMA contraction (`-ffp-contract=off`): a C file that wants a fused multiply-add writes `fmaf`.
`-march=native` only picks the instructions, never the arithmetic, which is why the host's CPU flags are
part of the cache key.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["cpu_flags", "load_functions", "load_library"]

# a local header: `#include "path"`, resolved beside the including file
_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)

_FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-march=native", "-shared", "-fPIC")


@cache
def cpu_flags() -> frozenset[str]:
    """The first processor's flags in /proc/cpuinfo (empty where unreadable)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _cache_dir() -> Path:
    root = os.environ.get("KVRESUME_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "kvresume" / "kernels"


def _with_headers(source: Path, seen: frozenset[Path] = frozenset()) -> bytes | None:
    """The source's bytes followed by those of every local header it includes (recursively, each once per
    chain), so that editing a header changes the cache key; None when a header is missing."""
    text = source.read_bytes()
    parts = [text]
    for name in _LOCAL_INCLUDE.findall(text):
        header = (source.parent / name.decode()).resolve()
        if header in seen:
            continue
        if not header.is_file():
            return None
        more = _with_headers(header, seen | {header})
        if more is None:
            return None
        parts.append(more)
    return b"\0".join(parts)


@cache
def load_library(source: Path) -> ctypes.CDLL | None:
    """The compiled library of `source` (a .c file), building it on the first call; None without a
    compiler, without the source (an install that left package data out), or when the build fails."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None or not source.is_file():
        return None
    text = _with_headers(source)
    if text is None:
        return None
    host = " ".join(sorted(cpu_flags()))
    digest = hashlib.sha256(text + " ".join(_FLAGS).encode() + host.encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # build beside the target and rename: concurrent first uses never load a half-written file
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            done = subprocess.run([compiler, *_FLAGS, str(source), "-o", str(built), "-lm"],
                                  capture_output=True, check=False)  # fmt: skip
            if done.returncode != 0:
                return None
            os.replace(built, target)
    return ctypes.CDLL(str(target))


def load_functions(source: Path, signatures: Mapping[str, tuple[list[Any], Any]]) -> ctypes.CDLL | None:
    """`load_library(source)` with each named function's ctypes signature declared: name -> (argtypes,
    restype); None where the library does not build. Call it once per process (under `functools.cache`)."""
    lib = load_library(source)
    if lib is None:
        return None
    for name, (argtypes, restype) in signatures.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = restype
    return lib
