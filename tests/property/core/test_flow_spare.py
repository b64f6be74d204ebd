"""The spare for the tenants behind (``PIG_TENANT_SPARE``) and the bounded fair-order retry.

Random traffic from one heavy tenant and several light ones in one band of a static cap, as a
runtime drives it (arrivals, waiters retried in fair order, releases, deadlines). On every
attempt, judged on the state before it:
- a tenant *ahead* (at its slot share, recent service over ``1 + margin`` times its band's)
  never takes a slot while no more than the spare slots are free;
- a tenant that is not ahead and would be admitted with no spare configured (same state,
  ``spare=0``) is admitted: the spare only ever holds back tenants ahead (it may admit one
  that would have waited, since a waiter ahead ranked before it no longer claims the slot);
- when :func:`~guard_core.flow.retry_has_room` is false, no waiter's retry is admitted, so a
  runtime that stops its pass there loses no admission.
"""

from __future__ import annotations

import math
import random

import attrs
from hypothesis import given
from hypothesis import strategies as st

import guard_core as core
from guard_core import tenants as tenant_rules
from guard_core.bands import Band, BandSpec
from guard_core.events import Arrived, Finished, Forwarded, RequestEvent, Retried
from guard_core.flow import FlowConfig, retry_has_room, retry_order
from guard_core.guard import GuardConfig, GuardState
from guard_core.guard import apply as apply_guard_event
from guard_core.tenants import TenantConfig

ONE_BAND = BandSpec.of((Band("shared"),))


def _config(cap: int, spare: float) -> GuardConfig:
    return GuardConfig(
        gate=core.GateConfig(global_limit=cap, dynamic=False, queue_wait_s=0.5),
        learning=False,
        flow=FlowConfig(bands=ONE_BAND, tenants=TenantConfig(spare=spare, recent_s=5.0)),
    )


def _without_spare(state: GuardState) -> GuardState:
    flow = state.flow
    assert flow is not None
    assert flow.config.tenants is not None
    tenants = attrs.evolve(flow.config.tenants, spare=0.0)
    config = attrs.evolve(flow.config, tenants=tenants)
    return attrs.evolve(state, flow=attrs.evolve(flow, config=config))


@given(
    st.integers(4, 24),
    st.sampled_from([0.1, 0.25, 0.5]),
    st.integers(0, 2**16),
    st.integers(20, 120),
)
def test_the_spare_holds_back_only_tenants_ahead(
    cap: int, spare: float, seed: int, steps: int
) -> None:
    rng = random.Random(seed)
    state = GuardState.initial(_config(cap, spare), at=0.0)
    tenants = state.config.flow.tenants  # type: ignore[union-attr]
    assert tenants is not None
    keep = math.floor(spare * cap + 1e-9)
    held: list[int] = []
    at = 0.0
    next_id = 1

    def attempt(rid: int, event: RequestEvent, tenant: str) -> None:
        nonlocal state
        flow = state.flow
        assert flow is not None
        free = cap - state.gate.inflight
        is_ahead = tenant_rules.ahead(flow.table, tenants, 0, tenant, slots=cap, at=event.at)
        if not retry_has_room(state.gate) and isinstance(event, Retried):
            assert not isinstance(apply_guard_event(state, event).outcome, core.Admitted)
        step = apply_guard_event(state, event)
        if is_ahead and free <= keep:
            assert not isinstance(step.outcome, core.Admitted), (tenant, free, keep)
        if not is_ahead and isinstance(
            apply_guard_event(_without_spare(state), event).outcome, core.Admitted
        ):
            assert isinstance(step.outcome, core.Admitted), (tenant, step.outcome)
        state = step.state
        if isinstance(step.outcome, core.Admitted):
            held.append(rid)
            state = apply_guard_event(state, Forwarded(at=event.at, request_id=rid)).state

    for _ in range(steps):
        at += rng.choice([0.0, 0.01, 0.1, 0.3])
        if held and rng.random() < 0.35:
            rid = held.pop(rng.randrange(len(held)))
            tokens = rng.choice([None, 50, 500])
            state = apply_guard_event(
                state, Finished(at=at, request_id=rid, output_tokens=tokens)
            ).state
        else:
            # The heavy tenant sends about half of the requests, three light ones the rest.
            tenant = "heavy" if rng.random() < 0.5 else rng.choice(["a", "b", "c"])
            event = Arrived(at=at, request_id=next_id, tier=core.Tier.BASIC, tenant=tenant)
            next_id += 1
            attempt(event.request_id, event, tenant)
        flow = state.flow
        assert flow is not None
        order = retry_order(flow, state.requests, limit=cap, inflight=state.gate.inflight)
        for rid in order:
            tracked = state.requests.get(rid)
            if tracked is not None and tracked.queued is not None:
                attempt(rid, Retried(at=at, request_id=rid), tracked.tenant)
    # Nothing leaked: the counts match the table.
    assert state.gate.inflight == len(held)
