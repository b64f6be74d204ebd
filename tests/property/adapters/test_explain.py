"""guard_adapters.explain: the prediction a step made, and the constraint a refusal counts under."""

from __future__ import annotations

import attrs
import pytest

from guard_adapters.config import load_config
from guard_adapters.explain import (
    as_json,
    attempt_prediction,
    explanation,
    poll_prediction,
    refusal_binding,
)
from guard_adapters.recording import Decision, decode_line, encode
from guard_core import (
    BackendPoll,
    BackendSample,
    Binding,
    DecisionSource,
    GuardState,
    LimitReason,
    LoadState,
    MetricsPolled,
    Prediction,
    PublishedDecision,
    RejectCode,
    Tier,
    apply_guard_event,
)
from guard_core.predictive import FitSummary
from tests.core_steps import attempt


def state_for(policy: str) -> GuardState:
    settings = load_config(
        {"DYNAMIC_METRICS_URL": "http://engine:8000/metrics", "DYNAMIC_POLICY": policy}
    )
    return GuardState.initial(settings.guard_config(), at=0.0)


def poll(state: GuardState, at: float, *, ok: bool = True) -> GuardState:
    sample = BackendSample(running=4.0, waiting=0.0, kv_usage=0.1, generation_tokens=100.0 * at)
    polled = BackendPoll(name="metrics1", sample=sample if ok else None, error="" if ok else "x")
    return apply_guard_event(state, MetricsPolled(at, (polled,))).state


def prediction(binding: Binding, **changes: object) -> Prediction:
    fields: dict[str, object] = {
        "user_tps": 31.5,
        "ttft_s": 0.25,
        "kv_usage": 0.4,
        "binding": binding,
        "fit": FitSummary(0.0115, 6.2e-05, 0.016, 7.5e-05, 0.03, 12),
        "cap": 40,
        **changes,
    }
    return Prediction(**fields)  # type: ignore[arg-type]


def decision(reason: LimitReason) -> PublishedDecision:
    return PublishedDecision(
        at=1.0, source=DecisionSource.METRICS, cap=10, state=LoadState.GREEN, final_reason=reason
    )


def test_under_pigs_learner_no_step_makes_a_prediction() -> None:
    before = state_for("pig")
    after = poll(before, 1.0)
    assert poll_prediction(before, after) is None
    attempted = attempt(after, 1.5, Tier.BASIC, 1000).state
    assert attempt_prediction(after, attempted) is None


def test_each_poll_and_each_judged_attempt_gives_its_own_prediction() -> None:
    start = state_for("predictive")
    first = poll(start, 1.0)
    made = poll_prediction(start, first)
    assert made is not None
    assert made is first.predictive.last_cap  # type: ignore[union-attr]
    second = poll(first, 2.0)
    assert poll_prediction(first, second) is second.predictive.last_cap  # type: ignore[union-attr]
    # An attempt is not a poll: it makes a verdict, not a cap.
    attempted = attempt(second, 2.5, Tier.BASIC, 1000).state
    assert poll_prediction(second, attempted) is None
    verdict = attempt_prediction(second, attempted)
    assert verdict is not None
    # The same question asked again is judged again: a new verdict, even if equal.
    again = attempt(attempted, 2.5, Tier.BASIC, 1000).state
    assert attempt_prediction(attempted, again) is again.verdict


def test_a_failed_poll_and_a_refusal_by_the_gate_make_none() -> None:
    start = state_for("predictive")
    # Before any metrics the gate refuses at once; the learner is not asked.
    refused = attempt(start, 0.5, Tier.BASIC, 1000)
    assert refused.outcome is not None
    assert attempt_prediction(start, refused.state) is None
    good = poll(start, 1.0)
    failed = poll(good, 2.0, ok=False)
    assert poll_prediction(good, failed) is None


@pytest.mark.parametrize(
    ("verdict", "reason", "code", "binding"),
    [
        (Binding.TTFT, LimitReason.PREDICTED_SPEED, RejectCode.GLOBAL_DYNAMIC_LIMIT, Binding.TTFT),
        (Binding.KV, LimitReason.HARD_GLOBAL, RejectCode.GLOBAL_DYNAMIC_LIMIT, Binding.KV),
        (None, LimitReason.PREDICTED_SPEED, RejectCode.GLOBAL_DYNAMIC_LIMIT, Binding.SPEED),
        (None, LimitReason.PREDICTED_SPEED, RejectCode.TIER_BASIC_LIMIT, Binding.NONE),
        (None, LimitReason.BACKEND_WAITING, RejectCode.GLOBAL_DYNAMIC_LIMIT, Binding.NONE),
        (None, LimitReason.BACKEND_UNAVAILABLE, RejectCode.BACKEND_UNAVAILABLE, Binding.NONE),
    ],
)
def test_refusal_binding(
    verdict: Binding | None, reason: LimitReason, code: RejectCode, binding: Binding
) -> None:
    judged = None if verdict is None else prediction(verdict)
    assert refusal_binding(judged, decision(reason), code) is binding


def test_an_explanation_keeps_every_number_through_the_recording() -> None:
    made = prediction(Binding.SPEED, user_tps=24.999999999999996, ttft_s=1 / 3)
    explained = explanation(made)
    assert (explained.cap, explained.binding, explained.user_tps) == (
        40,
        "predicted_speed",
        made.user_tps,
    )
    assert explained.fit_observations == 12
    record = Decision(at=1.0, poll=3, cap=40, state="green", reason="x", predicted=explained)
    assert decode_line(encode(record), line_no=1) == record
    assert explanation(attrs.evolve(made, ttft_s=made.ttft_s + 1e-15)) != explained


def test_as_json_names_the_predictions_the_binding_and_the_fit() -> None:
    shown = as_json(prediction(Binding.NONE))
    assert shown["binding"] == "none"
    assert shown["fit"] == {
        "step_base_s": 0.0115,
        "per_decoder_s": 6.2e-05,
        "per_kv_s": 0.016,
        "per_prompt_token_s": 7.5e-05,
        "relative_error": 0.03,
        "observations": 12,
    }
    assert (shown["user_tps"], shown["ttft_s"], shown["kv_usage"], shown["cap"]) == (
        31.5,
        0.25,
        0.4,
        40,
    )
