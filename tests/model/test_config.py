"""ModelConfig: official keys, validation at the edge, and the derived layer schedule (V41_SPEC §2, §11.1)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from model import PRESET_NAMES, LayerRole, ModelConfig, load_preset

R = LayerRole


def _tiny(**changes: object) -> dict:
    data = load_preset("v41-tiny").to_dict()
    data.update(changes)
    return data


def test_load_preset_v41_flash_schedule_matches_spec_table():
    cfg = load_preset("v41-flash")
    roles = [cfg.layer_role(layer) for layer in range(cfg.n_layers)]
    assert roles.count(R.SWA_ONLY) == 2 and roles.count(R.FULL) == 4
    assert roles.count(R.REINDEX) == 4 and roles.count(R.REUSE) == 30
    assert [layer for layer in range(40) if roles[layer] is R.FULL] == [2, 8, 14, 20]
    assert [layer for layer in range(40) if roles[layer] is R.REINDEX] == [24, 28, 32, 36]
    assert cfg.ced_split == 20 and cfg.supports_ced
    assert cfg.encoder_layers == range(0, 20) and cfg.decoder_layers == range(20, 40)
    assert cfg.draft_layers == range(40, 43)
    assert [cfg.layer_role(layer) for layer in cfg.draft_layers] == [R.SWA_ONLY] * 3
    assert [cfg.kv_source_of(layer) for layer in (0, 1, 2, 7, 13, 19, 20, 39, 40)] == [
        None, None, 2, 2, 8, 14, 20, 20, None,
    ]
    assert [cfg.index_source_of(layer) for layer in (3, 21, 25, 31, 39)] == [2, 20, 24, 28, 36]
    assert [layer for layer in range(43) if cfg.uses_candidates(layer)] == [24, 28, 32, 36]
    assert [layer for layer in range(43) if cfg.is_candidate_source(layer)] == [20]
    assert cfg.candidate_pool_covers_topk


def test_load_preset_v41_tiny_schedule_matches_conformance_readme():
    cfg = load_preset("v41-tiny")
    got = [(r.layer, r.half, r.ratio, r.role, r.kv_source, r.index_source) for r in cfg.layer_table()]
    assert got == [
        (0, "enc", 0, R.SWA_ONLY, None, None),
        (1, "enc", 0, R.SWA_ONLY, None, None),
        (2, "enc", 2, R.FULL, 2, 2),
        (3, "enc", 2, R.REUSE, 2, 2),
        (4, "enc", 2, R.FULL, 4, 4),
        (5, "enc", 2, R.REUSE, 4, 4),
        (6, "dec", 1, R.FULL, 6, 6),
        (7, "dec", 1, R.REUSE, 6, 6),
        (8, "dec", 1, R.REINDEX, 6, 8),
        (9, "dec", 1, R.REUSE, 6, 8),
        (10, "dec", 1, R.REINDEX, 6, 10),
        (11, "dec", 1, R.REUSE, 6, 10),
    ]
    assert [r.layer for r in cfg.layer_table() if r.uses_candidates] == [8, 10]
    assert [r.layer for r in cfg.layer_table() if r.is_candidate_source] == [6]
    assert cfg.unsupported_features() == []
    assert cfg.ced_split == 6 and cfg.supports_ced


def test_load_preset_unknown_name_is_value_error():
    with pytest.raises(ValueError, match="v41-huge"):
        load_preset("v41-huge")


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_load_preset_equals_conformance_config(name: str):
    shared = Path("/work/shared/conformance") / name / "config.json"
    if not shared.exists():
        pytest.skip(f"{shared} absent")
    data = json.loads(shared.read_text())
    assert ModelConfig.from_dict(data) == load_preset(name)


def test_unsupported_features_lists_every_enabled_v1_exclusion():
    feats = load_preset("v41-flash").unsupported_features()
    assert [f.split(" ")[0] for f in feats] == ["engram", "mtp", "vision", "dspark"]


def test_from_dict_missing_keys_take_reference_defaults():
    cfg = ModelConfig.from_dict({})
    assert cfg == ModelConfig()
    assert cfg.n_mtp_layers == 1 and cfg.compress_ratios == (0, 2, 2, 1, 1, 0)
    assert [cfg.layer_role(layer) for layer in range(6)] == [
        R.SWA_ONLY, R.FULL, R.REUSE, R.FULL, R.REUSE, R.SWA_ONLY,
    ]
    assert cfg.ced_split == 3 and not cfg.candidates_enabled


def test_from_dict_unknown_keys_named():
    with pytest.raises(ValueError, match=r"\['hidden_size', 'zeta'\]"):
        ModelConfig.from_dict(_tiny(zeta=1, hidden_size=5))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("dim", "256"),
        ("dim", 256.0),
        ("n_layers", True),
        ("compress_ratios", 3),
        ("kv_source_layers", [2, "4", 6]),
        ("norm_topk_prob", 1),
        ("score_func", "relu"),
        ("dtype", "fp16"),
        ("rope_theta", "1e4"),
        ("vision_max_wh_ratio", 1.5),
    ],
)
def test_from_dict_wrong_type_names_key_and_value(key: str, value: object):
    with pytest.raises(ValueError, match=key) as info:
        ModelConfig.from_dict(_tiny(**{key: value}))
    assert repr(value) in str(info.value)


def test_from_dict_normalizes_lists_and_ints():
    cfg = ModelConfig.from_dict(_tiny(rope_theta=10000, vision_max_wh_ratio=4))
    assert isinstance(cfg.compress_ratios, tuple) and cfg.rope_theta == 10000.0
    assert isinstance(cfg.rope_theta, float) and cfg.vision_max_wh_ratio == 4
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert hash(cfg) == hash(ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))))


def test_from_json_bad_file_names_path(tmp_path: Path):
    path = tmp_path / "config.json"
    path.write_text("{ not json")
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig.from_json(path)
    path.write_text(json.dumps({"dim": -1}))
    with pytest.raises(ValueError, match="dim"):
        ModelConfig.from_json(path)
    with pytest.raises(OSError):
        ModelConfig.from_json(tmp_path / "missing.json")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1]}, "11 entries"),
        ({"n_mtp_layers": 1}, "n_mtp_layers"),
        ({"compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 2], "n_mtp_layers": 1}, "draft"),
        ({"kv_source_layers": [2, 4, 6, 7]}, r"kv sources \[7\] are not in index_source_layers"),
        ({"kv_source_layers": [4, 2, 6]}, "strictly increasing"),
        ({"kv_source_layers": [1, 2, 4, 6]}, r"\[1\]"),
        ({"kv_source_layers": [2, 4, 6, 12]}, r"\[12\]"),
        ({"kv_source_layers": [2, 4], "index_source_layers": [2, 4, 8, 10]}, "layer 6"),
        ({"kv_source_layers": [4, 6], "index_source_layers": [4, 6, 8, 10]}, "layer 2"),
        ({"compress_ratios": [0, 0, 2, 2, 2, 2, 1, 2, 2, 1, 1, 1]}, "layer 7"),
        ({"candidate_source_layer": 8}, "candidate_source_layer 8"),
        ({"candidate_source_layer": -2}, "candidate_source_layer"),
        ({"candidate_source_layer": 4}, "index sources"),
        ({"candidate_topk_blocks": 0}, "candidate_topk_blocks"),
        ({"head_dim": 120}, "head_dim"),
        ({"index_head_dim": 48}, "index_head_dim"),
        ({"rope_head_dim": 31}, "rope_head_dim"),
        ({"rope_head_dim": 64}, "rope_head_dim"),
        ({"n_heads": 3}, "o_groups"),
        ({"dim": 250}, "dim"),
        ({"n_shared_experts": 2}, "n_shared_experts"),
        ({"n_activated_experts": 9}, "n_activated_experts"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"window_size": 0}, "window_size"),
        ({"engram_layer_ids": [1]}, "engram_num_embeddings"),
        ({"dspark_target_layer_ids": [12]}, "dspark_target_layer_ids"),
    ],
)
def test_model_config_rejects_invalid_schedule_and_dims(changes: dict, message: str):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(_tiny(**changes))


def test_model_config_is_frozen_and_replace_revalidates():
    cfg = load_preset("v41-tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dim = 512  # type: ignore[misc]
    assert dataclasses.replace(cfg, window_size=64).window_size == 64
    with pytest.raises(ValueError, match="head_dim"):
        dataclasses.replace(cfg, head_dim=100)


def test_layer_queries_reject_out_of_range():
    cfg = load_preset("v41-tiny")
    for call in (cfg.ratio, cfg.layer_role, cfg.kv_source_of, cfg.uses_candidates):
        with pytest.raises(ValueError, match="layer 12"):
            call(12)


def test_candidate_pool_covers_topk_reported_not_rejected():
    cfg = ModelConfig.from_dict(_tiny(candidate_topk_blocks=4))  # (4 - 1) * 4 = 12 < 16
    assert not cfg.candidate_pool_covers_topk
    assert load_preset("v41-tiny").candidate_pool_covers_topk


def test_supports_ced_false_without_ratio1_source_or_with_source_above_split():
    no_split = ModelConfig.from_dict(
        _tiny(
            compress_ratios=[0, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2],
            candidate_source_layer=-1,
        )
    )
    assert no_split.ced_split is None and not no_split.supports_ced
    assert no_split.encoder_layers == range(12) and no_split.decoder_layers == range(12, 12)
    above = ModelConfig.from_dict(
        _tiny(kv_source_layers=[2, 4, 6, 9], index_source_layers=[2, 4, 6, 8, 9], candidate_source_layer=-1)
    )
    assert above.ced_split == 6 and not above.supports_ced
