"""Text <-> token ids for a served model: its BPE tokenizer when it ships one, else UTF-8 bytes.

Knows nothing of the model's weights; it only needs the vocabulary size to refuse a tokenizer whose ids
would not fit. Both codecs keep the family's special-token table at ids 0..15, so a byte id is 16 + byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer

__all__ = ["TextCodec", "ByteCodec", "BpeCodec", "choose_codec", "N_SPECIAL_IDS"]

# ids 0..15 are the sibling family's special tokens (<pad>, <bos>, ..., <reserved_3>)
N_SPECIAL_IDS = 16


class TextCodec(Protocol):
    """What the turn engine needs from a tokenizer."""

    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteCodec:
    """One id per UTF-8 byte (16 + byte); special ids decode to nothing. Needs a vocabulary of >= 272."""

    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return [N_SPECIAL_IDS + b for b in text.encode("utf-8", errors="replace")]

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(i - N_SPECIAL_IDS for i in ids if N_SPECIAL_IDS <= i < N_SPECIAL_IDS + 256)
        return data.decode("utf-8", errors="replace")


class BpeCodec:
    """A byte-level BPE `tokenizer.json` (the family's shipped tokenizer, or a checkpoint's own)."""

    def __init__(self, path: Path) -> None:
        self._tok = Tokenizer.from_file(str(path))
        self.name = f"bpe:{path}"
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def choose_codec(vocab_size: int, candidates: Sequence[Path]) -> TextCodec:
    """The first candidate `tokenizer.json` that exists and fits the model's vocabulary, else bytes.

    Raises:
        ValueError: no tokenizer fits and the vocabulary is too small for the byte codec.
    """
    for path in candidates:
        if path.is_file():
            codec = BpeCodec(path)
            if codec.vocab_size <= vocab_size:
                return codec
    if vocab_size < N_SPECIAL_IDS + 256:
        raise ValueError(f"vocab_size={vocab_size} fits neither a shipped tokenizer nor the byte codec")
    return ByteCodec()
