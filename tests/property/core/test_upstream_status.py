"""The ``/v1/upstream-status`` digit (spec 9.1, quirk 15.14 kept)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from guard_core import (
    Admitted,
    DecisionSource,
    GateConfig,
    GateState,
    LimitReason,
    LoadState,
    PublishedDecision,
    SlotRequested,
    StateReason,
    Tier,
    apply_gate_event,
)
from guard_core.upstream_status import UpstreamStatus, upstream_status_digit


def decision(cap: int, state: LoadState = LoadState.GREEN, **changes: Any) -> PublishedDecision:
    base = PublishedDecision(
        at=0.0,
        source=DecisionSource.METRICS,
        cap=cap,
        state=state,
        final_reason=LimitReason.THROUGHPUT,
    )
    return attrs.evolve(base, **changes)


def gate(
    cap: int,
    state: LoadState = LoadState.GREEN,
    *,
    global_limit: int = 512,
    premium: int = 0,
    basic: int = 0,
    premium_waiting: int = 0,
    basic_waiting: int = 0,
    **decision_changes: Any,
) -> GateState:
    return GateState(
        config=GateConfig(global_limit=global_limit),
        decision=decision(cap, state, **decision_changes),
        premium_inflight=premium,
        basic_inflight=basic,
        premium_waiting=premium_waiting,
        basic_waiting=basic_waiting,
    )


def static_gate(global_limit: int, *, premium: int = 0, basic: int = 0) -> GateState:
    config = GateConfig(global_limit=global_limit, dynamic=False)
    return attrs.evolve(
        GateState.initial(config, at=0.0), premium_inflight=premium, basic_inflight=basic
    )


# -- literal examples, in rule order ------------------------------------------------------------


def test_not_initialised_is_3() -> None:
    assert upstream_status_digit(None) == 3
    assert upstream_status_digit(None) is UpstreamStatus.NOT_INITIALISED


def test_digit_prints_as_a_bare_number() -> None:
    assert f"{upstream_status_digit(None)}\n" == "3\n"
    assert f"{upstream_status_digit(gate(100))}\n" == "0\n"


def test_startup_and_failed_polls_are_red() -> None:
    config = GateConfig()
    startup = GateState.initial(config, at=0.0)
    assert upstream_status_digit(startup) == 2
    failed = attrs.evolve(
        startup, decision=PublishedDecision.all_polls_failed(at=1.0, backend_count=2)
    )
    assert upstream_status_digit(failed) == 2


def test_closed_cap_is_red() -> None:
    assert upstream_status_digit(gate(0)) == 2  # global_dynamic_limit
    assert upstream_status_digit(static_gate(0)) == 2  # GLOBAL_LIMIT=0 (quirk 11)


@pytest.mark.parametrize(("premium_waiting", "basic_waiting"), [(1, 0), (0, 1), (2, 3)])
def test_anyone_waiting_for_a_slot_is_red(premium_waiting: int, basic_waiting: int) -> None:
    g = gate(100, premium_waiting=premium_waiting, basic_waiting=basic_waiting)
    assert upstream_status_digit(g) == 2


def test_backend_unavailable_with_an_open_cap_is_red() -> None:
    assert upstream_status_digit(gate(100, backend_count=2, backend_failed=2)) == 2
    assert upstream_status_digit(gate(100, backend_count=2, backend_failed=1)) == 0
    flagged = gate(100, LoadState.GREEN, yellow_reasons=(StateReason.BACKEND_UNAVAILABLE,))
    assert upstream_status_digit(flagged) == 2


def test_backend_waiting_is_red() -> None:
    assert upstream_status_digit(gate(100, waiting=1)) == 2
    assert upstream_status_digit(gate(100, waiting=0)) == 0


def test_state_decides_before_the_counts() -> None:
    assert upstream_status_digit(gate(100, LoadState.RED)) == 2
    assert upstream_status_digit(gate(100, LoadState.YELLOW)) == 1
    assert upstream_status_digit(gate(100, LoadState.GREEN)) == 0
    assert upstream_status_digit(static_gate(512)) == 0  # disabled


def test_full_cap_is_red() -> None:
    assert upstream_status_digit(gate(10, premium=10)) == 2
    assert upstream_status_digit(gate(10, premium=4, basic=6)) == 2
    # A later, lower cap leaves more in flight than the cap allows.
    assert upstream_status_digit(gate(5, basic=3, premium=4)) == 2


def test_full_basic_share_is_red() -> None:
    # Cap 10 with no premium: basic may hold 9.
    assert upstream_status_digit(gate(10, basic=9)) == 2
    assert upstream_status_digit(gate(10, basic=8)) == 1
    # One premium in flight keeps two slots for premium: basic may hold 8.
    assert upstream_status_digit(gate(10, premium=1, basic=8)) == 2
    assert upstream_status_digit(gate(10, premium=1, basic=7)) == 1


def test_near_the_global_cap_is_yellow() -> None:
    # 85 % of 100: premium 85 in flight; the basic share (14) is idle and not near.
    assert upstream_status_digit(gate(100, premium=85)) == 1
    assert upstream_status_digit(gate(100, premium=84)) == 0
    # One slot left (premium holds the rest, so the basic share is 0 and not "full").
    assert upstream_status_digit(gate(5, premium=4)) == 1
    assert upstream_status_digit(gate(10, premium=3)) == 0


def test_near_the_basic_share_is_yellow() -> None:
    # Cap 10: basic share 9, 8 used leaves one (near); the global cap has two left and is at
    # 80 %, so only the basic rule fires.
    assert upstream_status_digit(gate(10, basic=8)) == 1
    assert upstream_status_digit(gate(10, basic=7)) == 0
    # 85 % of the basic share: cap 17 with one premium leaves basic 15; 13 of 15 is 86.7 %,
    # while 14 of 17 overall is 82 % with three slots left.
    assert upstream_status_digit(gate(17, premium=1, basic=13)) == 1
    assert upstream_status_digit(gate(17, premium=1, basic=12)) == 0


@pytest.mark.parametrize(("cap", "expected"), [(1, 1), (2, 1), (3, 0), (4, 0), (512, 0)])
def test_idle_guard_with_a_tiny_cap_is_yellow(cap: int, expected: int) -> None:
    """Quirk 14, kept: with cap <= 2 the basic share is one slot, so idle still reads yellow."""
    assert upstream_status_digit(gate(cap)) == expected
    assert upstream_status_digit(static_gate(cap)) == expected


# -- properties ---------------------------------------------------------------------------------


@st.composite
def gates(draw: st.DrawFn) -> GateState:
    dynamic = draw(st.booleans())
    global_limit = draw(st.integers(0, 64))
    cap = draw(st.integers(0, 64))
    config = GateConfig(global_limit=global_limit, dynamic=dynamic)
    published = decision(
        cap,
        draw(st.sampled_from(list(LoadState))),
        waiting=draw(st.integers(0, 2)),
        backend_count=(count := draw(st.integers(0, 3))),
        backend_failed=draw(st.integers(0, count)),
        yellow_reasons=draw(st.sampled_from([(), (StateReason.BACKEND_UNAVAILABLE,)])),
    )
    return GateState(
        config=config,
        decision=published,
        premium_inflight=draw(st.integers(0, 70)),
        basic_inflight=draw(st.integers(0, 70)),
        premium_waiting=draw(st.integers(0, 2)),
        basic_waiting=draw(st.integers(0, 2)),
    )


@given(gates())
def test_digit_is_one_of_four(g: GateState) -> None:
    digit = upstream_status_digit(g)
    assert digit in (0, 1, 2)
    assert isinstance(digit, int)


@given(gates())
def test_red_decision_is_always_2(g: GateState) -> None:
    red = attrs.evolve(g, decision=attrs.evolve(g.decision, state=LoadState.RED))
    assert upstream_status_digit(red) == 2


@given(gates())
def test_waiting_anywhere_is_always_2(g: GateState) -> None:
    assume(g.waiting > 0 or g.decision.waiting > 0)
    assert upstream_status_digit(g) == 2


@given(st.integers(1, 2), st.booleans(), st.sampled_from([LoadState.GREEN, LoadState.DISABLED]))
def test_idle_with_cap_at_most_2_is_1(cap: int, dynamic: bool, state: LoadState) -> None:
    g = GateState(
        config=GateConfig(global_limit=cap if not dynamic else 512, dynamic=dynamic),
        decision=decision(cap, state),
    )
    assert upstream_status_digit(g) == 1


@given(st.integers(3, 100_000))
def test_idle_with_a_larger_cap_and_green_is_0(cap: int) -> None:
    assert upstream_status_digit(gate(cap, global_limit=max(cap, 512))) == 0
    assert upstream_status_digit(static_gate(cap)) == 0


@given(gates())
def test_green_digit_means_a_basic_request_would_be_admitted(g: GateState) -> None:
    """A 0 promises room: the gate admits a basic request at once (cap within GLOBAL_LIMIT)."""
    assume(not g.config.dynamic or g.decision.cap <= g.config.global_limit)
    assume(g.inflight < g.config.global_limit)
    if upstream_status_digit(g) == 0:
        step = apply_gate_event(g, SlotRequested(1.0, Tier.BASIC))
        assert step.outcome == Admitted(Tier.BASIC)
