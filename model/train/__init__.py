"""Training data for the sibling model family: the local corpus, the tokenizer, long-range tasks, batches.

Knows nothing of the model's layers; builds token sequences and masks only. Command line:
`python -m model.train data build|check|sample`.
"""

from pathlib import Path

from model.train.agent_transcript import (
    QUESTION_KINDS,
    AgentFile,
    AgentSpec,
    Fact,
    agent_transcript,
    index_files,
)
from model.train.build import BuildSummary, SplitSummary, build_data
from model.train.corpus import (
    SPLITS,
    CorpusChangedError,
    CorpusManifest,
    CorpusSpec,
    FileEntry,
    ManifestDiff,
    build_manifest,
    compare_manifests,
    read_split,
    stdlib_root,
)
from model.train.dataset import ROW_KINDS, Batch, MixtureSpec, Row, TrainStream, tokenize_corpus
from model.train.kv_recall import KvRecallSpec, kv_recall
from model.train.score import AnswerResult, BucketRecall, recall_by_bucket, score_answers, score_batch
from model.train.tasks import (
    DISTANCE_BUCKETS,
    AnswerSpan,
    CorpusFiller,
    Filler,
    RandomFiller,
    TaskExample,
    bucket_of,
    bucket_targets,
)
from model.train.tokenizer import (
    SPECIAL_TOKENS,
    BpeTokenizer,
    ByteTokenizer,
    SpecialTokens,
    TextTokenizer,
    load_tokenizer,
)

__all__ = [
    "DISTANCE_BUCKETS",
    "QUESTION_KINDS",
    "ROW_KINDS",
    "SPECIAL_TOKENS",
    "SPLITS",
    "AgentFile",
    "AgentSpec",
    "AnswerResult",
    "AnswerSpan",
    "Batch",
    "BpeTokenizer",
    "BucketRecall",
    "BuildSummary",
    "ByteTokenizer",
    "CorpusChangedError",
    "CorpusFiller",
    "CorpusManifest",
    "CorpusSpec",
    "Fact",
    "FileEntry",
    "Filler",
    "KvRecallSpec",
    "ManifestDiff",
    "MixtureSpec",
    "RandomFiller",
    "Row",
    "SpecialTokens",
    "SplitSummary",
    "TaskExample",
    "TextTokenizer",
    "TrainStream",
    "agent_transcript",
    "bucket_of",
    "bucket_targets",
    "build_data",
    "build_manifest",
    "compare_manifests",
    "index_files",
    "kv_recall",
    "load_tokenizer",
    "read_split",
    "recall_by_bucket",
    "score_answers",
    "score_batch",
    "shipped_tokenizer_dir",
    "stdlib_root",
    "tokenize_corpus",
]


def shipped_tokenizer_dir() -> Path:
    """`checkpoints/tokenizer/` of this source tree (tokenizer.json, manifest.json, README.md)."""
    return Path(__file__).resolve().parents[2] / "checkpoints" / "tokenizer"
