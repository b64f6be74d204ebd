"""The predictive learner (guard_core.predictive) and its place in the guard reducer."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_core import (
    Admitted,
    Arrived,
    BackendPoll,
    BackendSample,
    Binding,
    Finished,
    Flavour,
    Forwarded,
    GateConfig,
    GuardConfig,
    GuardState,
    Histogram,
    LimitReason,
    MetricsPolled,
    PolicyConfigError,
    PredictiveConfig,
    Queued,
    Rejected,
    Tier,
    apply_guard_event,
)
from guard_core import predictive as rules
from guard_core.engine_fit import EngineFit, Interval, observe
from guard_core.predictive import PredictiveState

#: The default simulated profile's step law (a100-qwen2-7b).
LAW = (0.0115, 62e-6, 35e-9 * 464_848, 75e-6)


def _learned_fit() -> EngineFit:
    fit = EngineFit()
    for i in range(60):
        decoders = 5 + (i * 7) % 90
        kv = decoders * 1500 / 464_848
        prompt_tps = (i * 1300) % 9000
        a, d, k, p = LAW
        inter_token = (a + d * decoders + k * kv) / (1 - p * prompt_tps)
        fit = observe(fit, Interval(inter_token, decoders, kv, prompt_tps), forgetting=0.95)
    return fit


def _state(**changes: Any) -> PredictiveState:
    state = PredictiveState.initial(PredictiveConfig())
    state = attrs.evolve(
        state, fits={"b": _learned_fit()}, healthy=1, bytes_per_token=4.0, trusted_decoders=400.0
    )
    return attrs.evolve(state, **changes)


def _with_decoders(state: PredictiveState, count: int, *, at: float) -> PredictiveState:
    for rid in range(count):
        state = rules.forwarded(state, rid, 400, at=at)
        state = rules.first_token(state, rid, at=at)
    return state


def test_an_idle_engine_takes_any_request() -> None:
    verdict = rules.assess(_state(), 4 * 16_000, reserve=0, waited_s=0.0, at=0.0)
    assert verdict.admit
    assert verdict.prediction.binding is Binding.NONE


def test_too_many_decoders_is_refused_on_speed() -> None:
    # At 62 us per decoder plus 11.5 ms, about 450 decoders would make 25 tok/s impossible.
    state = _with_decoders(_state(), 500, at=0.0)
    verdict = rules.assess(state, 400, reserve=0, waited_s=0.0, at=0.0)
    assert not verdict.admit
    assert verdict.prediction.binding is Binding.SPEED
    assert verdict.prediction.user_tps < 25


def test_a_few_decoders_admit_a_short_prompt() -> None:
    state = _with_decoders(_state(), 20, at=0.0)
    verdict = rules.assess(state, 2000, reserve=0, waited_s=0.0, at=10.0)
    assert verdict.admit
    assert verdict.prediction.user_tps > 25


def test_a_burst_of_long_prompts_is_refused_before_it_stalls_the_decoders() -> None:
    state = _with_decoders(_state(), 20, at=0.0)
    admitted = 0
    for rid in range(100, 140):
        verdict = rules.assess(state, 4 * 8000, reserve=0, waited_s=0.0, at=1.0)
        if not verdict.admit:
            assert verdict.prediction.binding in (Binding.SPEED, Binding.TTFT)
            break
        state = rules.forwarded(state, rid, 4 * 8000, at=1.0)
        admitted += 1
    # 8k-token prompts at 75 us per token: a second of prefill is about 13k tokens, so only
    # one or two fit before the TTFT or speed target binds.
    assert 1 <= admitted <= 3


def test_a_young_fit_lets_load_grow_only_to_twice_what_it_has_seen() -> None:
    state = _with_decoders(_state(trusted_decoders=10.0), 19, at=0.0)
    verdict = rules.assess(state, 400, reserve=0, waited_s=0.0, at=1.0)
    assert verdict.admit  # 20 in flight: within twice the 10 seen
    state = rules.forwarded(state, 999, 400, at=1.0)
    verdict = rules.assess(state, 400, reserve=0, waited_s=0.0, at=1.0)
    assert not verdict.admit
    assert verdict.prediction.binding is Binding.UNTRIED
    assert rules.published_cap(state, at=1.0).cap == 20


def test_time_already_waited_counts_against_the_ttft_target() -> None:
    state = _with_decoders(_state(), 10, at=0.0)
    fresh = rules.assess(state, 4000, reserve=0, waited_s=0.0, at=5.0)
    late = rules.assess(state, 4000, reserve=0, waited_s=0.95, at=5.0)
    assert fresh.admit
    assert late.prediction.ttft_s == pytest.approx(fresh.prediction.ttft_s + 0.95)


def test_the_premium_reserve_makes_basic_see_more_decoders() -> None:
    state = _with_decoders(_state(), 60, at=0.0)
    premium = rules.assess(state, 400, reserve=0, waited_s=0.0, at=5.0)
    basic = rules.assess(state, 400, reserve=30, waited_s=0.0, at=5.0)
    assert basic.prediction.user_tps < premium.prediction.user_tps


@given(
    events=st.lists(
        st.tuples(st.sampled_from(["forward", "first", "end"]), st.integers(0, 15)),
        max_size=80,
    )
)
def test_request_bookkeeping_never_goes_negative_and_ends_at_zero(
    events: list[tuple[str, int]],
) -> None:
    state = _state()
    at = 0.0
    for kind, rid in events:
        at += 0.1
        if kind == "forward":
            state = rules.forwarded(state, rid, 4000, at=at)
        elif kind == "first":
            state = rules.first_token(state, rid, at=at)
        else:
            state = rules.finished(state, rid, at=at)
        assert state.pending_count >= 0
        assert state.decoders >= 0
        assert state.pending_count + state.decoders == len(state.requests)
        assert state.pending_tokens >= 0
        assert state.inflight_prompt_tokens >= 0
    for rid in list(state.requests):
        state = rules.finished(state, rid, at=at + 1)
    assert (state.pending_count, state.decoders, state.pending_tokens) == (0, 0, 0.0)


def test_retry_after_is_whole_seconds_within_bounds() -> None:
    state = _with_decoders(_state(), 500, at=0.0)
    verdict = rules.assess(state, 400, reserve=0, waited_s=0.0, at=0.0)
    seconds = rules.retry_after_s(state, verdict.prediction, at=0.0)
    assert isinstance(seconds, int)
    assert 1 <= seconds <= 30


def test_published_cap_keeps_the_speed_target() -> None:
    state = _with_decoders(_state(), 10, at=0.0)
    prediction = rules.published_cap(state, at=1.0)
    assert prediction.user_tps >= 25
    fit = state.fit()
    above = fit.inter_token_s(prediction.cap + 1, 0.0, 0.0)
    assert prediction.cap >= 100
    assert math.isfinite(above)


@pytest.mark.parametrize(
    "changes",
    [
        {"batch_tokens": 8},
        {"forgetting": 1.0},
        {"kv_limit": 0.0},
        {"bytes_per_token": 0.0},
        {"horizon_s": 0.1},
        {"user_tps_target": 0.0},
    ],
)
def test_bad_settings_are_refused_with_the_variable_named(changes: dict[str, Any]) -> None:
    with pytest.raises(PolicyConfigError, match="DYNAMIC_"):
        PredictiveConfig(**changes)


# -- inside the guard ------------------------------------------------------------------------


def _sample(generated: float, prompt: float, itl_sum: float, itl_count: float) -> BackendSample:
    return BackendSample(
        flavour=Flavour.VLLM,
        running=20.0,
        waiting=0.0,
        kv_usage=0.05,
        preemptions=0.0,
        generation_tokens=generated,
        prompt_tokens=prompt,
        inter_token_latency=Histogram(((math.inf, itl_count),), itl_count, itl_sum),
    )


def test_the_guard_publishes_the_predictive_cap_and_refuses_with_retry_after() -> None:
    config = GuardConfig(predictive=PredictiveConfig())
    state = GuardState.initial(config, at=0.0)
    generated = prompt = itl_sum = itl_count = 0.0
    for second in range(1, 12):
        generated += 20 * 60
        itl_count += 20 * 60
        itl_sum += 20 * 60 * 0.0168
        prompt += 3000
        poll = MetricsPolled(
            float(second),
            (BackendPoll(name="b", sample=_sample(generated, prompt, itl_sum, itl_count)),),
        )
        step = apply_guard_event(state, poll)
        state = step.state
    assert step.decision is not None
    assert step.decision.final_reason in (LimitReason.PREDICTED_SPEED, LimitReason.HARD_GLOBAL)
    assert state.predictive is not None
    assert state.predictive.last_cap is not None
    # Fill the engine until the learner refuses; the refusal names a Retry-After.
    outcome: object = None
    for rid in range(1, 2000):
        arrived = Arrived(at=12.0, request_id=rid, tier=Tier.PREMIUM, body_bytes=40_000)
        step = apply_guard_event(state, arrived)
        state, outcome = step.state, step.outcome
        if not isinstance(outcome, Admitted):
            break
        state = apply_guard_event(state, Forwarded(at=12.0, request_id=rid)).state
    assert isinstance(outcome, Queued | Rejected)
    if isinstance(outcome, Rejected):
        assert outcome.retry_after_s is not None
        assert 1 <= outcome.retry_after_s <= 30


def test_pig_is_the_default_and_carries_no_predictive_state() -> None:
    state = GuardState.initial(GuardConfig(), at=0.0)
    assert state.predictive is None
    arrived = Arrived(at=0.0, request_id=1, tier=Tier.BASIC, body_bytes=100)
    step = apply_guard_event(state, arrived)
    assert isinstance(step.outcome, Rejected)
    assert step.outcome.retry_after_s is None
    state = apply_guard_event(step.state, Forwarded(at=0.0, request_id=1)).state
    assert apply_guard_event(state, Finished(at=0.0, request_id=1)).state.predictive is None


def test_learning_without_enforcing_never_refuses() -> None:
    config = GuardConfig(
        gate=GateConfig(dynamic=False, global_limit=64), predictive=PredictiveConfig()
    )
    state = GuardState.initial(config, at=0.0)
    for rid in range(64):
        arrived = Arrived(at=0.0, request_id=rid, tier=Tier.PREMIUM, body_bytes=400_000)
        step = apply_guard_event(state, arrived)
        assert isinstance(step.outcome, Admitted)
        state = apply_guard_event(step.state, Forwarded(at=0.0, request_id=rid)).state
    arrived = Arrived(at=0.0, request_id=64, tier=Tier.PREMIUM, body_bytes=400)
    step = apply_guard_event(state, arrived)
    assert isinstance(step.outcome, Queued)  # only GLOBAL_LIMIT holds it
    assert str(step.outcome.code) == "global_limit"
    assert state.predictive is not None
    assert state.predictive.pending_count == 64  # it still tracks what it would predict from


def test_an_engine_too_slow_for_the_target_keeps_the_red_floor_instead() -> None:
    fast = _state()
    assert fast.speed_target() == 25.0
    slow_fit = EngineFit()
    for i in range(40):
        decoders = 1 + i % 8
        inter_token = 0.0466 + 0.000193 * decoders
        slow_fit = observe(slow_fit, Interval(inter_token, decoders, 0.01, 0.0), forgetting=0.95)
    slow = attrs.evolve(fast, fits={"b": slow_fit})
    # One user gets about 21.4 tok/s: the target becomes 95 % of that, never below 20.
    assert 20.0 <= slow.speed_target() < 21.4
    state = _with_decoders(slow, 3, at=0.0)
    assert rules.assess(state, 400, reserve=0, waited_s=0.0, at=1.0).admit
    crowded = _with_decoders(slow, 12, at=0.0)
    verdict = rules.assess(crowded, 400, reserve=0, waited_s=0.0, at=1.0)
    assert not verdict.admit
    assert verdict.prediction.binding is Binding.SPEED
