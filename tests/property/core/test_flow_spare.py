"""The spare for the tenants behind (``PIG_TENANT_SPARE``), strict shares
(``PIG_TENANT_LEND=false``) and the bounded fair-order retry.

Random traffic from one heavy tenant and several light ones in one band of a static cap, as a
runtime drives it (arrivals, waiters retried in fair order, releases, deadlines). On every
attempt, judged on the state before it:
- a tenant *ahead* (at its slot share, recent service over ``1 + margin`` times its band's)
  never takes a slot while no more than the spare slots are free;
- a tenant that is not ahead and would be admitted with no spare configured (same state,
  ``spare=0``) is admitted: the spare only ever holds back tenants ahead (it may admit one
  that would have waited, since a waiter ahead ranked before it no longer claims the slot);
- when :func:`~guard_core.flow.retry_has_room` is false, no waiter's retry is admitted, so a
  runtime that stops its pass there loses no admission;
- with strict shares, no attempt is admitted for a tenant that already holds its weighted fair
  share of the slots (rounded down, at least one), and every other attempt is judged exactly as
  with lending on (same state): the rule only ever holds back tenants at their share.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import attrs
from hypothesis import given
from hypothesis import strategies as st

import guard_core as core
from guard_core import tenants as tenant_rules
from guard_core.bands import Band, BandSpec
from guard_core.events import Arrived, Finished, Forwarded, RequestEvent, Retried
from guard_core.flow import FlowConfig, retry_has_room, retry_order
from guard_core.guard import GuardConfig, GuardState, GuardStep
from guard_core.guard import apply as apply_guard_event
from guard_core.tenants import TenantConfig

ONE_BAND = BandSpec.of((Band("shared"),))


def _config(cap: int, spare: float, *, lend: bool = True) -> GuardConfig:
    tenants = TenantConfig(spare=spare, recent_s=5.0, lend=lend)
    return GuardConfig(
        gate=core.GateConfig(global_limit=cap, dynamic=False, queue_wait_s=0.5),
        learning=False,
        flow=FlowConfig(bands=ONE_BAND, tenants=tenants),
    )


def _with_tenants(state: GuardState, **changes: Any) -> GuardState:
    """``state`` with its tenant settings changed (the same counts and table)."""
    flow = state.flow
    assert flow is not None
    assert flow.config.tenants is not None
    tenants = attrs.evolve(flow.config.tenants, **changes)
    config = attrs.evolve(flow.config, tenants=tenants)
    return attrs.evolve(state, flow=attrs.evolve(flow, config=config))


#: A test's check of one attempt: the state before it, the attempt, its tenant and its step.
Check = Callable[[GuardState, RequestEvent, str, GuardStep], None]


def _drive(state: GuardState, rng: random.Random, steps: int, check: Check) -> GuardState:
    """Random traffic as a runtime drives it, from ``state``: arrivals (a heavy tenant about
    half of them, three light ones the rest), finishes, and after each step the waiters retried
    in fair order. Every attempt is handed to ``check`` with the state it was judged on; what
    is admitted is forwarded. Checks that nothing leaked; returns the last state."""
    held: list[int] = []
    at = 0.0
    next_id = 1

    def attempt(event: RequestEvent, tenant: str) -> None:
        nonlocal state
        step = apply_guard_event(state, event)
        check(state, event, tenant, step)
        state = step.state
        if isinstance(step.outcome, core.Admitted):
            held.append(event.request_id)
            forwarded = Forwarded(at=event.at, request_id=event.request_id)
            state = apply_guard_event(state, forwarded).state

    for _ in range(steps):
        at += rng.choice([0.0, 0.01, 0.1, 0.3])
        if held and rng.random() < 0.35:
            rid = held.pop(rng.randrange(len(held)))
            tokens = rng.choice([None, 50, 500])
            finished = Finished(at=at, request_id=rid, output_tokens=tokens)
            state = apply_guard_event(state, finished).state
        else:
            tenant = "heavy" if rng.random() < 0.5 else rng.choice(["a", "b", "c"])
            attempt(Arrived(at=at, request_id=next_id, tier=core.Tier.BASIC, tenant=tenant), tenant)
            next_id += 1
        flow = state.flow
        assert flow is not None
        limit = state.gate.config.global_limit
        order = retry_order(flow, state.requests, limit=limit, inflight=state.gate.inflight)
        for rid in order:
            tracked = state.requests.get(rid)
            if tracked is not None and tracked.queued is not None:
                attempt(Retried(at=at, request_id=rid), tracked.tenant)
    assert state.gate.inflight == len(held)  # nothing leaked: the counts match the table
    return state


@given(
    st.integers(4, 24),
    st.sampled_from([0.1, 0.25, 0.5]),
    st.integers(0, 2**16),
    st.integers(20, 120),
)
def test_the_spare_holds_back_only_tenants_ahead(
    cap: int, spare: float, seed: int, steps: int
) -> None:
    state = GuardState.initial(_config(cap, spare), at=0.0)
    tenants = state.config.flow.tenants  # type: ignore[union-attr]
    assert tenants is not None
    keep = math.floor(spare * cap + 1e-9)

    def check(before: GuardState, event: RequestEvent, tenant: str, step: GuardStep) -> None:
        flow = before.flow
        assert flow is not None
        free = cap - before.gate.inflight
        is_ahead = tenant_rules.ahead(flow.table, tenants, 0, tenant, slots=cap, at=event.at)
        if not retry_has_room(before.gate) and isinstance(event, Retried):
            assert not isinstance(step.outcome, core.Admitted)
        if is_ahead and free <= keep:
            assert not isinstance(step.outcome, core.Admitted), (tenant, free, keep)
        if not is_ahead and isinstance(
            apply_guard_event(_with_tenants(before, spare=0.0), event).outcome, core.Admitted
        ):
            assert isinstance(step.outcome, core.Admitted), (tenant, step.outcome)

    _drive(state, random.Random(seed), steps, check)


@given(
    st.integers(2, 24),
    st.sampled_from([0.0, 0.1, 0.25]),
    st.integers(0, 2**16),
    st.integers(20, 120),
)
def test_strict_shares_hold_back_only_tenants_at_their_share(
    cap: int, spare: float, seed: int, steps: int
) -> None:
    state = GuardState.initial(_config(cap, spare, lend=False), at=0.0)
    tenants = state.config.flow.tenants  # type: ignore[union-attr]
    assert tenants is not None

    def check(before: GuardState, event: RequestEvent, tenant: str, step: GuardStep) -> None:
        flow = before.flow
        assert flow is not None
        held = flow.table.entries.get((0, tenant), tenant_rules.TenantStats()).inflight
        share = tenant_rules.fair_share(flow.table, tenants, 0, tenant, cap)
        at_share = held >= max(1, math.floor(share + 1e-9))
        assert at_share == tenant_rules.at_share(flow.table, tenants, 0, tenant, slots=cap)
        lending = apply_guard_event(_with_tenants(before, lend=True), event).outcome
        if at_share:
            assert not isinstance(step.outcome, core.Admitted), (tenant, held, share)
        else:
            assert step.outcome == lending, (tenant, step.outcome, lending)

    _drive(state, random.Random(seed), steps, check)


def test_strict_shares_leave_free_slots_free() -> None:
    """Not work-conserving, by design: a tenant alone at its share of two active tenants waits
    (and is refused at its deadline) with a slot free, where lending would admit it."""
    state = GuardState.initial(_config(4, 0.0, lend=False), at=0.0)
    for rid, tenant in enumerate(["a", "a", "b"], start=1):
        arrived = Arrived(at=0.0, request_id=rid, tier=core.Tier.BASIC, tenant=tenant)
        step = apply_guard_event(state, arrived)
        assert isinstance(step.outcome, core.Admitted)
        state = step.state
    # a holds 2 of 4 slots, its share with b active: a third waits though one slot is free.
    third = Arrived(at=0.1, request_id=4, tier=core.Tier.BASIC, tenant="a")
    assert state.gate.inflight == 3
    assert isinstance(apply_guard_event(state, third).outcome, core.Queued)
    lending = apply_guard_event(_with_tenants(state, lend=True), third).outcome
    assert isinstance(lending, core.Admitted)
