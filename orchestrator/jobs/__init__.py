"""Mapper fitting as a job: requests, the node's job service (admission, workers, child processes,
progress into SQL, cancel, watch, restart recovery) and the child process entry point.

The service is torch-free; the child (`python -m orchestrator.jobs.child`) runs the model stack.
"""

from orchestrator.jobs.progress import EtaEstimator, emit, parse_event
from orchestrator.jobs.request import (
    CORPORA,
    DEFAULT_SEQUENCE_TOKENS,
    GATE_THRESHOLDS,
    CalibrationPlan,
    FitRequest,
    plan_calibration,
)
from orchestrator.jobs.runner import NODE_RESTARTED, NODE_STOPPED, FitJobService, FitJobView

__all__ = [
    "CORPORA",
    "DEFAULT_SEQUENCE_TOKENS",
    "GATE_THRESHOLDS",
    "NODE_RESTARTED",
    "NODE_STOPPED",
    "CalibrationPlan",
    "EtaEstimator",
    "FitJobService",
    "FitJobView",
    "FitRequest",
    "emit",
    "parse_event",
    "plan_calibration",
]
