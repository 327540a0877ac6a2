"""registration_of: a saved mapper artifact's own figures and verdict become registry fields; a verdict
the registry cannot state as "figure >= threshold" registers as not passed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mappers import GateSpec, identity_mapper, save_mapper
from model import load_preset
from orchestrator.db import MapperRegistration
from orchestrator.engine import registration_of


def test_registration_of_a_gated_artifact(tmp_path: Path) -> None:
    cfg = load_preset("v41-tiny")
    base = identity_mapper(cfg, cfg, sender_name="s", receiver_name="r")
    gated = dataclasses.replace(
        base,
        gate=GateSpec(min_attn_cosine=0.9, max_next_token_kl=0.5, min_index_recall=None),
        quality={"attn_cosine_mean": 0.95, "next_token_kl": 0.1},
        passed_gate=True,
    )
    fields = registration_of(save_mapper(gated, tmp_path / "gated"))
    assert (fields["sender_model"], fields["receiver_model"], fields["kind"]) == ("s", "r", "identity")
    assert (fields["gate_metric"], fields["gate_threshold"], fields["passed_gate"]) == (
        "attn_cosine_mean",
        0.9,
        True,
    )
    assert fields["metrics"] == {"attn_cosine_mean": 0.95, "next_token_kl": 0.1}
    # the fields are a valid registration (its own consistency checks pass)
    MapperRegistration(**fields)
    # the identity artifact is ungated: nothing the registry can check, so it registers as not passed
    ungated = registration_of(save_mapper(base, tmp_path / "ungated"))
    assert ungated["passed_gate"] is False and ungated["gate_metric"] == ""
    MapperRegistration(**ungated)
