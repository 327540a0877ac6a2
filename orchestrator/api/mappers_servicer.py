"""The Mappers service: register (admin token), list and get (any token); fitting jobs (admin token).

Fitting jobs are admin operations, as RegisterMapper is: a job's outcome is a registered mapper that every
tenant's model switch may use, and the calibration data is the node's, not a tenant's. Jobs are run by
the node's `orchestrator.jobs.FitJobService` (`ctx.fit_jobs`; None: the job RPCs answer UNIMPLEMENTED).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from orchestrator.api.context import ServiceContext
from orchestrator.api.errors import (
    InvalidRequestError,
    NotFoundError,
    ResourceExhaustedError,
    check_name_length,
)
from orchestrator.api.status_table import stream_errors, unary_errors
from orchestrator.db import MapperRepository, run_serializable
from orchestrator.db.models import FitJobPhase

# The request module, not the package root: orchestrator.jobs imports orchestrator.api (its errors), so
# the job service is only named for typing here.
from orchestrator.jobs.request import DEFAULT_SEQUENCE_TOKENS, GATE_THRESHOLDS, FitRequest

if TYPE_CHECKING:
    from orchestrator.jobs import FitJobService, FitJobView

__all__ = ["MappersServicer", "servicer_class"]

_MAX_LIST_JOBS = 1000


def servicer_class(ctx: ServiceContext) -> type:
    return type("MappersServicer", (MappersServicer, ctx.stubs.mappers_grpc.MappersServicer), {})


def _ts(value: Any) -> Timestamp | None:
    if value is None:
        return None
    out = Timestamp()
    out.FromDatetime(value)
    return out


class MappersServicer:
    def __init__(self, ctx: ServiceContext) -> None:
        self._ctx = ctx
        self._pb = ctx.stubs.mappers

    @unary_errors
    def RegisterMapper(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._ctx.auth.admin(context)
        if not request.HasField("mapper"):
            raise InvalidRequestError("mapper is required")
        registration = self._ctx.convert.mapper_registration(request.mapper)

        def work(s: Any) -> Any:
            return self._ctx.convert.mapper(MapperRepository(s).register(registration))

        return run_serializable(self._ctx.serializable, work)

    @unary_errors
    def ListMappers(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._ctx.auth.any(context)
        with self._ctx.sessions() as s:
            rows = MapperRepository(s).list(
                sender_model=request.sender_model or None, receiver_model=request.receiver_model or None
            )
            return self._pb.ListMappersResponse(mappers=[self._ctx.convert.mapper(r) for r in rows])

    @unary_errors
    def GetMapper(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._ctx.auth.any(context)
        if not request.mapper_id:
            raise InvalidRequestError("mapper_id is required")
        with self._ctx.sessions() as s:
            row = MapperRepository(s).get(request.mapper_id)
            if row is None:
                raise NotFoundError(f"mapper {request.mapper_id} not found", reason="MAPPER_NOT_FOUND")
            return self._ctx.convert.mapper(row)

    # -- fitting jobs --------------------------------------------------------------------------------

    def _jobs(self, context: grpc.ServicerContext) -> tuple[FitJobService, str]:
        caller = self._ctx.auth.admin(context)
        jobs = self._ctx.fit_jobs
        if jobs is None:
            raise NotImplementedError("this server runs no mapper fitting jobs")
        return jobs, caller.actor

    @staticmethod
    def _job_id(request: Any) -> str:
        if not request.job_id:
            raise InvalidRequestError("job_id is required", field="job_id")
        check_name_length("job_id", request.job_id)
        return str(request.job_id)

    @unary_errors
    def StartFit(self, request: Any, context: grpc.ServicerContext) -> Any:
        jobs, actor = self._jobs(context)
        if request.resubmit_job_id:
            check_name_length("resubmit_job_id", request.resubmit_job_id)
            given = [f.name for f, _ in request.ListFields() if f.name != "resubmit_job_id"]
            if given:
                raise InvalidRequestError(
                    f"resubmit_job_id runs a job again with its own parameters; {given} must be unset",
                    field=given[0],
                )
            return self._job(jobs.resubmit(request.resubmit_job_id, actor=actor))
        return self._job(jobs.start(self._fit_request(request), actor=actor))

    @unary_errors
    def GetJob(self, request: Any, context: grpc.ServicerContext) -> Any:
        jobs, _ = self._jobs(context)
        return self._job(jobs.get(self._job_id(request)))

    @stream_errors
    def WatchJob(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        jobs, _ = self._jobs(context)
        for view in jobs.watch(self._job_id(request), active=context.is_active):
            yield self._job(view)

    @unary_errors
    def CancelJob(self, request: Any, context: grpc.ServicerContext) -> Any:
        jobs, actor = self._jobs(context)
        return self._job(jobs.cancel(self._job_id(request), actor=actor))

    @unary_errors
    def ListJobs(self, request: Any, context: grpc.ServicerContext) -> Any:
        jobs, _ = self._jobs(context)
        limit = request.limit or 100
        if limit > _MAX_LIST_JOBS:
            raise ResourceExhaustedError(f"limit={limit} exceeds {_MAX_LIST_JOBS}", field="limit",
                                         reason="REQUEST_TOO_LARGE")
        return self._pb.ListJobsResponse(jobs=[self._job(v) for v in jobs.list(limit=limit)])

    # -- conversions ---------------------------------------------------------------------------------

    def _fit_request(self, request: Any) -> FitRequest:
        for name in ("sender_model", "receiver_model"):
            if not getattr(request, name):
                raise InvalidRequestError(f"{name} is required", field=name)
            check_name_length(name, getattr(request, name))
        which = request.source.WhichOneof("source") if request.HasField("source") else None
        if which is None:
            raise InvalidRequestError("source is required: a corpus (name, seed) or a tokens_file",
                                      field="source")
        if which == "corpus":
            source: dict[str, Any] = {
                "kind": "corpus", "name": request.source.corpus.name, "seed": request.source.corpus.seed
            }
        else:
            source = {"kind": "tokens_file", "path": request.source.tokens_file}
        gate: dict[str, Any] = {
            name: getattr(request.gate, name) for name in GATE_THRESHOLDS if request.gate.HasField(name)
        }
        gate["task_episodes"] = request.gate.task_episodes
        gate["eval_prompts"] = request.gate.eval_prompts
        gate["disabled"] = list(request.gate.disabled)
        if request.gate.HasField("task_seed"):
            gate["task_seed"] = request.gate.task_seed
        if request.budget_tokens == 0:
            raise InvalidRequestError("budget_tokens must be positive", field="budget_tokens")
        fields = {"sender_model", "receiver_model", "source", "budget_tokens", "sequence_tokens", "gate",
                  "fallback"}
        try:
            return FitRequest(
                sender_model=request.sender_model,
                receiver_model=request.receiver_model,
                source=source,
                budget_tokens=request.budget_tokens,
                sequence_tokens=request.sequence_tokens or DEFAULT_SEQUENCE_TOKENS,
                gate=gate,
                fallback=request.fallback or "none",
                attention_weighted=request.attention_weighted,
            )
        except ValueError as exc:
            text = str(exc)
            field = next((f for f in sorted(fields) if text.startswith(f)), None)
            if field is None:
                field = "gate" if text.startswith("gate") else "source" if "calibration" in text else None
            raise InvalidRequestError(text, field=field) from exc

    def _job(self, view: FitJobView) -> Any:
        pb = self._pb
        src = view.source
        if src.get("kind") == "tokens_file":
            source = pb.CalibrationSource(tokens_file=str(src["path"]))
        else:
            source = pb.CalibrationSource(
                corpus=pb.CalibrationCorpus(name=str(src.get("name", "")), seed=int(src.get("seed", 0)))
            )
        gate = pb.FitGate(
            task_episodes=int(view.gate.get("task_episodes", 0)),
            eval_prompts=int(view.gate.get("eval_prompts", 0)),
        )
        for name in GATE_THRESHOLDS:
            if view.gate.get(name) is not None:
                setattr(gate, name, float(view.gate[name]))
        gate.disabled.extend(view.gate.get("disabled", []))
        if view.gate.get("task_seed") is not None:
            gate.task_seed = int(view.gate["task_seed"])
        msg = pb.FitJob(
            job_id=view.job_id,
            phase=pb.FitJobPhase.Value(f"FIT_JOB_PHASE_{view.phase.name}"),
            sender_model=view.sender_model,
            receiver_model=view.receiver_model,
            source=source,
            budget_tokens=view.budget_tokens,
            sequence_tokens=int(src.get("sequence_tokens", DEFAULT_SEQUENCE_TOKENS)),
            gate=gate,
            rows_done=view.rows_done,
            rows_total=view.rows_total,
            reason=view.reason,
            metrics=view.metrics,
            mapper_id=view.mapper_id,
            artifact_uri=view.artifact_uri,
            resubmitted_from=view.resubmitted_from or "",
            node=view.node,
            created_at=_ts(view.created_at),
            started_at=_ts(view.started_at),
            finished_at=_ts(view.finished_at),
            fallback=str(src.get("fallback", "none")),
            attention_weighted=bool(src.get("attention_weighted", False)),
        )
        if view.eta_s is not None and view.phase in (FitJobPhase.RUNNING, FitJobPhase.QUEUED):
            msg.eta_s = view.eta_s
        if view.passed_gate is not None:
            msg.passed_gate = view.passed_gate
        return msg
