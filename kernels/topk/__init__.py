"""Top-k selection for the lightning indexer (torch only): `select_topk` and `candidate_blocks`.

Both take tie_break="reference" (the official code's torch CPU topk call, for conformance) or
"deterministic" (higher score, then lower id: the service's rule, independent of shapes and chunking).
"""

from kernels.topk.candidate_blocks import candidate_blocks, candidate_ids, pool_ids
from kernels.topk.selection import TIE_BREAKS, select_topk

__all__ = ["TIE_BREAKS", "candidate_blocks", "candidate_ids", "pool_ids", "select_topk"]
