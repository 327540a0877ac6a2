"""kv_bytes: the global/window byte formulas of V41_SPEC §6.6 and §10.2 against hand-computed values."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from model import (
    ModelConfig,
    index_k_entry_bytes,
    kv_bytes,
    load_preset,
    main_kv_entry_bytes,
    window_kv_entry_bytes,
)


def test_kv_bytes_v41_flash_is_890_per_token():
    b = kv_bytes(load_preset("v41-flash"))
    assert (b.main_entry_bytes, b.index_entry_bytes, b.window_entry_bytes) == (288, 68, 528)
    assert b.global_bytes_per_token == 890 and str(b.global_bytes_per_token) == "890"
    assert b.encoder_global_bytes_per_token == 534 and b.decoder_global_bytes_per_token == 356
    assert [(s.layer, s.ratio, s.half) for s in b.sources] == [(2, 2, "enc"), (8, 2, "enc"), (14, 2, "enc"),
                                                               (20, 1, "dec")]
    # 40 x 128 x 528, half of it in the encoder; the 3 draft layers apart
    assert b.window_bytes_per_sequence == 2_703_360
    assert b.encoder_window_bytes_per_sequence == 1_351_680 == b.decoder_window_bytes_per_sequence
    assert b.draft_window_bytes_per_sequence == 3 * 128 * 528
    assert b.to_dict()["global_bytes_per_token"] == 890


def test_kv_bytes_v41_tiny_is_212_per_token():
    b = kv_bytes(load_preset("v41-tiny"))
    assert (b.main_entry_bytes, b.index_entry_bytes) == (72, 34)
    assert b.global_bytes_per_token == 212
    assert b.window_bytes_per_sequence == 50_688 and b.encoder_window_bytes_per_sequence == 25_344
    assert b.draft_window_bytes_per_sequence == 0


def test_kv_bytes_gpu_variant_matches_tiny():
    # V41_SPEC §10.3: same latent and index widths as tiny, so the same 212 B/token; W = 64 doubles windows
    gpu = ModelConfig.from_dict(
        load_preset("v41-tiny").to_dict()
        | {"dim": 512, "n_heads": 8, "q_lora_rank": 256, "o_groups": 4, "window_size": 64, "index_n_heads": 8,
           "index_topk": 64, "candidate_topk_blocks": 8, "candidate_block_size": 32}
    )
    b = kv_bytes(gpu)
    assert b.global_bytes_per_token == 212 and b.window_bytes_per_sequence == 12 * 64 * 132


def test_kv_bytes_fractional_geometry():
    # head_dim 64: main 32 + 4 = 36; index_head_dim 64: 32 + 2 = 34; entry 70.
    # sources: layer 1 ratio 3 (enc), layer 3 ratio 3 (enc), layer 4 ratio 1 (dec) -> 70/3 + 70/3 + 70
    cfg = ModelConfig(
        n_layers=6, n_mtp_layers=0, compress_ratios=(0, 3, 3, 3, 1, 1), kv_source_layers=(1, 3, 4),
        index_source_layers=(1, 3, 4), head_dim=64, index_head_dim=64, rope_head_dim=16, window_size=8,
    )
    b = kv_bytes(cfg)
    assert b.global_bytes_per_token == Fraction(70 * 2, 3) + 70 == Fraction(350, 3)
    assert b.to_dict()["global_bytes_per_token"] == pytest.approx(116.6667, abs=1e-4)
    assert b.encoder_global_bytes_per_token == Fraction(140, 3)
    assert b.window_bytes_per_sequence == 6 * 8 * (64 + 2)
    assert b.encoder_window_bytes_per_sequence == 4 * 8 * 66
    # 10 tokens: ratio-3 sources hold 3 entries each, the ratio-1 source 10
    assert b.global_bytes(10) == 70 * (3 + 3 + 10)
    assert b.global_bytes(0) == 0


def test_kv_bytes_v4_style_geometry_reconstructs_per_entry_formula():
    # d_c 512, d_I 128 with ratios 4 and 128 (no ratio-1 source, so no CED split: all encoder)
    ratios = (0, 0) + (4, 128) * 20 + (4,)
    sources = tuple(range(2, 43))
    cfg = ModelConfig(
        n_layers=43, n_mtp_layers=0, compress_ratios=ratios, kv_source_layers=sources,
        index_source_layers=sources, head_dim=512, rope_head_dim=64, index_head_dim=128,
    )
    b = kv_bytes(cfg)
    assert b.global_bytes_per_token == 356 * (Fraction(21, 4) + Fraction(20, 128))
    assert b.decoder_global_bytes_per_token == 0 and b.encoder_window_bytes_per_sequence == 43 * 128 * 528


@pytest.mark.parametrize(
    ("width", "main", "index", "window"),
    [(32, 18, 17, 33), (64, 36, 34, 66), (128, 72, 68, 132), (512, 288, 272, 528)],
)
def test_entry_bytes_by_width(width: int, main: int, index: int, window: int):
    assert main_kv_entry_bytes(width) == main
    assert index_k_entry_bytes(width) == index
    assert window_kv_entry_bytes(width) == window


@pytest.mark.parametrize("call", [main_kv_entry_bytes, index_k_entry_bytes, window_kv_entry_bytes])
def test_entry_bytes_rejects_partial_scale_group(call):
    with pytest.raises(ValueError, match="multiple"):
        call(40)
    with pytest.raises(ValueError, match="multiple"):
        call(0)


def test_global_bytes_rejects_negative():
    with pytest.raises(ValueError, match="-1"):
        kv_bytes(load_preset("v41-tiny")).global_bytes(-1)


def _closed_form(cfg: ModelConfig) -> Fraction:
    # V41_SPEC §10.2 written the other way: (9/16 d_c + 17/32 d_I) x sum over kv sources of 1/m
    per_entry = Fraction(9, 16) * cfg.head_dim + Fraction(17, 32) * cfg.index_head_dim
    return per_entry * sum(Fraction(1, cfg.compress_ratios[s]) for s in cfg.kv_source_layers)


@pytest.mark.parametrize("seed", range(8))
def test_kv_bytes_matches_closed_form_on_random_geometries(seed: int):
    rng = random.Random(seed)
    n_enc, n_dec = rng.randint(1, 6), rng.randint(1, 6)
    enc_ratio = rng.choice([2, 3, 4, 8])
    # encoder: one SWA-only head layer, then ratio-m layers with random kv sources (the first one forced)
    enc_sources = [1] + [layer for layer in range(2, 1 + n_enc) if rng.random() < 0.4]
    split = 1 + n_enc
    ratios = [0] + [enc_ratio] * n_enc + [1] * n_dec
    kv = [*enc_sources, split]
    head_dim, index_head_dim = rng.choice([64, 128, 256, 512]), rng.choice([64, 128])
    cfg = ModelConfig(
        n_layers=len(ratios), n_mtp_layers=0, compress_ratios=tuple(ratios), kv_source_layers=tuple(kv),
        index_source_layers=tuple(kv), head_dim=head_dim, index_head_dim=index_head_dim, rope_head_dim=32,
    )
    b = kv_bytes(cfg)
    assert b.global_bytes_per_token == _closed_form(cfg)
    assert b.window_bytes_per_sequence == len(ratios) * cfg.window_size * Fraction(33, 32) * head_dim
    assert b.encoder_window_bytes_per_sequence == split * cfg.window_size * (head_dim + head_dim // 32)
    n_tokens = rng.randint(0, 1000)
    assert b.global_bytes(n_tokens) == sum(
        (n_tokens // cfg.compress_ratios[s]) * (head_dim * 9 // 16 + index_head_dim * 17 // 32) for s in kv
    )
