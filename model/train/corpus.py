"""The training corpus: a deterministic selection of the running interpreter's standard-library sources,
recorded as a manifest (path, sha256, size, split) so a rebuild elsewhere is checked, not assumed equal.
Knows nothing of tokenizers or models.

Selection: every `*.py` file under `sysconfig.get_paths()["stdlib"]` outside the excluded directories,
between `min_file_bytes` and `max_file_bytes`, valid UTF-8; ordered by sha256("select:" + relative path)
and taken while the running total stays within `max_bytes` (a hash order samples all of the library
instead of its alphabetical head). The split of a file is a function of its relative path alone
(sha256("split:" + path) against the split fractions), so adding a file never moves another one.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from model.errors import ModelError

__all__ = [
    "SPLITS",
    "CorpusChangedError",
    "CorpusManifest",
    "CorpusSpec",
    "FileEntry",
    "ManifestDiff",
    "build_manifest",
    "compare_manifests",
    "read_split",
    "stdlib_root",
]

SPLITS: tuple[str, ...] = ("train", "validation", "test")
MANIFEST_VERSION = 1
# Hash prefixes give the split a uniform value in [0, 1) from 48 bits of the digest.
_HASH_HEX_DIGITS = 12


class CorpusChangedError(ModelError):
    """A corpus file differs from the manifest (other Python version or edited file).

    Rebuild the manifest and tokenizer on this interpreter (`python -m model.train data build`), or run
    with the interpreter the manifest records.
    """


@dataclass(frozen=True, kw_only=True)
class CorpusSpec:
    """Which stdlib files make up the corpus and how they split. Sizes in bytes."""

    max_bytes: int = 4_000_000
    max_file_bytes: int = 128 * 1024
    min_file_bytes: int = 256
    # test suites are mostly fixtures; encodings/ and pydoc_data/ are generated tables and prose
    exclude_dirs: tuple[str, ...] = (
        "site-packages",
        "dist-packages",
        "__pycache__",
        "test",
        "tests",
        "idle_test",
        "encodings",
        "pydoc_data",
        "lib-dynload",
        "ensurepip",
    )
    split_fractions: tuple[float, float, float] = (0.90, 0.05, 0.05)

    def __post_init__(self) -> None:
        object.__setattr__(self, "exclude_dirs", tuple(self.exclude_dirs))
        object.__setattr__(self, "split_fractions", tuple(float(f) for f in self.split_fractions))
        if self.max_bytes <= 0:
            raise ValueError(f"max_bytes={self.max_bytes} must be positive")
        if not 0 <= self.min_file_bytes <= self.max_file_bytes:
            raise ValueError(
                f"need 0 <= min_file_bytes={self.min_file_bytes} <= max_file_bytes={self.max_file_bytes}"
            )
        fr = self.split_fractions
        if len(fr) != len(SPLITS) or any(f < 0 for f in fr) or abs(sum(fr) - 1.0) > 1e-9:
            raise ValueError(f"split_fractions={fr} must be {len(SPLITS)} non-negative numbers summing to 1")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CorpusSpec:
        """Inverse of `dataclasses.asdict`; unknown keys are an error."""
        unknown = set(data) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise ValueError(f"unknown CorpusSpec keys {sorted(unknown)}")
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    """One corpus file: `path` is relative to the stdlib root, POSIX separators."""

    path: str
    sha256: str
    size: int
    split: str


@dataclass(frozen=True, kw_only=True)
class ManifestDiff:
    """How a current stdlib differs from a recorded manifest (empty tuples when it does not)."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    python_before: str = ""
    python_now: str = ""

    @property
    def identical(self) -> bool:
        return not (self.added or self.removed or self.changed)

    def summary(self) -> str:
        if self.identical:
            return "corpus identical to manifest"
        return (
            f"corpus differs from manifest (python {self.python_before} -> {self.python_now}): "
            f"{len(self.added)} added, {len(self.removed)} removed, {len(self.changed)} changed; "
            f"first: {(self.added + self.removed + self.changed)[:3]}"
        )


@dataclass(frozen=True, kw_only=True)
class CorpusManifest:
    """The recorded corpus: spec, interpreter, and files sorted by path."""

    spec: CorpusSpec
    python: str
    files: tuple[FileEntry, ...]
    version: int = MANIFEST_VERSION
    # informational; comparisons and reads take the root of the running interpreter
    source: str = field(default="python-stdlib")

    def split(self, name: str) -> tuple[FileEntry, ...]:
        """The files of split `name` ("train", "validation" or "test"), sorted by path."""
        if name not in SPLITS:
            raise ValueError(f"split={name!r} must be one of {SPLITS}")
        return tuple(f for f in self.files if f.split == name)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> str:
        """Stable JSON text (sorted keys, fixed indentation): equal manifests give equal bytes."""
        data = {
            "version": self.version,
            "source": self.source,
            "python": self.python,
            "spec": asdict(self.spec),
            "files": [asdict(f) for f in self.files],
        }
        return json.dumps(data, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> CorpusManifest:
        """Parse `to_json` output.

        Raises:
            ValueError: unknown manifest version or malformed content.
        """
        data = json.loads(text)
        if data.get("version") != MANIFEST_VERSION:
            raise ValueError(f"manifest version={data.get('version')!r}, expected {MANIFEST_VERSION}")
        files = tuple(FileEntry(**f) for f in data["files"])
        return cls(
            spec=CorpusSpec.from_dict(data["spec"]),
            python=data["python"],
            files=files,
            version=data["version"],
            source=data["source"],
        )

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.write_text(self.to_json(), encoding="utf-8")
        return p

    @classmethod
    def load(cls, path: str | Path) -> CorpusManifest:
        return cls.from_json(Path(path).read_text(encoding="utf-8"))


def stdlib_root() -> Path:
    """The standard-library directory of the running interpreter (not a virtualenv's)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _unit_hash(prefix: str, rel: str) -> int:
    return int(hashlib.sha256((prefix + rel).encode("utf-8")).hexdigest()[:_HASH_HEX_DIGITS], 16)


def _split_of(rel: str, fractions: tuple[float, float, float]) -> str:
    u = _unit_hash("split:", rel) / 16**_HASH_HEX_DIGITS
    edge = 0.0
    for name, frac in zip(SPLITS, fractions, strict=True):
        edge += frac
        if u < edge:
            return name
    return SPLITS[-1]


def _candidates(root: Path, spec: CorpusSpec) -> list[tuple[str, Path, int]]:
    excluded = set(spec.exclude_dirs)
    out: list[tuple[str, Path, int]] = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if excluded.intersection(rel.split("/")[:-1]) or not p.is_file():
            continue
        size = p.stat().st_size
        if spec.min_file_bytes <= size <= spec.max_file_bytes:
            out.append((rel, p, size))
    return out


def build_manifest(spec: CorpusSpec | None = None, root: str | Path | None = None) -> CorpusManifest:
    """Select and hash the corpus files under `root` (default: the running interpreter's stdlib).

    Raises:
        ValueError: `root` is not a directory, or no file qualifies.
    """
    spec = spec or CorpusSpec()
    base = Path(root) if root is not None else stdlib_root()
    if not base.is_dir():
        raise ValueError(f"corpus root {str(base)!r} is not a directory")
    chosen: list[FileEntry] = []
    total = 0
    for rel, path, size in sorted(_candidates(base, spec), key=lambda c: (_unit_hash("select:", c[0]), c[0])):
        if total + size > spec.max_bytes:
            continue
        data = path.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        total += len(data)
        chosen.append(
            FileEntry(
                path=rel,
                sha256=hashlib.sha256(data).hexdigest(),
                size=len(data),
                split=_split_of(rel, spec.split_fractions),
            )
        )
    if not chosen:
        raise ValueError(f"no corpus file under {str(base)!r} fits spec {spec}")
    chosen.sort(key=lambda f: f.path)
    return CorpusManifest(spec=spec, python=platform.python_version(), files=tuple(chosen))


def compare_manifests(recorded: CorpusManifest, current: CorpusManifest) -> ManifestDiff:
    """Files added, removed, or changed (different sha256 or split) from `recorded` to `current`."""
    before = {f.path: f for f in recorded.files}
    now = {f.path: f for f in current.files}
    changed = tuple(
        p
        for p in sorted(before.keys() & now.keys())
        if (before[p].sha256, before[p].split) != (now[p].sha256, now[p].split)
    )
    return ManifestDiff(
        added=tuple(sorted(now.keys() - before.keys())),
        removed=tuple(sorted(before.keys() - now.keys())),
        changed=changed,
        python_before=recorded.python,
        python_now=current.python,
    )


def read_split(manifest: CorpusManifest, name: str, root: str | Path | None = None) -> list[tuple[str, str]]:
    """(path, text) of every file of split `name`, each checked against its recorded sha256.

    Raises:
        ValueError: unknown split name.
        CorpusChangedError: a file is missing or its bytes differ from the manifest.
    """
    base = Path(root) if root is not None else stdlib_root()
    out: list[tuple[str, str]] = []
    for entry in manifest.split(name):
        p = base / entry.path
        if not p.is_file():
            raise CorpusChangedError(f"corpus file {entry.path!r} missing under {str(base)!r}")
        data = p.read_bytes()
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            raise CorpusChangedError(
                f"corpus file {entry.path!r} differs from manifest (python {manifest.python} recorded, "
                f"{platform.python_version()} running)"
            )
        out.append((entry.path, data.decode("utf-8")))
    return out
