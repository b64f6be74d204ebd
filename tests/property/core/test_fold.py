"""``fold`` over request events: deterministic, atomic, and no slot ever leaks.

The events are arbitrary: ids repeat, arrive out of their life's order, name requests that
never arrived or already ended, and interleave with cap changes. After every single event:
- the gate's in-flight and waiting counts, per tier, equal what the request table holds, and
  the prefill ledger (and the predictive learner's ledger) holds exactly the forwarded requests
  that still hold a slot: no step is ever seen half done;
- an event that does not fit changes nothing at all.
Folding the same events gives the same state; folding in two parts gives what one fold gives;
``Finished`` is the release and the prefill end together, and ending every request brings every
count back to zero.
"""

from __future__ import annotations

import math

import attrs
from hypothesis import given
from hypothesis import strategies as st

import guard_core as core
from guard_core import requests as request_rules
from guard_core.events import Abandoned, Arrived, Finished, FirstToken, Forwarded, Refused, Retried
from guard_core.gate import DecisionPublished, SlotReleased, SlotRequested
from guard_core.guard import GuardConfig, GuardEvent, GuardState, fold
from guard_core.guard import apply as apply_guard_event
from guard_core.predictive import Binding, FitSummary, Prediction

IDS = st.integers(1, 6)


def configs() -> st.SearchStrategy[GuardConfig]:
    return st.builds(
        lambda limit, dynamic, wait, predictive: GuardConfig(
            gate=core.GateConfig(global_limit=limit, dynamic=dynamic, queue_wait_s=wait),
            learning=False,
            predictive=core.PredictiveConfig() if predictive else None,
        ),
        st.integers(0, 5),
        st.booleans(),
        st.sampled_from([0.0, 0.1, 0.5]),
        st.booleans(),
    )


def _published(at: float, cap: int) -> DecisionPublished:
    return DecisionPublished(
        core.PublishedDecision(
            at=at,
            source=core.DecisionSource.METRICS,
            cap=cap,
            state=core.LoadState.GREEN,
            final_reason=core.LimitReason.THROUGHPUT,
            backend_count=1,
        )
    )


@st.composite
def streams(draw: st.DrawFn) -> list[GuardEvent]:
    """Events with non-decreasing ``at``; any id, any order."""
    at = 0.0
    events: list[GuardEvent] = []
    for _ in range(draw(st.integers(0, 40))):
        at += draw(st.sampled_from([0.0, 0.01, 0.2, 0.6]))
        rid = draw(IDS)
        kind = draw(st.integers(0, 8))
        event: GuardEvent
        if kind == 0:
            tier = draw(st.sampled_from(core.Tier))
            body = draw(st.none() | st.integers(0, 200_000))
            event = Arrived(at=at, request_id=rid, tier=tier, body_bytes=body)
        elif kind == 1:
            event = Retried(at=at, request_id=rid)
        elif kind == 2:
            event = Abandoned(at=at, request_id=rid)
        elif kind == 3:
            event = Forwarded(at=at, request_id=rid)
        elif kind == 4:
            event = Refused(at=at, request_id=rid, code=core.RejectCode.GLOBAL_DYNAMIC_LIMIT)
        elif kind == 5:
            event = FirstToken(at=at, request_id=rid, seconds=draw(st.floats(0, 10)))
        elif kind == 6:
            event = Finished(at=at, request_id=rid, status=draw(st.sampled_from([0, 200, 499])))
        else:
            event = _published(at, draw(st.integers(0, 5)))
        events.append(event)
    return events


def check(state: GuardState) -> None:
    """The table, the gate's counts and the prefill ledgers say the same thing."""
    gate = state.gate
    held = {rid: t for rid, t in state.requests.items() if t.queued is None}
    waiting = [t for t in state.requests.values() if t.queued is not None]
    assert gate.premium_inflight == sum(t.tier is core.Tier.PREMIUM for t in held.values())
    assert gate.basic_inflight == sum(t.tier is core.Tier.BASIC for t in held.values())
    assert gate.premium_waiting == sum(t.tier is core.Tier.PREMIUM for t in waiting)
    assert gate.basic_waiting == sum(t.tier is core.Tier.BASIC for t in waiting)
    assert gate.inflight <= gate.config.global_limit
    forwarded = sorted(rid for rid, t in held.items() if t.forwarded)
    assert sorted(state.learner.prefill) == forwarded
    if state.predictive is not None:
        assert sorted(state.predictive.requests) == forwarded
    for tracked in state.requests.values():
        assert not (tracked.forwarded and tracked.queued is not None)


def _ended(state: GuardState, at: float) -> GuardState:
    """Every request ends: waiters retry past their deadline, what holds a slot finishes."""
    for rid, tracked in sorted(state.requests.items()):
        if tracked.queued is not None:
            state = apply_guard_event(state, Retried(at=math.inf, request_id=rid)).state
    for rid in sorted(state.requests):
        state = apply_guard_event(state, Finished(at=at, request_id=rid)).state
    return state


@given(configs(), streams())
def test_no_step_is_seen_half_done_and_no_slot_leaks(
    config: GuardConfig, events: list[GuardEvent]
) -> None:
    state = GuardState.initial(config, at=0.0)
    for event in events:
        before = state
        state = apply_guard_event(state, event).state
        check(state)
        if isinstance(event, Retried | Abandoned | FirstToken | Finished):
            tracked = before.requests.get(event.request_id)
            fits = tracked is not None and (
                (tracked.queued is not None) == isinstance(event, Retried | Abandoned)
            )
            if not fits:
                assert state is before, f"{event} does not fit but changed the state"
    state = _ended(state, events[-1].at if events else 0.0)
    check(state)
    gate = state.gate
    assert (gate.inflight, gate.waiting, dict(state.requests)) == (0, 0, {})
    assert dict(state.learner.prefill) == {}


@given(configs(), streams())
def test_a_retry_that_changes_nothing_copies_nothing(
    config: GuardConfig, events: list[GuardEvent]
) -> None:
    # The engine retries every waiter on each release and poll, so a retry that still waits
    # for the same reason must hand back the very state it was given, not an equal copy.
    state = GuardState.initial(config, at=0.0)
    at = 0.0
    for event in events:
        at = getattr(event, "at", at)
        state = apply_guard_event(state, event).state
        for rid in [rid for rid, tracked in state.requests.items() if tracked.queued]:
            retried = apply_guard_event(state, Retried(at=at, request_id=rid)).state
            if retried == state:
                assert retried is state, f"retrying {rid} changed nothing but copied the state"


@given(configs(), streams(), st.integers(0, 40))
def test_the_same_events_fold_to_the_same_state(
    config: GuardConfig, events: list[GuardEvent], cut: int
) -> None:
    start = GuardState.initial(config, at=0.0)
    whole = fold(start, events)
    assert fold(start, events) == whole
    assert fold(fold(start, events[:cut]), events[cut:]) == whole
    assert fold(start, []) is start


@given(configs(), streams(), st.sampled_from(core.Tier), st.integers(0, 100_000))
def test_finished_is_the_release_and_the_prefill_end_in_one_step(
    config: GuardConfig, events: list[GuardEvent], tier: core.Tier, body: int
) -> None:
    at = events[-1].at if events else 0.0
    state = fold(GuardState.initial(config, at=0.0), events)
    state = _ended(fold(state, [_published(at, 5)]), at)
    rid = 99
    admitted = apply_guard_event(
        state, Arrived(at=at, request_id=rid, tier=tier, body_bytes=body)
    ).state
    if rid not in admitted.requests or admitted.requests[rid].queued is not None:
        return  # GLOBAL_LIMIT 0 or the learner's refusal: nothing to finish
    forwarded = apply_guard_event(admitted, Forwarded(at=at, request_id=rid)).state
    assert rid in forwarded.learner.prefill
    finished = apply_guard_event(forwarded, Finished(at=at + 1, request_id=rid)).state
    # What the engine used to send as two events, and the table forgetting the request.
    released = core.apply_gate_event(forwarded.gate, SlotReleased(at + 1, tier)).state
    assert finished.gate == released
    assert finished.learner == attrs.evolve(
        forwarded.learner,
        prefill={r: d for r, d in forwarded.learner.prefill.items() if r != rid},
    )
    assert rid not in finished.requests
    if finished.predictive is not None:
        assert rid not in finished.predictive.requests
    # A second end of the same request changes nothing.
    assert apply_guard_event(finished, Finished(at=at + 2, request_id=rid)).state is finished


#: A last published cap of the predictive learner (its Retry-After's basis); the fit is only
#: reported, the learner's own fit computes the seconds.
_LAST_CAPS = st.builds(
    lambda binding, user_tps: Prediction(
        user_tps=user_tps,
        ttft_s=0.4,
        kv_usage=0.5,
        binding=binding,
        fit=FitSummary(0.01, 0.001, 0.0, 1e-5, 0.1, 12),
        cap=4,
    ),
    st.sampled_from(Binding),
    st.floats(0, 60),
)


@given(configs(), streams(), st.none() | st.integers(0, 200_000), st.none() | _LAST_CAPS)
def test_a_refusal_at_once_is_the_whole_attempt_without_its_copies(
    config: GuardConfig, events: list[GuardEvent], body: int | None, last_cap: Prediction | None
) -> None:
    """The reducer's short cut for an arrival refused with no wait (``_refused_at_once``) gives
    exactly the state and outcome of the whole attempt (the request filed, judged by the gate
    and by the predictive learner when it is on, counted, its Retry-After from the learner's
    last cap), in every state the events reach, for both tiers."""
    state = GuardState.initial(config, at=0.0)
    if state.predictive is not None and last_cap is not None:
        state = attrs.evolve(state, predictive=attrs.evolve(state.predictive, last_cap=last_cap))
    shortcuts = 0
    at = 0.0
    for event in [*events, None]:
        if event is not None:
            state = apply_guard_event(state, event).state
            at = event.at
        for tier in core.Tier:
            arrival = Arrived(at=at, request_id=1_000, tier=tier, body_bytes=body)
            step = apply_guard_event(state, arrival)
            tracked = request_rules.Tracked(tier=tier, arrived_at=at, body_bytes=body)
            attempt = SlotRequested(at, tier, body)
            whole, outcome = request_rules._attempt(state, 1_000, tracked, attempt)
            assert (step.state, step.outcome) == (whole, outcome)
            shortcuts += request_rules._refused_at_once(state, arrival) is not None
    if config.gate.global_limit == 0 and config.gate.queue_wait_s == 0:
        assert shortcuts == 2 * (len(events) + 1)  # everyone is refused at once
