"""Compiled CPU helpers shared by the kernels: building a C source into a cached shared library.

Knows nothing of any op; each op's `cpu.py` declares its own entry points on the library it gets here
(`load_functions` declares them from a table of signatures).
"""

from kernels.native.build import cpu_flags, load_functions, load_library

__all__ = ["cpu_flags", "load_functions", "load_library"]
