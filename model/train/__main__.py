"""Command line of the training data: `python -m model.train data build|check|sample`.

    data build --out DIR [--max-bytes N] [--vocab-size V]   manifest + tokenizer + summary table
    data check --manifest FILE                               does the running stdlib match? (exit 1 if not)
    data sample --tokenizer DIR --task kv|agent [--seed S] [--distance D ...]   print one decoded example
    train --model NAME [--steps N] [--threads T] [--export DIR] ...       train or resume a sibling model
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from model.train.agent_transcript import AgentSpec, agent_transcript, index_files
from model.train.build import MANIFEST_FILE, build_data
from model.train.corpus import CorpusManifest, CorpusSpec, build_manifest, compare_manifests, read_split
from model.train.dataset import tokenize_corpus
from model.train.family import FAMILY_RECALL_TASK
from model.train.kv_recall import kv_recall
from model.train.tasks import CorpusFiller
from model.train.tokenizer import load_tokenizer
from model.train.trainer import add_train_arguments, train_from_args


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m model.train", description=__doc__.splitlines()[0])
    top = p.add_subparsers(dest="group", required=True)
    data = top.add_parser("data", help="corpus and tokenizer").add_subparsers(dest="command", required=True)
    b = data.add_parser("build", help="select the corpus, train the tokenizer, print a summary")
    b.add_argument("--out", required=True, type=Path)
    b.add_argument("--max-bytes", type=int, default=CorpusSpec().max_bytes)
    b.add_argument("--vocab-size", type=int, default=4096)
    b.add_argument("--min-frequency", type=int, default=2)
    c = data.add_parser("check", help="compare a recorded manifest with the running interpreter's stdlib")
    c.add_argument("--manifest", required=True, type=Path)
    s = data.add_parser("sample", help="print one generated example, decoded")
    s.add_argument("--tokenizer", type=Path, default=None, help="dir with tokenizer.json (default: bytes)")
    s.add_argument("--manifest", type=Path, default=None, help="default: manifest.json beside the tokenizer")
    s.add_argument("--task", choices=("kv", "agent"), default="kv")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--distance", type=int, nargs="*", default=None)
    k = data.add_parser("tokens", help="write a JSON list of token-id rows of the training mixture (mapper "
                        "calibration: `kvresume mapper fit --tokens-file`)")
    k.add_argument("--out", required=True, type=Path)
    k.add_argument("--rows", type=int, default=64)
    k.add_argument("--length", type=int, default=256)
    k.add_argument("--split", choices=("train", "validation", "test"), default="validation")
    k.add_argument("--seed", type=int, default=0)
    add_train_arguments(top.add_parser("train", help="train or resume a sibling model (kvresume train)"))
    return p


def _sample(args: argparse.Namespace) -> int:
    tok = load_tokenizer(args.tokenizer)
    manifest_path = args.manifest or (args.tokenizer / MANIFEST_FILE if args.tokenizer else None)
    manifest = CorpusManifest.load(manifest_path) if manifest_path else build_manifest()
    # a small corpus can have an empty validation split; fall back to train rather than fail
    files = read_split(manifest, "validation") or read_split(manifest, "train")
    filler = CorpusFiller(tokenize_corpus(tok, [t for _, t in files]))
    rng = np.random.default_rng(args.seed)
    if args.task == "kv":
        spec = dataclasses.replace(FAMILY_RECALL_TASK, n_pairs=max(4, len(args.distance or ())))
        ex = kv_recall(tok, rng, spec, filler, distances=args.distance)
    else:
        ex = agent_transcript(tok, rng, AgentSpec(), index_files(files), filler, distances=args.distance)
    print(tok.decode(ex.ids.tolist()))
    print("---")
    for a in ex.answers:
        print(f"{a.kind:<14} distance {a.distance:>6}  answer {a.text!r}  tokens [{a.start}, {a.end})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.group == "train":
        return train_from_args(args)
    if args.command == "build":
        summary = build_data(
            args.out,
            spec=CorpusSpec(max_bytes=args.max_bytes),
            vocab_size=args.vocab_size,
            min_frequency=args.min_frequency,
        )
        print(summary.table())
        return 0
    if args.command == "check":
        recorded = CorpusManifest.load(args.manifest)
        diff = compare_manifests(recorded, build_manifest(recorded.spec))
        print(diff.summary())
        return 0 if diff.identical else 1
    if args.command == "tokens":
        return _tokens(args)
    return _sample(args)


def _tokens(args: argparse.Namespace) -> int:
    """Rows of the shipped mixture (corpus LM and key-value episodes at the full distance range) drawn from
    one split with the shipped tokenizer, written as JSON lists of ids."""
    import json

    from model.train import shipped_tokenizer_dir
    from model.train.dataset import TrainStream
    from model.train.trainer import default_mixture

    if args.rows < 1 or args.length < 16:
        raise SystemExit(f"--rows={args.rows} must be >= 1 and --length={args.length} >= 16")
    tok_dir = shipped_tokenizer_dir()
    mix = default_mixture(seed=args.seed, seq_len=args.length)
    manifest = CorpusManifest.load(tok_dir / MANIFEST_FILE)
    stream = TrainStream.from_manifest(mix, load_tokenizer(tok_dir), manifest, args.split)
    # a step past the curriculum's last stage: questions at every distance the mixture allows
    late = mix.curriculum[-1][0] + 1
    rows = [stream.row(late, i).ids[: args.length].tolist() for i in range(args.rows)]
    args.out.write_text(json.dumps(rows))
    print(f"wrote {len(rows)} rows of {args.length} tokens ({args.split} split) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
