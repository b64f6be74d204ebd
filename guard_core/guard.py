"""The whole guard as one reducer: the admission gate and the capacity learner together.

Reads: every observation the runtime makes, as an event stamped with ``at``: admission attempts
and their ends, metrics polls, first useful tokens, prefill starts and ends.
Guarantees:
- one state value, changed only by :func:`apply`, so a runtime has a single owner of the policy
  and a recording of the events replays to the same decisions;
- a poll's decision is published to the gate in the same step that evaluates it, together with
  the one :class:`~guard_core.published.Published` value every reader of a poll reads;
- requests in flight per backend, the adaptive output samples and the tier refusals are state
  here too (:mod:`guard_core.traffic`), so a runtime keeps no copy of them;
- refusals by the dynamic cap or the tier rule are counted for the learner when they end in a
  429 (not while the request still waits, and not when its client left);
- with ``DYNAMIC_POLICY=predictive`` (``config.predictive`` set) PIG's pipeline still runs on
  every poll, for its state reasons and its intake rules (no metrics, every backend failing,
  backend waiting), but the cap it publishes is the predictive learner's, and an attempt the
  gate's counts would admit is also checked against the learner's predictions
  (:mod:`guard_core.predictive`); a refusal then carries a predicted ``Retry-After``.
"""

from __future__ import annotations

import attrs

from guard_core import gate as gate_rules
from guard_core import predictive as predictive_rules
from guard_core.decision import (
    Admission,
    Admitted,
    DecisionSource,
    LimitReason,
    LoadState,
    PublishedDecision,
    RejectCode,
    Rejected,
)
from guard_core.evaluation import (
    BackendPoll,
    GateView,
    LearnerState,
    evaluate_round,
    observe_first_token,
)
from guard_core.gate import GateConfig, GateState
from guard_core.lanes import AdaptiveOutputConfig
from guard_core.policy import PolicyConfig
from guard_core.predictive import Prediction, PredictiveConfig, PredictiveState
from guard_core.prefill_guard import grace_s
from guard_core.published import Published, publish
from guard_core.tier import Tier, premium_reserved
from guard_core.traffic import (
    BackendFinished,
    BackendForwarded,
    OutputIntentObserved,
    RefusedAfterAdmission,
    TrafficEvent,
    TrafficState,
    apply_traffic,
)

__all__ = (
    "FirstTokenObserved",
    "GuardConfig",
    "GuardEvent",
    "GuardState",
    "GuardStep",
    "MetricsPolled",
    "PrefillEnded",
    "PrefillStarted",
    "apply",
    "apply_traffic_event",
)

_DYNAMIC_REJECTS = frozenset(
    {RejectCode.GLOBAL_DYNAMIC_LIMIT, RejectCode.TIER_PRIORITY, RejectCode.TIER_BASIC_LIMIT}
)


@attrs.frozen(kw_only=True)
class GuardConfig:
    """Everything the pure guard needs to know about its settings."""

    gate: GateConfig = attrs.field(factory=GateConfig)
    policy: PolicyConfig = attrs.field(factory=PolicyConfig)
    #: ``DYNAMIC_PIG_ENABLED``: the learner runs. The gate enforces its cap only when
    #: ``gate.dynamic`` is also set (``DYNAMIC_PIG_ENFORCE``).
    learning: bool = True
    failsafe: LoadState = LoadState.YELLOW
    #: ``DYNAMIC_POLICY=predictive``: the predictive learner's settings; ``None`` is PIG's.
    predictive: PredictiveConfig | None = None
    #: ``ADAPTIVE_OUTPUT_CLASSIFICATION``: the adaptive output lanes' settings; ``None``: off.
    adaptive_output: AdaptiveOutputConfig | None = None


@attrs.frozen
class MetricsPolled:
    """One poll round finished: every backend's sample or failure."""

    at: float
    polls: tuple[BackendPoll, ...]


@attrs.frozen
class FirstTokenObserved:
    """A streamed response delivered its first useful token ``seconds`` after it arrived."""

    at: float
    seconds: float
    #: Which forwarded request it was (``PrefillStarted.request_id``), when known.
    request_id: int | None = None


@attrs.frozen
class PrefillStarted:
    """An admitted request was forwarded; it counts as prefilling for a grace period."""

    at: float
    request_id: int
    body_bytes: int | None
    #: The request's tier, when the runtime says (the predictive learner reserves for premium).
    tier: Tier | None = None


@attrs.frozen
class PrefillEnded:
    """An admitted request finished (any way), ending its prefill grace early."""

    at: float
    request_id: int


_TRAFFIC_EVENTS = (BackendForwarded, BackendFinished, OutputIntentObserved, RefusedAfterAdmission)

GuardEvent = (
    gate_rules.GateEvent
    | MetricsPolled
    | FirstTokenObserved
    | PrefillStarted
    | PrefillEnded
    | BackendForwarded
    | BackendFinished
    | OutputIntentObserved
    | RefusedAfterAdmission
)


@attrs.frozen(kw_only=True)
class GuardState:
    config: GuardConfig
    gate: GateState
    learner: LearnerState
    predictive: PredictiveState | None = None
    #: The predictive learner's latest admission verdict and its explanation (kept here, not in
    #: the learner's state, so judging an attempt copies only this small value).
    verdict: Prediction | None = None
    #: What the latest poll round published (the gate's decision and everything behind it).
    published: Published
    traffic: TrafficState = attrs.field(factory=TrafficState)

    @classmethod
    def initial(cls, config: GuardConfig, *, at: float) -> GuardState:
        gate = GateState.initial(config.gate, at=at)
        if config.gate.dynamic:
            gate = attrs.evolve(
                gate, decision=PublishedDecision.startup(at=at, failsafe=config.failsafe)
            )
        learner = LearnerState(config=config.policy, failsafe=config.failsafe)
        predictive = None
        if config.predictive is not None:
            predictive = PredictiveState.initial(config.predictive)
        return cls(
            config=config,
            gate=gate,
            learner=learner,
            predictive=predictive,
            published=Published(decision=gate.decision),
        )


@attrs.frozen
class GuardStep:
    state: GuardState
    #: The outcome of an admission attempt.
    outcome: Admission | None = None
    #: The decision a poll published.
    decision: PublishedDecision | None = None


def _poll(state: GuardState, event: MetricsPolled) -> GuardStep:
    if not state.config.learning:
        return GuardStep(state)
    gate = state.gate
    view = GateView(
        queue=gate.waiting,
        premium_inflight=gate.premium_inflight,
        basic_inflight=gate.basic_inflight,
        premium_waiting=gate.premium_waiting,
        published_cap=gate.decision.cap,
    )
    evaluated = evaluate_round(state.learner, view, event.polls, at=event.at)
    learner, decision = evaluated.learner, evaluated.decision
    predictive = state.predictive
    if predictive is not None:
        predictive = predictive_rules.polled(predictive, event.polls, at=event.at)
        decision, predictive = _predictive_decision(decision, learner, predictive, at=event.at)
    gate = gate_rules.apply(gate, gate_rules.DecisionPublished(decision)).state
    # A failed round publishes a decision with no learner detail (the learner keeps its
    # snapshot for the next good round, but it is not what is published).
    snapshot = learner.last if decision.source is DecisionSource.METRICS else None
    published = publish(
        state.published,
        event.polls,
        evaluated.normalised,
        decision=decision,
        snapshot=snapshot,
        semantic=learner.semantic_ttft,
        tier_rejects=state.traffic.tier_rejects,
        tier_waiting=(gate.basic_waiting, gate.premium_waiting),
        at=event.at,
    )
    return GuardStep(
        attrs.evolve(state, gate=gate, learner=learner, predictive=predictive, published=published),
        decision=decision,
    )


def _predictive_decision(
    pig: PublishedDecision, learner: LearnerState, predictive: PredictiveState, *, at: float
) -> tuple[PublishedDecision, PredictiveState]:
    """The predictive cap, under PIG's intake rules and hard limits."""
    snapshot = learner.last
    if pig.source is not DecisionSource.METRICS or snapshot is None:
        return pig, predictive  # no metrics: intake stays closed as PIG closes it
    prediction = predictive_rules.published_cap(predictive, at=at)
    predictive = attrs.evolve(predictive, last_cap=prediction)
    components = snapshot.components
    cap, reason = prediction.cap, LimitReason.PREDICTED_SPEED
    if cap >= components.hard_global:
        cap, reason = components.hard_global, LimitReason.HARD_GLOBAL
    if components.availability is not None and components.availability < cap:
        cap, reason = components.availability, LimitReason.AVAILABILITY
    if components.override is LimitReason.BACKEND_UNAVAILABLE:
        cap, reason = 0, LimitReason.BACKEND_UNAVAILABLE
    elif predictive.waiting_unexplained:
        # The engine queues requests that the prefill the guard just sent does not explain
        # (seats or KV ran out): intake closes until the next poll, as PIG's does on waiting.
        cap, reason = 0, LimitReason.BACKEND_WAITING
    return attrs.evolve(pig, cap=cap, final_reason=reason), predictive


def _waited(
    event: gate_rules.SlotRequested | gate_rules.WaitRetried,
) -> tuple[float, Tier, int | None]:
    if isinstance(event, gate_rules.SlotRequested):
        return 0.0, event.tier, event.body_bytes
    queued = event.queued
    arrived = queued.arrived_at if queued.arrived_at is not None else event.at
    return max(0.0, event.at - arrived), queued.tier, queued.body_bytes


def _predictive_attempt(
    state: GuardState, event: gate_rules.SlotRequested | gate_rules.WaitRetried
) -> tuple[gate_rules.GateStep, Prediction | None]:
    """The gate's counts first; what they admit must also pass the learner's predictions."""
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
        verdict = predictive_rules.assess(
            predictive, body_bytes, reserve=reserve, waited_s=waited, at=event.at
        )
        if not verdict.admit:
            step = gate_rules.refuse(gate, event, RejectCode.GLOBAL_DYNAMIC_LIMIT)
        return step, verdict.prediction
    return step, None


def apply_traffic_event(state: GuardState, event: TrafficEvent) -> GuardState:
    """:func:`apply` for a traffic event, which has no outcome: the new state only."""
    traffic = apply_traffic(state.traffic, event, state.config.adaptive_output)
    # Built directly (not through attrs.evolve): this runs twice per forwarded request.
    return GuardState(config=state.config, gate=state.gate, learner=state.learner,
                      predictive=state.predictive, verdict=state.verdict,
                      published=state.published, traffic=traffic)  # fmt: skip


def apply(state: GuardState, event: GuardEvent) -> GuardStep:
    """Apply one event; attempts return their outcome, polls the decision they published."""
    if isinstance(event, MetricsPolled):
        return _poll(state, event)
    if isinstance(event, _TRAFFIC_EVENTS):
        return GuardStep(apply_traffic_event(state, event))
    learner = state.learner
    if isinstance(event, FirstTokenObserved):
        histogram = observe_first_token(learner.semantic_ttft, event.seconds)
        state = attrs.evolve(state, learner=attrs.evolve(learner, semantic_ttft=histogram))
        if state.predictive is not None and event.request_id is not None:
            predictive = predictive_rules.first_token(
                state.predictive, event.request_id, at=event.at
            )
            state = attrs.evolve(state, predictive=predictive)
        return GuardStep(state)
    if isinstance(event, PrefillStarted):
        deadline = event.at + grace_s(learner.config, event.body_bytes)
        prefill = (*learner.prefill, (event.request_id, deadline))
        state = attrs.evolve(state, learner=attrs.evolve(learner, prefill=prefill))
        if state.predictive is not None:
            predictive = predictive_rules.forwarded(
                state.predictive,
                event.request_id,
                event.body_bytes,
                at=event.at,
                premium=event.tier is Tier.PREMIUM,
            )
            state = attrs.evolve(state, predictive=predictive)
        return GuardStep(state)
    if isinstance(event, PrefillEnded):
        prefill = tuple(entry for entry in learner.prefill if entry[0] != event.request_id)
        state = attrs.evolve(state, learner=attrs.evolve(learner, prefill=prefill))
        if state.predictive is not None:
            predictive = predictive_rules.finished(state.predictive, event.request_id, at=event.at)
            state = attrs.evolve(state, predictive=predictive)
        return GuardStep(state)
    prediction: Prediction | None = None
    step: gate_rules.GateStep
    if (
        state.predictive is not None
        and state.gate.config.dynamic
        and isinstance(event, gate_rules.SlotRequested | gate_rules.WaitRetried)
    ):
        # Learning without enforcing (DYNAMIC_PIG_ENFORCE=false) predicts but never refuses.
        step, prediction = _predictive_attempt(state, event)
    else:
        step = gate_rules.apply(state.gate, event)
    outcome = step.outcome
    traffic = state.traffic
    if isinstance(outcome, Rejected):
        if outcome.code in _DYNAMIC_REJECTS:
            learner = attrs.evolve(learner, dynamic_rejects=learner.dynamic_rejects + 1)
        if outcome.code is not RejectCode.BACKEND_UNAVAILABLE and isinstance(
            event, gate_rules.SlotRequested | gate_rules.WaitRetried
        ):
            traffic = traffic.refused(_waited(event)[1])
    model = state.predictive
    verdict = state.verdict
    if model is not None:
        if prediction is not None:
            verdict = prediction
        if isinstance(outcome, Rejected) and outcome.code is not RejectCode.BACKEND_UNAVAILABLE:
            basis = prediction or model.last_cap
            if basis is not None:
                seconds = predictive_rules.retry_after_s(model, basis, at=event.at)
                outcome = attrs.evolve(outcome, retry_after_s=seconds)
    return GuardStep(
        attrs.evolve(state, gate=step.state, learner=learner, verdict=verdict, traffic=traffic),
        outcome=outcome,
    )
