"""Agent-style transcripts: a tool call reads a corpus file, its text comes back as the tool result, other
turns follow, and questions about the file are asked late; each answer is a span of the file. Knows
nothing of models; see `tasks.py` for how distances are placed and measured.

Layout (" x" is encoded text with its leading space):

    <bos> <user> " Read the files I name ..." <end>
    <asst> <tool> ' read_file("json/decoder.py")' <end> <result> {lines 1..L of the file} <end>
    [other turns: reads of other code, as filler]
    <user> <q> " What is the name of the function defined at line 42 of json/decoder.py?" <end>
    <asst> <a> " py_scanstring" <end>

Question kinds, all answered by a span of the shown lines (found with `ast`, so they are checkable):
`def_at_line` (function defined at line N), `class_at_line` (class defined at line N), `first_import`
(the first module the file imports, by line). The evidence is the span of the name inside the result.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from model.train.tasks import (
    AnswerSpan,
    Filler,
    Query,
    TaskExample,
    place_queries,
    sample_distances,
    to_example,
)
from model.train.tokenizer import TextTokenizer

__all__ = ["QUESTION_KINDS", "AgentFile", "AgentSpec", "Fact", "agent_transcript", "index_files"]

QUESTION_KINDS: tuple[str, ...] = ("def_at_line", "class_at_line", "first_import")
KIND = "agent"
_INTRO = " Read the files I name, then answer my questions about them."
# Each distractor turn carries at most this many filler tokens; longer gaps become several turns.
_MAX_DISTRACTOR_TOKENS = 512
# Files tried per episode before the generator gives up on finding one with an askable fact.
_FILE_TRIES = 16
# Consecutive episodes that may fail to fit before a packed transcript is completed with other turns.
_EPISODE_TRIES = 4


@dataclass(frozen=True, kw_only=True)
class Fact:
    """An askable fact: `answer` starts at character `offset` of the file, on 1-based `line`."""

    kind: str
    line: int
    answer: str
    offset: int


@dataclass(frozen=True, kw_only=True)
class AgentFile:
    """A corpus file with its askable facts, sorted by line."""

    path: str
    text: str
    facts: tuple[Fact, ...]
    # character offset where each line begins (line n starts at line_starts[n - 1])
    line_starts: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class AgentSpec:
    """Shape of the agent-transcript task.

    n_questions: questions per episode (distinct facts of the file read in it; fewer if the file has
    fewer). max_file_tokens: cap on the shown lines of a file. min_distance, max_distance: sampled range
    of evidence->answer distances (the curriculum knob). length: total tokens (episodes packed) or None.
    kinds: question kinds to ask, a subset of QUESTION_KINDS.
    """

    n_questions: int = 3
    max_file_tokens: int = 384
    min_distance: int = 1
    max_distance: int = 1024
    length: int | None = None
    kinds: tuple[str, ...] = QUESTION_KINDS

    def __post_init__(self) -> None:
        object.__setattr__(self, "kinds", tuple(self.kinds))
        for name in ("n_questions", "max_file_tokens", "min_distance", "max_distance"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_distance < self.min_distance:
            raise ValueError(f"max_distance={self.max_distance} must be >= min_distance={self.min_distance}")
        bad = [k for k in self.kinds if k not in QUESTION_KINDS]
        if bad or not self.kinds:
            raise ValueError(f"kinds={self.kinds} must be a non-empty subset of {QUESTION_KINDS}")
        if self.length is not None and self.length < 2:
            raise ValueError(f"length={self.length} must be >= 2 or None")


def _line_starts(text: str) -> list[int]:
    starts = [0]
    for m in re.finditer("\n", text):
        starts.append(m.end())
    return starts


def _facts(text: str) -> list[Fact]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.split("\n")
    starts = _line_starts(text)
    found: list[Fact] = []

    def locate(kind: str, line: int, pattern: str, answer: str) -> None:
        m = re.search(pattern, lines[line - 1])
        if m is not None:
            found.append(Fact(kind=kind, line=line, answer=answer, offset=starts[line - 1] + m.start(1)))

    imports: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            locate("def_at_line", node.lineno, rf"\bdef\s+({re.escape(node.name)})\b", node.name)
        elif isinstance(node, ast.ClassDef):
            locate("class_at_line", node.lineno, rf"\bclass\s+({re.escape(node.name)})\b", node.name)
        elif isinstance(node, ast.Import):
            imports.append((node.lineno, node.col_offset, node.names[0].name))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imports.append((node.lineno, node.col_offset, node.module))
    if imports:
        line, _, module = min(imports)
        locate("first_import", line, rf"\b(?:import|from)\s+({re.escape(module)})\b", module)
    return sorted(found, key=lambda f: (f.line, f.offset))


def index_files(files: Sequence[tuple[str, str]]) -> list[AgentFile]:
    """Find the askable facts of each (path, text); files without any (or that do not parse) are left out."""
    out = []
    for path, text in files:
        facts = _facts(text)
        if facts:
            starts = tuple(_line_starts(text))
            out.append(AgentFile(path=path, text=text, facts=tuple(facts), line_starts=starts))
    return out


def _question(fact: Fact, path: str) -> str:
    if fact.kind == "def_at_line":
        return f" What is the name of the function defined at line {fact.line} of {path}?"
    if fact.kind == "class_at_line":
        return f" What is the name of the class defined at line {fact.line} of {path}?"
    return f" Which module does {path} import first?"


class _Transcript:
    """Builds one transcript in place; holds the generator, tokenizer and filler of one call."""

    def __init__(
        self,
        tok: TextTokenizer,
        rng: np.random.Generator,
        spec: AgentSpec,
        files: Sequence[AgentFile],
        filler: Filler,
        memo: dict[tuple[str, int], int],
    ) -> None:
        self.tok, self.rng, self.spec, self.files, self.filler = tok, rng, spec, files, filler
        self.memo = memo
        self.ids: list[int] = [tok.specials.bos, tok.specials.user, *tok.encode(_INTRO), tok.specials.end]

    def _tool_header(self, path: str) -> list[int]:
        sp = self.tok.specials
        return [sp.asst, sp.tool, *self.tok.encode(f' read_file("{path}")'), sp.end, sp.result]

    def gap(self, n: int) -> list[int]:
        """Exactly n tokens of other turns: reads of other code, or a short user turn when n is small."""
        sp = self.tok.specials
        out: list[int] = []
        while len(out) < n:
            left = n - len(out)
            path = self.files[int(self.rng.integers(0, len(self.files)))].path
            header = self._tool_header(path)
            overhead = len(header) + 1
            if left < overhead + 1:
                out.extend([sp.user, *self.filler(self.rng, left - 2), sp.end] if left >= 2 else [sp.end])
                continue
            body = min(left - overhead, _MAX_DISTRACTOR_TOKENS)
            # never leave a remainder too short for a well-formed turn when a longer body can absorb it
            if 0 < left - overhead - body < 2:
                body -= 2
            out.extend([*header, *self.filler(self.rng, body), sp.end])
        assert len(out) == n
        return out

    def _shown_lines(self, f: AgentFile) -> int:
        """How many leading lines of the file fit in max_file_tokens tokens (memoized per call site)."""
        key = (f.path, self.spec.max_file_tokens)
        if key not in self.memo:
            self.memo[key] = self._count_shown_lines(f)
        return self.memo[key]

    def _count_shown_lines(self, f: AgentFile) -> int:
        text, starts = f.text, f.line_starts
        cap = self.spec.max_file_tokens
        # only a head of the file can fit; long tokens are rare, so 12 characters per token is ample
        head = text[: cap * 12]
        _, offs = self.tok.encode_with_offsets(head)
        token_starts = np.asarray([o[0] for o in offs], dtype=np.int64)
        # tokens before each line start, for the line starts that lie inside the head
        inside = [c for c in starts if c <= len(head)]
        before = np.searchsorted(token_starts, np.asarray(inside), side="left")
        n_lines = int(np.sum(before <= cap)) - 1
        # a cut can tokenize its last line differently from the whole file: check the cut itself
        while n_lines > 0 and len(self.tok.encode(text[: starts[n_lines]])) > cap:
            n_lines -= 1
        return n_lines

    def _read(self, f: AgentFile, shown: int) -> tuple[list[int], list[int], np.ndarray, np.ndarray]:
        """Header ids, body ids, and token start/end character offsets of the first `shown` lines."""
        starts = f.line_starts
        body, offs = self.tok.encode_with_offsets(f.text[: starts[shown]] if shown < len(starts) else f.text)
        begins = np.asarray([o[0] for o in offs], dtype=np.int64)
        ends = np.asarray([o[1] for o in offs], dtype=np.int64)
        return self._tool_header(f.path), body, begins, ends

    def _query(self, f: AgentFile, fact: Fact, ev: tuple[int, int], distance: int) -> Query:
        sp = self.tok.specials
        q_ids = self.tok.encode(_question(fact, f.path))
        a_ids = self.tok.encode(" " + fact.answer)
        return Query(
            tokens=(sp.user, sp.q, *q_ids, sp.end, sp.asst, sp.a, *a_ids, sp.end),
            answer_offset=2 + len(q_ids) + 3,
            answer_len=len(a_ids),
            evidence=ev,
            distance=distance,
            text=fact.answer,
            kind=fact.kind,
        )

    def episode(self, distances: Sequence[int] | None, end_limit: int | None) -> list[AnswerSpan]:
        """Append one read and its questions; returns the placed answers (empty when none fit)."""
        spec, rng = self.spec, self.rng
        need = 1 if distances is None else len(distances)
        for _ in range(_FILE_TRIES):
            f = self.files[int(rng.integers(0, len(self.files)))]
            n_lines = self._shown_lines(f)
            facts = [x for x in f.facts if x.line <= n_lines and x.kind in spec.kinds]
            if len(facts) >= need:
                break
        else:
            if distances is not None:
                raise ValueError(f"{len(distances)} distances: no file tried has that many askable facts")
            return []
        if distances is not None:
            picks = rng.choice(len(facts), size=len(distances), replace=False)
            chosen = [facts[i] for i in sorted(picks)]
            # show exactly through the last asked line so that short distances stay reachable
            shown = max(x.line for x in chosen)
        else:
            anchor = facts[int(rng.integers(0, len(facts)))]
            shown = int(rng.integers(anchor.line, n_lines + 1))
            chosen = [x for x in facts if x.line <= shown]
        planned = self._queries(f, chosen, shown, distances, end_limit)
        if planned is None and distances is None:
            # the tail after the last fact is longer than max_distance allows: end the read at that fact
            shown = max(x.line for x in chosen)
            planned = self._queries(f, chosen, shown, distances, end_limit)
        if planned is None:
            return []
        queries, read = planned
        self.ids.extend(read)
        limit = None if distances is not None else spec.max_distance
        return place_queries(self.ids, queries, self.gap, max_distance=limit, end_limit=end_limit)

    def _queries(
        self,
        f: AgentFile,
        chosen: list[Fact],
        shown: int,
        distances: Sequence[int] | None,
        end_limit: int | None,
    ) -> tuple[list[Query], list[int]] | None:
        """Questions about `chosen` facts and the ids of the read showing `shown` lines (to be appended
        next), or None when sampling finds no feasible distance."""
        spec, rng = self.spec, self.rng
        header, body, begins, ends = self._read(f, shown)
        base = len(self.ids) + len(header)
        context_end = base + len(body) + 1

        def evidence(fact: Fact) -> tuple[int, int]:
            start = base + int(np.searchsorted(ends, fact.offset, side="right"))
            return start, base + int(np.searchsorted(begins, fact.offset + len(fact.answer), side="left"))

        queries: list[Query] = []
        if distances is not None:
            # the latest evidence takes the smallest distance (it has the lowest floor)
            latest_first = sorted(chosen, key=lambda x: -x.offset)
            for fact, d in zip(latest_first, sorted(int(x) for x in distances), strict=True):
                q = self._query(f, fact, evidence(fact), d)
                floor = context_end - q.evidence[0] + q.answer_offset
                if d < floor:
                    raise ValueError(f"distance={d} is shorter than the file read allows ({floor})")
                queries.append(q)
        else:
            feasible: list[tuple[Query, int, int]] = []
            for fact in chosen:
                q = self._query(f, fact, evidence(fact), 0)
                lo = max(spec.min_distance, context_end - q.evidence[0] + q.answer_offset)
                hi = spec.max_distance
                if end_limit is not None:
                    hi = min(hi, end_limit - q.evidence[0] - len(q.tokens))
                if lo <= hi:
                    feasible.append((q, lo, hi))
            if not feasible:
                return None
            picks = rng.choice(len(feasible), size=min(spec.n_questions, len(feasible)), replace=False)
            for i in sorted(picks):
                q, lo, hi = feasible[i]
                d = sample_distances(rng, 1, lo, hi)[0]
                queries.append(dataclasses.replace(q, distance=d))
        return queries, [*header, *body, self.tok.specials.end]


def agent_transcript(
    tok: TextTokenizer,
    rng: np.random.Generator,
    spec: AgentSpec,
    files: Sequence[AgentFile],
    filler: Filler,
    *,
    distances: Sequence[int] | None = None,
    memo: dict[tuple[str, int], int] | None = None,
) -> TaskExample:
    """Generate one agent transcript.

    Args:
        tok: encodes the turns; its special ids frame them.
        rng: the only source of randomness (same generator state -> same example).
        spec: task shape; `spec.length` fixes the total length (episodes packed, tail filled with turns).
        files: `index_files` output for one corpus split (the files that may be read).
        filler: background tokens inside the other turns.
        distances: explicit evidence->answer distances for one read (harness use); None samples them.
        memo: a dict reused across calls to skip re-measuring how much of each file fits; share one only
            between calls with the same tokenizer and files.

    Returns:
        A `TaskExample`; its loss mask covers exactly the answer tokens.

    Raises:
        ValueError: `files` is empty, no file tried has as many askable facts as `distances`, a requested
            distance is shorter than the read allows, or nothing fits in `spec.length`.
    """
    if not files:
        raise ValueError("files is empty: index_files found no askable fact in the split")
    t = _Transcript(tok, rng, spec, files, filler, {} if memo is None else memo)
    if distances is not None or spec.length is None:
        answers = t.episode(distances, None)
        if not answers:
            raise ValueError(f"no file among {len(files)} yielded a question under spec {spec}")
        if spec.length is not None:
            if len(t.ids) > spec.length:
                raise ValueError(f"example needs {len(t.ids)} tokens, more than length={spec.length}")
            t.ids.extend(t.gap(spec.length - len(t.ids)))
        return to_example(t.ids, answers, KIND)
    if len(t.ids) > spec.length:
        raise ValueError(f"length={spec.length} is shorter than the transcript's opening turn")
    answers = []
    misses = 0
    while misses < _EPISODE_TRIES:
        mark = len(t.ids)
        got = t.episode(None, spec.length)
        if not got or len(t.ids) > spec.length:
            # this file could not be asked about in the space left: drop its read, try another
            del t.ids[mark:]
            misses += 1
            continue
        answers.extend(got)
    if not answers:
        raise ValueError(f"no question fits in length={spec.length} with spec {spec}")
    t.ids.extend(t.gap(spec.length - len(t.ids)))
    return to_example(t.ids, answers, KIND)
