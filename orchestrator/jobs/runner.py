"""The node's mapper fitting jobs: admission, a bounded set of workers, one child process per job, its
progress into SQL, cancel, watch, and start-up recovery.

SQL (`fit_jobs`) is the record; this object only knows which of this node's jobs wait or run now. A job
is admitted while fewer than `fit_max_running_jobs + fit_max_queued_jobs` of this node's jobs are
unfinished (else RESOURCE_EXHAUSTED); `fit_max_running_jobs` workers each run one child process
(`orchestrator.jobs.child`) with `fit_threads` torch threads. A node that starts marks its unfinished
rows FAILED "node restarted" (their children died with the process that held their pipes); `close`
marks the ones it stops FAILED "node stopped". Neither is ever deleted: `resubmit` runs one again.

Torch-free: the child imports the model stack, this process only reads its event lines.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from sqlalchemy.orm import Session, sessionmaker

# The errors module itself, not the api package root: the Mappers servicer imports this package while
# orchestrator.api is still initialising.
from orchestrator.api.errors import (
    InvalidRequestError,
    NotFoundError,
    PreconditionError,
    ResourceExhaustedError,
    UnavailableError,
    model_not_served,
)
from orchestrator.db import MapperRegistration, MapperRepository, run_serializable
from orchestrator.db.models import FitJobPhase, FitJobRow
from orchestrator.db.repositories import FitJobRepository, FitJobSubmission
from orchestrator.jobs.progress import EtaEstimator, parse_event
from orchestrator.jobs.request import FitRequest, resolve_tokens_file
from orchestrator.numerics_env import PINNED_ENVS, resolve_cpu_path
from orchestrator.settings import Settings

__all__ = ["FitJobService", "FitJobView", "NODE_RESTARTED", "NODE_STOPPED"]

log = structlog.get_logger(__name__)

NODE_RESTARTED = "node restarted"
NODE_STOPPED = "node stopped"
# Progress reaches SQL at most this often (the child reports every calibration batch).
_PROGRESS_INTERVAL_S = 0.25
# How long a watcher sleeps between checks of the row when nothing in this process wakes it (a job of
# another node, or a cancelled call).
_WATCH_POLL_S = 0.5
_REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, kw_only=True)
class FitJobView:
    """A job row as read (detached from its SQL session)."""

    job_id: str
    phase: FitJobPhase
    actor: str
    node: str
    sender_model: str
    receiver_model: str
    source: dict[str, Any]
    budget_tokens: int
    gate: dict[str, Any]
    rows_done: int
    rows_total: int
    eta_s: float | None
    reason: str
    metrics: dict[str, float]
    passed_gate: bool | None
    mapper_id: str
    artifact_uri: str
    resubmitted_from: str | None
    created_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None

    @classmethod
    def of(cls, row: FitJobRow) -> FitJobView:
        return cls(
            job_id=row.id, phase=row.phase, actor=row.actor, node=row.node, sender_model=row.sender_model,
            receiver_model=row.receiver_model, source=dict(row.source), budget_tokens=row.budget_tokens,
            gate=dict(row.gate), rows_done=row.rows_done, rows_total=row.rows_total, eta_s=row.eta_s,
            reason=row.reason, metrics=dict(row.metrics), passed_gate=row.passed_gate,
            mapper_id=row.mapper_id, artifact_uri=row.artifact_uri, resubmitted_from=row.resubmitted_from,
            created_at=row.created_at, started_at=row.started_at, finished_at=row.finished_at,
        )

    @property
    def request(self) -> FitRequest:
        return FitRequest.from_stored(
            sender_model=self.sender_model, receiver_model=self.receiver_model, source=self.source,
            budget_tokens=self.budget_tokens, gate=self.gate,
        )


@dataclass
class _Slot:
    """A job this process has admitted and not yet ended: its child once started, and whether a cancel
    or a shutdown already wrote its final row."""

    job_id: str
    proc: subprocess.Popen[str] | None = None
    ended: bool = False


class FitJobService:
    """Fitting jobs of one node.

    Args:
        settings: the fit_* limits, data_dir (artifacts under data_dir/fit_jobs/<job id>/), the models'
            device, kernel backend and numerics path.
        model_sources: served model name -> source string (`ServedModelSpec.source`).
        python: the interpreter that runs the children.
    """

    def __init__(
        self,
        *,
        settings: Settings,
        sessions: sessionmaker[Session],
        serializable: sessionmaker[Session],
        node: str,
        model_sources: Mapping[str, str],
        python: str = sys.executable,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._sessions = sessions
        self._serializable = serializable
        self._node = node
        self._sources = dict(model_sources)
        self._python = python
        self._clock = clock
        # Re-entrant: a cancel writes the final row and kills the child under it, and notifies watchers.
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._slots: dict[str, _Slot] = {}
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._closed = False
        self._workers = [
            threading.Thread(target=self._work, name=f"fit-job-{i}", daemon=True)
            for i in range(settings.fit_max_running_jobs)
        ]
        for worker in self._workers:
            worker.start()

    @property
    def capacity(self) -> int:
        return self._settings.fit_max_running_jobs + self._settings.fit_max_queued_jobs

    # -- reads ---------------------------------------------------------------------------------------

    def get(self, job_id: str) -> FitJobView:
        """Raises NotFoundError (FIT_JOB_NOT_FOUND)."""
        with self._sessions() as s:
            row = FitJobRepository(s).get(job_id)
            if row is None:
                raise NotFoundError(f"fitting job {job_id} not found", reason="FIT_JOB_NOT_FOUND")
            return FitJobView.of(row)

    def list(self, *, limit: int = 100) -> list[FitJobView]:
        with self._sessions() as s:
            return [FitJobView.of(r) for r in FitJobRepository(s).list(limit=limit)]

    def watch(self, job_id: str, *, active: Callable[[], bool] = lambda: True) -> Iterator[FitJobView]:
        """The job now, then at each change, until it is final or `active()` turns False."""
        last: FitJobView | None = None
        while True:
            view = self.get(job_id)
            if view != last:
                yield view
                last = view
            if view.phase.final or not active():
                return
            with self._changed:
                self._changed.wait(_WATCH_POLL_S)

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    # -- writes --------------------------------------------------------------------------------------

    def recover(self) -> int:
        """Mark this node's unfinished jobs FAILED "node restarted" (start-up). Returns how many."""
        n = run_serializable(
            self._serializable, lambda s: FitJobRepository(s).fail_unfinished(self._node, NODE_RESTARTED)
        )
        if n:
            log.warning("fit_jobs_failed_on_restart", jobs=n, node=self._node)
        return n

    def check(self, request: FitRequest) -> None:
        """What the node can check before admitting: the models are served, the budget is in the limit,
        a tokens file exists.

        Raises:
            NotFoundError: MODEL_NOT_SERVED.
            InvalidRequestError: a tokens file that is not there (field source).
            ResourceExhaustedError: REQUEST_TOO_LARGE, a budget over fit_max_budget_tokens.
        """
        for name in (request.sender_model, request.receiver_model):
            if name not in self._sources:
                raise model_not_served(name, sorted(self._sources))
        limit = self._settings.fit_max_budget_tokens
        if request.budget_tokens > limit:
            raise ResourceExhaustedError(
                f"budget_tokens={request.budget_tokens} exceeds this node's fit_max_budget_tokens={limit}",
                reason="REQUEST_TOO_LARGE", field="budget_tokens",
            )
        if request.source["kind"] == "tokens_file":
            try:
                resolve_tokens_file(str(request.source["path"]), self._settings.data_dir)
            except ValueError as exc:
                raise InvalidRequestError(str(exc), field="source") from exc

    def start(self, request: FitRequest, *, actor: str, resubmitted_from: str | None = None) -> FitJobView:
        """Admit and queue a job.

        Raises:
            NotFoundError, InvalidRequestError: see `check`.
            ResourceExhaustedError: CAPACITY, this node's queue is full.
            PreconditionError: the service is closed.
        """
        self.check(request)
        sub = FitJobSubmission(
            sender_model=request.sender_model, receiver_model=request.receiver_model,
            source=request.stored_source(), budget_tokens=request.budget_tokens, gate=dict(request.gate),
            actor=actor, node=self._node, resubmitted_from=resubmitted_from,
        )
        with self._lock:
            if self._closed:
                raise UnavailableError("the fitting service is shutting down")
            if len(self._slots) >= self.capacity:
                raise ResourceExhaustedError(
                    f"{len(self._slots)} fitting jobs are running or queued on this node, the limit "
                    f"(fit_max_running_jobs + fit_max_queued_jobs) is {self.capacity}",
                    reason="CAPACITY", retry_after_s=5.0,
                )
            view = run_serializable(
                self._serializable,
                lambda s: FitJobView.of(FitJobRepository(s).create(sub, rows_total=request.plan.rows_total)),
            )
            self._slots[view.job_id] = _Slot(job_id=view.job_id)
        self._queue.put(view.job_id)
        log.info("fit_job_queued", job=view.job_id, sender=sub.sender_model, receiver=sub.receiver_model,
                 budget_tokens=sub.budget_tokens, actor=actor)
        return view

    def resubmit(self, job_id: str, *, actor: str) -> FitJobView:
        """Run an ended job again with its parameters (a new job naming it in `resubmitted_from`).

        Raises:
            NotFoundError: FIT_JOB_NOT_FOUND. PreconditionError: the job has not ended.
        """
        old = self.get(job_id)
        if not old.phase.final:
            raise PreconditionError(f"fitting job {job_id} is {old.phase.value}; only an ended job can be "
                                    "resubmitted", reason="STATE_CHANGED")
        return self.start(old.request, actor=actor, resubmitted_from=job_id)

    def cancel(self, job_id: str, *, actor: str) -> FitJobView:
        """Stop a job: a queued one never starts, a running one's child is killed; CANCELLED.

        Raises:
            NotFoundError: FIT_JOB_NOT_FOUND.
            PreconditionError: STATE_CHANGED, the job ended otherwise or runs on another node.
        """
        view = self.get(job_id)
        if view.phase == FitJobPhase.CANCELLED:
            return view
        if view.phase.final:
            raise PreconditionError(f"fitting job {job_id} already ended {view.phase.value}",
                                    reason="STATE_CHANGED")
        with self._lock:
            slot = self._slots.get(job_id)
            if slot is None:
                raise PreconditionError(f"fitting job {job_id} runs on node {view.node!r}, not this one",
                                        reason="STATE_CHANGED")
            # The final row first: a progress line the child writes before it dies is then ignored.
            self._finish(job_id, FitJobPhase.CANCELLED, reason=f"cancelled by {actor}")
            slot.ended = True
            if slot.proc is not None:
                slot.proc.kill()
        self._notify()
        log.info("fit_job_cancelled", job=job_id, actor=actor)
        return self.get(job_id)

    def close(self) -> None:
        """Stop the workers and the children; their jobs end FAILED "node stopped"."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for slot in self._slots.values():
                if not slot.ended:
                    self._finish(slot.job_id, FitJobPhase.FAILED, reason=NODE_STOPPED)
                    slot.ended = True
                if slot.proc is not None:
                    slot.proc.kill()
        for _ in self._workers:
            self._queue.put(None)
        for worker in self._workers:
            worker.join(timeout=10)
        self._notify()

    # -- the workers ---------------------------------------------------------------------------------

    def _finish(self, job_id: str, phase: FitJobPhase, *, reason: str, **outcome: Any) -> bool:
        return run_serializable(
            self._serializable,
            lambda s: FitJobRepository(s).finish(job_id, phase, reason=reason, **outcome) is not None,
        )

    def _set_phase(self, job_id: str, phase: FitJobPhase, *, notify: bool = True) -> None:
        run_serializable(self._serializable, lambda s: FitJobRepository(s).set_phase(job_id, phase))
        if notify:
            self._notify()

    def _progress(self, job_id: str, done: int, total: int, eta_s: float | None) -> None:
        run_serializable(
            self._serializable,
            lambda s: FitJobRepository(s).progress(job_id, rows_done=done, rows_total=total, eta_s=eta_s),
        )
        self._notify()

    def _work(self) -> None:
        while True:
            job_id = self._queue.get()
            if job_id is None:
                return
            try:
                self._run(job_id)
            except Exception as exc:  # a bug here must end the job, never the worker
                log.exception("fit_job_crashed", job=job_id)
                self._finish(job_id, FitJobPhase.FAILED, reason=f"internal error: {exc!r}")
            finally:
                with self._lock:
                    self._slots.pop(job_id, None)
                self._notify()

    def _spec(self, view: FitJobView, job_dir: Path) -> dict[str, Any]:
        s = self._settings
        return {
            "job_id": view.job_id,
            "request": view.request.to_json(),
            "sender": {"name": view.sender_model, "source": self._sources[view.sender_model]},
            "receiver": {"name": view.receiver_model, "source": self._sources[view.receiver_model]},
            "device": s.model_device,
            "kernel_backend": s.model_kernel_backend,
            "cpu_path": resolve_cpu_path(s.model_numerics),
            # the served math, so the artifact records the fingerprints the node serves under
            "linear_math": s.model_math,
            "threads": s.fit_threads,
            "data_dir": str(s.data_dir.resolve()),
            "out_dir": str((job_dir / "artifact").resolve()),
        }

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        cpu_path = resolve_cpu_path(self._settings.model_numerics)
        if cpu_path in PINNED_ENVS:
            env.update(PINNED_ENVS[cpu_path])
        threads = str(self._settings.fit_threads)
        # OpenMP starts with one thread under the portable profile; intra-op threads are set in the child.
        env.setdefault("OMP_NUM_THREADS", "1")
        env["MKL_NUM_THREADS"] = threads
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH", "")]))
        return env

    def _run(self, job_id: str) -> None:
        with self._lock:
            slot = self._slots.get(job_id)
            if slot is None or slot.ended or self._closed:
                return
            view = self.get(job_id)
            if view.phase != FitJobPhase.QUEUED:
                return
            job_dir = self._settings.data_dir / "fit_jobs" / job_id
            job_dir.mkdir(parents=True, exist_ok=True)
            spec_path = job_dir / "spec.json"
            spec_path.write_text(json.dumps(self._spec(view, job_dir), indent=2, sort_keys=True))
            self._set_phase(job_id, FitJobPhase.RUNNING, notify=False)
            with open(job_dir / "child.log", "w") as log_file:
                slot.proc = subprocess.Popen(
                    [self._python, "-m", "orchestrator.jobs.child", str(spec_path)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file, text=True,
                    cwd=_REPO_ROOT, env=self._env(),
                )
        self._notify()
        log.info("fit_job_started", job=job_id, pid=slot.proc.pid)
        result, error = self._follow(job_id, slot.proc)
        rc = slot.proc.wait()
        assert slot.proc.stdin is not None
        slot.proc.stdin.close()
        if slot.ended:
            return
        if result is not None:
            self._conclude(job_id, result, job_dir)
            return
        if error is None:
            tail = (job_dir / "child.log").read_text(errors="replace").strip().splitlines()[-1:]
            error = f"child process exited with code {rc}" + (f": {tail[0]}" if tail else "")
        self._finish(job_id, FitJobPhase.FAILED, reason=error)
        log.warning("fit_job_failed", job=job_id, reason=error)

    def _follow(self, job_id: str, proc: subprocess.Popen[str]) -> tuple[dict[str, Any] | None, str | None]:
        """Read the child's events into SQL until it closes stdout. Returns (result, error message).

        Progress reaches SQL at most every _PROGRESS_INTERVAL_S; a report held back by that limit is
        written when the interval has passed even if the child says nothing more (a reader thread feeds
        the lines, so this loop wakes on time)."""
        assert proc.stdout is not None
        stdout = proc.stdout
        lines: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            for line in stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, name=f"fit-job-read-{job_id[:8]}", daemon=True).start()
        eta = EtaEstimator(self._clock)
        last_write = -1e9
        pending: tuple[int, int, float | None] | None = None
        result: dict[str, Any] | None = None
        while True:
            wait = max(0.0, last_write + _PROGRESS_INTERVAL_S - self._clock()) if pending else None
            try:
                line = lines.get(timeout=wait)
            except queue.Empty:
                line = ""
            if pending is not None and (line is None or self._clock() - last_write >= _PROGRESS_INTERVAL_S):
                last_write = self._clock()
                self._progress(job_id, *pending)
                pending = None
            if line is None:
                return result, None
            if not line:
                continue
            try:
                event = parse_event(line)
            except ValueError as exc:
                proc.kill()
                return None, str(exc)
            kind = event["event"]
            if kind == "progress":
                done, total = event["rows_done"], event["rows_total"]
                pending = (done, total, eta.update(done, total))
                if self._clock() - last_write >= _PROGRESS_INTERVAL_S or done == total:
                    last_write = self._clock()
                    self._progress(job_id, *pending)
                    pending = None
            elif kind == "phase" and event["phase"] == "evaluating":
                self._set_phase(job_id, FitJobPhase.EVALUATING)
            elif kind == "error":
                return None, str(event.get("message", "the child reported an error"))
            elif kind == "result":
                result = event

    def _conclude(self, job_id: str, result: dict[str, Any], job_dir: Path) -> None:
        """Register a passing artifact and end SUCCEEDED, or end REJECTED with the failed conditions; one
        transaction, so a registered mapper always has its job SUCCEEDED."""
        fields = dict(result["registration"])
        passed = bool(result["passed_gate"])
        metrics = {str(k): float(v) for k, v in dict(result["metrics"]).items()}
        artifact = str(fields.get("artifact_uri", ""))
        failures = list(result.get("failures") or [])

        def work(s: Session) -> bool:
            jobs = FitJobRepository(s)
            if passed:
                reg = MapperRegistration(**fields)
                done = jobs.finish(job_id, FitJobPhase.SUCCEEDED, reason=f"registered {reg.mapper_id}",
                                   metrics=metrics, passed_gate=True, mapper_id=reg.mapper_id,
                                   artifact_uri=artifact)
                if done is not None:
                    MapperRepository(s).register(reg)
                return done is not None
            why = "; ".join(failures) or "the gate states no measured figure >= threshold"
            done = jobs.finish(job_id, FitJobPhase.REJECTED, reason=f"gate not passed: {why}",
                               metrics=metrics, passed_gate=False, artifact_uri=artifact)
            return done is not None

        if run_serializable(self._serializable, work):
            log.info("fit_job_done", job=job_id, passed_gate=passed, artifact=artifact)
