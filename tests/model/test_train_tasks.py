"""Long-range tasks: answers sit at the requested distances, masks cover exactly the answers, answers are
checkable against their evidence, generation is seeded, and bad parameters name themselves."""

from __future__ import annotations

import ast
import re

import numpy as np
import pytest

from model.train import (
    DISTANCE_BUCKETS,
    AgentFile,
    AgentSpec,
    BpeTokenizer,
    ByteTokenizer,
    CorpusFiller,
    CorpusManifest,
    KvRecallSpec,
    RandomFiller,
    TaskExample,
    TextTokenizer,
    agent_transcript,
    bucket_of,
    bucket_targets,
    index_files,
    kv_recall,
    read_split,
    shipped_tokenizer_dir,
    tokenize_corpus,
)


@pytest.fixture(scope="module")
def bpe() -> BpeTokenizer:
    return BpeTokenizer.load(shipped_tokenizer_dir())


@pytest.fixture(scope="module")
def validation() -> list[tuple[str, str]]:
    return read_split(CorpusManifest.load(shipped_tokenizer_dir() / "manifest.json"), "validation")


@pytest.fixture(scope="module")
def files(validation: list[tuple[str, str]]) -> list[AgentFile]:
    return index_files(validation)


@pytest.fixture(scope="module")
def filler(bpe: BpeTokenizer, validation: list[tuple[str, str]]) -> CorpusFiller:
    return CorpusFiller(tokenize_corpus(bpe, [t for _, t in validation]))


def _check_masks_and_spans(tok: TextTokenizer, ex: TaskExample) -> None:
    expected = np.zeros_like(ex.loss_mask)
    for a in ex.answers:
        expected[a.start : a.end] = True
        # the answer tokens spell the answer; the evidence holds it
        assert tok.decode(ex.ids[a.start : a.end].tolist()) == " " + a.text
        assert a.text in tok.decode(ex.ids[a.evidence_start : a.evidence_end].tolist())
        assert a.evidence_end <= a.start and a.distance == a.start - a.evidence_start
    assert np.array_equal(ex.loss_mask, expected)
    assert int(ex.loss_mask.sum()) == sum(a.end - a.start for a in ex.answers)


@pytest.mark.parametrize("tokenizer", ["bpe", "byte"])
def test_kv_recall_answers_at_requested_distances(tokenizer: str, bpe: BpeTokenizer) -> None:
    tok: TextTokenizer = bpe if tokenizer == "bpe" else ByteTokenizer()
    distances = [100, 256, 1024, 4096]
    spec = KvRecallSpec(n_pairs=4, n_queries=4)
    ex = kv_recall(tok, np.random.default_rng(7), spec, RandomFiller(tok.vocab_size), distances=distances)
    assert sorted(ex.distances) == distances
    assert len({a.text for a in ex.answers}) == 4
    _check_masks_and_spans(tok, ex)
    sp = tok.specials
    for a in ex.answers:
        # "key -> ?": <a> right before the answer, the key between <q><key> and <a>
        assert ex.ids[a.start - 1] == sp.a and ex.ids[a.end] == sp.end
    assert ex.ids[0] == sp.bos and len(ex.ids) == max(a.end for a in ex.answers) + 1


def test_kv_recall_unmarked_layout_puts_the_value_right_after_its_key(bpe: BpeTokenizer) -> None:
    """markers=False (the family's task): definitions are <key> K V <end> and questions <q> <key> K V <end>;
    the token before each answer is the key's last token, which also precedes the evidence; the shortest
    distance the layout allows is accepted exactly."""
    spec = KvRecallSpec(n_pairs=4, n_queries=4, key_syllables=2, value_digits=2, markers=False)
    sp = bpe.specials
    filler = RandomFiller(bpe.vocab_size)
    ex = kv_recall(bpe, np.random.default_rng(11), spec, filler, distances=[60, 90, 130])
    assert sorted(ex.distances) == [60, 90, 130]
    _check_masks_and_spans(bpe, ex)
    ids = ex.ids.tolist()
    assert sp.a not in ids and sp.val not in ids
    for a in ex.answers:
        assert ids[a.start - 1] == ids[a.evidence_start - 1] != sp.key and ids[a.end] == sp.end
        key_start = max(i for i in range(a.start) if ids[i] == sp.key) + 1
        assert ids[key_start - 2] == sp.q
        key = ids[key_start : a.start]
        assert ids[a.evidence_start - len(key) : a.evidence_start] == key
    # the floor of the layout: a question placed right after the definitions block
    for d in range(1, 200):
        try:
            kv_recall(bpe, np.random.default_rng(11), spec, RandomFiller(bpe.vocab_size), distances=[d])
        except ValueError:
            continue
        break
    one = kv_recall(bpe, np.random.default_rng(11), spec, RandomFiller(bpe.vocab_size), distances=[d])
    assert one.distances == [d]


def test_kv_recall_packed_fills_length_within_max_distance(bpe: BpeTokenizer, filler: CorpusFiller) -> None:
    spec = KvRecallSpec(n_pairs=6, n_queries=6, min_distance=8, max_distance=96, length=513)
    for seed in range(5):
        ex = kv_recall(bpe, np.random.default_rng(seed), spec, filler)
        assert ex.ids.shape == (513,) and ex.ids.dtype == np.int64
        assert len(ex.answers) >= 6
        assert all(8 <= d <= 96 for d in ex.distances), ex.distances
        _check_masks_and_spans(bpe, ex)


def test_kv_recall_is_seeded(bpe: BpeTokenizer, filler: CorpusFiller) -> None:
    spec = KvRecallSpec(length=300)
    a = kv_recall(bpe, np.random.default_rng(3), spec, filler)
    b = kv_recall(bpe, np.random.default_rng(3), spec, filler)
    c = kv_recall(bpe, np.random.default_rng(4), spec, filler)
    assert np.array_equal(a.ids, b.ids) and a.answers == b.answers
    assert not np.array_equal(a.ids, c.ids)


def test_kv_recall_colliding_questions_move_right_and_say_so(bpe: BpeTokenizer) -> None:
    tok = ByteTokenizer()
    spec = KvRecallSpec(n_pairs=3, n_queries=3)
    ex = kv_recall(tok, np.random.default_rng(0), spec, RandomFiller(tok.vocab_size), distances=[80, 81, 82])
    got = sorted(ex.distances)
    # the stride between definitions keeps equal distances apart, but not distances one token apart:
    # questions that would overlap move right, and the example records the distance they ended up at
    assert got != [80, 81, 82] and all(g >= r for g, r in zip(got, [80, 81, 82], strict=True))
    assert len(set(got) & {80, 81, 82}) >= 1
    _check_masks_and_spans(tok, ex)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"n_pairs": 2, "n_queries": 3}, "n_queries=3"),
        ({"min_distance": 50, "max_distance": 10}, "max_distance=10"),
        ({"n_pairs": 0}, "n_pairs=0"),
        ({"length": 1}, "length=1"),
    ],
)
def test_kv_recall_spec_rejects_bad_values(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        KvRecallSpec(**kwargs)


def test_kv_recall_rejects_unreachable_distances(bpe: BpeTokenizer, filler: CorpusFiller) -> None:
    four = KvRecallSpec(n_pairs=4, n_queries=4)
    with pytest.raises(ValueError, match="distance=3"):
        kv_recall(bpe, np.random.default_rng(0), four, filler, distances=[3])
    with pytest.raises(ValueError, match="5 distances"):
        kv_recall(bpe, np.random.default_rng(0), four, filler, distances=[500] * 5)
    with pytest.raises(ValueError, match="length=100"):
        kv_recall(bpe, np.random.default_rng(0), KvRecallSpec(length=100), filler, distances=[500])


def _check_against_file(tok: TextTokenizer, ex: TaskExample, by_path: dict[str, str]) -> None:
    """Re-derive each answer from the question text and the file, independently of the generator."""
    for a in ex.answers:
        question = tok.decode(ex.ids[max(0, a.start - 60) : a.start].tolist()).rsplit("<q>", 1)[1]
        if a.kind == "first_import":
            path = re.search(r"Which module does (\S+) import first\?", question).group(1)
            tree = ast.parse(by_path[path])
            first = min(
                (n.lineno, n.col_offset, n.names[0].name if isinstance(n, ast.Import) else n.module)
                for n in ast.walk(tree)
                if isinstance(n, ast.Import) or (isinstance(n, ast.ImportFrom) and n.level == 0)
            )
            assert first[2] == a.text
        else:
            m = re.search(r"defined at line (\d+) of (\S+)\?", question)
            line = by_path[m.group(2)].split("\n")[int(m.group(1)) - 1]
            word = "def" if a.kind == "def_at_line" else "class"
            assert re.search(rf"\b{word}\s+{re.escape(a.text)}\b", line), (line, a)


def test_agent_transcript_answers_are_file_spans_at_requested_distances(
    bpe: BpeTokenizer, files: list[AgentFile], filler: CorpusFiller, validation: list[tuple[str, str]]
) -> None:
    by_path = dict(validation)
    for seed in range(4):
        distances = [64, 512, 4096]
        rng = np.random.default_rng(seed)
        ex = agent_transcript(bpe, rng, AgentSpec(), files, filler, distances=distances)
        assert sorted(ex.distances) == distances
        _check_masks_and_spans(bpe, ex)
        _check_against_file(bpe, ex, by_path)
        text = bpe.decode(ex.ids.tolist())
        assert text.startswith("<bos><user>") and "<tool> read_file(" in text and "<result>" in text


def test_agent_transcript_packed_fills_length(
    bpe: BpeTokenizer, files: list[AgentFile], filler: CorpusFiller, validation: list[tuple[str, str]]
) -> None:
    spec = AgentSpec(max_distance=300, max_file_tokens=256, length=1025)
    seen = set()
    for seed in range(6):
        ex = agent_transcript(bpe, np.random.default_rng(seed), spec, files, filler)
        assert ex.ids.shape == (1025,)
        assert ex.answers and all(d <= 300 for d in ex.distances)
        _check_masks_and_spans(bpe, ex)
        _check_against_file(bpe, ex, dict(validation))
        seen.update(a.kind for a in ex.answers)
    assert seen == {"def_at_line", "class_at_line", "first_import"}


def test_index_files_finds_facts() -> None:
    text = "'''doc: import nothing'''\nfrom os import path\nimport sys\n\n"
    text += "class A:\n    def m(self):\n        pass\n"
    (f,) = index_files([("x.py", text), ("broken.py", "def (:\n")])
    got = [(x.kind, x.line, x.answer, text[x.offset : x.offset + len(x.answer)]) for x in f.facts]
    assert got == [
        ("first_import", 2, "os", "os"),
        ("class_at_line", 5, "A", "A"),
        ("def_at_line", 6, "m", "m"),
    ]


def test_agent_spec_rejects_bad_values(bpe: BpeTokenizer, filler: CorpusFiller) -> None:
    with pytest.raises(ValueError, match="kinds"):
        AgentSpec(kinds=("line_count",))
    with pytest.raises(ValueError, match="max_file_tokens=0"):
        AgentSpec(max_file_tokens=0)
    with pytest.raises(ValueError, match="files is empty"):
        agent_transcript(bpe, np.random.default_rng(0), AgentSpec(), [], filler)


def test_distance_buckets_cover_their_targets() -> None:
    for window in (16, 128):
        targets = bucket_targets(window)
        assert set(targets) == {name for name, _, _ in DISTANCE_BUCKETS}
        assert all(bucket_of(d, window) == name for name, d in targets.items())
        assert targets["32W"] == 32 * window and bucket_of(window, window) is None
    with pytest.raises(ValueError, match="window=0"):
        bucket_of(5, 0)
