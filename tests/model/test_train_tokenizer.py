"""Tokenizers: deterministic BPE training, exact round trips, special tokens kept out of plain text."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model.train import (
    SPECIAL_TOKENS,
    BpeTokenizer,
    ByteTokenizer,
    CorpusManifest,
    SpecialTokens,
    TextTokenizer,
    load_tokenizer,
    read_split,
    shipped_tokenizer_dir,
)

SAMPLE = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    x: int = 0\n\n    def norm(self) -> float:\n        return abs(self.x)\n",
    "import os\nfrom pathlib import Path\n# comment with <key> markup and ünïcode ✓\n",
] * 20


@functools.cache
def _load_shipped() -> BpeTokenizer:
    return BpeTokenizer.load(shipped_tokenizer_dir())


@pytest.fixture(scope="module")
def shipped() -> BpeTokenizer:
    return _load_shipped()


def test_bpe_train_is_deterministic() -> None:
    a = BpeTokenizer.train(SAMPLE, vocab_size=400, min_frequency=1)
    b = BpeTokenizer.train(SAMPLE, vocab_size=400, min_frequency=1)
    assert a.to_json() == b.to_json() and a.digest() == b.digest()
    assert BpeTokenizer.from_json(a.to_json()).digest() == a.digest()


def test_bpe_save_load_round_trip(tmp_path: Path) -> None:
    tok = BpeTokenizer.train(SAMPLE, vocab_size=400, min_frequency=1)
    path = tok.save(tmp_path)
    assert path.name == "tokenizer.json"
    again = load_tokenizer(tmp_path)
    assert isinstance(again, BpeTokenizer) and again.digest() == tok.digest()
    assert again.encode(SAMPLE[1]) == tok.encode(SAMPLE[1])


def test_shipped_tokenizer_round_trips_corpus_text(shipped: BpeTokenizer) -> None:
    manifest = CorpusManifest.load(shipped_tokenizer_dir() / "manifest.json")
    files = read_split(manifest, "validation")
    assert shipped.vocab_size == 4096
    for path, text in files:
        ids = shipped.encode(text)
        assert shipped.decode(ids) == text, path
        # code compresses: far fewer tokens than bytes
        assert len(ids) < len(text.encode("utf-8")) / 2.5, path


def test_special_tokens_have_fixed_ids_and_stay_out_of_plain_text(shipped: BpeTokenizer) -> None:
    sp = SpecialTokens()
    for tok in (shipped, ByteTokenizer()):
        assert isinstance(tok, TextTokenizer)
        for i, name in enumerate(SPECIAL_TOKENS):
            assert tok.decode([i]) == name
            # a literal marker in text is ordinary text, never the special id
            ids = tok.encode(name)
            assert all(j >= sp.count for j in ids) and tok.decode(ids) == name
        built = [sp.bos, *tok.encode(" x"), sp.key, *tok.encode(" k"), sp.a, *tok.encode(" 42"), sp.end]
        assert tok.decode(built) == "<bos> x<key> k<a> 42<end>"
    assert (sp.pad, sp.bos, sp.eos, sp.key, sp.a) == (0, 1, 2, 8, 11)


def test_encode_with_offsets_maps_tokens_to_text(shipped: BpeTokenizer) -> None:
    text = SAMPLE[2]
    for tok in (shipped, ByteTokenizer()):
        ids, offs = tok.encode_with_offsets(text)
        assert ids == tok.encode(text) and len(offs) == len(ids)
        assert offs[0][0] == 0 and offs[-1][1] == len(text)
        assert all(a <= b for a, b in offs)


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trips_any_unicode(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert all(16 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_bpe_tokenizer_round_trips_any_unicode(text: str) -> None:
    tok = _load_shipped()
    assert tok.decode(tok.encode(text)) == text


def test_tokenizers_reject_bad_input() -> None:
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="index 1"):
        tok.encode("a\ud800")
    with pytest.raises(ValueError, match="272"):
        tok.decode([5, 272])
    with pytest.raises(ValueError, match="vocab_size=100"):
        BpeTokenizer.train(SAMPLE, vocab_size=100)
    with pytest.raises(ValueError, match="min_frequency=0"):
        BpeTokenizer.train(SAMPLE, vocab_size=400, min_frequency=0)


def test_load_tokenizer_picks_fallback_or_file(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer(shipped_tokenizer_dir()), BpeTokenizer)
    with pytest.raises(ValueError, match="nowhere"):
        load_tokenizer(tmp_path / "nowhere")
