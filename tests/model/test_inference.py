"""prefill / decode / decode_batch on a random-initialised v41-tiny: modes, chunking, replays, row counts."""

from __future__ import annotations

import time

import pytest
import torch

from model import (
    ModelConfig,
    Transformer,
    UnsupportedConfigError,
    decode,
    decode_batch,
    init_random,
    load_preset,
    prefill,
)

W = 32  # v41-tiny window


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # small matmuls on a shared 2-core machine run ~10x faster without OpenMP oversubscription;
    # the reference is thread-count independent (vectors README section 8)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return init_random(Transformer(load_preset("v41-tiny")), seed=0).eval()


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(seed))


def _encoder(model: Transformer) -> range:
    return range(model.split)


@torch.inference_mode()
def test_prefill_chunked_reference_equals_one_shot(model: Transformer) -> None:
    toks = _tokens(101, 1)
    whole = prefill(model, toks, mode="reference")
    state = None
    # odd boundaries against the 2:1 compressor: 37 | 1 | 63
    for lo, hi in [(0, 37), (37, 38), (38, 101)]:
        out = prefill(model, toks[:, lo:hi], state, mode="reference")
        state = out.state
    assert torch.equal(out.logits, whole.logits)
    for layer, src in whole.state.sources.items():
        assert torch.equal(state.sources[layer].kv, src.kv), layer
        assert torch.equal(state.sources[layer].index_k, src.index_k), layer
    assert all(torch.equal(a, b) for a, b in zip(state.windows, whole.state.windows, strict=True))


@torch.inference_mode()
def test_decode_equals_prefill_of_longer_prompt(model: Transformer) -> None:
    toks = _tokens(70, 2)
    out = prefill(model, toks[:, :69], mode="reference")
    step = decode(model, toks[0, 69:], out.state)
    assert torch.equal(step.logits, prefill(model, toks, mode="reference").logits)
    assert step.stats.rows_per_layer == (1,) * 12


@torch.inference_mode()
def test_prefill_ced_runs_decoder_on_last_window_only(model: Transformer) -> None:
    toks = _tokens(101, 3)
    out = prefill(model, toks, mode="ced")
    assert out.stats.rows_per_layer == (101,) * 6 + (W,) * 6
    assert out.stats.decoder_from == 101 - W
    # the decoder kv source still compresses every prompt row
    assert out.stats.compressed_rows[6] == 101
    assert out.state.sources[6].n_entries == 101
    ref = prefill(model, toks, mode="reference")
    assert torch.equal(out.state.sources[6].kv, ref.state.sources[6].kv)
    assert not torch.equal(out.logits, ref.logits)  # truncated decoder windows: approximate by design


@torch.inference_mode()
def test_prefill_ced_equals_reference_when_prompt_fits_window(model: Transformer) -> None:
    toks = _tokens(W - 3, 4)
    assert torch.equal(prefill(model, toks, mode="ced").logits, prefill(model, toks, mode="reference").logits)


@torch.inference_mode()
def test_prefill_ced_chunked_equals_one_shot(model: Transformer) -> None:
    toks = _tokens(101, 5)
    whole = prefill(model, toks, mode="ced")
    state, rows = None, []
    for lo, hi in [(0, 37), (37, 38), (38, 90), (90, 101)]:
        out = prefill(model, toks[:, lo:hi], state, mode="ced", prompt_end=101)
        state = out.state
        rows.append(out.stats.rows_per_layer[-1])
    assert rows == [0, 0, 90 - (101 - W), 11]
    assert torch.equal(out.logits, whole.logits)


@torch.inference_mode()
def test_full_hit_second_turn_equals_cold_ced_prefill(model: Transformer) -> None:
    toks = _tokens(120, 6)
    first = prefill(model, toks[:, :70], mode="ced")
    state, history, logits = first.state, [toks[:, :70]], first.logits
    for _ in range(3):
        nxt = logits.argmax(-1)
        history.append(nxt.view(1, 1))
        logits = decode(model, nxt, state).logits
    for n_new in (5, 40):  # fewer and more new tokens than W
        new = toks[:, 70 : 70 + n_new]
        turn = prefill(model, new, state.clone(), mode="ced")
        cold = prefill(model, torch.cat([*history, new], dim=1), mode="ced")
        assert torch.equal(turn.logits, cold.logits), n_new
        assert turn.stats.rows_per_layer[:6] == (n_new,) * 6


@torch.inference_mode()
def test_encoder_replay_keeps_global_and_is_exact_for_short_history(model: Transformer) -> None:
    toks = _tokens(90, 7)
    state = prefill(model, toks[:, :73], mode="ced").state
    stored = {i: s.kv.clone() for i, s in state.sources.items()}
    state.drop_windows(_encoder(model))
    state.drop_encoder_rows()
    out = prefill(model, toks[:, 73:], state, mode="ced")
    assert out.stats.start == 40  # max(0, 73 - 32) rounded down to the ratio-2 grid
    assert out.stats.rows_per_layer[0] == 90 - 40
    for i, kv in stored.items():
        assert torch.equal(out.state.sources[i].kv[:, : kv.size(1)], kv), i
    assert out.state.sources[2].n_entries == 45 and out.state.sources[6].n_entries == 90
    decode(model, out.logits.argmax(-1), out.state)  # decoding continues after a replay

    short = prefill(model, toks[:, :20], mode="ced").state
    short.drop_windows(_encoder(model))
    short.drop_encoder_rows()
    replayed = prefill(model, toks[:, 20:25], short, mode="ced")
    assert replayed.stats.start == 0
    assert torch.equal(replayed.logits, prefill(model, toks[:, :25], mode="ced").logits)


@torch.inference_mode()
def test_decode_batch_equals_each_sequence_alone(model: Transformer) -> None:
    states = [prefill(model, _tokens(n, 8 + n), mode="ced").state for n in (9, 40)]
    alone = [decode(model, torch.tensor([5]), s.clone()).logits for s in states]
    together = decode_batch(model, torch.tensor([5, 5]), states)
    assert torch.equal(together, torch.cat(alone))


@torch.inference_mode()
def test_batched_prefill_rows_match_single_sequences(model: Transformer) -> None:
    toks = torch.cat([_tokens(45, 20), _tokens(45, 21)])
    both = prefill(model, toks, mode="reference")
    for b in range(2):
        one = prefill(model, toks[b : b + 1], mode="reference")
        torch.testing.assert_close(both.logits[b], one.logits[0], rtol=0, atol=1e-3 * one.logits.abs().max())


def test_prefill_rejects_bad_mode_and_shapes(model: Transformer) -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        prefill(model, _tokens(4, 0), mode="fast")
    with pytest.raises(ValueError, match="tokens must be"):
        prefill(model, torch.zeros(1, 0, dtype=torch.int64))
    with pytest.raises(ValueError, match="prompt_end"):
        prefill(model, _tokens(4, 0), prompt_end=2)


def test_transformer_rejects_unsupported_features() -> None:
    base = load_preset("v41-tiny").to_dict()
    for key, value in [("engram_layer_ids", [1]), ("vision_n_layers", 1), ("dspark_block_size", 5)]:
        cfg_dict = dict(base, **{key: value})
        if key == "engram_layer_ids":
            cfg_dict["engram_num_embeddings"] = [100]
        with pytest.raises(UnsupportedConfigError, match=key.split("_")[0]):
            Transformer(ModelConfig.from_dict(cfg_dict))


@torch.inference_mode()
def test_random_tiny_prefills_2k_and_decodes_under_60s() -> None:
    t0 = time.perf_counter()
    model = init_random(Transformer(load_preset("v41-tiny")), seed=1)
    out = prefill(model, _tokens(2048, 9), mode="ced")
    logits = out.logits
    for _ in range(4):
        logits = decode(model, logits.argmax(-1), out.state).logits
    elapsed = time.perf_counter() - t0
    assert out.state.n_tokens == 2052
    assert torch.isfinite(logits).all()
    assert elapsed < 60, f"2K prefill + 4 decode steps took {elapsed:.1f} s"
