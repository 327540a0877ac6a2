"""FitRequest validation (each bad value named), the budget's split into sequences, the stored form's
round trip, the child's event protocol and the ETA."""

from __future__ import annotations

import io
import json

import pytest

from orchestrator.jobs import EtaEstimator, FitRequest, emit, parse_event, plan_calibration
from orchestrator.jobs.request import GATE_THRESHOLDS

RANDOM = {"kind": "corpus", "name": "random", "seed": 5}


def _req(**kw) -> FitRequest:
    base = dict(sender_model="s", receiver_model="r", source=RANDOM, budget_tokens=1024)
    return FitRequest(**(base | kw))


def test_plan_holds_out_a_quarter_and_rounds_the_budget_down() -> None:
    assert plan_calibration(256, 128) == plan_calibration(300, 128)
    p = plan_calibration(256, 128)
    assert (p.train, p.heldout, p.rows_total) == (1, 1, 256)
    p = plan_calibration(100_000, 128)
    assert (p.train + p.heldout, p.heldout, p.rows_total) == (781, 195, 781 * 128)
    with pytest.raises(ValueError, match="budget_tokens=255 holds 1 sequence"):
        plan_calibration(255, 128)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"sender_model": ""}, "sender_model is required"),
        ({"receiver_model": "s"}, "both 's'"),
        ({"budget_tokens": 0}, "budget_tokens=0 must be positive"),
        ({"budget_tokens": 200}, "budget_tokens=200 holds 1"),
        ({"sequence_tokens": 0}, "sequence_tokens=0"),
        ({"sequence_tokens": 10_000}, "sequence_tokens=10000"),
        ({"source": {"kind": "corpus", "name": "wiki"}}, "corpus 'wiki'"),
        ({"source": {"kind": "corpus", "name": "random", "seed": -1}}, "seed -1"),
        ({"source": {"kind": "url", "path": "x"}}, "kind 'url'"),
        ({"source": {"kind": "tokens_file", "path": ""}}, "must name a file"),
        ({"gate": {"min_attn_cosine": float("nan")}}, "min_attn_cosine=nan"),
        ({"gate": {"min_retention": 0.9}}, "min_retention needs task_episodes"),
        ({"gate": {"min_retention_lower": 0.8}}, "min_retention_lower needs task_episodes"),
        ({"gate": {"disabled": ["max_kl"]}}, r"\['max_kl'\] are not thresholds"),
        ({"gate": {"min_attn_cosine": 0.5, "disabled": ["min_attn_cosine"]}}, "both set and disabled"),
        ({"gate": {"task_episodes": -1}}, "task_episodes=-1"),
        ({"gate": {"eval_prompts": 10_000}}, "eval_prompts=10000"),
        ({"gate": {"task_seed": "7"}}, "task_seed='7'"),
        ({"gate": {"colour": 1}}, r"unknown gate settings \['colour'\]"),
    ],
)
def test_bad_requests_name_the_bad_value(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _req(**change)


def test_the_stored_form_round_trips_and_defaults_are_filled() -> None:
    req = _req(sequence_tokens=64, gate={"min_attn_cosine": 0.5, "task_episodes": 8, "task_seed": 9,
                                         "disabled": ["min_retention_lower", "min_retention_lower"]})
    assert req.gate == {"min_attn_cosine": 0.5, "task_episodes": 8, "eval_prompts": 2, "task_seed": 9,
                        "disabled": ["min_retention_lower"]}
    again = FitRequest.from_stored(sender_model="s", receiver_model="r", source=req.stored_source(),
                                   budget_tokens=1024, gate=req.gate)
    assert again == req and again.plan.sequence_tokens == 64
    assert FitRequest.from_json(json.loads(json.dumps(req.to_json()))) == req
    assert set(GATE_THRESHOLDS) >= {k for k in req.gate if k.startswith(("min_", "max_"))}


def test_the_map_options_survive_storage_and_reach_the_fit_spec() -> None:
    from orchestrator.jobs.child import _fit_spec

    req = _req(fallback="mlp", attention_weighted=True)
    again = FitRequest.from_stored(sender_model="s", receiver_model="r", source=req.stored_source(),
                                   budget_tokens=1024, gate=req.gate)
    assert again == req and FitRequest.from_json(json.loads(json.dumps(req.to_json()))) == req
    spec = _fit_spec(again)
    assert spec.fallback == "mlp" and spec.attention_weighted is True
    assert _fit_spec(_req()).attention_weighted is False


def test_events_are_one_checked_json_object_per_line() -> None:
    buf = io.StringIO()
    emit(buf, "progress", rows_done=3, rows_total=10)
    emit(buf, "phase", phase="evaluating")
    lines = buf.getvalue().splitlines()
    assert [parse_event(line)["event"] for line in lines] == ["progress", "phase"]
    with pytest.raises(ValueError, match="unknown job event"):
        emit(buf, "chatter")
    for bad, match in [
        ("not json", "not JSON"),
        ('{"event": "hello"}', "unknown event"),
        ('[1]', "unknown event"),
        ('{"event": "progress", "rows_done": 11, "rows_total": 10}', "impossible progress"),
        ('{"event": "progress", "rows_done": "1", "rows_total": 10}', "impossible progress"),
        ('{"event": "phase", "phase": "succeeded"}', "unknown phase"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_event(bad)


def test_eta_is_the_rows_left_at_the_mean_rate_since_the_first_report() -> None:
    now = [100.0]
    eta = EtaEstimator(lambda: now[0])
    assert eta.update(0, 1000) is None  # starts the clock
    now[0] = 102.0
    assert eta.update(0, 1000) is None  # no rows yet: no rate
    now[0] = 104.0
    assert eta.update(200, 1000) == pytest.approx(800 * 4.0 / 200)
    now[0] = 110.0
    assert eta.update(1000, 1000) == 0.0
