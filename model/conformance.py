"""Conformance check against official-reference vectors (a folder laid out like shared/conformance/v41-tiny).

Knows nothing of the CLI: `check_conformance` loads the checkpoint, runs every prompt of the vectors folder in
`reference` mode with the reference's own top-k and shared index-key slot, teacher-forces the stored decode
tokens, and compares (vectors README §8): logits (prefill, every position, and decode) within
`rel_tol` * max|ref|, greedy ids identical, and every cache tensor after prefill and after decode bitwise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from model.inference import decode, prefill
from model.state import ModelState
from model.transformer import Transformer
from model.weights import load_model

LOGITS_REL_TOL = 1e-5


@dataclass(frozen=True, kw_only=True)
class TensorDiff:
    """One compared tensor: max |ours - ref| (inf where one side is non-finite and they differ), max |ref|."""

    name: str
    max_abs: float
    max_ref: float
    ok: bool


@dataclass(frozen=True, kw_only=True)
class PromptReport:
    """Results for one prompt: logits relative error, greedy ids, cache diffs; failures name tensors."""

    prompt: str
    n_tokens: int
    logits_rel_err: float
    generated: list[int]
    reference_generated: list[int]
    caches: list[TensorDiff]
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def cache_max_abs(self) -> float:
        return max((d.max_abs for d in self.caches), default=0.0)


def _diff(name: str, ours: torch.Tensor, ref: torch.Tensor, rel_tol: float | None) -> TensorDiff:
    if tuple(ours.shape) != tuple(ref.shape):
        return TensorDiff(
            name=f"{name} (shape {list(ours.shape)} vs {list(ref.shape)})",
            max_abs=float("inf"),
            max_ref=0.0,
            ok=False,
        )
    a, b = ours.float().cpu(), ref.float()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    delta = torch.where(same, 0.0, (a - b).abs().nan_to_num(nan=float("inf")))
    max_abs = float(delta.max()) if delta.numel() else 0.0
    finite = b[torch.isfinite(b)]
    max_ref = float(finite.abs().max()) if finite.numel() else 0.0
    ok = max_abs == 0.0 if rel_tol is None else max_abs <= rel_tol * max_ref
    return TensorDiff(name=name, max_abs=max_abs, max_ref=max_ref, ok=ok)


def cache_tensors(model: Transformer, state: ModelState) -> dict[str, torch.Tensor]:
    """The state as the reference's cache buffers for batch row 0 (names as in p<n>_cache_*.safetensors)."""
    out: dict[str, torch.Tensor] = {}
    for i, ring in enumerate(state.windows):
        out[f"layers.{i}.window_kv"] = ring[0]
    for i, src in state.sources.items():
        out[f"layers.{i}.compress_kv"] = src.kv[0]
        out[f"layers.{i}.index_k"] = src.index_k[0]
        if src.carry_kv is not None and src.carry_score is not None:
            out[f"layers.{i}.compressor.kv_state"] = src.carry_kv[0]
            out[f"layers.{i}.compressor.score_state"] = src.carry_score[0]
    return out


def _compare_caches(
    model: Transformer, state: ModelState, ref: dict[str, torch.Tensor], tag: str
) -> list[TensorDiff]:
    ours = cache_tensors(model, state)
    diffs = []
    for name in sorted(ref):
        if name not in ours:
            diffs.append(
                TensorDiff(name=f"{tag}:{name} (missing)", max_abs=float("inf"), max_ref=0.0, ok=False)
            )
            continue
        diffs.append(_diff(f"{tag}:{name}", ours[name], ref[name], None))
    return diffs


def check_prompt(
    model: Transformer, vectors: Path, index: int, tokens: torch.Tensor, rel_tol: float = LOGITS_REL_TOL
) -> PromptReport:
    """Run prompt `index` ([1, S] int64 tokens) and compare with the p<index>_* files of `vectors`."""
    dev = model.head.weight.device
    ref_logits = load_file(str(vectors / f"p{index}_logits.safetensors"))
    cache_prefill = load_file(str(vectors / f"p{index}_cache_prefill.safetensors"))
    cache_decode = load_file(str(vectors / f"p{index}_cache_decode.safetensors"))
    logit_diffs: list[TensorDiff] = []
    with torch.inference_mode():
        out = prefill(
            model,
            tokens.to(dev),
            mode="reference",
            tie_break="reference",
            reference_slots=True,
            all_logits=True,
        )
        state = out.state
        assert out.logits is not None
        all_rows = out.logits[0]
        logit_diffs.append(_diff("prefill.logits_all", all_rows, ref_logits["prefill.logits_all"], rel_tol))
        logit_diffs.append(
            _diff("prefill.logits_last", all_rows[-1], ref_logits["prefill.logits_last"], rel_tol)
        )
        generated = [int(all_rows[-1].argmax())]
        caches = _compare_caches(model, state, cache_prefill, "prefill")
        steps = ref_logits["decode.input_ids"].tolist()
        for j, tok in enumerate(steps):
            step = decode(
                model, torch.tensor([tok], device=dev), state, tie_break="reference", reference_slots=True
            )
            assert step.logits is not None
            logit_diffs.append(
                _diff(f"decode.logits[{j}]", step.logits[0], ref_logits["decode.logits"][j], rel_tol)
            )
            generated.append(int(step.logits[0].argmax()))
        caches += _compare_caches(model, state, cache_decode, "decode")
    ref_generated = ref_logits["generated_ids"].tolist()
    failures = [
        f"{d.name}: max|delta| {d.max_abs:.3e} > {rel_tol:g} * max|ref| {d.max_ref:.3e}"
        for d in logit_diffs
        if not d.ok
    ]
    if generated != ref_generated:
        failures.append(f"generated_ids: {generated} != reference {ref_generated}")
    failures += [f"{d.name}: not bitwise, max|delta| {d.max_abs:.3e}" for d in caches if not d.ok]
    rel = max((d.max_abs / d.max_ref if d.max_ref else d.max_abs) for d in logit_diffs)
    return PromptReport(
        prompt=f"prompt{index}",
        n_tokens=tokens.size(1),
        logits_rel_err=rel,
        generated=generated,
        reference_generated=ref_generated,
        caches=caches,
        failures=failures,
    )


def check_conformance(
    checkpoint: str | Path,
    vectors: str | Path,
    *,
    device: str = "cpu",
    prompts: list[int] | None = None,
    rel_tol: float = LOGITS_REL_TOL,
) -> list[PromptReport]:
    """Check every prompt (or the listed indices) of a vectors folder against the model in `checkpoint`.

    Raises:
        FileNotFoundError: a missing folder or file. ValueError: a listed prompt that the folder lacks.
        model.errors.CheckpointMismatch: the checkpoint does not fit its config.
    """
    vectors = Path(vectors)
    if not vectors.is_dir():
        raise FileNotFoundError(f"no vectors folder at {vectors}")
    model = load_model(checkpoint, device=device)
    inputs = load_file(str(vectors / "input_ids.safetensors"))
    found = sorted(int(m.group(1)) for k in inputs if (m := re.fullmatch(r"prompt(\d+)", k)))
    wanted = found if prompts is None else prompts
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise ValueError(f"prompts {missing} are not in {vectors} (it has {found})")
    return [check_prompt(model, vectors, i, inputs[f"prompt{i}"], rel_tol) for i in wanted]
