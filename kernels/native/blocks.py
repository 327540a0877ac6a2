"""Copy many equal-sized blocks between raw addresses in one call (copy_blocks.c), for writers that would
otherwise make a tensor view per destination only to copy into it (model/append_buffer.py).

Knows nothing of tensors: the caller computes the addresses of memory it keeps alive and guarantees that
the blocks neither overlap nor leave their allocations. Without a compiler `available()` is False and the
caller keeps its torch path, the slow twin (`torch._foreach_copy_` into views).
"""

from __future__ import annotations

import ctypes
from array import array
from functools import cache
from pathlib import Path

from kernels.native.build import load_functions

__all__ = ["available", "copy_blocks"]

_SOURCE = Path(__file__).with_name("copy_blocks.c")
_P = ctypes.c_void_p
_I64 = ctypes.c_int64


@cache
def _library() -> ctypes.CDLL | None:
    return load_functions(_SOURCE, {"copy_blocks": ([_P, _P, _I64, _I64], None)})


def available() -> bool:
    """Whether the compiled helper loads in this process."""
    return _library() is not None


def copy_blocks(dst: array, src: array, nbytes: int) -> None:
    """Copy `nbytes` bytes from each address src[i] to dst[i] (two `array('q')` of equal length).

    Raises:
        ValueError: arrays of another type code or of unequal lengths, or a negative size.
        RuntimeError: the helper is not available (check `available()` first).
    """
    if dst.typecode != "q" or src.typecode != "q" or len(dst) != len(src) or nbytes < 0:
        raise ValueError(
            f"copy_blocks needs two array('q') of one length and nbytes >= 0, got {dst.typecode!r} x "
            f"{len(dst)}, {src.typecode!r} x {len(src)}, nbytes={nbytes}"
        )
    lib = _library()
    if lib is None:
        raise RuntimeError("copy_blocks: the compiled helper is not available here (no C compiler?)")
    if dst:
        lib.copy_blocks(dst.buffer_info()[0], src.buffer_info()[0], nbytes, len(dst))
