"""Building the data artifacts: corpus manifest plus trained tokenizer in one directory, with a summary.
Knows nothing of training; `__main__.py` is its command line.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from model.train.corpus import SPLITS, CorpusManifest, CorpusSpec, build_manifest, read_split
from model.train.tokenizer import BpeTokenizer

__all__ = ["BuildSummary", "SplitSummary", "build_data"]

MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SUMMARY_FILE = "summary.json"


@dataclass(frozen=True, kw_only=True)
class SplitSummary:
    split: str
    files: int
    bytes: int
    tokens: int


@dataclass(frozen=True, kw_only=True)
class BuildSummary:
    """What `build_data` wrote: per-split counts, vocabulary, file digests, wall seconds."""

    out: Path
    python: str
    splits: tuple[SplitSummary, ...]
    vocab_size: int
    manifest_sha256: str
    tokenizer_sha256: str
    seconds: float

    def table(self) -> str:
        """A plain-text table for the terminal."""
        rows = [f"{'split':<11}{'files':>7}{'bytes':>11}{'tokens':>10}{'bytes/tok':>11}"]
        for s in (*self.splits, self.total):
            ratio = s.bytes / s.tokens if s.tokens else 0.0
            rows.append(f"{s.split:<11}{s.files:>7}{s.bytes:>11}{s.tokens:>10}{ratio:>11.2f}")
        rows.append(f"vocab size {self.vocab_size}; python {self.python}; {self.seconds:.1f} s")
        rows.append(f"manifest.json  sha256 {self.manifest_sha256}")
        rows.append(f"tokenizer.json sha256 {self.tokenizer_sha256}")
        return "\n".join(rows)

    @property
    def total(self) -> SplitSummary:
        return SplitSummary(
            split="total",
            files=sum(s.files for s in self.splits),
            bytes=sum(s.bytes for s in self.splits),
            tokens=sum(s.tokens for s in self.splits),
        )

    def to_json(self) -> str:
        data = {
            "python": self.python,
            "splits": [vars(s) for s in self.splits],
            "vocab_size": self.vocab_size,
            "manifest_sha256": self.manifest_sha256,
            "tokenizer_sha256": self.tokenizer_sha256,
            "seconds": round(self.seconds, 2),
        }
        return json.dumps(data, indent=1, sort_keys=True) + "\n"


def build_data(
    out: str | Path,
    *,
    spec: CorpusSpec | None = None,
    vocab_size: int = 4096,
    min_frequency: int = 2,
    root: str | Path | None = None,
) -> BuildSummary:
    """Select the corpus, train the tokenizer on its train split, and write manifest.json, tokenizer.json
    and summary.json into `out` (created if missing).

    Raises:
        ValueError: bad spec or vocabulary parameters (see `CorpusSpec`, `BpeTokenizer.train`).
    """
    t0 = time.perf_counter()
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest: CorpusManifest = build_manifest(spec, root)
    texts = {name: read_split(manifest, name, root) for name in SPLITS}
    train_texts = [t for _, t in texts["train"]]
    tok = BpeTokenizer.train(train_texts, vocab_size=vocab_size, min_frequency=min_frequency)
    manifest_json = manifest.to_json()
    tokenizer_json = tok.to_json()
    (out_dir / MANIFEST_FILE).write_text(manifest_json, encoding="utf-8")
    (out_dir / TOKENIZER_FILE).write_text(tokenizer_json, encoding="utf-8")
    splits = tuple(
        SplitSummary(
            split=name,
            files=len(files),
            bytes=sum(len(t.encode("utf-8")) for _, t in files),
            tokens=sum(len(ids) for ids in tok.encode_batch([t for _, t in files])),
        )
        for name, files in texts.items()
    )
    summary = BuildSummary(
        out=out_dir,
        python=manifest.python,
        splits=splits,
        vocab_size=tok.vocab_size,
        manifest_sha256=hashlib.sha256(manifest_json.encode("utf-8")).hexdigest(),
        tokenizer_sha256=hashlib.sha256(tokenizer_json.encode("utf-8")).hexdigest(),
        seconds=time.perf_counter() - t0,
    )
    (out_dir / SUMMARY_FILE).write_text(summary.to_json(), encoding="utf-8")
    return summary
