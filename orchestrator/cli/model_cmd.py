"""`kvresume model ...`: byte accounting and conformance checks of the model package (server install).

Sub-commands are registered by `_register_<name>(model_subparsers)` functions called from `register`;
their options are added when the command is chosen (`bytes` names the presets of the model package).
"""

from __future__ import annotations

import argparse
import sys
from fractions import Fraction
from typing import TYPE_CHECKING

from orchestrator.cli.numerics_flag import add_numerics_flag, enter_numerics
from orchestrator.cli.output import add_json_flag, text_stream, write_json
from orchestrator.numerics_env import describe, profile_report

if TYPE_CHECKING:
    from model import KVBytes, ModelConfig


def _load_config(args: argparse.Namespace) -> tuple[str, ModelConfig]:
    """The config named by --preset or --config, with a label for output. Raises ValueError / OSError."""
    from model import PRESET_NAMES, ModelConfig, load_preset

    if args.config is not None:
        return str(args.config), ModelConfig.from_json(args.config)
    if args.preset is not None:
        return args.preset, load_preset(args.preset)
    raise ValueError(f"give --preset ({', '.join(PRESET_NAMES)}) or --config PATH")


def _fmt(value: Fraction | int) -> str:
    if isinstance(value, Fraction) and value.denominator != 1:
        return f"{float(value):,.3f} ({value})"
    return f"{int(value):,}"


def _table(label: str, config: ModelConfig, b: KVBytes) -> str:
    lines = [
        f"KV bytes for {label}: {config.n_layers} backbone layers, ced_split={config.ced_split}, "
        f"head_dim={config.head_dim}, index_head_dim={config.index_head_dim}, window={config.window_size}",
        f"  main KV entry    {b.main_entry_bytes:>6} B  (FP4 E2M1 + E4M3 scale per 16)",
        f"  index-K entry    {b.index_entry_bytes:>6} B  (FP4 E2M1 + E8M0 scale per 32)",
        f"  window KV row    {b.window_entry_bytes:>6} B  (FP8 E4M3 + UE8M0 scale per 32)",
        "",
        f"  {'kv source':>9}  {'half':>4}  {'ratio':>5}  {'entry B':>7}  {'B/token':>12}",
    ]
    for s in b.sources:
        lines.append(
            f"  {s.layer:>9}  {s.half:>4}  {s.ratio:>5}  {s.entry_bytes:>7}  {_fmt(s.bytes_per_token):>12}"
        )
    lines += [
        "",
        f"  global KV per token        {_fmt(b.global_bytes_per_token)} B"
        f"  (encoder {_fmt(b.encoder_global_bytes_per_token)}, "
        f"decoder {_fmt(b.decoder_global_bytes_per_token)})",
        f"  window KV per sequence     {_fmt(b.window_bytes_per_sequence)} B"
        f"  (encoder {_fmt(b.encoder_window_bytes_per_sequence)}, "
        f"decoder {_fmt(b.decoder_window_bytes_per_sequence)})",
    ]
    if b.draft_layer_count:
        lines.append(
            f"  draft-layer windows        {_fmt(b.draft_window_bytes_per_sequence)} B"
            f"  ({b.draft_layer_count} DSpark/MTP layers, not counted above)"
        )
    unsupported = config.unsupported_features()
    if unsupported:
        lines.append(f"  note: not run by this project's model: {', '.join(unsupported)}")
    return "\n".join(lines)


def _run_bytes(args: argparse.Namespace) -> int:
    from model import kv_bytes

    label, config = _load_config(args)
    breakdown = kv_bytes(config)
    print(_table(label, config, breakdown), file=text_stream(args.json))
    write_json({"config": label, **breakdown.to_dict()}, args.json)
    return 0


def _bytes_options(parser: argparse.ArgumentParser) -> None:
    from model import PRESET_NAMES

    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", help=f"a shipped config: {', '.join(PRESET_NAMES)}")
    source.add_argument("--config", help="path of an inference config.json")
    add_json_flag(parser, what="the byte breakdown")


def _register_bytes(model_subparsers: argparse._SubParsersAction) -> None:
    parser = model_subparsers.add_parser(
        "bytes", help="KV-cache bytes per token and per sequence", options=_bytes_options
    )
    parser.set_defaults(handler=_run_bytes)


def _run_check(args: argparse.Namespace) -> int:
    rc = enter_numerics(args, args.numerics)
    if rc is not None:
        return rc
    # imported after entering the profile: its variables must be set before torch loads
    from model import ModelError, check_conformance, configure_torch

    portable = args.numerics == "portable"
    # The pinned profiles run one intra-op thread; native keeps the caller's threads.
    configure_torch(args.numerics, threads=1 if args.numerics != "native" else None)
    profile = profile_report(args.numerics)
    if not profile["in_force"]:
        print(f"kvresume model check: error: the {args.numerics} numerics profile is not in force: "
              f"{'; '.join(profile['problems'])}", file=sys.stderr)  # type: ignore[arg-type]
        return 1
    prompts = [int(p) for p in args.prompts.split(",")] if args.prompts else None
    try:
        reports = check_conformance(args.checkpoint, args.vectors, device=args.device, prompts=prompts)
    except ModelError as exc:
        print(f"kvresume model check: error: {exc}", file=sys.stderr)
        return 1
    agree = all(r.ok for r in reports)
    out = text_stream(args.json)
    print(describe(profile), file=out)
    if not portable:
        print(f"  the vectors were made under the portable profile: under {args.numerics} numerics "
              "bitwise agreement is not expected and no conformance is claimed", file=out)
    for r in reports:
        same = sum(a == b for a, b in zip(r.generated, r.reference_generated, strict=False))
        print(
            f"{r.prompt} ({r.n_tokens} tokens): logits max rel err {r.logits_rel_err:.3e}; "
            f"greedy {same}/{len(r.reference_generated)} equal; "
            f"{len(r.caches)} caches, max err {r.cache_max_abs:.3e}: {'OK' if r.ok else 'FAIL'}",
            file=out,
        )
        for d in r.caches:
            if args.verbose or not d.ok:
                print(f"    {d.name}: max err {d.max_abs:.3e}", file=out)
        for failure in r.failures:
            print(f"  FAIL {failure}", file=out)
    if portable:
        print("conformance: " + ("PASS (bitwise under the portable profile)" if agree else "FAIL"), file=out)
    else:
        print(f"{args.numerics} numerics: " + ("agrees with the vectors (not a conformance claim)" if agree
                                     else f"differs from the vectors (run without --numerics {args.numerics} "
                                     "for the conformance check)"), file=out)
    write_json({
        "numerics": profile,
        "conformance_claimed": portable,
        "ok": agree,
        "prompts": [
            {
                "prompt": r.prompt, "tokens": r.n_tokens, "ok": r.ok, "logits_rel_err": r.logits_rel_err,
                "generated": r.generated, "reference_generated": r.reference_generated,
                "caches": {d.name: d.max_abs for d in r.caches}, "failures": r.failures,
            }
            for r in reports
        ],
    }, args.json)
    return 0 if agree else 1


def _register_check(model_subparsers: argparse._SubParsersAction) -> None:
    parser = model_subparsers.add_parser(
        "check", help="conformance: run the vectors' prompts, compare logits, greedy ids and caches"
    )
    parser.add_argument("--checkpoint", required=True, help="folder with config.json and model.safetensors")
    parser.add_argument("--vectors", required=True, help="folder laid out like shared/conformance/v41-tiny")
    parser.add_argument("--device", default="cpu", help="torch device to run on (default cpu)")
    parser.add_argument("--prompts", help="comma-separated prompt indices (default: every prompt)")
    parser.add_argument("--verbose", action="store_true", help="list every cache tensor's error")
    add_json_flag(parser, what="the report")
    add_numerics_flag(parser, default="portable", what="the check")
    parser.set_defaults(handler=_run_check)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="model utilities (bytes, check)")
    model_subparsers = parser.add_subparsers(dest="model_command", required=True)
    _register_bytes(model_subparsers)
    _register_check(model_subparsers)
