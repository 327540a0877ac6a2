"""What crosses the boundary between the service process and its model process: one pickled request and
one pickled reply per call on a `multiprocessing.connection` (AF_UNIX, authenticated), and the forms a
forward pass's output and an error take on the way.

Logits cross as numpy arrays (pickle protocol 5 copies their bytes once; torch's own tensor pickling goes
through `torch.save`, several times slower per call); a float32 array and the tensor rebuilt from it are
the same bytes, so what the sampler sees is bit for bit what the model computed. Errors cross as the
exception object when it pickles and unpickles, else as a RuntimeError naming its type and message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from orchestrator.child_process import Reply, dumps, loads, pack_error

__all__ = ["Reply", "WireOutput", "dumps", "loads", "pack_error", "pack_logits", "unpack_logits"]


def pack_logits(logits: torch.Tensor | None) -> np.ndarray | None:
    if logits is None:
        return None
    # contiguous so the array is one buffer; detach: inference tensors have no grad anyway
    return logits.detach().contiguous().numpy()


def unpack_logits(packed: np.ndarray | None) -> torch.Tensor | None:
    if packed is None:
        return None
    return torch.from_numpy(packed)


@dataclass(frozen=True, slots=True)
class WireOutput:
    """A forward pass's output as it crosses: the state by its id in the model process, its length, the
    logits array and the pass statistics (a small dataclass of ints)."""

    state_id: int
    n_tokens: int
    logits: np.ndarray | None
    stats: Any
