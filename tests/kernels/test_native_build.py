"""kernels.native: a local header a C source includes is part of the build's cache key, so editing the header
rebuilds every library that includes it; a missing header is a failed build (None); `load_functions`
declares the signatures it is given."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kernels.native import build


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_a_header_edit_rebuilds_and_a_missing_header_fails(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVRESUME_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)
    src = tmp_path / "k" / "value.c"
    src.parent.mkdir()
    header = tmp_path / "shared.h"
    src.write_text('#include "../shared.h"\nint value(void) { return VALUE; }\n')
    header.write_text("#define VALUE 1\n")
    try:
        assert build.load_library(src).value() == 1
        header.write_text("#define VALUE 2\n")
        build.load_library.cache_clear()
        assert build.load_library(src).value() == 2
        header.unlink()
        build.load_library.cache_clear()
        assert build.load_library(src) is None
    finally:
        build.load_library.cache_clear()


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_load_functions_declares_each_signature(tmp_path: Path, monkeypatch) -> None:
    import ctypes

    monkeypatch.setenv("KVRESUME_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)
    src = tmp_path / "halve.c"
    src.write_text("double halve(double x) { return x / 2; }\n")
    try:
        lib = build.load_functions(src, {"halve": ([ctypes.c_double], ctypes.c_double)})
        assert lib is not None and lib.halve(3.0) == 1.5  # undeclared, the int default would garble it
        src.write_text("this is not C\n")
        build.load_library.cache_clear()
        assert build.load_functions(src, {"halve": ([ctypes.c_double], ctypes.c_double)}) is None
    finally:
        build.load_library.cache_clear()
