"""FitJobService against a stand-in child process (a script speaking the job protocol), to reach the
outcomes a real fit rarely gives on demand: a crash, protocol garbage, a reported error, a rejection, a
pass, and a node that stops mid-job. The real child runs in tests/orchestrator/test_e2e_fit_jobs.py.
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from orchestrator.api import ResourceExhaustedError
from orchestrator.db import MapperRepository, make_engine, make_session_factory, serializable_factory, upgrade
from orchestrator.db.models import FitJobPhase
from orchestrator.db.repositories import FitJobRepository, FitJobSubmission
from orchestrator.jobs import NODE_STOPPED, FitJobService, FitJobView, FitRequest
from orchestrator.settings import Settings

# Invoked as `<script> -m orchestrator.jobs.child SPEC`; does what data_dir/behaviour.json says.
_FAKE = textwrap.dedent(
    """\
    #!{python}
    import json, sys, time
    from pathlib import Path
    spec = json.loads(Path(sys.argv[3]).read_text())
    what = json.loads((Path(spec["data_dir"]) / "behaviour.json").read_text())
    def emit(**e):
        print(json.dumps(e), flush=True)
    total = spec["request"]["budget_tokens"]
    emit(event="phase", phase="running")
    emit(event="progress", rows_done=0, rows_total=total)
    emit(event="progress", rows_done=total // 2, rows_total=total)
    kind = what["kind"]
    if kind == "crash":
        print("Traceback ...\\nRuntimeError: boom", file=sys.stderr, flush=True)
        sys.exit(3)
    if kind == "garbage":
        print("loading weights...", flush=True)
        time.sleep(60)
    if kind == "error":
        emit(event="error", message="ValueError: calibration token ids must be in [0, 512)")
        sys.exit(1)
    if kind == "hang":
        time.sleep(60)
    emit(event="progress", rows_done=total, rows_total=total)
    emit(event="phase", phase="evaluating")
    # optionally stay in evaluating until the test lets go (a watcher polls: a phase that passes at once
    # may never be seen)
    release = what.get("release")
    while release and not Path(release).exists():
        time.sleep(0.02)
    emit(event="result", passed_gate=what["passed"], failures=what.get("failures", []),
         metrics={{"attn_cosine_mean": 0.95}}, artifact_dir="/nowhere", registration=what["registration"])
    """
)


def _registration(passed: bool) -> dict:
    return {
        "mapper_id": "s->r@abc", "sender_model": "s", "receiver_model": "r", "artifact_uri": "/nowhere",
        "artifact_sha256": "ab" * 32, "kind": "linear", "metrics": {"attn_cosine_mean": 0.95},
        "gate_metric": "attn_cosine_mean", "gate_threshold": 0.9, "passed_gate": passed,
    }


@pytest.fixture
def service(tmp_path: Path, sqlite_url: str) -> Iterator[tuple[FitJobService, Path]]:
    fake = tmp_path / "fake_child"
    fake.write_text(_FAKE.format(python=sys.executable))
    fake.chmod(0o755)
    engine = make_engine(sqlite_url)
    settings = Settings(data_dir=tmp_path, database_url=sqlite_url, fit_max_running_jobs=1,
                        fit_max_queued_jobs=1, model_numerics="native")
    svc = FitJobService(
        settings=settings, sessions=make_session_factory(engine), serializable=serializable_factory(engine),
        node="n1", model_sources={"s": "random:v41-tiny@1", "r": "random:v41-tiny@2"}, python=str(fake),
    )
    try:
        yield svc, tmp_path
    finally:
        svc.close()
        engine.dispose()


def _behave(data_dir: Path, **what: object) -> None:
    (data_dir / "behaviour.json").write_text(json.dumps(what))


def _request() -> FitRequest:
    return FitRequest(sender_model="s", receiver_model="r", source={"kind": "corpus", "name": "random"},
                      budget_tokens=512)


def _final(svc: FitJobService, job_id: str) -> FitJobView:
    views = list(svc.watch(job_id))
    assert views[-1].phase.final
    return views[-1]


def test_a_crashed_child_fails_the_job_with_its_last_words(service) -> None:
    svc, d = service
    _behave(d, kind="crash")
    job = _final(svc, svc.start(_request(), actor="admin").job_id)
    assert job.phase == FitJobPhase.FAILED
    assert job.reason == "child process exited with code 3: RuntimeError: boom"
    assert job.rows_done == 256 and job.started_at is not None and job.finished_at is not None


def test_protocol_garbage_and_reported_errors_fail_the_job(service) -> None:
    svc, d = service
    _behave(d, kind="garbage")
    t0 = time.monotonic()
    job = _final(svc, svc.start(_request(), actor="admin").job_id)
    assert job.phase == FitJobPhase.FAILED and "not JSON" in job.reason and "loading weights" in job.reason
    assert time.monotonic() - t0 < 30  # the child was killed, not waited for
    _behave(d, kind="error")
    job = _final(svc, svc.start(_request(), actor="admin").job_id)
    assert job.phase == FitJobPhase.FAILED
    assert job.reason == "ValueError: calibration token ids must be in [0, 512)"


def test_a_rejected_artifact_is_not_registered_and_a_passing_one_is(service) -> None:
    svc, d = service
    _behave(d, kind="done", passed=False, failures=["attn_cosine_mean=0.1 fails min_attn_cosine=0.9"],
            registration=_registration(False))
    job = _final(svc, svc.start(_request(), actor="admin").job_id)
    assert job.phase == FitJobPhase.REJECTED and job.passed_gate is False and job.mapper_id == ""
    assert job.reason == "gate not passed: attn_cosine_mean=0.1 fails min_attn_cosine=0.9"
    assert job.metrics == {"attn_cosine_mean": 0.95} and job.rows_done == job.rows_total == 512
    with svc._sessions() as s:
        assert MapperRepository(s).list() == []
    release = d / "release-evaluation"
    _behave(d, kind="done", passed=True, registration=_registration(True), release=str(release))
    views = []
    for view in svc.watch(svc.start(_request(), actor="admin").job_id):
        views.append(view)
        if view.phase == FitJobPhase.EVALUATING:
            release.touch()
    phases = [v.phase for v in views]
    assert phases[-1] == FitJobPhase.SUCCEEDED and FitJobPhase.EVALUATING in phases
    assert views[-1].mapper_id == "s->r@abc" and views[-1].reason == "registered s->r@abc"
    with svc._sessions() as s:
        (row,) = MapperRepository(s).list()
        assert (row.id, row.passed_gate, row.gate_metric) == ("s->r@abc", True, "attn_cosine_mean")


def test_admission_is_bounded_and_stopping_the_node_fails_its_jobs(service) -> None:
    svc, d = service
    _behave(d, kind="hang")
    running = svc.start(_request(), actor="admin")
    queued = svc.start(_request(), actor="admin")
    with pytest.raises(ResourceExhaustedError, match="limit .* is 2") as info:
        svc.start(_request(), actor="admin")
    assert info.value.reason == "CAPACITY" and info.value.retry_after_s
    deadline = time.monotonic() + 30
    while svc.get(running.job_id).rows_done == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    svc.close()
    for job_id in (running.job_id, queued.job_id):
        job = svc.get(job_id)
        assert (job.phase, job.reason) == (FitJobPhase.FAILED, NODE_STOPPED)
    assert svc.get(queued.job_id).started_at is None


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_final_phase_is_never_left(backend: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue(f"{backend}_url")
    upgrade(url)  # a no-op on the migrated SQLite fixture; the PostgreSQL schema starts empty
    engine = make_engine(url)
    with Session(engine) as s, s.begin():
        repo = FitJobRepository(s)
        job = repo.create(FitJobSubmission(sender_model="s", receiver_model="r", source={}, budget_tokens=1,
                                           node="n1"), rows_total=256)
        assert repo.progress(job.id, rows_done=10, rows_total=256, eta_s=2.0)
        with pytest.raises(ValueError, match="rows_done=300 of rows_total=256"):
            repo.progress(job.id, rows_done=300, rows_total=256, eta_s=None)
        assert repo.finish(job.id, FitJobPhase.CANCELLED, reason="cancelled by admin") is not None
        assert not repo.progress(job.id, rows_done=20, rows_total=256, eta_s=1.0)
        assert repo.set_phase(job.id, FitJobPhase.EVALUATING) is None
        assert repo.finish(job.id, FitJobPhase.SUCCEEDED, reason="late") is None
        assert repo.fail_unfinished("n1", "node restarted") == 0
        with pytest.raises(ValueError, match="final phase"):
            repo.finish(job.id, FitJobPhase.RUNNING, reason="x")
        row = repo.get(job.id)
        assert row is not None and (row.phase, row.reason, row.rows_done) == (FitJobPhase.CANCELLED,
                                                                                "cancelled by admin", 10)
        # Start-up recovery fails exactly the node's unfinished rows.
        sub = FitJobSubmission(sender_model="s", receiver_model="r", source={}, budget_tokens=1, node="n1")
        queued, running = repo.create(sub).id, repo.create(sub).id
        repo.set_phase(running, FitJobPhase.RUNNING)
        other = repo.create(FitJobSubmission(sender_model="s", receiver_model="r", source={}, budget_tokens=1,
                                             node="n2")).id
        assert repo.fail_unfinished("n1", "node restarted") == 2
        s.expire_all()
        assert [(r.id, r.phase) for r in repo.unfinished("n2")] == [(other, FitJobPhase.QUEUED)]
        assert repo.unfinished("n1") == []
        for job_id in (queued, running):
            row = repo.get(job_id)
            assert row is not None and (row.phase, row.reason) == (FitJobPhase.FAILED, "node restarted")
            assert row.finished_at is not None
    engine.dispose()
