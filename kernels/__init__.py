"""Number formats and hot ops: a pure-torch reference and a Triton kernel for each, chosen by `backend=`.

Knows nothing of models, caches or storage. See kernels/README.md for the derivations.
"""

from kernels.errors import KernelError
from kernels.index_score import index_score
from kernels.sparse_attn import sparse_attn
from kernels.topk import TIE_BREAKS, candidate_blocks, select_topk

__all__ = ["TIE_BREAKS", "KernelError", "candidate_blocks", "index_score", "select_topk", "sparse_attn"]
