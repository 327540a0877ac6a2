"""`kvresume mapper fit --target HOST:PORT` and `kvresume mapper job ...`: mapper fitting jobs on a
running server, through the Mappers API (light client: no model stack).

`mapper fit` with `--target` submits a job (StartFit) and follows it (WatchJob) with a progress bar on
stderr; without `--target` it fits locally (mapper_cmd.py). The admin token is needed, as for
RegisterMapper. Exit code: 0 when the job SUCCEEDED (or was REJECTED, unless --require-gate), 1 when it
was REJECTED under --require-gate, FAILED or CANCELLED.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from orchestrator.cli.command_parser import CommandParser
from orchestrator.cli.connection import ADMIN, add_connection_flags, connect
from orchestrator.cli.output import add_json_flag, fields_text, table_text, text_stream, write_json

__all__ = ["register_jobs", "route_fit_target", "progress_line"]

_PHASE_PREFIX = "FIT_JOB_PHASE_"
_GATE_FLAGS = (
    ("gate_attn_cosine", "min_attn_cosine"), ("gate_next_token_kl", "max_next_token_kl"),
    ("gate_index_recall", "min_index_recall"), ("gate_retention", "min_retention"),
    ("gate_retention_lower", "min_retention_lower"),
)
_BAR_WIDTH = 30


def _targets(args: Sequence[str]) -> bool:
    return any(a == "--target" or a.startswith("--target=") for a in args)


class _TargetRoutingParser(CommandParser):
    """`mapper fit`'s parser: with `--target` among its arguments it takes the remote options (light),
    else the local ones (which name the model presets, so they load the model stack)."""

    _remote_options: Callable[[argparse.ArgumentParser], None]

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        if self._options is not None and _targets(argv):
            self._options = self._remote_options
        return super().parse_known_args(args, namespace)


def route_fit_target(fit: argparse.ArgumentParser) -> None:
    """Make the `mapper fit` parser submit a job to the server when `--target` is given."""
    assert isinstance(fit, CommandParser)
    fit.__class__ = _TargetRoutingParser
    fit._remote_options = _remote_fit_options  # type: ignore[attr-defined]


def _remote_fit_options(fit: argparse.ArgumentParser) -> None:
    fit.description = "Submit a mapper fitting job to the server and follow it (admin token)."
    fit.add_argument("--sender", help="sender: a model the server serves")
    fit.add_argument("--receiver", help="receiver: a model the server serves")
    fit.add_argument("--budget-tokens", type=int, default=4096,
                     help="calibration tokens (fitting + held-out rows; default 4096)")
    fit.add_argument("--tokens", type=int, default=0, help="tokens per calibration sequence (default 128)")
    fit.add_argument("--corpus", default="random",
                     help="calibration corpus on the server: random (seeded ids) or recall (the family's "
                          "key-value recall episodes); default random")
    fit.add_argument("--seed", type=int, default=0, help="seed of the corpus")
    fit.add_argument("--tokens-file",
                     help="a JSON list of token-id lists on the server (instead of --corpus)")
    fit.add_argument("--eval-prompts", type=int, default=0, help="held-out prompts for the screens (2)")
    fit.add_argument("--task-episodes", type=int, default=0,
                     help="recall episodes per distance bucket for the task retention (0: none; the "
                          "library's default gate, min_retention_lower, refuses a mapper whose retention "
                          "was not measured)")
    fit.add_argument("--gate-attn-cosine", type=float, help="gate: min mean attention cosine")
    fit.add_argument("--gate-next-token-kl", type=float, help="gate: max next-token KL")
    fit.add_argument("--gate-index-recall", type=float, help="gate: min index top-k recall")
    fit.add_argument("--gate-retention", type=float, help="gate: min task retention (needs --task-episodes)")
    fit.add_argument("--gate-retention-lower", type=float,
                     help="gate: min lower end of the retention's 95%% interval (needs --task-episodes)")
    fit.add_argument("--gate-off", action="append", default=[], metavar="THRESHOLD",
                     help="turn a gate threshold off, e.g. min_retention_lower (repeatable)")
    fit.add_argument("--task-seed", type=int, help="seed of the retention episodes (default: --seed + 2000)")
    fit.add_argument("--fallback", choices=("none", "mlp"), default="none",
                     help="parts whose ridge fails the part gate: keep ridge (none) or fit a residual MLP")
    fit.add_argument("--attention-weighted", action="store_true",
                     help="weight calibration rows by the receiver's own attention mass on each entry")
    fit.add_argument("--resubmit", metavar="JOB_ID", help="run an ended job again with its parameters")
    fit.add_argument("--detach", action="store_true", help="print the queued job and exit (no watching)")
    fit.add_argument("--require-gate", action="store_true", help="exit 1 when the job is REJECTED")
    fit.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_connection_flags(fit, role=ADMIN)
    add_json_flag(fit, what="the final job")
    fit.set_defaults(handler=_run_remote_fit)


def _phase(job: Any) -> str:
    from kvresume.v1 import mappers_pb2

    return mappers_pb2.FitJobPhase.Name(job.phase).removeprefix(_PHASE_PREFIX)


def progress_line(job: Any) -> str:
    """`[#####.....]  512/2048 rows  RUNNING  eta 3s` for one job state."""
    total, done = int(job.rows_total), int(job.rows_done)
    filled = _BAR_WIDTH * done // total if total else 0
    bar = "#" * filled + "." * (_BAR_WIDTH - filled)
    eta = f"  eta {job.eta_s:.0f}s" if job.HasField("eta_s") else ""
    return f"[{bar}] {done:>{len(str(total))}}/{total} rows  {_phase(job)}{eta}"


def _start_request(args: argparse.Namespace) -> Any:
    from kvresume.v1 import mappers_pb2

    if args.resubmit:
        return mappers_pb2.StartFitRequest(resubmit_job_id=args.resubmit)
    if not args.sender or not args.receiver:
        raise ValueError("mapper fit --target needs --sender and --receiver (models the server serves), or "
                         "--resubmit JOB_ID")
    if args.tokens_file:
        source = mappers_pb2.CalibrationSource(tokens_file=args.tokens_file)
    else:
        source = mappers_pb2.CalibrationSource(
            corpus=mappers_pb2.CalibrationCorpus(name=args.corpus, seed=args.seed)
        )
    for name in ("budget_tokens", "tokens", "seed", "eval_prompts", "task_episodes"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 0")
    gate = mappers_pb2.FitGate(task_episodes=args.task_episodes, eval_prompts=args.eval_prompts)
    for flag, field in _GATE_FLAGS:
        if getattr(args, flag) is not None:
            setattr(gate, field, getattr(args, flag))
    gate.disabled.extend(args.gate_off)
    if args.task_seed is not None:
        if args.task_seed < 0:
            raise ValueError(f"--task-seed={args.task_seed} must be >= 0")
        gate.task_seed = args.task_seed
    return mappers_pb2.StartFitRequest(
        sender_model=args.sender, receiver_model=args.receiver, source=source,
        budget_tokens=args.budget_tokens, sequence_tokens=args.tokens, gate=gate, fallback=args.fallback,
        attention_weighted=args.attention_weighted,
    )


class _Progress:
    """The bar on stderr: redrawn in place on a terminal, else one line per phase and per tenth done."""

    def __init__(self, stream: TextIO, enabled: bool) -> None:
        self._out, self._on = stream, enabled
        self._tty = enabled and stream.isatty()
        self._last: tuple[str, int] | None = None

    def show(self, job: Any) -> None:
        if not self._on:
            return
        tenth = 10 * int(job.rows_done) // int(job.rows_total) if job.rows_total else 0
        key = (_phase(job), tenth)
        if self._tty:
            self._out.write("\r" + progress_line(job) + "\x1b[K")
        elif key != self._last:
            self._out.write(progress_line(job) + "\n")
        self._last = key
        self._out.flush()

    def end(self) -> None:
        if self._tty:
            self._out.write("\n")
            self._out.flush()


def _job_doc(job: Any) -> dict[str, Any]:
    from kvresume import message_json

    return json.loads(message_json(job))


def _print_job(job: Any, dest: str | None) -> None:
    doc = _job_doc(job)
    out = text_stream(dest)
    print(f"job {job.job_id}: {_phase(job)}" + (f" ({job.reason})" if job.reason else ""), file=out)
    print(fields_text({k: v for k, v in doc.items() if k not in ("job_id", "reason")}), file=out)
    write_json(doc, dest)


def _exit_code(job: Any, require_gate: bool) -> int:
    phase = _phase(job)
    if phase == "SUCCEEDED" or (phase == "REJECTED" and not require_gate):
        return 0
    print(f"kvresume mapper fit: job {job.job_id} {phase}: {job.reason}", file=sys.stderr)
    return 1


def _watch(client: Any, job_id: str, progress: _Progress) -> Any:
    from kvresume.v1 import mappers_pb2

    job = None
    # No deadline on the stream: a fit takes as long as its budget (the server ends it at a final phase).
    for job in client.mappers.WatchJob(mappers_pb2.WatchJobRequest(job_id=job_id), metadata=client.metadata):
        progress.show(job)
    progress.end()
    if job is None:
        raise ValueError(f"the server sent no state of job {job_id}")
    return job


def _run_remote_fit(args: argparse.Namespace) -> int:
    request = _start_request(args)
    with connect(args) as client:
        job = client.call("mappers", "StartFit", request)
        print(f"job {job.job_id} {_phase(job)}: {job.sender_model} -> {job.receiver_model}, "
              f"{job.rows_total} calibration tokens", file=sys.stderr)
        if not args.detach:
            job = _watch(client, job.job_id, _Progress(sys.stderr, not args.no_progress))
    _print_job(job, args.json)
    return 0 if args.detach else _exit_code(job, args.require_gate)


_JOB_COLUMNS = (
    ("job", "job_id"), ("phase", "phase"), ("sender", "sender_model"), ("receiver", "receiver_model"),
    ("rows", "rows_done"), ("of", "rows_total"), ("mapper", "mapper_id"), ("reason", "reason"),
)  # fmt: skip


def _run_job(args: argparse.Namespace) -> int:
    from kvresume.v1 import mappers_pb2

    with connect(args) as client:
        if args.job_command == "list":
            doc = _job_doc(client.call("mappers", "ListJobs", mappers_pb2.ListJobsRequest(limit=args.limit)))
            rows = [r | {"phase": str(r["phase"]).removeprefix(_PHASE_PREFIX)} for r in doc["jobs"]]
            print(table_text(rows, _JOB_COLUMNS) if rows else "no fitting jobs", file=text_stream(args.json))
            write_json(doc, args.json)
            return 0
        if args.job_command == "watch":
            job = _watch(client, args.job_id, _Progress(sys.stderr, True))
        else:
            method = {"get": "GetJob", "cancel": "CancelJob"}[args.job_command]
            request_cls = {"get": mappers_pb2.GetJobRequest, "cancel": mappers_pb2.CancelJobRequest}
            job = client.call("mappers", method, request_cls[args.job_command](job_id=args.job_id))
    _print_job(job, args.json)
    return 0


def register_jobs(sub: argparse._SubParsersAction) -> None:
    """`kvresume mapper job get|watch|cancel|list` (client, admin token)."""
    job = sub.add_parser("job", help="mapper fitting jobs on the server: get, watch, cancel, list (client)")
    jobs = job.add_subparsers(dest="job_command", required=True, metavar="COMMAND")
    for name, text in (("get", "one job's state"), ("watch", "follow a job to its end (progress on stderr)"),
                       ("cancel", "stop a job (CANCELLED)")):
        p = jobs.add_parser(name, help=text)
        p.add_argument("job_id")
        add_connection_flags(p, role=ADMIN)
        add_json_flag(p, what="the job")
        p.set_defaults(handler=_run_job)
    ls = jobs.add_parser("list", help="jobs, newest first")
    ls.add_argument("--limit", type=int, default=100, help="at most this many (default 100)")
    add_connection_flags(ls, role=ADMIN)
    add_json_flag(ls, what="the jobs")
    ls.set_defaults(handler=_run_job)
