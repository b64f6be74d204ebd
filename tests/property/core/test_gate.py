"""Example tests of the admission gate with literal times (spec 4.1 - 4.3)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_core import (
    Admitted,
    DecisionPublished,
    DecisionSource,
    GateConfig,
    GateState,
    InvalidObservation,
    LimitReason,
    LoadState,
    PolicyConfigError,
    PublishedDecision,
    Queued,
    RejectCode,
    Rejected,
    SlotReleased,
    SlotRequested,
    StateReason,
    Tier,
    WaitAbandoned,
    WaitRetried,
    apply_gate_event,
    current_limit,
    next_check_at,
    short_wait_s,
)

P, B = Tier.PREMIUM, Tier.BASIC


def metrics_decision(cap: int, **changes: Any) -> PublishedDecision:
    base = PublishedDecision(
        at=0.0,
        source=DecisionSource.METRICS,
        cap=cap,
        state=LoadState.GREEN,
        final_reason=LimitReason.THROUGHPUT,
    )
    return attrs.evolve(base, **changes)


def open_gate(cap: int, **config: object) -> GateState:
    gate = GateState.initial(GateConfig(**config), at=0.0)  # type: ignore[arg-type]
    return apply_gate_event(gate, DecisionPublished(metrics_decision(cap))).state


def attempt(gate: GateState, tier: Tier, at: float = 1.0) -> tuple[GateState, object]:
    step = apply_gate_event(gate, SlotRequested(at, tier))
    return step.state, step.outcome


def fill(gate: GateState, *tiers: Tier) -> GateState:
    for tier in tiers:
        gate, outcome = attempt(gate, tier)
        assert outcome == Admitted(tier)
    return gate


# -- current limit and start-up ----------------------------------------------------------------


def test_dynamic_gate_is_closed_until_the_first_poll() -> None:
    gate = GateState.initial(GateConfig(), at=0.0)
    assert current_limit(gate) == (0, RejectCode.BACKEND_UNAVAILABLE)
    for tier in Tier:
        _, outcome = attempt(gate, tier)
        assert outcome == Rejected(RejectCode.BACKEND_UNAVAILABLE)  # no queue wait at all


def test_all_polls_failed_rejects_at_once() -> None:
    gate = open_gate(10)
    failed = PublishedDecision.all_polls_failed(at=2.0, backend_count=2)
    gate = apply_gate_event(gate, DecisionPublished(failed)).state
    assert attempt(gate, P)[1] == Rejected(RejectCode.BACKEND_UNAVAILABLE)


def test_static_mode_uses_global_limit_and_the_tier_rule() -> None:
    gate = GateState.initial(GateConfig(global_limit=3, dynamic=False, queue_wait_s=0), at=0.0)
    assert gate.decision.state is LoadState.DISABLED
    assert current_limit(gate) == (3, None)
    gate = fill(gate, B, B)
    assert attempt(gate, B)[1] == Rejected(RejectCode.TIER_BASIC_LIMIT)
    gate = fill(gate, P)
    assert attempt(gate, P)[1] == Rejected(RejectCode.GLOBAL_LIMIT)


def test_static_mode_ignores_published_decisions_for_the_cap() -> None:
    gate = GateState.initial(GateConfig(global_limit=2, dynamic=False, queue_wait_s=0), at=0.0)
    gate = apply_gate_event(gate, DecisionPublished(metrics_decision(0))).state
    assert attempt(gate, P)[1] == Admitted(P)


def test_global_limit_zero_admits_nobody() -> None:
    gate = GateState.initial(GateConfig(global_limit=0, dynamic=False, queue_wait_s=0), at=0.0)
    assert attempt(gate, P)[1] == Rejected(RejectCode.GLOBAL_LIMIT)
    assert attempt(gate, B)[1] == Rejected(RejectCode.TIER_BASIC_LIMIT)


def test_cap_zero_without_unavailability_is_a_dynamic_limit() -> None:
    gate = open_gate(10, queue_wait_s=0)
    waiting = metrics_decision(
        0,
        final_reason=LimitReason.BACKEND_WAITING,
        state=LoadState.YELLOW,
        yellow_reasons=(StateReason.BACKEND_WAITING_QUEUE,),
        waiting=3,
    )
    gate = apply_gate_event(gate, DecisionPublished(waiting)).state
    assert current_limit(gate) == (0, RejectCode.GLOBAL_DYNAMIC_LIMIT)


# -- tiers under a dynamic cap -----------------------------------------------------------------


def test_premium_may_use_the_whole_cap_basic_leaves_the_reserve() -> None:
    gate = open_gate(8, queue_wait_s=0)
    gate = fill(gate, *[B] * 7)
    assert attempt(gate, B)[1] == Rejected(RejectCode.TIER_BASIC_LIMIT)
    gate = fill(gate, P)
    assert attempt(gate, P)[1] == Rejected(RejectCode.GLOBAL_DYNAMIC_LIMIT)


def test_reserve_grows_with_premium_in_flight() -> None:
    gate = open_gate(8, queue_wait_s=0)
    gate = fill(gate, P, P, B, B, B, B, B)  # basic limit with 2 premium in flight: 8 - 3 = 5
    assert attempt(gate, B)[1] == Rejected(RejectCode.TIER_BASIC_LIMIT)
    assert attempt(gate, P)[1] == Admitted(P)


def test_cap_of_one_is_shared() -> None:
    gate = open_gate(1, queue_wait_s=0)
    assert attempt(gate, B)[1] == Admitted(B)
    gate = fill(gate, P)
    assert attempt(gate, B)[1] == Rejected(RejectCode.GLOBAL_DYNAMIC_LIMIT)


def test_no_basic_admission_while_premium_waits() -> None:
    gate = open_gate(4)
    gate = fill(gate, P, P, P, P)
    gate, queued = attempt(gate, P)
    assert isinstance(queued, Queued)
    assert queued.code is RejectCode.GLOBAL_DYNAMIC_LIMIT
    gate = apply_gate_event(gate, SlotReleased(1.1, P)).state
    # A slot is free, but a premium request is waiting: basic must not take it.
    gate, basic = attempt(gate, B, at=1.2)
    assert isinstance(basic, Queued)
    assert basic.code is RejectCode.TIER_PRIORITY
    step = apply_gate_event(gate, WaitRetried(1.2, queued))
    assert step.outcome == Admitted(P)
    assert step.state.premium_waiting == 0


def test_a_lower_cap_never_evicts() -> None:
    gate = fill(open_gate(4, queue_wait_s=0), P, B, B)
    gate = apply_gate_event(gate, DecisionPublished(metrics_decision(1))).state
    assert gate.inflight == 3
    assert attempt(gate, P)[1] == Rejected(RejectCode.GLOBAL_DYNAMIC_LIMIT)
    for tier in (P, B, B):
        gate = apply_gate_event(gate, SlotReleased(2.0, tier)).state
    assert attempt(gate, P)[1] == Admitted(P)


def test_global_limit_holds_when_the_published_cap_is_higher() -> None:
    gate = fill(open_gate(50, global_limit=2, queue_wait_s=0), P, P)
    assert attempt(gate, P)[1] == Rejected(RejectCode.GLOBAL_LIMIT)


# -- the short wait ----------------------------------------------------------------------------


def test_wait_ends_at_the_deadline_with_a_reject() -> None:
    gate = fill(open_gate(1), P)
    gate, queued = attempt(gate, P, at=10.0)
    assert queued == Queued(P, 10.5, RejectCode.GLOBAL_DYNAMIC_LIMIT, arrived_at=10.0)
    step = apply_gate_event(gate, WaitRetried(10.2, queued))
    assert step.outcome == queued
    assert step.state == gate
    step = apply_gate_event(gate, WaitRetried(10.5, queued))
    assert step.outcome == Rejected(RejectCode.GLOBAL_DYNAMIC_LIMIT)
    assert step.state.waiting == 0


def test_waiter_is_refused_at_once_when_the_backend_disappears() -> None:
    gate = fill(open_gate(1), P)
    gate, queued = attempt(gate, B, at=10.0)
    assert isinstance(queued, Queued)
    failed = PublishedDecision.all_polls_failed(at=10.1, backend_count=1)
    gate = apply_gate_event(gate, DecisionPublished(failed)).state
    step = apply_gate_event(gate, WaitRetried(10.1, queued))
    assert step.outcome == Rejected(RejectCode.BACKEND_UNAVAILABLE)


def test_abandoned_waiter_leaves_the_queue() -> None:
    gate = fill(open_gate(1), P)
    gate, queued = attempt(gate, P)
    assert isinstance(queued, Queued)
    step = apply_gate_event(gate, WaitAbandoned(1.1, queued))
    assert step.outcome is None
    assert step.state.premium_waiting == 0
    with pytest.raises(InvalidObservation):
        apply_gate_event(step.state, WaitAbandoned(1.2, queued))


def test_releasing_a_slot_nobody_holds_is_a_caller_bug() -> None:
    gate = fill(open_gate(4), P)
    with pytest.raises(InvalidObservation):
        apply_gate_event(gate, SlotReleased(1.0, B))
    with pytest.raises(InvalidObservation):
        apply_gate_event(gate, WaitRetried(1.0, Queued(P, 2.0, RejectCode.GLOBAL_LIMIT)))


def code_wait(decision: PublishedDecision, **config: object) -> float:
    return short_wait_s(decision, RejectCode.GLOBAL_DYNAMIC_LIMIT, GateConfig(**config))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, 0.5),
        ({"source": DecisionSource.STARTUP, "state": LoadState.RED}, 0.5),
        ({"red_reasons": (StateReason.PREEMPTIONS,), "state": LoadState.RED}, 0.1),
        ({"red_reasons": (StateReason.KV_CACHE,), "state": LoadState.RED}, 0.1),
        ({"red_reasons": (StateReason.WAITING,), "state": LoadState.RED}, 0.1),
        ({"state": LoadState.RED}, 0.1),
        ({"kv_usage": 0.80}, 0.1),
        ({"kv_usage": 0.79}, 0.5),
        ({"running": 9, "waiting": 1}, 0.25),
        ({"waiting": 1}, 0.25),
        ({"state": LoadState.YELLOW, "waiting": 1}, 0.25),
        ({"running": 10, "waiting": 0}, 0.5),
    ],
)
def test_short_wait_rules(changes: dict[str, object], expected: float) -> None:
    assert code_wait(metrics_decision(10, **changes)) == expected


def test_short_wait_config_edges() -> None:
    decision = metrics_decision(10)
    assert code_wait(decision, queue_wait_s=2.0) == 0.5
    assert code_wait(decision, queue_wait_s=0.2) == 0.2
    assert code_wait(decision, queue_wait_s=0.0) == 0.0
    assert code_wait(metrics_decision(10, kv_usage=0.97), kv_red=0.0) == 0.1
    assert code_wait(metrics_decision(10, kv_usage=0.9), kv_red=0.0) == 0.5
    assert code_wait(metrics_decision(10, waiting=1), waiting_red=0) == 0.5
    assert code_wait(metrics_decision(10, waiting=2), waiting_red=5) == 0.25
    assert (
        code_wait(metrics_decision(10, waiting=1, state=LoadState.RED), queue_wait_s=0.05) == 0.05
    )
    assert short_wait_s(decision, RejectCode.BACKEND_UNAVAILABLE, GateConfig()) == 0.0


@given(
    st.sampled_from(RejectCode),
    st.sampled_from(DecisionSource),
    st.sampled_from(LoadState),
    st.lists(st.sampled_from(StateReason), max_size=4).map(tuple),
    st.floats(0, 1),
    st.integers(0, 20),
    st.integers(0, 50),
    st.floats(0, 5),
)
def test_short_wait_is_bounded(
    code: RejectCode,
    source: DecisionSource,
    state: LoadState,
    red: tuple[StateReason, ...],
    kv: float,
    waiting: int,
    running: int,
    configured: float,
) -> None:
    decision = metrics_decision(
        8,
        source=source,
        state=state,
        red_reasons=red,
        kv_usage=kv,
        waiting=waiting,
        running=running,
    )
    wait = short_wait_s(decision, code, GateConfig(queue_wait_s=configured))
    assert 0 <= wait <= min(configured, 0.5)
    if code is RejectCode.BACKEND_UNAVAILABLE:
        assert wait == 0


def test_fallback_check_period() -> None:
    queued = Queued(P, 10.5, RejectCode.GLOBAL_LIMIT)
    assert GateConfig().fallback_check_s == 1.0
    assert next_check_at(queued, now=10.0, config=GateConfig()) == 10.5
    fast = GateConfig(queue_poll_ms=2)
    assert fast.fallback_check_s == 0.05
    assert next_check_at(queued, now=10.0, config=fast) == pytest.approx(10.05)


@pytest.mark.parametrize(
    "bad", [{"global_limit": -1}, {"queue_wait_s": -0.1}, {"queue_poll_ms": 0}, {"kv_red": -1}]
)
def test_config_ranges(bad: dict[str, object]) -> None:
    with pytest.raises(PolicyConfigError):
        GateConfig(**bad)  # type: ignore[arg-type]
