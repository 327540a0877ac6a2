"""Screening a mapper on held-out prompts, and gating it.

Knows nothing of fitting or storage. For each prompt of P + S tokens the sender prefills the prefix, the
mapper turns its global KV into the receiver's, and the receiver continues over the S suffix tokens from
the mapped state (after `state_from_global`, i.e. with encoder bounded replay) and, as references, from
its own cold cache (the uninterrupted computation) and from its own stored global KV (the same bounded
replay without mapping: the floor that replay alone costs). Figures (MAPPING.md §2.2):
- per receiver source: R² of the re-quantized mapped entries against the receiver's own, in content space;
  index top-k recall: the receiver's own suffix queries (taken from the cold run) select top-k over its
  own and over the mapped index keys of the prefix; recall = |both| / |own|;
- per layer: cosine between the attention outputs of the suffix rows, mapped vs own replay (the mapping's
  error alone: bounded replay truncates windows, which changes the outputs even for an exact map) and
  mapped vs cold;
- next-token KL(cold ‖ mapped) over the suffix rows, top-1 agreement with cold, KL(cold ‖ own replay) (the
  floor replay alone costs) and KL(own replay ‖ mapped) (the mapping's share).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mappers.apply import apply_mapper
from mappers.artifact import GateSpec, KVMapper
from mappers.capture import content_of
from model import Transformer, export_global, model_fingerprint, prefill, state_from_global

if TYPE_CHECKING:
    from mappers.retention import RetentionReport


@dataclass(frozen=True, kw_only=True)
class MapperEval:
    """Measured figures of one mapper on held-out prompts (see the module docstring)."""

    n_prompts: int
    prefix_tokens: int
    suffix_tokens: int
    r2_kv: dict[int, float]
    r2_index: dict[int, float]
    index_recall: dict[int, float]
    attn_cosine: dict[int, float]
    attn_cosine_cold: dict[int, float]
    next_token_kl: float
    top1_agreement: float
    replay_kl: float
    mapping_kl: float

    def figures(self) -> dict[str, float]:
        """Pair-level figures as stored in the artifact's `quality`."""
        def mean(d: dict[int, float]) -> float:
            return sum(d.values()) / len(d)

        return {
            "r2_kv_mean": mean(self.r2_kv),
            "r2_index_mean": mean(self.r2_index),
            "index_recall": mean(self.index_recall),
            "attn_cosine_mean": mean(self.attn_cosine),
            "attn_cosine_min": min(self.attn_cosine.values()),
            "attn_cosine_cold_mean": mean(self.attn_cosine_cold),
            "next_token_kl": self.next_token_kl,
            "top1_agreement": self.top1_agreement,
            "replay_kl": self.replay_kl,
            "mapping_kl": self.mapping_kl,
            "eval_prompts": float(self.n_prompts),
        }


class _AttnTap:
    """Forward hooks on every attention module: the inputs and outputs of the rows at given positions."""

    def __init__(self, model: Transformer, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.outputs: dict[int, dict[int, torch.Tensor]] = {}
        self.inputs: dict[int, dict[int, torch.Tensor]] = {}
        self.handles = [
            block.attn.register_forward_hook(self._hook(i)) for i, block in enumerate(model.layers)
        ]

    def _hook(self, layer: int):
        def hook(module, args, output) -> None:
            x, io = args[0], args[1]
            for row in range(output.size(1)):
                pos = io.start + row
                if self.lo <= pos < self.hi:
                    self.outputs.setdefault(layer, {})[pos] = output[:, row].float()
                    self.inputs.setdefault(layer, {})[pos] = x[:, row]

        return hook

    def rows(self, which: dict[int, dict[int, torch.Tensor]], layer: int) -> torch.Tensor:
        """[B, hi - lo, ...] rows of `layer` in position order."""
        got = which[layer]
        return torch.stack([got[p] for p in range(self.lo, self.hi)], dim=1)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _run_tapped(model: Transformer, suffix: torch.Tensor, state, lo: int, hi: int):
    tap = _AttnTap(model, lo, hi)
    try:
        out = prefill(model, suffix, state, all_logits=True)
    finally:
        tap.close()
    return _row_logits(out)[:, -(hi - lo) :].double(), tap  # [B, S, vocab]


def _row_logits(out) -> torch.Tensor:
    """[B, S, vocab] logits of an all_logits pass (a one-row pass returns them as [B, vocab])."""
    assert out.logits is not None
    return out.logits if out.logits.dim() == 3 else out.logits.unsqueeze(1)


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) per row: [..., vocab] -> [...] fp64."""
    lp, lq = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


def _index_recall(model: Transformer, layer: int, x: torch.Tensor, own, mapped, lo: int, n: int) -> float:
    """Recall of the receiver's own top-k index picks when its keys are replaced by the mapped ones.

    x: [1, S, dim] bf16 attention inputs of suffix positions lo..lo+S-1 at `layer` (cold run); own/mapped:
    index keys [1, >= n, D_I] bf16 of the prefix entries (the first n are compared).
    """
    attn = model.layers[layer].attn
    m = model.cfg.compress_ratios[layer]
    pos = torch.arange(lo, lo + x.size(1), device=x.device)
    freqs = model.rope_for(layer, lo + x.size(1), x.device)[pos]
    visible = ((pos + 1) // m).clamp_max(n)
    qr = attn.q_norm(attn.wq_a(x))

    def pick(keys: torch.Tensor) -> torch.Tensor:
        ids, _ = attn.indexer.select(
            x, qr, freqs, keys[:, :n], visible, candidate_source=False, candidates=None,
            block_size=1, topk_blocks=1, tie_break="deterministic",
        )  # fmt: skip
        return ids[0]  # [S, K]

    a, b = pick(own), pick(mapped)
    hits = total = 0
    for ra, rb in zip(a.tolist(), b.tolist(), strict=True):
        sa = {i for i in ra if i >= 0}
        hits += len(sa & {i for i in rb if i >= 0})
        total += len(sa)
    return hits / total if total else 1.0


@torch.no_grad()
def evaluate_mapper(
    mapper: KVMapper,
    sender_model: Transformer,
    receiver_model: Transformer,
    prompts: torch.Tensor,
    *,
    suffix_tokens: int,
) -> MapperEval:
    """Screen `mapper` on held-out prompts.

    Args:
        prompts: [B, P + S] int64 held-out token sequences; each row is one prompt.
        suffix_tokens: S, the tokens the receiver runs after the mapped prefix (1 <= S <= window_size,
            and P must hold at least one entry of every ratio).

    Returns:
        MapperEval (per-layer and pair-level figures).

    Raises:
        ValueError: a bad suffix length or a prefix too short.
    """
    r_cfg = receiver_model.cfg
    n_total = prompts.size(1)
    p = n_total - suffix_tokens
    if not 1 <= suffix_tokens <= r_cfg.window_size:
        raise ValueError(
            f"suffix_tokens must be in [1, window_size={r_cfg.window_size}], got {suffix_tokens}"
        )
    biggest = max(r_cfg.compress_ratios[s] for s in r_cfg.kv_source_layers)
    if p < biggest:
        raise ValueError(f"the prefix of {p} tokens holds no entry of ratio {biggest}")
    fp_s, fp_r = (
        bytes.fromhex(ref.fingerprint) if ref.fingerprint else model_fingerprint(model)
        for ref, model in ((mapper.sender, sender_model), (mapper.receiver, receiver_model))
    )
    sources = list(r_cfg.kv_source_layers)
    sse = {part: dict.fromkeys(sources, 0.0) for part in ("kv", "index")}
    own_rows: dict[str, dict[int, list[torch.Tensor]]] = {part: {s: [] for s in sources} for part in sse}
    recall = dict.fromkeys(sources, 0.0)
    cosine = dict.fromkeys(range(r_cfg.n_layers), 0.0)
    cosine_cold = dict.fromkeys(range(r_cfg.n_layers), 0.0)
    kl, top1, replay_kl, mapping_kl = [], [], [], []
    for b in range(prompts.size(0)):
        prefix, suffix = prompts[b : b + 1, :p], prompts[b : b + 1, p:]
        s_state = prefill(sender_model, prefix).state
        r_state = prefill(receiver_model, prefix).state
        own_blob = export_global(r_state, 0, p, fingerprint=fp_r)
        mapped = apply_mapper(
            mapper, s_state, sender_fingerprint=fp_s, receiver_fingerprint=fp_r, receiver_model=receiver_model
        )
        m_state = state_from_global(receiver_model, prefix, list(mapped.blobs), fingerprint=fp_r)
        o_state = state_from_global(receiver_model, prefix, [own_blob], fingerprint=fp_r)

        own_c, map_c = content_of(r_cfg, r_state.sources, p), content_of(r_cfg, m_state.sources, p)
        for part in ("kv", "index"):
            for s in sources:
                own, got = own_c.part(part)[s], map_c.part(part)[s]
                sse[part][s] += float(((own - got) ** 2).sum())
                own_rows[part][s].append(own.flatten(0, 1))
        keys_own = {s: r_state.sources[s].index_k for s in sources}
        keys_map = {s: m_state.sources[s].index_k for s in sources}

        cold_logits, cold_tap = _run_tapped(receiver_model, suffix, r_state.clone(), p, n_total)
        map_logits, map_tap = _run_tapped(receiver_model, suffix, m_state, p, n_total)
        rep_logits, rep_tap = _run_tapped(receiver_model, suffix, o_state, p, n_total)
        kl.append(_kl(cold_logits, map_logits).mean())
        replay_kl.append(_kl(cold_logits, rep_logits).mean())
        mapping_kl.append(_kl(rep_logits, map_logits).mean())
        top1.append((cold_logits.argmax(-1) == map_logits.argmax(-1)).double().mean())
        for layer in cosine:
            got = map_tap.rows(map_tap.outputs, layer)
            for ref, acc in ((rep_tap, cosine), (cold_tap, cosine_cold)):
                want = ref.rows(ref.outputs, layer)
                acc[layer] += float(torch.nn.functional.cosine_similarity(got, want, dim=-1).mean())
        for s in sources:
            n = p // r_cfg.compress_ratios[s]
            x = cold_tap.rows(cold_tap.inputs, s)
            recall[s] += _index_recall(receiver_model, s, x, keys_own[s], keys_map[s], p, n)

    n_prompts = prompts.size(0)
    r2 = {}
    for part in ("kv", "index"):
        r2[part] = {}
        for s in sources:
            own = torch.cat(own_rows[part][s])
            sst = float(((own - own.mean(0)) ** 2).sum())
            r2[part][s] = 1.0 - sse[part][s] / max(sst, torch.finfo(torch.float64).tiny)
    return MapperEval(
        n_prompts=n_prompts,
        prefix_tokens=p,
        suffix_tokens=suffix_tokens,
        r2_kv=r2["kv"],
        r2_index=r2["index"],
        index_recall={s: v / n_prompts for s, v in recall.items()},
        attn_cosine={layer: v / n_prompts for layer, v in cosine.items()},
        attn_cosine_cold={layer: v / n_prompts for layer, v in cosine_cold.items()},
        next_token_kl=float(torch.stack(kl).mean()),
        top1_agreement=float(torch.stack(top1).mean()),
        replay_kl=float(torch.stack(replay_kl).mean()),
        mapping_kl=float(torch.stack(mapping_kl).mean()),
    )


def gate_failures(gate: GateSpec, figures: dict[str, float]) -> list[str]:
    """The gate conditions `figures` fail (empty: passed). A gated figure that was not measured fails."""
    checks = [
        ("min_attn_cosine", "attn_cosine_mean", lambda v, t: v >= t),
        ("max_next_token_kl", "next_token_kl", lambda v, t: v <= t),
        ("min_index_recall", "index_recall", lambda v, t: v >= t),
        ("min_retention", "retention", lambda v, t: v >= t),
        ("min_retention_lower", "retention_ci_lower", lambda v, t: v >= t),
    ]
    failed = []
    for knob, figure, ok in checks:
        threshold = getattr(gate, knob)
        if threshold is None:
            continue
        value = figures.get(figure)
        if value is None:
            failed.append(f"{figure} not measured (gate {knob}={threshold})")
        elif not ok(value, threshold):
            failed.append(f"{figure}={value:.4g} fails {knob}={threshold}")
    return failed


def gate_mapper(
    mapper: KVMapper,
    evaluation: MapperEval,
    *,
    gate: GateSpec | None = None,
    retention: float | None = None,
    task: TaskRetention | RetentionReport | None = None,
) -> tuple[KVMapper, list[str]]:
    """The mapper with the evaluation's figures recorded and `passed_gate` set.

    Args:
        gate: thresholds to apply (the mapper's own when None); recorded in the result.
        retention: measured task retention (mapped accuracy / receiver's own), when a task evaluation ran.
        task: a whole task evaluation (`evaluate_task_retention`, or `measure_retention`'s report with
            per-bucket bootstrap intervals): its figures are recorded and its retention (and interval)
            are the ones gated (they win over `retention`).

    Returns:
        the updated mapper and the failed conditions (empty when it passed).
    """
    gate = gate or mapper.gate
    figures = evaluation.figures() | ({"retention": retention} if retention is not None else {})
    if task is not None:
        figures |= task.figures()
    failed = gate_failures(gate, figures)
    layers = tuple(
        dataclasses.replace(
            lm,
            quality=dict(lm.quality)
            | {
                "eval_r2_kv": evaluation.r2_kv[lm.receiver_layer],
                "eval_r2_index": evaluation.r2_index[lm.receiver_layer],
                "eval_index_recall": evaluation.index_recall[lm.receiver_layer],
                "eval_attn_cosine": evaluation.attn_cosine[lm.receiver_layer],
            },
        )
        for lm in mapper.layers
    )
    updated = dataclasses.replace(
        mapper,
        layers=layers,
        gate=gate,
        quality=dict(mapper.quality) | figures,
        passed_gate=not failed,
    )
    return updated, failed


@dataclass(frozen=True, kw_only=True)
class TaskRetention:
    """Answer accuracy on recall episodes, with the answer's question asked after a mapped cache.

    Each episode's history (all but the last `suffix_tokens`) is cached, the suffix (the question and the
    answer) runs on top. receiver_acc: the receiver's own uninterrupted run (the target); mapped_acc: the
    receiver from the sender's mapped global KV (bounded replay); replay_acc: the receiver from its own
    global KV after the same bounded replay (what replay alone costs); sender_acc: the sender alone (the
    source score). retention = mapped / receiver; gap_recovered = (mapped - chance floor) /
    (receiver - chance floor), the floor being `floor_acc`: the receiver with an empty history cache
    (nothing to recall from).
    """

    n: int
    suffix_tokens: int
    sender_acc: float
    receiver_acc: float
    mapped_acc: float
    replay_acc: float
    floor_acc: float
    # per path ("sender", "receiver", "mapped", "replay", "floor"): 1/0 per episode, in episode order (the
    # paired bootstrap of mappers/retention.py resamples episodes across paths together)
    outcomes: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    @property
    def retention(self) -> float:
        return self.mapped_acc / self.receiver_acc if self.receiver_acc else 0.0

    @property
    def gap_recovered(self) -> float:
        gap = self.receiver_acc - self.floor_acc
        return (self.mapped_acc - self.floor_acc) / gap if gap > 0 else 0.0

    def figures(self) -> dict[str, float]:
        return {
            "task_episodes": float(self.n),
            "task_sender_acc": self.sender_acc,
            "task_receiver_acc": self.receiver_acc,
            "task_mapped_acc": self.mapped_acc,
            "task_replay_acc": self.replay_acc,
            "task_floor_acc": self.floor_acc,
            "retention": self.retention,
            "task_gap_recovered": self.gap_recovered,
        }


def _answers_right(logits: torch.Tensor, row: torch.Tensor, start: int, end: int, lo: int) -> bool:
    """Whether the argmax of every answer position is the answer token. logits [S, vocab] cover the rows
    lo .. lo + S - 1; the token at sequence index i is predicted by row i - 1."""
    pred = logits[start - 1 - lo : end - 1 - lo].argmax(-1)
    return bool(torch.equal(pred.cpu(), row[start:end].cpu()))


@torch.no_grad()
def evaluate_task_retention(
    mapper: KVMapper,
    sender_model: Transformer,
    receiver_model: Transformer,
    tokens: torch.Tensor,
    answers: list[tuple[int, int]],
    *,
    suffix_tokens: int,
) -> TaskRetention:
    """Recall accuracy of the receiver when the history comes from the sender through `mapper`.

    Args:
        tokens: [N, L] int64 episodes, each ending with its answer.
        answers: per row, the answer span (start, end) in sequence coordinates; it must lie in the suffix.
        suffix_tokens: S, the tokens run after the cached history (1 <= S <= the receiver's window), the
            question included, so that the evidence is reachable only through the (mapped) global KV.

    Raises:
        ValueError: a bad suffix length, a row count that does not match `answers`, or an answer outside
            the suffix.
    """
    r_cfg = receiver_model.cfg
    n, length = tokens.shape
    p = length - suffix_tokens
    if not 1 <= suffix_tokens <= r_cfg.window_size:
        raise ValueError(
            f"suffix_tokens must be in [1, window_size={r_cfg.window_size}], got {suffix_tokens}"
        )
    if len(answers) != n:
        raise ValueError(f"{len(answers)} answer spans for {n} rows")
    for start, end in answers:
        if not p < start <= end <= length:
            raise ValueError(f"answer span ({start}, {end}) is not inside the suffix [{p + 1}, {length}]")
    fp_s, fp_r = (
        bytes.fromhex(ref.fingerprint) if ref.fingerprint else model_fingerprint(model)
        for ref, model in ((mapper.sender, sender_model), (mapper.receiver, receiver_model))
    )
    right: dict[str, list[int]] = {k: [] for k in ("sender", "receiver", "mapped", "replay", "floor")}
    for b in range(n):
        row = tokens[b : b + 1]
        prefix, suffix = row[:, :p], row[:, p:]
        start, end = answers[b]
        s_state = prefill(sender_model, prefix).state
        r_state = prefill(receiver_model, prefix).state
        mapped = apply_mapper(
            mapper, s_state.clone(), sender_fingerprint=fp_s, receiver_fingerprint=fp_r,
            receiver_model=receiver_model,
        )
        own_blob = export_global(r_state, 0, p, fingerprint=fp_r)
        states = {
            "sender": (sender_model, s_state),
            "receiver": (receiver_model, r_state),
            "mapped": (receiver_model, state_from_global(receiver_model, prefix, list(mapped.blobs),
                                                         fingerprint=fp_r)),
            "replay": (receiver_model, state_from_global(receiver_model, prefix, [own_blob],
                                                         fingerprint=fp_r)),
        }
        for key, (model, state) in states.items():
            logits = _row_logits(prefill(model, suffix, state, all_logits=True))
            right[key].append(int(_answers_right(logits[0], row[0], start, end, p)))
        # the floor: the question alone, with no history to recall from (positions shifted to 0)
        logits = _row_logits(prefill(receiver_model, suffix, all_logits=True))
        right["floor"].append(int(_answers_right(logits[0], suffix[0], start - p, end - p, 0)))
    acc = {k: sum(v) / n for k, v in right.items()}
    return TaskRetention(
        n=n, suffix_tokens=suffix_tokens, sender_acc=acc["sender"], receiver_acc=acc["receiver"],
        mapped_acc=acc["mapped"], replay_acc=acc["replay"], floor_acc=acc["floor"],
        outcomes={k: tuple(v) for k, v in right.items()},
    )
