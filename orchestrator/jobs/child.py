"""The child process of one fitting job: `python -m orchestrator.jobs.child SPEC.json`.

Loads the two served models as the node serves them (same sources, device, kernels and numerics
profile, so the artifact binds the fingerprints the node's model switch checks), builds the calibration
sequences, calls the one library fitting entry point (`mappers.fit_mapper`), evaluates and gates the
artifact (`mappers.evaluate_mapper`, `evaluate_task_retention`, `gate_mapper`), saves it, and reports on
stdout in the `progress` protocol. Its torch threads are capped by the spec (the node's `fit_threads`)
and it runs at a lower CPU priority, so fitting takes no more than its share from the turns being
served. It exits when its stdin closes: the node that started it has died.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from orchestrator.jobs.progress import emit
from orchestrator.jobs.request import GATE_THRESHOLDS, CalibrationPlan, FitRequest, resolve_tokens_file

__all__ = [
    "EVAL_PREFIX_TOKENS", "EVAL_SUFFIX_TOKENS", "calibration_sequences", "main", "run_fit", "task_seed_of"
]

# The screens' held-out prompts: a mapped prefix, then the receiver's own tokens after it (the CLI's).
EVAL_PREFIX_TOKENS = 64
EVAL_SUFFIX_TOKENS = 8
# Seeds of the evaluation prompts and recall episodes, offset from the calibration seed (as `kvresume
# mapper fit` offsets them from --seed), so evaluation never reads a calibration row of a corpus.
EVAL_SEED_OFFSET = 1000
TASK_SEED_OFFSET = 2000
# A lower priority than the serving process: turns get the cores first.
NICE_INCREMENT = 10


def _watch_parent(stdin: TextIO) -> None:
    """Exit when stdin reaches EOF: the parent closed it or died (SIGKILL included)."""

    def watch() -> None:
        try:
            while stdin.read(4096):
                pass
        finally:
            os._exit(3)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _windows(seqs: list[list[int]], t: int) -> list[list[int]]:
    return [s[i : i + t] for s in seqs for i in range(0, len(s) - t + 1, t)]


def calibration_sequences(request: FitRequest, vocab: int, data_dir: Path, *, seed_offset: int = 0,
                          n: int | None = None, t: int | None = None):
    """[n, t] int64 token rows from the request's source (default: the whole plan's sequences).

    random: uniform ids (torch.Generator seeded with seed + seed_offset); recall: the family's recall
    episodes at distance t (seed + seed_offset), each cut to its first t tokens; tokens_file: windows of t
    tokens in file order (seed_offset > 0 takes them from the end of the file instead).

    Raises:
        ValueError: a file with too few windows, or token ids outside the vocabulary.
    """
    import torch

    plan: CalibrationPlan = request.plan
    n = n if n is not None else plan.train + plan.heldout
    t = t if t is not None else plan.sequence_tokens
    src = request.source
    if src["kind"] == "corpus" and src["name"] == "random":
        g = torch.Generator().manual_seed(int(src["seed"]) + seed_offset)
        return torch.randint(0, vocab, (n, t), generator=g)
    if src["kind"] == "corpus":
        from model import family_recall_episodes

        eps = family_recall_episodes(t, n, seed=int(src["seed"]) + seed_offset)
        rows = eps.tokens[:, :t]
    else:
        path = resolve_tokens_file(str(src["path"]), data_dir)
        seqs = json.loads(path.read_text())
        if not isinstance(seqs, list) or not all(isinstance(s, list) for s in seqs):
            raise ValueError(f"tokens_file {path} must hold a JSON list of token-id lists")
        windows = _windows(seqs, t)
        if len(windows) < n:
            raise ValueError(f"tokens_file {path} holds {len(windows)} windows of {t} tokens, {n} needed")
        windows = windows[len(windows) - n :] if seed_offset else windows[:n]
        rows = torch.tensor(windows, dtype=torch.int64)
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= vocab):
        raise ValueError(f"calibration token ids must be in [0, {vocab}), got [{int(rows.min())}, "
                         f"{int(rows.max())}]")
    return rows


def task_seed_of(request: FitRequest) -> int:
    """The retention episodes' task seed: the gate's task_seed, else the calibration seed + 2000 (as
    `kvresume mapper fit` derives --task-seed from --seed)."""
    given = request.gate.get("task_seed")
    return int(given) if given is not None else int(request.source.get("seed", 0)) + TASK_SEED_OFFSET


def _calibration(spec: dict[str, Any], request: FitRequest, data_dir: Path, task_seed: int) -> dict[str, Any]:
    """What the fit read, for the artifact (`KVMapper.calibration`): the corpus and its seeds, the rows,
    and the task seed its gate is measured on, which a later `mapper eval` refuses."""
    import hashlib

    src = dict(request.source)
    if src["kind"] == "tokens_file":
        path = resolve_tokens_file(str(src["path"]), data_dir)
        src["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    plan = request.plan
    checkpoints = {
        f"{side}_checkpoint": spec[side]["source"].removeprefix("checkpoint:")
        for side in ("sender", "receiver")
        if spec[side]["source"].startswith("checkpoint:")
    }
    seed = int(src.get("seed", 0))
    return {
        "corpus": src,
        "calibration_seed": seed,
        "eval_prompt_seed": seed + EVAL_SEED_OFFSET,
        "rows": {"sequences": plan.train, "heldout": plan.heldout, "tokens": plan.sequence_tokens},
        "task_seeds": [task_seed] if request.gate.get("task_episodes") else [],
        "fit_job": spec["job_id"],
        **checkpoints,
    }


def _reporting(batches: list[Any], report: Callable[[int], None]) -> Iterator[Any]:
    """Yield batches; each one is reported done when the fit asks for the next (or ends the loop)."""
    for batch in batches:
        yield batch
        report(int(batch.numel()))


def _fit_spec(request: FitRequest) -> Any:
    """The fit's mappers.FitSpec from the request's options (mappers imports torch, hence here)."""
    from mappers import FitSpec

    return FitSpec(fallback=request.fallback, attention_weighted=request.attention_weighted)


def run_fit(spec: dict[str, Any], out: TextIO) -> dict[str, Any]:
    """The job: fit, evaluate, gate, save. Returns the result event's fields."""
    from model import configure_torch

    cpu_path = spec["cpu_path"]
    configure_torch(cpu_path, threads=int(spec["threads"]))

    import torch

    # The job's log says what it ran with (tests read it: the thread cap is the point of the child).
    print(f"fit job {spec['job_id']}: torch threads {torch.get_num_threads()}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, nice {os.nice(0)}",
          file=sys.stderr, flush=True)

    from mappers import (
        GateSpec,
        evaluate_mapper,
        fit_mapper,
        gate_mapper,
        measure_retention,
        save_mapper,
    )
    from orchestrator.engine import ServedModelSpec, load_served, registration_of

    request = FitRequest.from_json(spec["request"])
    data_dir = Path(spec["data_dir"])
    served = {
        side: load_served(
            ServedModelSpec.parse(spec[side]["name"], spec[side]["source"]),
            device=spec["device"], kernel_backend=spec["kernel_backend"], cpu_path=cpu_path,
            linear_math=spec.get("linear_math", "exact"),
        )
        for side in ("sender", "receiver")
    }
    sender, receiver = served["sender"], served["receiver"]
    if sender.vocab_size != receiver.vocab_size:
        raise ValueError(f"sender and receiver vocabularies differ: {sender.vocab_size} vs "
                         f"{receiver.vocab_size} (siblings share a tokenizer)")
    plan = request.plan
    rows = calibration_sequences(request, sender.vocab_size, data_dir).to(spec["device"])
    step = 2  # sequences per captured batch
    train = [rows[i : min(i + step, plan.train)] for i in range(0, plan.train, step)]
    held = [rows[i : min(i + step, rows.size(0))] for i in range(plan.train, rows.size(0), step)]
    done = [0]

    def report(n: int) -> None:
        done[0] += n
        emit(out, "progress", rows_done=done[0], rows_total=plan.rows_total)

    gate_cfg = dict(request.gate)
    thresholds = {k: v for k, v in gate_cfg.items() if k in GATE_THRESHOLDS}
    gate = GateSpec(**thresholds, **dict.fromkeys(gate_cfg["disabled"]))
    task_seed = task_seed_of(request)
    emit(out, "phase", phase="running")
    emit(out, "progress", rows_done=0, rows_total=plan.rows_total)
    with torch.inference_mode():
        mapper = fit_mapper(
            sender.model, receiver.model, _reporting(train, report),
            heldout_batches=_reporting(held, report), spec=_fit_spec(request),
            sender_name=sender.name, receiver_name=receiver.name, gate=gate,
            sender_fingerprint=sender.fingerprint, receiver_fingerprint=receiver.fingerprint,
            calibration=_calibration(spec, request, data_dir, task_seed),
        )
        emit(out, "phase", phase="evaluating")
        prompts = calibration_sequences(
            request, sender.vocab_size, data_dir, seed_offset=EVAL_SEED_OFFSET,
            n=int(gate_cfg["eval_prompts"]), t=EVAL_PREFIX_TOKENS + EVAL_SUFFIX_TOKENS,
        ).to(spec["device"])
        evaluation = evaluate_mapper(mapper, sender.model, receiver.model, prompts,
                                     suffix_tokens=EVAL_SUFFIX_TOKENS)
        # Retention per distance bucket (8W, 32W) with its paired-bootstrap interval: the gate's figure.
        task = (
            measure_retention(mapper, sender.model, receiver.model, episodes=int(gate_cfg["task_episodes"]),
                              task_seed=task_seed, device=spec["device"])
            if gate_cfg["task_episodes"] else None
        )
        mapper, failed = gate_mapper(mapper, evaluation, gate=gate, task=task)
    directory = save_mapper(mapper, spec["out_dir"])
    fields = registration_of(directory)
    return {
        "registration": fields,
        "passed_gate": bool(fields["passed_gate"]),
        "failures": list(failed),
        "metrics": {k: float(v) for k, v in mapper.quality.items()},
        "artifact_dir": str(directory),
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m orchestrator.jobs.child SPEC.json", file=sys.stderr)
        return 2
    # Events go to the real stdout; anything a library prints goes to stderr (the job's log).
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr
    _watch_parent(sys.stdin)
    try:
        os.nice(NICE_INCREMENT)
    except OSError:
        pass
    try:
        spec = json.loads(Path(args[0]).read_text())
        result = run_fit(spec, out)
    except Exception as exc:  # the job's failure, reported to the parent as its reason
        import traceback

        traceback.print_exc()
        emit(out, "error", message=f"{type(exc).__name__}: {exc}")
        return 1
    emit(out, "result", **result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
