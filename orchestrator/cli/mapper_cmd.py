"""`kvresume mapper ...`: fit, evaluate and list cross-model KV mapper artifacts (server install), and
the mappers registered on a running server (`mapper list` without folders, `mapper get`: client).

Models come from a shipped preset or a config.json (seeded random weights) or a checkpoint folder; each
side may override config keys (`--receiver-set dim=128`) to make a sibling of another width. Calibration
and evaluation tokens are seeded random ids unless `--tokens-file` gives real sequences (a JSON list of
token-id lists). Default sizes fit v41-tiny pairs in well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

from orchestrator.cli.connection import ANY, add_connection_flags, connect
from orchestrator.cli.mapper_remote import register_jobs, route_fit_target
from orchestrator.cli.output import add_json_flag, table_text, text_stream, write_json


def _add_model_args(parser: argparse.ArgumentParser, side: str, *, required: bool = True) -> None:
    from model import PRESET_NAMES

    group = parser.add_mutually_exclusive_group(required=required)
    group.add_argument(f"--{side}-preset", help=f"shipped config, random weights: {', '.join(PRESET_NAMES)}")
    group.add_argument(f"--{side}-config", help="config.json path, random weights")
    group.add_argument(f"--{side}-checkpoint", help="checkpoint folder (config.json + model.safetensors)")
    parser.add_argument(f"--{side}-seed", type=int, default=0 if side == "sender" else 1,
                        help="seed of the random weights (preset/config only)")
    parser.add_argument(f"--{side}-set", action="append", default=[], metavar="KEY=JSON",
                        help="override a config key (repeatable), e.g. dim=128")
    parser.add_argument(f"--{side}-name", help="display name recorded in the artifact")


def _artifact_checkpoint(mapper, side: str) -> str:
    """The checkpoint folder of one side of a saved mapper: the one the fit recorded, else the shipped
    `checkpoints/<name>` of this source tree. Raises ValueError when neither exists."""
    recorded = dict(mapper.calibration).get(f"{side}_checkpoint")
    shipped = Path(__file__).resolve().parents[2] / "checkpoints" / getattr(mapper, side).name
    for candidate in (recorded, shipped):
        if candidate and (Path(candidate) / "config.json").is_file():
            return str(candidate)
    raise ValueError(
        f"the artifact's {side} {getattr(mapper, side).name!r} has no checkpoint here (recorded: "
        f"{recorded!r}, shipped: {str(shipped)!r}); pass --{side}-checkpoint"
    )


def _load_model(args: argparse.Namespace, side: str, mapper=None):
    """(name, model) for one side; without a model option, the artifact's own (`mapper`, eval only).
    Raises ValueError / OSError."""
    import torch

    given = any(getattr(args, f"{side}_{k}") for k in ("preset", "config", "checkpoint"))
    if mapper is not None and not given:
        setattr(args, f"{side}_checkpoint", _artifact_checkpoint(mapper, side))

    from model import ModelConfig, Transformer, init_random, load_model, load_preset

    def get(key: str):
        return getattr(args, f"{side}_{key}")

    overrides: dict[str, Any] = {}
    for item in get("set"):
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--{side}-set expects KEY=JSON, got {item!r}")
        try:
            overrides[key] = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--{side}-set {key}: not JSON: {raw!r}") from exc
    if get("checkpoint"):
        if overrides:
            raise ValueError(f"--{side}-set cannot change a checkpoint's config")
        name = get("name") or Path(get("checkpoint")).name
        return name, load_model(get("checkpoint"), device=args.device).eval()
    if get("preset"):
        cfg, name = load_preset(get("preset")), get("preset")
    else:
        cfg, name = ModelConfig.from_json(get("config")), Path(get("config")).stem
    if overrides:
        cfg = ModelConfig.from_dict(cfg.to_dict() | overrides)
        name += "+" + ",".join(f"{k}={v}" for k, v in overrides.items())
    name = get("name") or f"{name}@seed{get('seed')}"
    with torch.device(args.device):
        model = Transformer(cfg)
    return name, init_random(model, seed=get("seed")).eval()


def _token_batches(
    args: argparse.Namespace, vocab: int, seed: int, n: int, b: int, t: int, *, offset: int = 0,
    from_end: bool = False,
):
    """n batches [b, t] int64: seeded random ids, or windows of --tokens-file sequences. File windows are
    taken in order from `offset` (calibration, then held-out rows after them) or, with `from_end`, from the
    end of the file (evaluation prompts), so the three sets never share a window when the file holds
    enough of them."""
    import torch

    if args.tokens_file:
        seqs = _read_tokens_file(args.tokens_file)
        rows = [torch.tensor(s[i : i + t]) for s in seqs for i in range(0, len(s) - t + 1, t)]
        if len(rows) < offset + n * b:
            raise ValueError(
                f"--tokens-file holds {len(rows)} windows of {t} tokens, {offset + n * b} needed"
            )
        rows = rows[len(rows) - n * b :] if from_end else rows[offset : offset + n * b]
        return [torch.stack(rows[i * b : (i + 1) * b]).to(args.device) for i in range(n)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (b, t), generator=g).to(args.device) for _ in range(n)]


@functools.cache
def _read_tokens_file(path: str) -> list[list[int]]:
    """--tokens-file parsed once per process (calibration, held-out and evaluation rows all read it)."""
    return json.loads(Path(path).read_text())


def _sequences_for(seqs: list[list[int]], t: int, rows: int) -> int:
    """How many leading sequences of `seqs` the first `rows` windows of t tokens come from."""
    got = 0
    for k, seq in enumerate(seqs, 1):
        got += len(seq) // t
        if got >= rows:
            return k
    return len(seqs) + 1


def _gate(args: argparse.Namespace):
    """GateSpec defaults, with the thresholds given on the command line."""
    from mappers import GateSpec

    given = {
        "min_attn_cosine": args.gate_attn_cosine,
        "max_next_token_kl": args.gate_next_token_kl,
        "min_index_recall": args.gate_index_recall,
        "min_retention": args.gate_retention,
        "min_retention_lower": args.gate_retention_lower,
    }
    # a negative threshold on the command line switches that condition off (None)
    return GateSpec(**{k: (None if v < 0 else v) for k, v in given.items() if v is not None})


def _summary(mapper, failed: list[str] | None, directory: Path | None, report=None) -> dict[str, Any]:
    q = dict(mapper.quality)
    return {
        "retention": q.get("retention") if report is not None else None,
        "retention_ci_lower": q.get("retention_ci_lower") if report is not None else None,
        "task_seed": report.task_seed if report is not None else None,
        "retention_table": report.table() if report is not None else None,
        "dir": str(directory) if directory else None,
        "sender": mapper.sender.name,
        "receiver": mapper.receiver.name,
        "layers": [
            {
                "receiver_layer": lm.receiver_layer,
                "ratio": lm.ratio,
                "kv_from": list(lm.kv.sender_layers),
                "index_from": list(lm.index.sender_layers),
                "kv_kind": lm.kv.kind,
                "index_kind": lm.index.kind,
                "kv_reason": lm.kv.reason,
                "index_reason": lm.index.reason,
                "quality": dict(lm.quality),
            }
            for lm in mapper.layers
        ],
        "quality": dict(mapper.quality),
        "passed_gate": mapper.passed_gate,
        "gate_failures": failed,
        "digest": mapper.digest(),
    }


def _print(summary: dict[str, Any], dest: str | None) -> None:
    out = text_stream(dest)
    where = f" at {summary['dir']}" if summary["dir"] else ""
    print(f"mapper {summary['sender']} -> {summary['receiver']}{where}", file=out)
    for lm in summary["layers"]:
        q = lm["quality"]
        figures = " ".join(f"{k}={v:.4g}" for k, v in sorted(q.items()) if k.startswith(("r2_", "eval_")))
        print(f"  layer {lm['receiver_layer']} (ratio {lm['ratio']}): kv<-{lm['kv_from']} "
              f"index<-{lm['index_from']}  {figures}", file=out)
        for part in ("kv", "index"):
            if lm[f"{part}_reason"]:
                print(f"    {part}: {lm[f'{part}_kind']} ({lm[f'{part}_reason']})", file=out)
    if summary["retention_table"]:
        print(f"  task retention (task seed {summary['task_seed']}):", file=out)
        print("    " + summary["retention_table"].replace("\n", "\n    "), file=out)
    print("  " + " ".join(f"{k}={v:.4g}" for k, v in sorted(summary["quality"].items())), file=out)
    verdict = "PASSED" if summary["passed_gate"] else "NOT PASSED"
    why = f" ({'; '.join(summary['gate_failures'])})" if summary["gate_failures"] else ""
    print(f"  gate: {verdict}{why}", file=out)
    write_json(summary, dest)


# --task-seed defaults to --seed + this (the episode seed before --task-seed existed)
TASK_SEED_OFFSET = 2000


def task_seed_of(args: argparse.Namespace) -> int:
    """--task-seed, or --seed + 2000 when not given. Bucket i of task seed N draws its recall episodes
    with seed N * 16 + i (`mappers.bucket_seed`), so different task seeds never share episodes."""
    return args.task_seed if args.task_seed is not None else args.seed + TASK_SEED_OFFSET


def _task(args, mapper, sender, receiver):
    """Task retention on the family's key-value recall episodes, per distance bucket with a paired
    bootstrap interval (None when --task-episodes is 0): the question and answer run after the mapped
    history, so the evidence is reachable only through it."""
    if not args.task_episodes:
        return None
    from mappers import measure_retention

    buckets = {f"d{args.task_distance}": args.task_distance} if args.task_distance else None
    return measure_retention(mapper, sender, receiver, episodes=args.task_episodes,
                             task_seed=task_seed_of(args), buckets=buckets, device=args.device)


def _check_task_args(args: argparse.Namespace) -> None:
    if args.gate_retention is not None and not args.task_episodes:
        raise ValueError("--gate-retention needs --task-episodes > 0 (retention must be measured)")
    if args.task_episodes < 0:
        raise ValueError(f"--task-episodes={args.task_episodes} must be >= 0")
    if args.task_seed is not None and args.task_seed < 0:
        raise ValueError(f"--task-seed={args.task_seed} must be >= 0")


def _evaluate(args, mapper, sender, receiver):
    from mappers import evaluate_mapper, gate_mapper

    _check_task_args(args)
    prompts = _token_batches(args, receiver.cfg.vocab_size, args.seed + 1000, 1, args.eval_prompts,
                             args.eval_prefix + args.eval_suffix, from_end=True)[0]
    evaluation = evaluate_mapper(mapper, sender, receiver, prompts, suffix_tokens=args.eval_suffix)
    report = _task(args, mapper, sender, receiver)
    mapper, failed = gate_mapper(mapper, evaluation, gate=_gate(args), task=report)
    return mapper, failed, report


def _calibration(args: argparse.Namespace) -> dict[str, Any]:
    """What the fit reads, for the artifact: corpus, seeds, and the task seed its gate was measured on (a
    later `mapper eval` refuses it: those episodes chose this artifact)."""
    import hashlib

    if args.tokens_file:
        digest = hashlib.sha256(Path(args.tokens_file).read_bytes()).hexdigest()
        corpus = {"kind": "tokens_file", "path": str(args.tokens_file), "sha256": digest}
    else:
        corpus = {"kind": "random_ids", "seed": args.seed}
    return {
        "corpus": corpus,
        "calibration_seed": args.seed,
        "heldout_seed": args.seed + 1,
        "eval_prompt_seed": args.seed + 1000,
        "rows": {"batches": args.batches, "heldout": args.heldout, "batch_size": args.batch_size,
                 "tokens": args.tokens},
        "task_seeds": [task_seed_of(args)] if args.task_episodes and args.eval_prompts else [],
        "sender_checkpoint": args.sender_checkpoint,
        "receiver_checkpoint": args.receiver_checkpoint,
    }


def _run_fit(args: argparse.Namespace) -> int:
    import torch

    from mappers import FitSpec, fit_mapper, save_mapper

    _check_task_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    s_name, sender = _load_model(args, "sender")
    r_name, receiver = _load_model(args, "receiver")
    if sender.cfg.vocab_size != receiver.cfg.vocab_size:
        raise ValueError(f"sender and receiver vocabularies differ: {sender.cfg.vocab_size} vs "
                         f"{receiver.cfg.vocab_size} (siblings share a tokenizer)")
    vocab = sender.cfg.vocab_size
    train = _token_batches(args, vocab, args.seed, args.batches, args.batch_size, args.tokens)
    held = _token_batches(args, vocab, args.seed + 1, args.heldout, args.batch_size, args.tokens,
                          offset=args.batches * args.batch_size)
    if args.tokens_file and args.eval_prompts:
        # evaluation prompts come from the last sequences of the file: they must not reach the fitted ones
        seqs = _read_tokens_file(args.tokens_file)
        fit_seqs = _sequences_for(seqs, args.tokens, (args.batches + args.heldout) * args.batch_size)
        eval_seqs = _sequences_for(seqs[::-1], args.eval_prefix + args.eval_suffix, args.eval_prompts)
        if fit_seqs + eval_seqs > len(seqs):
            raise ValueError(
                f"--tokens-file holds {len(seqs)} sequences: calibration + held-out rows need the first "
                f"{fit_seqs} and the evaluation prompts the last {eval_seqs}; they would overlap"
            )
    spec = FitSpec(k=args.k, alphas=tuple(args.alphas), index_mode=args.index_mode, fallback=args.fallback,
                   part_gate_r2=args.part_gate_r2, mlp_epochs=args.mlp_epochs, mlp_hidden=args.mlp_hidden,
                   mlp_context=args.mlp_context, attention_weighted=args.attention_weighted,
                   force_mlp=tuple(args.force_mlp_part))
    with torch.inference_mode():
        mapper = fit_mapper(sender, receiver, train, heldout_batches=held, spec=spec, sender_name=s_name,
                            receiver_name=r_name, gate=_gate(args), calibration=_calibration(args))
        failed, report = None, None
        if args.eval_prompts:
            mapper, failed, report = _evaluate(args, mapper, sender, receiver)
    out = save_mapper(mapper, args.out)
    _print(_summary(mapper, failed, out, report), args.json)
    return 1 if args.require_gate and not mapper.passed_gate else 0


def _run_eval(args: argparse.Namespace) -> int:
    import torch

    from mappers import applicability, load_mapper, save_mapper
    from model import model_fingerprint

    if args.threads:
        torch.set_num_threads(args.threads)
    mapper = load_mapper(args.dir)
    _check_task_args(args)
    if args.task_episodes and task_seed_of(args) in mapper.fit_task_seeds:
        raise ValueError(
            f"task seed {task_seed_of(args)} was used in fitting this artifact (its fit task seeds: "
            f"{list(mapper.fit_task_seeds)}); pass another --task-seed"
        )
    _, sender = _load_model(args, "sender", mapper)
    _, receiver = _load_model(args, "receiver", mapper)
    verdict = applicability(mapper, sender_fingerprint=model_fingerprint(sender),
                            receiver_fingerprint=model_fingerprint(receiver), require_gate=False)
    if not verdict.ok:
        raise ValueError(f"the mapper at {args.dir} does not fit these models: {verdict.reason}")
    with torch.inference_mode():
        mapper, failed, report = _evaluate(args, mapper, sender, receiver)
    if args.write:
        save_mapper(mapper, args.dir)
    _print(_summary(mapper, failed, Path(args.dir), report), args.json)
    return 1 if args.require_gate and not mapper.passed_gate else 0


def _run_list(args: argparse.Namespace) -> int:
    if not args.roots:
        return _run_registered(args)
    from mappers import read_metadata

    found = []
    for root in args.roots:
        base = Path(root)
        if not base.exists():
            raise ValueError(f"{root} does not exist")
        direct = base / "mapper.json"
        for doc_path in [direct] if direct.is_file() else sorted(base.rglob("mapper.json")):
            doc = read_metadata(doc_path.parent)
            found.append({
                "dir": str(doc_path.parent),
                "sender": doc["sender"]["name"],
                "receiver": doc["receiver"]["name"],
                "sender_fingerprint": doc["sender"]["fingerprint"],
                "receiver_fingerprint": doc["receiver"]["fingerprint"],
                "layers": len(doc["layers"]),
                "passed_gate": doc["passed_gate"],
                "quality": doc["quality"],
            })
    out = text_stream(args.json)
    for f in found:
        q = f["quality"]
        keys = ("attn_cosine_mean", "next_token_kl", "index_recall")
        figures = " ".join(f"{k}={q[k]:.4g}" for k in keys if k in q)
        print(f"{f['dir']}: {f['sender']} -> {f['receiver']}, {f['layers']} layers, "
              f"gate {'passed' if f['passed_gate'] else 'not passed'} {figures}".rstrip(), file=out)
    if not found:
        print("no mappers found", file=out)
    write_json(found, args.json)
    return 0


_REGISTERED = (
    ("mapper", "mapper_id"), ("sender", "sender_model"), ("receiver", "receiver_model"), ("kind", "kind"),
    ("gate", "gate_metric"), ("passed", "passed_gate"), ("artifact", "artifact_uri"),
)  # fmt: skip


def _run_registered(args: argparse.Namespace) -> int:
    """`mapper list` without folders, `mapper get ID`: the server's Mappers service (light client)."""
    from kvresume import message_json
    from kvresume.v1 import mappers_pb2

    if args.mapper_command == "get":
        method, request = "GetMapper", mappers_pb2.GetMapperRequest(mapper_id=args.mapper_id)
    else:
        method = "ListMappers"
        request = mappers_pb2.ListMappersRequest(
            sender_model=args.sender or "", receiver_model=args.receiver or ""
        )
    with connect(args) as client:
        doc = json.loads(message_json(client.call("mappers", method, request)))
    rows = doc["mappers"] if method == "ListMappers" else [doc]
    print(table_text(rows, _REGISTERED) if rows else "no mappers registered", file=text_stream(args.json))
    write_json(doc, args.json)
    return 0


def _add_common(parser: argparse.ArgumentParser, *, models_required: bool = True) -> None:
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random calibration/eval tokens")
    parser.add_argument("--tokens-file", help="JSON list of token-id lists to calibrate and evaluate on")
    parser.add_argument("--eval-prompts", type=int, default=2, help="held-out prompts to evaluate (0: skip)")
    parser.add_argument("--eval-prefix", type=int, default=64, help="mapped prefix tokens per prompt")
    parser.add_argument("--eval-suffix", type=int, default=8, help="receiver tokens after the prefix")
    parser.add_argument("--gate-attn-cosine", type=float, help="gate: min mean attention cosine (0.9)")
    parser.add_argument("--gate-next-token-kl", type=float, help="gate: max next-token KL vs cold (0.2)")
    parser.add_argument("--gate-index-recall", type=float, help="gate: min index top-k recall (0.5)")
    parser.add_argument("--gate-retention", type=float,
                        help="gate: min task retention point estimate (off unless given; needs "
                             "--task-episodes)")
    parser.add_argument("--gate-retention-lower", type=float,
                        help="gate: min lower bound of the 95%% paired-bootstrap retention interval, "
                             "smallest over the buckets (default 0.8; negative: off)")
    parser.add_argument("--task-episodes", type=int, default=0,
                        help="key-value recall episodes per distance bucket for task retention (shipped "
                             "tokenizer and test-split corpus; 0: skip)")
    parser.add_argument("--task-distance", type=int, default=None,
                        help="one bucket at this evidence-to-answer distance (default: two buckets, 8x "
                             "and 32x the receiver's window)")
    parser.add_argument("--task-seed", type=int, default=None,
                        help="seed of the recall episodes (default --seed + 2000); bucket i uses episode "
                             "seed N*16+i; `mapper eval` refuses the task seed the fit was gated on")
    add_json_flag(parser, what="the mapper's summary")
    parser.add_argument("--require-gate", action="store_true", help="exit 1 when the mapper fails its gate")
    _add_model_args(parser, "sender", required=models_required)
    _add_model_args(parser, "receiver", required=models_required)


def _mapper_errors_exit_1(handler):
    """MapperError (e.g. a fit without usable rows) becomes a message and exit code 1, as ValueError does."""

    def run(args: argparse.Namespace) -> int:
        from mappers import MapperError

        try:
            return handler(args)
        except MapperError as exc:
            print(f"kvresume mapper {args.mapper_command}: error: {exc}", file=sys.stderr)
            return 1

    return run


def _fit_options(fit: argparse.ArgumentParser) -> None:
    fit.add_argument("--out", required=True, help="artifact folder to write")
    fit.add_argument("--batches", type=int, default=3, help="calibration batches")
    fit.add_argument("--heldout", type=int, default=1, help="held-out batches (layer ranking, alpha)")
    fit.add_argument("--batch-size", type=int, default=2, help="sequences per batch")
    fit.add_argument("--tokens", type=int, default=128, help="tokens per sequence")
    fit.add_argument("--k", type=int, default=None, help="sender layers stacked per receiver layer (all)")
    fit.add_argument("--alphas", type=float, nargs="+", default=[1e-3, 1e-2, 1e-1, 1.0],
                     help="relative ridge penalties to choose from")
    fit.add_argument("--index-mode", choices=("map", "recompute", "best"), default="map",
                     help="index keys: separate ridge map, recomputed by the receiver's indexer, or the "
                          "better on held-out rows")
    fit.add_argument("--fallback", choices=("none", "mlp"), default="none",
                     help="parts whose ridge fails the part gate: keep ridge, or try a residual MLP on "
                          "context features (kept when better on held-out rows)")
    fit.add_argument("--part-gate-r2", type=float, default=0.9, help="held-out R² a part's ridge must reach")
    fit.add_argument("--attention-weighted", action="store_true",
                     help="weight calibration rows by the receiver's own attention mass on each entry")
    fit.add_argument("--force-mlp-part", action="append", default=[], metavar="LAYER.PART",
                     help="try the MLP fallback on this receiver part (e.g. 6.kv) even when its ridge passes "
                          "the part gate (repeatable; needs --fallback mlp)")
    fit.add_argument("--mlp-epochs", type=int, default=20, help="training epochs of an MLP part")
    fit.add_argument("--mlp-hidden", type=int, default=512, help="hidden width of an MLP part")
    fit.add_argument("--mlp-context", type=int, default=2, help="previous entries an MLP part reads")
    _add_common(fit)


def _eval_options(ev: argparse.ArgumentParser) -> None:
    ev.add_argument("dir", help="artifact folder")
    ev.add_argument("--write", action="store_true", help="record the figures and gate in the artifact")
    # without model options the artifact's own sender and receiver checkpoints are loaded
    _add_common(ev, models_required=False)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("mapper", help="cross-model KV mappers (fit, eval, list, get)")
    sub = parser.add_subparsers(dest="mapper_command", required=True, metavar="COMMAND")

    # fit's and eval's options name the model presets: added when the command is chosen (model stack).
    fit = sub.add_parser(
        "fit", help="fit a ridge mapper between two models, evaluate, gate and save it (server); with "
        "--target HOST:PORT, submit a fitting job to that server and follow it (client, mapper_remote.py)",
        options=_fit_options,
    )
    fit.set_defaults(handler=_mapper_errors_exit_1(_run_fit))
    ev = sub.add_parser(
        "eval", help="evaluate a saved mapper on held-out prompts and apply the gate (server)",
        options=_eval_options,
    )
    ev.set_defaults(handler=_mapper_errors_exit_1(_run_eval))

    ls = sub.add_parser(
        "list",
        help="mapper artifacts under folders (server), or without folders those registered on the "
        "server (client)",
    )
    ls.add_argument("roots", nargs="*", help="artifact folders, or folders holding them (none: the server's)")
    ls.add_argument("--sender", help="registered mappers from this model only")
    ls.add_argument("--receiver", help="registered mappers to this model only")
    add_connection_flags(ls, role=ANY)
    add_json_flag(ls, what="the list")
    ls.set_defaults(handler=_run_list)

    get = sub.add_parser("get", help="one mapper registered on the server (client)")
    get.add_argument("mapper_id")
    add_connection_flags(get, role=ANY)
    add_json_flag(get, what="the mapper")
    get.set_defaults(handler=_run_registered)
    route_fit_target(fit)
    register_jobs(sub)
