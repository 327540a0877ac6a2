"""Number formats and hot ops: a pure-torch reference and a Triton kernel for each, chosen by `backend=`.

Knows nothing of models, caches or storage. See kernels/README.md for the derivations.
"""

from kernels.errors import KernelError

__all__ = ["KernelError"]
