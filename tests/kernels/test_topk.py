"""select_topk and candidate_blocks: loop twins, shape-independent determinism, and the v41-tiny vectors."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kernels import candidate_blocks, candidate_ids, pool_ids, select_topk
from kernels.topk.selection import rank_keys, top_indices, top_indices_sorted
from tests.shared_vectors import conformance_vectors

# v41-tiny: compress ratio per index-source layer, index_topk, candidate source and its block pool
RATIOS = {2: 2, 4: 2, 6: 1, 8: 1, 10: 1}
INDEX_TOPK = 16
CANDIDATE_LAYER, CANDIDATE_BLOCK, CANDIDATE_TOPK_BLOCKS = 6, 4, 8
PROMPT_LENGTHS = {0: 300, 1: 37, 2: 19}
DECODE_STEPS = 4


def select_topk_naive(scores: torch.Tensor, k: int, visible: torch.Tensor) -> torch.Tensor:
    """Loop twin of the deterministic rule: best score first, lower id on ties; unusable picks -> -1 last."""
    b, t, _ = scores.shape
    out = torch.full((b, t, k), -1, dtype=torch.int32)
    for bi in range(b):
        for ti in range(t):
            row = scores[bi, ti].tolist()
            ranked = sorted(range(len(row)), key=lambda j: (-row[j], j))[:k]
            kept = sorted(j for j in ranked if j < int(visible[bi, ti]) and row[j] != float("-inf"))
            out[bi, ti, : len(kept)] = torch.tensor(kept, dtype=torch.int32)
    return out


def candidate_blocks_naive(
    scores: torch.Tensor, visible: torch.Tensor, block: int, topk_blocks: int
) -> torch.Tensor:
    """Loop twin: per row, block max, newest visible block pinned, best blocks by (score, lower id) kept."""
    b, t, n = scores.shape
    out = torch.zeros(b, t, n, dtype=torch.bool)
    for bi in range(b):
        for ti in range(t):
            row = scores[bi, ti].tolist()
            blocks = [max(row[s : s + block]) for s in range(0, n, block)]
            newest = (int(visible[bi, ti]) - 1) // block
            if newest >= 0:
                blocks[newest] = float("inf")
            ranked = sorted(range(len(blocks)), key=lambda j: (-blocks[j], j))[:topk_blocks]
            for j in ranked:
                if blocks[j] > float("-inf"):
                    out[bi, ti, j * block : (j + 1) * block] = True
    return out


def random_scores(
    b: int, t: int, n: int, *, seed: int, levels: int | None = None, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores [B, T, N] with a causal -inf mask (row t sees (t + 1) * N // T entries) and those counts [B, T].

    `levels` draws integers below it instead of normals, to force many ties.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, n, generator=g)
    if levels is not None:
        x = torch.randint(0, levels, (b, t, n), generator=g).float()
    visible = (torch.arange(1, t + 1) * n // t).expand(b, t).contiguous()
    scores = x.to(dtype).masked_fill(torch.arange(n) >= visible.unsqueeze(-1), -torch.inf)
    return scores, visible


@pytest.mark.parametrize("levels", [None, 3], ids=["continuous", "ties"])
@pytest.mark.parametrize(
    "bt_n_k", [(1, 1, 37, 16), (2, 63, 150, 16), (1, 30, 40, 40)], ids=["T1", "T63", "k=N"]
)
def test_select_topk_deterministic_matches_loop_twin(bt_n_k: tuple[int, ...], levels: int | None) -> None:
    b, t, n, k = bt_n_k
    scores, visible = random_scores(b, t, n, seed=1, levels=levels)
    got = select_topk(scores, k, visible, tie_break="deterministic")
    assert got.dtype == torch.int32 and got.shape == (b, t, k)
    assert torch.equal(got, select_topk_naive(scores, k, visible))


def _special_values(x: torch.Tensor) -> torch.Tensor:
    """x with NaNs of both signs, both zeros and both infinities planted in every row."""
    x = x.clone()
    x[..., 3], x[..., 5], x[..., 7], x[..., 9] = float("nan"), -float("nan"), -0.0, 0.0
    x[..., 11], x[..., 13] = torch.inf, -torch.inf
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "shape_k",
    [
        ((1, 1, 63), 16),
        ((2, 5, 1000), 16),
        ((1, 3, 1000), 1000),
        ((1, 2, 2**16), 16),
        ((1, 1, 2**16 + 7), 300),
    ],
    ids=["N63", "N1000", "k=N", "N=2^16", "N>2^16"],
)
@pytest.mark.parametrize("seed", [0, 1, None], ids=["seed0", "seed1", "fresh"])
def test_top_indices_deterministic_matches_sort_twin(
    shape_k: tuple[tuple[int, ...], int], dtype: torch.dtype, seed: int | None
) -> None:
    shape, k = shape_k
    seed = seed if seed is not None else time.time_ns() % 2**31
    g = torch.Generator().manual_seed(seed)
    for levels in (None, 2, 5):
        if levels is None:
            x = torch.randn(shape, generator=g)
        else:
            x = torch.randint(0, levels, shape, generator=g) - 2.0
        x = _special_values(x.to(dtype))
        got = top_indices(x, k, tie_break="deterministic", reference_sorted=False).sort(-1).values
        want = top_indices_sorted(x, k).sort(-1).values
        assert torch.equal(got, want), f"seed {seed} levels {levels}: {(got != want).sum().item()} ids differ"


def test_rank_keys_are_distinct_and_ordered() -> None:
    x = torch.tensor([[[1.0, -0.0, 0.0, float("nan"), -1.0, torch.inf, 1.0]]])
    for dtype, key_dtype in ((torch.bfloat16, torch.int32), (torch.float32, torch.int64)):
        keys = rank_keys(x.to(dtype))[0, 0]
        assert keys.dtype == key_dtype
        # NaN, +inf, 1.0 (id 0), 1.0 (id 6), -0.0 and +0.0 tie (ids 1, 2), -1.0
        assert keys.argsort(descending=True).tolist() == [3, 5, 0, 6, 1, 2, 4]


def test_select_topk_reference_equals_deterministic_without_ties() -> None:
    scores, visible = random_scores(2, 40, 200, seed=2, dtype=torch.float32)
    # continuous fp32 values: ties occur only among the -inf entries, which both rules turn into -1
    ref = select_topk(scores, 16, visible, tie_break="reference")
    det = select_topk(scores, 16, visible, tie_break="deterministic")
    assert torch.equal(ref, det)


def test_select_topk_deterministic_ignores_shape_and_chunking() -> None:
    g = torch.Generator().manual_seed(3)
    row = torch.randint(0, 4, (50,), generator=g).bfloat16()  # heavy ties
    row[45:] = -torch.inf  # entries this query cannot see yet
    alone = select_topk(row.view(1, 1, 50), 16, 45, tie_break="deterministic")
    # the same row inside a wider, taller batch, with more (invisible) entries to its right
    wide = torch.randint(0, 4, (3, 7, 80), generator=g).bfloat16()
    wide[1, 4, :50] = row
    wide[1, 4, 45:] = -torch.inf
    visible = torch.full((3, 7), 80)
    visible[1, 4] = 45
    inside = select_topk(wide, 16, visible, tie_break="deterministic")
    assert torch.equal(inside[1, 4], alone[0, 0])


def test_select_topk_drops_neg_inf_picks_and_keeps_ascending_order() -> None:
    scores = torch.tensor([[[1.0, -torch.inf, 3.0, -torch.inf, 2.0, 5.0]]]).bfloat16()
    # 5 picks from a row with 4 finite scores: one -inf pick at a visible position
    got = select_topk(scores, 5, 5, tie_break="deterministic")
    assert got.tolist() == [[[0, 2, 4, -1, -1]]]
    kept = select_topk(scores, 5, 6, tie_break="deterministic", drop_neg_inf=False)
    assert kept.tolist() == [[[0, 1, 2, 4, 5]]]


def test_select_topk_rejects_bad_arguments() -> None:
    scores = torch.zeros(1, 2, 5)
    with pytest.raises(ValueError, match="k must be"):
        select_topk(scores, 6, 5)
    with pytest.raises(ValueError, match="tie_break"):
        select_topk(scores, 2, 5, tie_break="lowest")
    with pytest.raises(ValueError, match="visible"):
        select_topk(scores, 2, torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="scores must be"):
        select_topk(scores[0], 2, 5)


@pytest.mark.parametrize("levels", [None, 3], ids=["continuous", "ties"])
@pytest.mark.parametrize("shape", [(1, 1, 37), (2, 63, 150), (1, 19, 19)], ids=["T1", "T63", "T19"])
def test_candidate_blocks_deterministic_matches_loop_twin(shape: tuple[int, ...], levels: int | None) -> None:
    dtype = torch.float32 if levels is None else torch.bfloat16
    scores, visible = random_scores(*shape, seed=4, levels=levels, dtype=dtype)
    got = candidate_blocks(scores, visible, 4, 3, tie_break="deterministic")
    assert got.dtype == torch.bool and got.shape == scores.shape
    assert torch.equal(got, candidate_blocks_naive(scores, visible, 4, 3))
    if levels is None:
        assert torch.equal(candidate_blocks(scores, visible, 4, 3), got)


@pytest.mark.parametrize("shape", [(1, 1, 37), (2, 63, 150), (1, 5, 2**16 + 3)], ids=["T1", "T63", "N>2^16"])
def test_pool_ids_lists_the_candidates_ascending(shape: tuple[int, ...]) -> None:
    scores, visible = random_scores(*shape, seed=7, levels=4)
    pool = candidate_blocks(scores, visible, 4, 3, tie_break="deterministic")
    got = pool_ids(pool, 12)
    assert got.shape == (*shape[:2], 12) and got.dtype == torch.int64
    for bi in range(shape[0]):
        for ti in range(shape[1]):
            want = pool[bi, ti].nonzero().flatten().tolist()
            assert got[bi, ti].tolist() == want + [-1] * (12 - len(want))
    with pytest.raises(ValueError, match="more than size"):
        pool_ids(pool, 2)


@pytest.mark.parametrize("levels", [None, 2], ids=["continuous", "ties"])
@pytest.mark.parametrize(
    "shape", [(1, 1, 37), (2, 63, 150), (1, 19, 19), (1, 3, 2**16 + 5)], ids=["T1", "T63", "T19", "N>2^16"]
)
def test_candidate_ids_equals_pool_ids_of_the_mask(shape: tuple[int, ...], levels: int | None) -> None:
    scores, visible = random_scores(*shape, seed=9, levels=levels)
    for block, blocks in ((4, 3), (4, 8), (7, 2)):
        mask = candidate_blocks(scores, visible, block, blocks, tie_break="deterministic")
        want = pool_ids(mask, block * blocks)
        assert torch.equal(candidate_ids(scores, visible, block, blocks), want), f"P={block} K={blocks}"


def test_candidate_blocks_rejects_bad_arguments() -> None:
    scores = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="block_size"):
        candidate_blocks(scores, 8, 0, 2)
    with pytest.raises(ValueError, match="tie_break"):
        candidate_blocks(scores, 8, 4, 2, tie_break="x")


def conformance_dir() -> Path:
    return conformance_vectors()


def indexer_rows(prompt: int):
    """Yield (step, layer, tensors, visible, k) for every selection the reference made for one prompt."""
    from safetensors.torch import load_file

    data = load_file(conformance_dir() / f"p{prompt}_indexer.safetensors")
    length = PROMPT_LENGTHS[prompt]
    steps = [("prefill", length)] + [(f"decode{j}", length + j + 1) for j in range(DECODE_STEPS)]
    for step, end_pos in steps:
        for layer, ratio in RATIOS.items():
            get = lambda name, s=step, i=layer: data[f"{s}.layers.{i}.{name}"]  # noqa: E731
            scores = get("index_score").unsqueeze(0)  # the reference's [1, rows, N] tensor
            n = scores.size(-1)
            # prefill: query t sees (t + 1) // ratio entries; decode: the whole width
            visible = torch.arange(1, length + 1) // ratio if step == "prefill" else n
            yield step, layer, get, scores, visible, min(INDEX_TOPK, end_pos // ratio)


@pytest.mark.parametrize("prompt", sorted(PROMPT_LENGTHS))
def test_select_topk_matches_conformance(prompt: int) -> None:
    checked = 0
    for step, layer, get, scores, visible, k in indexer_rows(prompt):
        where = f"p{prompt} {step} layer {layer}"
        assert torch.equal(select_topk(scores, k, visible)[0], get("topk_rows")), where
        # README §7: no reference pick was -inf at a visible position, so dropping such picks changes nothing
        kept = select_topk(scores, k, visible, drop_neg_inf=False)[0]
        assert torch.equal(kept, get("topk_rows")), where
        # the deterministic rule may differ only on rows the reference flagged as boundary ties
        det = select_topk(scores, k, visible, tie_break="deterministic")[0]
        ties = get("topk_tie_rows")
        assert torch.equal(det[~ties], get("topk_rows")[~ties]), where
        checked += 1
    assert checked == 5 * (1 + DECODE_STEPS)


@pytest.mark.parametrize("prompt", sorted(PROMPT_LENGTHS))
def test_candidate_blocks_matches_conformance(prompt: int) -> None:
    checked = 0
    for step, layer, get, scores, visible, _ in indexer_rows(prompt):
        if layer != CANDIDATE_LAYER:
            continue
        got = candidate_blocks(scores, visible, CANDIDATE_BLOCK, CANDIDATE_TOPK_BLOCKS)
        assert torch.equal(got[0], get("candidates")), f"p{prompt} {step}"
        det = candidate_blocks(
            scores, visible, CANDIDATE_BLOCK, CANDIDATE_TOPK_BLOCKS, tie_break="deterministic"
        )
        ties = get("candidate_block_tie_rows")
        assert torch.equal(det[0][~ties], get("candidates")[~ties]), f"p{prompt} {step}"
        checked += 1
    assert checked == 1 + DECODE_STEPS
