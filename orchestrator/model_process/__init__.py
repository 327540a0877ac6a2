"""The model process: the served models, their cache states and every torch operation on them in a
process apart from the service's (its gRPC servicers, SQL registry, store and turn threads), so the two
do not share one GIL. `ProcessCompute` is the turn engine's `ModelCompute` over it; `worker` is the
process itself. Selected by the `model_process` setting ("separate"); "inline" keeps the model in the
service's process (`engine.TorchCompute`).
"""

from orchestrator.model_process.process_compute import (
    ModelProcessError,
    ProcessCompute,
    RemoteKept,
    RemoteState,
)

__all__ = ["ModelProcessError", "ProcessCompute", "RemoteKept", "RemoteState"]
