"""The request path of the guard: each request event applied whole, in one step.

Reads: one :mod:`guard_core.events` value and the guard's state, whose ``requests`` table this
module alone changes.
Guarantees:
- the table holds exactly the requests that wait for a slot or hold one; the gate's in-flight
  and waiting counts always match it (a slot never leaks, whatever the order of events);
- one event is one step: :class:`~guard_core.events.Finished` gives the slot back *and* ends
  the prefill grace; an attempt is judged by the gate and, under the predictive learner, by
  its predictions, with the refusal counted for the learner, all together;
- an event that does not fit the table (an unknown or finished request, a retry of a request
  that does not wait) changes nothing; this is how a replay under other settings follows its
  own outcomes: a request it refused never runs, and a recorded end of a wait it still has
  ends that wait at its deadline;
- a recorded refusal of a request this state admitted ends it at once (nothing is known of
  how long it would have run); a live runtime only sends one after the core refused.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import attrs

from guard_core import flow as flow_rules
from guard_core import gate as gate_rules
from guard_core import predictive as predictive_rules
from guard_core._values import replace
from guard_core.decision import Admission, Admitted, Queued, RejectCode, Rejected
from guard_core.evaluation import observe_first_token
from guard_core.events import (
    Abandoned,
    Arrived,
    Finished,
    FirstToken,
    Refused,
    RequestEvent,
    Retried,
)
from guard_core.pool_admission import is_pool, pool_assess
from guard_core.predictive import Prediction, PredictiveState
from guard_core.predictive_cap import retry_after_s
from guard_core.prefill_guard import grace_s
from guard_core.table import filed, forgotten
from guard_core.tier import Tier, premium_reserved

if TYPE_CHECKING:
    from guard_core.evaluation import LearnerState
    from guard_core.guard import GuardState
    from guard_core.traffic import TrafficState

__all__ = ("Tracked", "apply")

_DYNAMIC_REJECTS = frozenset(
    {RejectCode.GLOBAL_DYNAMIC_LIMIT, RejectCode.TIER_PRIORITY, RejectCode.TIER_BASIC_LIMIT}
)

_Step = tuple["GuardState", Admission | None]


@attrs.frozen(kw_only=True, slots=False)  # copied per request: see guard_core._values
class Tracked:
    """One request the guard knows: waiting (``queued`` set) or holding a slot."""

    tier: Tier
    arrived_at: float
    body_bytes: int | None = None
    queued: Queued | None = None
    forwarded: bool = False
    #: Its priority band (an index into the flow config's bands) and tenant key, when flow
    #: control is configured (:mod:`guard_core.flow`).
    band: int = 0
    tenant: str = ""
    #: When its first useful token came, kept only under flow control: a finish the runtime
    #: did not count the output of is charged its decode time at the speed target.
    first_token_at: float | None = None


def _with(
    state: GuardState, request_id: int, tracked: Tracked | None, **changes: Any
) -> GuardState:
    """``state`` with the request filed as ``tracked`` (or forgotten) and ``changes``: one
    copy of the state per event."""
    if tracked is None and request_id not in state.requests:
        return replace(state, **changes)  # never filed (refused at once): the table stays
    if tracked is None:
        requests = forgotten(state.requests, request_id)
    else:
        requests = filed(state.requests, request_id, tracked)
    return replace(state, requests=requests, **changes)


# -- attempts ----------------------------------------------------------------------------------


def _waited(
    event: gate_rules.SlotRequested | gate_rules.WaitRetried,
) -> tuple[float, Tier, int | None]:
    if isinstance(event, gate_rules.SlotRequested):
        return 0.0, event.tier, event.body_bytes
    queued = event.queued
    arrived = queued.arrived_at if queued.arrived_at is not None else event.at
    return max(0.0, event.at - arrived), queued.tier, queued.body_bytes


def _predictive_attempt(
    state: GuardState, event: gate_rules.SlotRequested | gate_rules.WaitRetried, tracked: Tracked
) -> tuple[gate_rules.GateStep, Prediction | None]:
    """The gate's counts first; what they admit must also pass the learner's predictions (a
    tenant ahead of its band must also leave room for the band's spare, ``PIG_TENANT_SPARE``,
    as that many more decoders)."""
    predictive = state.predictive
    assert predictive is not None
    gate = state.gate
    step = gate_rules.apply(gate, event)
    if isinstance(step.outcome, Admitted):
        waited, tier, body_bytes = _waited(event)
        limit, _ = gate_rules.current_limit(gate)
        # The reserve counts slots premium already holds; what basic must leave free on top of
        # those is the rest (one slot, unless the cap is tiny).
        reserve = 0
        if tier is Tier.BASIC:
            reserve = max(0, premium_reserved(limit, gate.premium_inflight) - gate.premium_inflight)
        if state.flow is not None:
            reserve += flow_rules.spare_reserve(
                state.flow,
                tracked.band,
                tracked.tenant,
                limit=limit,
                inflight=gate.inflight,
                at=event.at,
            )
        if is_pool(predictive):
            # No request counted in flight while the learner tracks some: the per-backend
            # counts are not known (a replay: recordings hold no traffic events).
            counted = dict(state.traffic.inflight)
            known = bool(any(counted.values()) or not predictive.requests)
            verdict = pool_assess(
                predictive,
                counted if known else None,
                body_bytes,
                reserve=reserve,
                waited_s=waited,
                at=event.at,
            )
        else:
            verdict = predictive_rules.assess(
                predictive, body_bytes, reserve=reserve, waited_s=waited, at=event.at
            )
        if not verdict.admit:
            step = gate_rules.refuse(gate, event, RejectCode.GLOBAL_DYNAMIC_LIMIT)
        return step, verdict.prediction
    return step, None


def _attempt(
    state: GuardState,
    request_id: int,
    tracked: Tracked,
    event: gate_rules.SlotRequested | gate_rules.WaitRetried,
) -> _Step:
    """Judge one attempt and file the request by its outcome: holding, waiting or gone."""
    prediction: Prediction | None = None
    step: gate_rules.GateStep
    predicting = (
        state.predictive is not None
        and state.gate.config.dynamic
        and not gate_rules.failing_open(state.gate)
    )
    if predicting:
        # Learning without enforcing (DYNAMIC_PIG_ENFORCE=false) predicts but never refuses.
        step, prediction = _predictive_attempt(state, event, tracked)
    else:
        step = gate_rules.apply(state.gate, event)
    flow = state.flow
    if flow is not None:
        if isinstance(step.outcome, Admitted):
            limit, _ = gate_rules.current_limit(state.gate)
            code = flow_rules.refusal(
                flow,
                tracked.band,
                tracked.tenant,
                limit=limit,
                inflight=state.gate.inflight,
                at=event.at,
            )
            if code is not None:
                step = gate_rules.refuse(state.gate, event, code)
        flow = flow_rules.settled(
            flow,
            tracked.band,
            tracked.tenant,
            was_waiting=tracked.queued is not None,
            admitted=isinstance(step.outcome, Admitted),
            waits=isinstance(step.outcome, Queued),
            body_bytes=tracked.body_bytes,
            at=event.at,
        )
    outcome = step.outcome
    learner = state.learner
    if isinstance(outcome, Rejected):
        learner = _learner_counts(state, outcome.code)
    model = state.predictive
    verdict = state.verdict
    if model is not None:
        if prediction is not None:
            verdict = prediction
        if isinstance(outcome, Rejected):
            outcome = _predicted_refusal(model, outcome, prediction, at=event.at)
    traffic = state.traffic
    if isinstance(outcome, Rejected):
        traffic = _traffic_counts(state, outcome.code, tracked.tier)
    unchanged = step.state is state.gate and learner is state.learner and verdict is state.verdict
    if (
        unchanged
        and flow is state.flow
        and traffic is state.traffic
        and isinstance(outcome, Rejected)
        and request_id not in state.requests
    ):
        return state, outcome  # a refusal at once that changes nothing copies nothing
    if unchanged and outcome is tracked.queued and flow is state.flow and traffic is state.traffic:
        return state, outcome  # a retry that still waits for the same reason changes nothing
    filed: Tracked | None = None
    if isinstance(outcome, Admitted):
        filed = replace(tracked, queued=None)
    elif isinstance(outcome, Queued):
        filed = replace(tracked, queued=outcome)
    state = _with(
        state,
        request_id,
        filed,
        gate=step.state,
        learner=learner,
        verdict=verdict,
        traffic=traffic,
        flow=flow,
    )
    return state, outcome


def _end_wait(state: GuardState, request_id: int, tracked: Tracked, at: float) -> _Step:
    """The runtime says the wait is over while this state still waits: retry at the deadline
    (or now, when later), which admits or refuses."""
    queued = tracked.queued
    if queued is None:
        return state, None
    late = max(at, queued.deadline)
    return _attempt(state, request_id, tracked, gate_rules.WaitRetried(late, queued))


# -- a held slot -------------------------------------------------------------------------------


def _forward(state: GuardState, request_id: int, tracked: Tracked, at: float) -> GuardState:
    """An admitted request starts its prefill grace."""
    learner = state.learner
    deadline = at + grace_s(learner.config, tracked.body_bytes)
    learner = replace(learner, prefill=filed(learner.prefill, request_id, deadline))
    predictive = state.predictive
    if predictive is not None:
        predictive = predictive_rules.forwarded(
            predictive,
            request_id,
            tracked.body_bytes,
            at=at,
            premium=tracked.tier is Tier.PREMIUM,
        )
    forwarded = replace(tracked, forwarded=True)
    return _with(state, request_id, forwarded, learner=learner, predictive=predictive)


def _finish(
    state: GuardState,
    request_id: int,
    tracked: Tracked,
    at: float,
    output_tokens: int | None = None,
) -> GuardState:
    """The slot goes back and, for a forwarded request, its prefill grace ends: one step."""
    gate = gate_rules.apply(state.gate, gate_rules.SlotReleased(at, tracked.tier)).state
    if state.flow is not None:
        if output_tokens is None and tracked.first_token_at is not None:
            # Not counted by the runtime (the live proxy): its decode time at the speed target.
            decoding = max(0.0, at - tracked.first_token_at)
            output_tokens = round(decoding * state.config.policy.user_tps_yellow)
        flow = flow_rules.finished(
            state.flow, tracked.band, tracked.tenant, output_tokens=output_tokens, at=at
        )
        state = replace(state, flow=flow)
    if not tracked.forwarded:
        return _with(state, request_id, None, gate=gate)
    learner = state.learner
    if request_id in learner.prefill:  # else a poll already dropped its passed grace
        learner = replace(learner, prefill=forgotten(learner.prefill, request_id))
    predictive = state.predictive
    if predictive is not None:
        predictive = predictive_rules.finished(predictive, request_id, at=at)
    return _with(state, request_id, None, gate=gate, learner=learner, predictive=predictive)


def _first_token(state: GuardState, event: FirstToken) -> GuardState:
    if state.flow is not None:
        tracked = state.requests.get(event.request_id)
        if tracked is not None and tracked.first_token_at is None:
            state = _with(state, event.request_id, replace(tracked, first_token_at=event.at))
    learner = state.learner
    histogram = observe_first_token(learner.semantic_ttft, event.seconds)
    state = replace(state, learner=replace(learner, semantic_ttft=histogram))
    if state.predictive is not None:
        predictive = predictive_rules.first_token(state.predictive, event.request_id, at=event.at)
        state = replace(state, predictive=predictive)
    return state


def _learner_counts(state: GuardState, code: RejectCode) -> LearnerState:
    """The learner's state after a refusal for ``code``: PIG counts its dynamic refusals."""
    learner = state.learner
    if code in _DYNAMIC_REJECTS:
        return replace(learner, dynamic_rejects=learner.dynamic_rejects + 1)
    return learner


def _traffic_counts(state: GuardState, code: RejectCode, tier: Tier) -> TrafficState:
    """The traffic counts after a refusal of ``tier`` for ``code``: the tier reject deltas a
    poll publishes (a refusal for no usable backend is not one)."""
    if code is RejectCode.BACKEND_UNAVAILABLE:
        return state.traffic
    return state.traffic.refused(tier)


def _predicted_refusal(
    model: PredictiveState, outcome: Rejected, prediction: Prediction | None, *, at: float
) -> Rejected:
    """``outcome`` with the predictive learner's Retry-After: when the attempt's own prediction
    (else the learner's last cap) says the binding constraint has room again; none for a
    refusal for no usable backend, or before the learner has a cap."""
    basis = prediction or model.last_cap
    if basis is None or outcome.code is RejectCode.BACKEND_UNAVAILABLE:
        return outcome
    return attrs.evolve(outcome, retry_after_s=retry_after_s(model, basis, at=at))


#: The outcome of each refusal with no learner's Retry-After (values: shared, never changed).
_REFUSED = MappingProxyType({code: Rejected(code) for code in RejectCode})


def _refused_at_once(state: GuardState, event: Arrived) -> _Step | None:
    """The step of an arrival the gate refuses with no wait, without flow control: only the
    refusal counts change (and, under the predictive learner, the 429 says when its last cap
    predicts room), and the request is never filed. None for any other arrival or state. It
    gives exactly what :func:`_attempt` gives (``tests/property/core/test_fold.py`` holds them
    together); the refusal path, the guard's busiest under overload, skips building the
    attempt (the learner is only asked about what the gate would admit)."""
    if state.flow is not None:
        return None
    code = gate_rules.refused_at_once(state.gate, event.tier)
    if code is None:
        return None
    outcome = _REFUSED[code]
    if state.predictive is not None:
        outcome = _predicted_refusal(state.predictive, outcome, None, at=event.at)
    learner = _learner_counts(state, code)
    traffic = _traffic_counts(state, code, event.tier)
    if learner is not state.learner or traffic is not state.traffic:
        state = replace(state, learner=learner, traffic=traffic)
    return state, outcome


# -- the reducer -------------------------------------------------------------------------------


def _arrived(state: GuardState, event: Arrived) -> _Step:
    if event.request_id in state.requests:
        return state, None  # the id is taken: not a new request
    refused = _refused_at_once(state, event)
    if refused is not None:
        return refused
    flow = state.flow
    if flow is None:
        tracked = Tracked(tier=event.tier, arrived_at=event.at, body_bytes=event.body_bytes)
        attempt = gate_rules.SlotRequested(event.at, event.tier, event.body_bytes)
        return _attempt(state, event.request_id, tracked, attempt)
    flow, band, tenant = flow_rules.arrived(flow, event.band, event.tenant, at=event.at)
    spec = flow.config.bands
    tier = spec.tier_of(band)  # the band decides the tier, so a replay under other bands agrees
    tracked = Tracked(
        tier=tier, arrived_at=event.at, body_bytes=event.body_bytes, band=band, tenant=tenant
    )
    wait_cap = spec.bands[band].wait_cap_s
    attempt = gate_rules.SlotRequested(event.at, tier, event.body_bytes, wait_cap)
    return _attempt(replace(state, flow=flow), event.request_id, tracked, attempt)


def apply(state: GuardState, event: RequestEvent) -> _Step:
    """Apply one request event: the new state and, for an attempt, its outcome."""
    if isinstance(event, Arrived):
        return _arrived(state, event)
    request_id = event.request_id
    tracked = state.requests.get(request_id)
    if tracked is None:
        return state, None
    queued = tracked.queued
    if isinstance(event, Retried):
        if queued is None:
            return state, None
        return _attempt(state, request_id, tracked, gate_rules.WaitRetried(event.at, queued))
    if isinstance(event, Abandoned):
        if queued is None:
            return state, None
        gate = gate_rules.apply(state.gate, gate_rules.WaitAbandoned(event.at, queued)).state
        if state.flow is not None:
            flow = flow_rules.abandoned(state.flow, tracked.band, tracked.tenant)
            return _with(state, request_id, None, gate=gate, flow=flow), None
        return _with(state, request_id, None, gate=gate), None
    if isinstance(event, FirstToken | Finished):
        if queued is not None:
            return state, None  # it never ran
        if isinstance(event, FirstToken):
            return _first_token(state, event), None
        return _finish(state, request_id, tracked, event.at, event.output_tokens), None
    # Forwarded or Refused: the runtime ended the attempt; a wait this state still has ends too.
    state, outcome = _end_wait(state, request_id, tracked, event.at)
    held = state.requests.get(request_id)
    if held is None:
        return state, outcome
    if not held.forwarded:
        state = _forward(state, request_id, held, event.at)
    if isinstance(event, Refused):
        # Admitted here, refused there: it ends at once (forwarded and finished).
        state = _finish(state, request_id, state.requests[request_id], event.at)
    return state, outcome
