"""Text tokenizers for the sibling model family: a byte-level BPE trained on the local corpus, and a byte
fallback with the same interface for models that ship without one. Knows nothing of models or tasks.

Both share one special-token table (`SPECIAL_TOKENS`, ids 0..15 in this order), so task generators and
the service can address markers by id without knowing which tokenizer is in use:

| id | token | meaning |
|---|---|---|
| 0 | `<pad>` | padding; never supervised |
| 1 | `<bos>` | start of a sequence |
| 2 | `<eos>` | end of a document (between corpus files) |
| 3 | `<user>` | a user turn begins |
| 4 | `<asst>` | an assistant turn begins |
| 5 | `<tool>` | a tool call begins (inside an assistant turn) |
| 6 | `<result>` | a tool result begins |
| 7 | `<end>` | the current turn, definition or answer ends |
| 8 | `<key>` | a key follows (definition or query) |
| 9 | `<val>` | the value of the preceding key follows |
| 10 | `<q>` | a question follows |
| 11 | `<a>` | the answer follows; its tokens are the supervised positions |
| 12-15 | `<reserved_0>`..`<reserved_3>` | unused; keep later additions from shifting ids |

`encode` treats its input as plain text: a literal "<key>" inside source code is split into ordinary
tokens, never mapped to the special id (otherwise corpus text could forge task markers). Special ids
are only ever inserted by the callers that build sequences; `decode` renders them as their strings.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = [
    "SPECIAL_TOKENS",
    "BpeTokenizer",
    "ByteTokenizer",
    "SpecialTokens",
    "TextTokenizer",
    "load_tokenizer",
]

SPECIAL_TOKENS: tuple[str, ...] = (
    "<pad>",
    "<bos>",
    "<eos>",
    "<user>",
    "<asst>",
    "<tool>",
    "<result>",
    "<end>",
    "<key>",
    "<val>",
    "<q>",
    "<a>",
    "<reserved_0>",
    "<reserved_1>",
    "<reserved_2>",
    "<reserved_3>",
)
_N_SPECIAL = len(SPECIAL_TOKENS)
# Below this the trainer has no room for merges beyond the 256 byte symbols and the specials.
_MIN_BPE_VOCAB = _N_SPECIAL + 256 + 1


@dataclass(frozen=True, kw_only=True)
class SpecialTokens:
    """Ids of the special tokens; identical for every tokenizer of this module."""

    pad: int = 0
    bos: int = 1
    eos: int = 2
    user: int = 3
    asst: int = 4
    tool: int = 5
    result: int = 6
    end: int = 7
    key: int = 8
    val: int = 9
    q: int = 10
    a: int = 11

    @property
    def count(self) -> int:
        """Number of ids reserved for special tokens (the first non-special id)."""
        return _N_SPECIAL


@runtime_checkable
class TextTokenizer(Protocol):
    """What task generators, the dataset and the service need from a tokenizer."""

    specials: SpecialTokens

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def digest(self) -> str: ...


def _check_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    out = [int(i) for i in ids]
    bad = [i for i in out if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    return out


class BpeTokenizer:
    """Byte-level BPE (GPT-2 pre-tokenization, no prefix space) over the `tokenizers` library.

    Every string round-trips exactly: `decode(encode(s)) == s` for any `s` that is valid UTF-8.
    """

    specials = SpecialTokens()

    def __init__(self, tokenizer: Tokenizer) -> None:
        got = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
        if got != list(range(_N_SPECIAL)):
            raise ValueError(
                f"tokenizer special-token ids {got} differ from SPECIAL_TOKENS order 0..{_N_SPECIAL - 1}"
            )
        # Plain-text encoding: special strings inside the input are not matched (see module docstring).
        tokenizer.encode_special_tokens = True
        self._tok = tokenizer

    @classmethod
    def train(cls, texts: Iterable[str], *, vocab_size: int = 4096, min_frequency: int = 2) -> BpeTokenizer:
        """Train on `texts` (the corpus train split). Deterministic: the same texts give the same JSON.

        Raises:
            ValueError: `vocab_size` leaves no room for merges, or `min_frequency` < 1.
        """
        if vocab_size < _MIN_BPE_VOCAB:
            raise ValueError(f"vocab_size={vocab_size} must be >= {_MIN_BPE_VOCAB} (specials, 256 bytes, 1)")
        if min_frequency < 1:
            raise ValueError(f"min_frequency={min_frequency} must be >= 1")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(SPECIAL_TOKENS),
            # all 256 byte symbols, even those absent from the corpus, so any input stays encodable
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(list(texts), trainer=trainer)
        return cls(tok)

    @classmethod
    def from_json(cls, text: str) -> BpeTokenizer:
        """Load from the JSON text of `to_json` (a `tokenizer.json`)."""
        return cls(Tokenizer.from_str(text))

    @classmethod
    def load(cls, path: str | Path) -> BpeTokenizer:
        """Load a `tokenizer.json` file (or a directory holding one)."""
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        return cls.from_json(p.read_text(encoding="utf-8"))

    def to_json(self) -> str:
        """The `tokenizer.json` text; byte-identical for identical training input."""
        # encode_special_tokens is runtime state, not part of the saved file: save it at its default
        self._tok.encode_special_tokens = False
        try:
            return self._tok.to_str(pretty=True)
        finally:
            self._tok.encode_special_tokens = True

    def save(self, path: str | Path) -> Path:
        """Write `tokenizer.json` to `path` (a file, or a directory to put it in); returns the file path."""
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        p.write_text(self.to_json(), encoding="utf-8")
        return p

    def digest(self) -> str:
        """sha256 hex of the saved JSON: identifies the tokenizer in checkpoints and fingerprints."""
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids (no special tokens added or matched)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Plain text -> (ids, [start, end) character offsets of each token in `text`)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, list(enc.offsets)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` over many texts (parallel in the library)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text; special ids render as their strings; invalid UTF-8 becomes U+FFFD.

        Raises:
            ValueError: an id outside the vocabulary.
        """
        return self._tok.decode(_check_ids(ids, self.vocab_size), skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry of one id (byte-level symbols for ordinary tokens)."""
        (i,) = _check_ids([token_id], self.vocab_size)
        return self._tok.id_to_token(i)


class ByteTokenizer:
    """UTF-8 bytes as tokens: id = 16 + byte; the specials keep ids 0..15. Vocabulary 272.

    Round-trips every string that encodes as UTF-8 (any text without lone surrogates).
    """

    specials = SpecialTokens()

    @property
    def vocab_size(self) -> int:
        return _N_SPECIAL + 256

    def encode(self, text: str) -> list[int]:
        """Plain text -> one id per UTF-8 byte.

        Raises:
            ValueError: `text` holds a lone surrogate (not encodable as UTF-8).
        """
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"text is not encodable as UTF-8 at index {exc.start}: {exc.reason}") from exc
        return [_N_SPECIAL + b for b in data]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Plain text -> (ids, offsets); every byte of a character carries that character's offsets."""
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        for i, ch in enumerate(text):
            piece = self.encode(ch)
            ids.extend(piece)
            offsets.extend([(i, i + 1)] * len(piece))
        return ids, offsets

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text; special ids render as their strings; invalid UTF-8 becomes U+FFFD.

        Raises:
            ValueError: an id outside the vocabulary.
        """
        parts: list[str] = []
        pending = bytearray()
        for i in _check_ids(ids, self.vocab_size):
            if i >= _N_SPECIAL:
                pending.append(i - _N_SPECIAL)
                continue
            parts.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            parts.append(SPECIAL_TOKENS[i])
        parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)

    def digest(self) -> str:
        """A fixed identifier: the byte tokenizer has no trained state."""
        return hashlib.sha256(("byte-fallback-v1:" + ",".join(SPECIAL_TOKENS)).encode("utf-8")).hexdigest()


def load_tokenizer(path: str | Path | None) -> TextTokenizer:
    """The BPE tokenizer saved at `path` (file or directory), or the byte fallback when `path` is None.

    Raises:
        ValueError: `path` is given but holds no `tokenizer.json`.
    """
    if path is None:
        return ByteTokenizer()
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ValueError(f"no tokenizer.json at {str(path)!r}")
    return BpeTokenizer.load(p)
