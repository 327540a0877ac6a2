"""Mapper fitting jobs over real gRPC: a node serving the shipped siblings (v41-sib-s, v41-sib-l) fits
in a real child process (`orchestrator.jobs.child`, the library's `fit_mapper`) with a small token
budget; jobs are started, watched, cancelled, refused, and survive a kill -9 of a real `kvresume serve`
as FAILED rows that can be resubmitted. The CLI's `mapper fit --target` / `mapper list --target` run
against the same kind of server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from sqlalchemy.orm import Session

from kvresume import Client, error_details
from kvresume.v1 import mappers_pb2
from mappers import load_mapper
from orchestrator.cli import main as cli_main
from orchestrator.db import make_engine, upgrade
from orchestrator.db.models import FitJobPhase
from orchestrator.db.repositories import FitJobRepository, FitJobSubmission
from orchestrator.engine import ModelRegistry, ServedModelSpec
from orchestrator.jobs import runner as job_runner
from tests.orchestrator.engine.node_harness import ADMIN, Node, admin_md, md, start_node

REPO = Path(__file__).resolve().parents[2]
CKPT = REPO / "checkpoints"
S, L = "v41-sib-s", "v41-sib-l"
PHASES = ["QUEUED", "RUNNING", "EVALUATING", "SUCCEEDED"]
# The screens only (the retention gate needs recall episodes; the job's gate is checked, not the pair's
# quality): thresholds every fitted ridge of this pair meets on random calibration text.
LENIENT = {"min_attn_cosine": 0.0, "max_next_token_kl": 100.0, "min_index_recall": 0.0}
# One held-out prompt for the screens keeps each job's evaluation short.
SHORT = {"eval_prompts": 1}


def _siblings() -> ModelRegistry:
    return ModelRegistry({n: ServedModelSpec(name=n, checkpoint=CKPT / n) for n in (S, L)})


def _gate(**extra: Any) -> mappers_pb2.FitGate:
    gate = mappers_pb2.FitGate(**(LENIENT | SHORT | extra))
    gate.disabled.extend(_retention_defaults())
    return gate


def _retention_defaults() -> list[str]:
    """Thresholds the library's GateSpec sets by default that need recall episodes (none, or the
    retention interval's lower end): turned off here, where the screens alone are under test."""
    from mappers import GateSpec

    return [n for n in ("min_retention", "min_retention_lower") if getattr(GateSpec(), n, None) is not None]


def _start(node_mappers: Any, *, budget: int = 512, gate: mappers_pb2.FitGate | None = None,
           metadata: Any = None, **fields: Any) -> Any:
    request = mappers_pb2.StartFitRequest(
        sender_model=fields.pop("sender", S), receiver_model=fields.pop("receiver", L),
        source=mappers_pb2.CalibrationSource(corpus=mappers_pb2.CalibrationCorpus(name="random", seed=7)),
        budget_tokens=budget, sequence_tokens=fields.pop("sequence_tokens", 128),
        gate=gate if gate is not None else _gate(), **fields,
    )
    return node_mappers.StartFit(request, metadata=metadata or admin_md())


def _phase(job: Any) -> str:
    return mappers_pb2.FitJobPhase.Name(job.phase).removeprefix("FIT_JOB_PHASE_")


def _wait(stub: Any, job_id: str, until: Any, timeout_s: float = 120.0, metadata: Any = None) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        job = stub.GetJob(mappers_pb2.GetJobRequest(job_id=job_id), metadata=metadata or admin_md())
        if until(job):
            return job
        assert time.monotonic() < deadline, f"job {job_id} stuck at {_phase(job)} {job.rows_done}"
        time.sleep(0.05)


def _children(job_id: str) -> list[int]:
    """PIDs of live processes running this job's child (its spec path is on their command line)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().split()[2]
        except OSError:
            continue
        if "orchestrator.jobs.child" in cmdline and job_id in cmdline and state != "Z":
            pids.append(int(proc.name))
    return pids


def _gone(job_id: str, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while _children(job_id):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _err(call: Any) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    d = error_details(info.value)
    return info.value.code(), d.reason, dict(d.metadata)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = start_node(tmp_path_factory.mktemp("fit"), _siblings(), fit_max_running_jobs=1, fit_max_queued_jobs=1,
                   fit_max_budget_tokens=200_000)
    try:
        yield n
    finally:
        n.stop()


def test_a_job_is_watched_through_its_phases_and_registers_its_mapper(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every progress line reaches SQL: the node's throttle (one write per 0.25 s, the last always) would
    # otherwise leave only 0 and the total when the child captures this small budget faster than that
    # (seen on a fast CPU), and the watch below checks that it streams the progress in between.
    monkeypatch.setattr(job_runner, "_PROGRESS_INTERVAL_S", 0.0)
    job = _start(node.mappers)
    assert _phase(job) == "QUEUED" and job.rows_total == 512 and job.node and job.fallback == "none"
    states = list(node.mappers.WatchJob(mappers_pb2.WatchJobRequest(job_id=job.job_id), metadata=admin_md()))
    phases = [_phase(s) for s in states]
    # Every phase once, in order (a watcher may miss QUEUED when the worker was quicker than the stream).
    assert [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p] in (PHASES, PHASES[1:])
    rows = [s.rows_done for s in states]
    assert rows == sorted(rows) and rows[-1] == 512 and len(set(rows)) >= 3, rows
    assert any(s.HasField("eta_s") for s in states if _phase(s) == "RUNNING")
    final = states[-1]
    assert final.passed_gate and final.mapper_id and final.reason == f"registered {final.mapper_id}"
    assert final.metrics["attn_cosine_mean"] > 0 and final.finished_at.seconds >= final.started_at.seconds
    # Registered with its figures, under the served names, and the artifact is the library's own format.
    mapper = node.mappers.GetMapper(mappers_pb2.GetMapperRequest(mapper_id=final.mapper_id), metadata=md())
    assert (mapper.sender_model, mapper.receiver_model, mapper.passed_gate) == (S, L, True)
    assert mapper.metrics["attn_cosine_mean"] == pytest.approx(final.metrics["attn_cosine_mean"])
    artifact = load_mapper(mapper.artifact_uri)
    served = node.service.registry.get(S)
    assert served is not None and artifact.passed_gate
    assert artifact.sender.fingerprint == served.fingerprint_hex
    assert not _children(job.job_id)
    # The child ran under the thread cap (fit_threads, default 1) at a lower priority than the node.
    log = (node.service.ctx.settings.data_dir / "fit_jobs" / job.job_id / "child.log").read_text()
    assert f"fit job {job.job_id}: torch threads 1, OMP_NUM_THREADS=1, nice {min(19, os.nice(0) + 10)}" in log
    listed = node.mappers.ListJobs(mappers_pb2.ListJobsRequest(), metadata=admin_md()).jobs
    assert job.job_id in [j.job_id for j in listed]


def test_cancel_kills_the_child_and_admission_is_bounded(node: Node) -> None:
    big = _start(node.mappers, budget=100_000)
    # the one queue place (fit_max_queued_jobs=1); its map options come back as given
    queued = _start(node.mappers, budget=100_000, fallback="mlp", attention_weighted=True)
    assert queued.fallback == "mlp" and queued.attention_weighted and not big.attention_weighted
    code, reason, _ = _err(lambda: _start(node.mappers))
    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "CAPACITY")
    # Cancelled as soon as its child runs (progress itself is the first test's subject).
    running = _wait(node.mappers, big.job_id, lambda j: _phase(j) == "RUNNING" and bool(_children(j.job_id)))
    # The queued one is cancelled before it ever starts (the one worker is busy).
    q = node.mappers.CancelJob(mappers_pb2.CancelJobRequest(job_id=queued.job_id), metadata=admin_md())
    assert _phase(q) == "CANCELLED" and q.started_at.seconds == 0 and not _children(queued.job_id)
    done = node.mappers.CancelJob(mappers_pb2.CancelJobRequest(job_id=big.job_id), metadata=admin_md())
    assert _phase(done) == "CANCELLED" and done.reason == "cancelled by admin"
    assert done.rows_done >= running.rows_done and done.finished_at.seconds > 0
    assert _gone(big.job_id), "the cancelled job's child process still runs"
    # Cancelling again is a no-op.
    again = node.mappers.CancelJob(mappers_pb2.CancelJobRequest(job_id=big.job_id), metadata=admin_md())
    assert _phase(again) == "CANCELLED"
    stored = node.mappers.GetJob(mappers_pb2.GetJobRequest(job_id=queued.job_id), metadata=admin_md())
    assert _phase(stored) == "CANCELLED" and stored.attention_weighted and stored.fallback == "mlp"
    time.sleep(0.3)
    late = node.mappers.GetJob(mappers_pb2.GetJobRequest(job_id=big.job_id), metadata=admin_md())
    assert _phase(late) == "CANCELLED" and not late.mapper_id  # nothing the dying child said overwrote it


def test_bad_requests_have_their_status_and_reason(node: Node) -> None:
    m = node.mappers
    code, reason, _ = _err(lambda: _start(m, sender="nope"))
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "MODEL_NOT_SERVED")
    code, reason, meta = _err(lambda: _start(m, budget=0))
    assert (code, reason, meta.get("field")) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT",
                                                 "budget_tokens")
    code, _, meta = _err(lambda: _start(m, budget=100))  # less than two sequences of 128
    assert (code, meta.get("field")) == (grpc.StatusCode.INVALID_ARGUMENT, "budget_tokens")
    code, reason, meta = _err(lambda: _start(m, budget=10_000_000))  # over fit_max_budget_tokens
    assert (code, reason, meta.get("field")) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "REQUEST_TOO_LARGE",
                                                 "budget_tokens")
    code, reason, _ = _err(lambda: m.ListJobs(mappers_pb2.ListJobsRequest(limit=5000), metadata=admin_md()))
    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "REQUEST_TOO_LARGE")
    code, _, _ = _err(lambda: _start(m, sender=L))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _, meta = _err(lambda: m.StartFit(mappers_pb2.StartFitRequest(
        sender_model=S, receiver_model=L, budget_tokens=512,
        source=mappers_pb2.CalibrationSource(corpus=mappers_pb2.CalibrationCorpus(name="wiki"))),
        metadata=admin_md()))
    assert (code, meta.get("field")) == (grpc.StatusCode.INVALID_ARGUMENT, "source")
    code, _, meta = _err(lambda: m.StartFit(mappers_pb2.StartFitRequest(
        sender_model=S, receiver_model=L, budget_tokens=512), metadata=admin_md()))
    assert (code, meta.get("field")) == (grpc.StatusCode.INVALID_ARGUMENT, "source")
    code, _, meta = _err(lambda: m.StartFit(mappers_pb2.StartFitRequest(
        sender_model=S, receiver_model=L, budget_tokens=512,
        source=mappers_pb2.CalibrationSource(tokens_file="missing.json")), metadata=admin_md()))
    assert (code, meta.get("field")) == (grpc.StatusCode.INVALID_ARGUMENT, "source")
    code, _, _ = _err(lambda: _start(m, gate=mappers_pb2.FitGate(min_retention=0.9)))  # no episodes
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _, meta = _err(lambda: _start(m, fallback="tree"))
    assert (code, meta.get("field")) == (grpc.StatusCode.INVALID_ARGUMENT, "fallback")
    code, _, meta = _err(lambda: _start(m, gate=mappers_pb2.FitGate(disabled=["max_kl"])))
    assert (code, meta.get("field")) == (grpc.StatusCode.INVALID_ARGUMENT, "gate")
    unknown = "0" * 32
    for call in (
        lambda: m.GetJob(mappers_pb2.GetJobRequest(job_id=unknown), metadata=admin_md()),
        lambda: m.CancelJob(mappers_pb2.CancelJobRequest(job_id=unknown), metadata=admin_md()),
        lambda: list(m.WatchJob(mappers_pb2.WatchJobRequest(job_id=unknown), metadata=admin_md())),
        lambda: m.StartFit(mappers_pb2.StartFitRequest(resubmit_job_id=unknown), metadata=admin_md()),
    ):
        code, reason, _ = _err(call)
        assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "FIT_JOB_NOT_FOUND")
    code, reason, _ = _err(lambda: m.GetJob(mappers_pb2.GetJobRequest(), metadata=admin_md()))
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
    code, _, meta = _err(lambda: m.StartFit(mappers_pb2.StartFitRequest(
        resubmit_job_id="0" * 32, budget_tokens=512), metadata=admin_md()))
    assert (code, meta.get("field")) == (grpc.StatusCode.INVALID_ARGUMENT, "budget_tokens")
    # Fitting is an admin operation (as RegisterMapper): a tenant's token is refused, no token too.
    code, reason, _ = _err(lambda: _start(m, metadata=md()))
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED")
    code, reason, _ = _err(lambda: m.ListJobs(mappers_pb2.ListJobsRequest(), metadata=md("globex")))
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED")
    code, _, _ = _err(lambda: m.GetJob(mappers_pb2.GetJobRequest(job_id="x")))
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_cli_fit_and_list_through_the_api(node: Node, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    target = f"127.0.0.1:{node.server.port}"
    monkeypatch.setenv("KVRESUME_ADMIN_TOKEN", ADMIN)
    out = tmp_path / "out.json"

    def run(*argv: str) -> tuple[int, Any]:
        # JSON to a file: this process's stdout also carries the in-process server's log lines.
        out.unlink(missing_ok=True)
        rc = cli_main([*argv, "--json", str(out)])
        return rc, json.loads(out.read_text())

    # A gate no ridge meets: the job is REJECTED with its figures, and --require-gate makes it exit 1.
    rc, job = run("mapper", "fit", "--target", target, "--sender", S, "--receiver", L,
                  "--budget-tokens", "512", "--seed", "3", "--eval-prompts", "1",
                  "--gate-attn-cosine", "0.9999", "--gate-next-token-kl", "100", "--gate-index-recall", "0",
                  *[a for n in _retention_defaults() for a in ("--gate-off", n)], "--require-gate")
    err = capsys.readouterr().err
    assert rc == 1 and job["phase"] == "FIT_JOB_PHASE_REJECTED" and job["passed_gate"] is False
    assert "attn_cosine_mean" in job["reason"] and job["metrics"]["attn_cosine_mean"] < 0.9999
    assert job["mapper_id"] == "" and "RUNNING" in err and f"/{job['rows_total']} rows" in err
    # Run again from the server's record: same parameters, a new job naming the old one.
    rc, again = run("mapper", "fit", "--target", target, "--resubmit", job["job_id"], "--detach")
    assert rc == 0 and again["resubmitted_from"] == job["job_id"] and again["budget_tokens"] == "512"
    assert again["gate"]["min_attn_cosine"] == 0.9999 and again["source"]["corpus"]["seed"] == "3"
    rc, cancelled = run("mapper", "job", "cancel", again["job_id"], "--target", target)
    assert rc == 0 and cancelled["phase"] == "FIT_JOB_PHASE_CANCELLED"
    for command in ("get", "watch"):  # an ended job: watch prints its final state at once
        rc, got = run("mapper", "job", command, job["job_id"], "--target", target)
        assert rc == 0 and got["phase"] == "FIT_JOB_PHASE_REJECTED" and got["reason"] == job["reason"]
    rc, jobs = run("mapper", "job", "list", "--target", target)
    assert rc == 0 and {job["job_id"], again["job_id"]} <= {j["job_id"] for j in jobs["jobs"]}
    # `mapper list --target` lists the registered mappers through the API (no folder argument).
    monkeypatch.setenv("KVRESUME_TOKEN", "tok-acme")
    rc, listed = run("mapper", "list", "--target", target)
    registered = node.mappers.ListMappers(mappers_pb2.ListMappersRequest(), metadata=md()).mappers
    assert rc == 0 and sorted(m["mapper_id"] for m in listed.get("mappers", [])) == sorted(
        m.mapper_id for m in registered
    )


def test_the_remote_cli_commands_load_no_model_stack(node: Node) -> None:
    from tests.orchestrator.test_cli_light import _heavy_loaded, _light

    admin = ["--target", f"127.0.0.1:{node.server.port}", "--token", ADMIN]
    proc = _light("mapper", "fit", *admin, "--sender", S, "--receiver", L, "--budget-tokens", "512",
                  "--detach", "--json", "-")
    assert proc.returncode == 0, proc.stderr
    assert _heavy_loaded(proc) == []
    job = json.loads(proc.stdout)
    proc = _light("mapper", "job", "cancel", job["job_id"], *admin)
    assert proc.returncode == 0 and _heavy_loaded(proc) == [], proc.stderr
    assert f"job {job['job_id']}: CANCELLED (cancelled by admin)" in proc.stdout
    assert _gone(job["job_id"])


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_node_starting_fails_its_unfinished_jobs_and_they_can_be_resubmitted(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # The rows a node left when its process died mid-job (the kill -9 itself: the slow test below).
    url = f"sqlite:///{tmp_path / 'registry.sqlite3'}" if backend == "sqlite" else request.getfixturevalue(
        "postgres_url"
    )
    upgrade(url)
    engine = make_engine(url)
    sub = dict(sender_model=S, receiver_model=L, source={"kind": "corpus", "name": "random", "seed": 1,
               "sequence_tokens": 128}, budget_tokens=512, gate={"eval_prompts": 2, "task_episodes": 0})
    with Session(engine) as s, s.begin():
        repo = FitJobRepository(s)
        mine = [repo.create(FitJobSubmission(**sub, node="n1")).id for _ in range(3)]
        repo.set_phase(mine[1], FitJobPhase.RUNNING)
        repo.progress(mine[1], rows_done=256, rows_total=512, eta_s=1.0)
        repo.set_phase(mine[2], FitJobPhase.EVALUATING)
        other = repo.create(FitJobSubmission(**sub, node="n2")).id
        ended = repo.create(FitJobSubmission(**sub, node="n1")).id
        repo.finish(ended, FitJobPhase.REJECTED, reason="gate not passed: x")
    engine.dispose()
    n = start_node(tmp_path, _siblings(), database_url=url, node_name="n1")
    try:
        get = lambda job_id: n.mappers.GetJob(mappers_pb2.GetJobRequest(job_id=job_id), metadata=admin_md())  # noqa: E731
        for job_id in mine:
            job = get(job_id)
            assert (_phase(job), job.reason, job.node) == ("FAILED", "node restarted", "n1")
            assert not job.HasField("eta_s") and job.finished_at.seconds > 0
        assert get(mine[1]).rows_done == 256
        # Another node's job and an ended one are left as they were.
        assert _phase(get(other)) == "QUEUED" and _phase(get(ended)) == "REJECTED"
        again = n.mappers.StartFit(mappers_pb2.StartFitRequest(resubmit_job_id=mine[1]), metadata=admin_md())
        assert _phase(again) == "QUEUED" and again.resubmitted_from == mine[1] and again.node == "n1"
        assert again.source.corpus.seed == 1 and again.gate.eval_prompts == 2
        # Only an ended job is resubmitted; the running one is cancelled.
        code, reason, _ = _err(lambda: n.mappers.StartFit(
            mappers_pb2.StartFitRequest(resubmit_job_id=again.job_id), metadata=admin_md()))
        assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "STATE_CHANGED")
        code, reason, _ = _err(lambda: n.mappers.CancelJob(
            mappers_pb2.CancelJobRequest(job_id=other), metadata=admin_md()))
        assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "STATE_CHANGED")
        done = n.mappers.CancelJob(mappers_pb2.CancelJobRequest(job_id=again.job_id), metadata=admin_md())
        assert _phase(done) == "CANCELLED"
        assert _gone(again.job_id)
    finally:
        n.stop()


@pytest.mark.slow
def test_a_retention_gated_job_records_its_task_seed_and_eval_refuses_it(node: Node, tmp_path: Path) -> None:
    # The retention interval gates (mappers.GateSpec.min_retention_lower): this ridge on random text does
    # not pass it (the pair's own figures are helper E's); what is checked here is the job's pipeline.
    job = _start(node.mappers, gate=mappers_pb2.FitGate(task_episodes=4, task_seed=77, **LENIENT))
    watch = node.mappers.WatchJob(mappers_pb2.WatchJobRequest(job_id=job.job_id), metadata=admin_md())
    final = list(watch)[-1]
    assert _phase(final) in ("SUCCEEDED", "REJECTED")
    assert final.metrics["task_seed"] == 77 and final.metrics["task_episodes"] == 8  # 4 per bucket, 2 buckets
    assert "retention_ci_lower" in final.metrics
    if _phase(final) == "REJECTED":
        assert "retention_ci_lower" in final.reason and not final.mapper_id
    artifact = load_mapper(final.artifact_uri)
    assert artifact.fit_task_seeds == (77,) and artifact.calibration["fit_job"] == job.job_id
    assert artifact.calibration["corpus"] == {"kind": "corpus", "name": "random", "seed": 7}
    # `kvresume mapper eval` refuses to re-score the artifact on the episodes that gated it.
    out = tmp_path / "eval.json"
    assert cli_main(["mapper", "eval", final.artifact_uri, "--task-seed", "77", "--task-episodes", "4",
                     "--json", str(out)]) == 1
    assert not out.exists()


# -- a real `kvresume serve`, killed with SIGKILL mid-job, then restarted on the same data dir ------------


def _serve(data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    ready = data_dir / f"ready-{time.monotonic_ns()}.json"
    env = {
        **os.environ,
        "KVRESUME_TENANT_TOKENS": "acme=tok-acme",
        "KVRESUME_ADMIN_TOKEN": ADMIN,
        "KVRESUME_SERVED_MODELS": f"{S}=checkpoint:{CKPT / S},{L}=checkpoint:{CKPT / L}",
        "KVRESUME_NODE_NAME": "fit-node",
    }
    log = open(data_dir / "serve.log", "ab")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "serve", "--data-dir", str(data_dir), "--port", "0",
         "--metrics-port", "0", "--json", str(ready)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log,
    )
    deadline = time.monotonic() + 120
    while not ready.is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"serve did not start: {(data_dir / 'serve.log').read_text()[-2000:]}")
        time.sleep(0.1)
    return proc, json.loads(ready.read_text())["grpc"]


@pytest.mark.slow
def test_kill_9_of_the_node_marks_the_running_job_failed_and_it_can_be_resubmitted(tmp_path: Path) -> None:
    proc, target = _serve(tmp_path)
    try:
        with Client(target, token=ADMIN, timeout_s=30) as c:
            job = _start(c.mappers, budget=60_000)
            running = _wait(c.mappers, job.job_id, lambda j: _phase(j) == "RUNNING" and j.rows_done > 0)
            assert _children(job.job_id)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        # The child notices its parent's death (its stdin closes) and exits: no orphan keeps fitting.
        assert _gone(job.job_id), "the job's child outlived the killed node"
        proc, target = _serve(tmp_path)
        with Client(target, token=ADMIN, timeout_s=30) as c:
            failed = c.mappers.GetJob(mappers_pb2.GetJobRequest(job_id=job.job_id), metadata=c.metadata)
            assert _phase(failed) == "FAILED" and failed.reason == "node restarted"
            assert failed.rows_done >= running.rows_done and failed.node == "fit-node"
            again = c.mappers.StartFit(mappers_pb2.StartFitRequest(resubmit_job_id=job.job_id),
                                       metadata=c.metadata)
            assert again.resubmitted_from == job.job_id and again.budget_tokens == 60_000
            # It runs (a fresh child on the restarted node), then is cancelled to keep the test short.
            _wait(c.mappers, again.job_id, lambda j: _phase(j) == "RUNNING" and j.rows_done > 0)
            done = c.mappers.CancelJob(mappers_pb2.CancelJobRequest(job_id=again.job_id), metadata=c.metadata)
            assert _phase(done) == "CANCELLED"
            assert _gone(again.job_id)
    finally:
        proc.kill()
        proc.wait(timeout=30)
