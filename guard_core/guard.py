"""The whole guard as one reducer: the admission gate and the capacity learner together.

Reads: every observation the runtime makes, as an event stamped with ``at``: the request
events of :mod:`guard_core.events` (applied by :mod:`guard_core.requests`) and metrics polls.
Guarantees:
- one state value, changed only by :func:`apply` (or :func:`fold` over many events), so a
  runtime has a single owner of the policy and a recording of the events replays to the same
  decisions;
- a poll's decision is published to the gate in the same step that evaluates it, together with
  the one :class:`~guard_core.published.Published` value every reader of a poll reads;
- requests in flight per backend, the adaptive output samples and the tier refusals are state
  here too (:mod:`guard_core.traffic`), so a runtime keeps no copy of them; so is each
  backend's health (:mod:`guard_core.health`), changed by the health events and by each poll
  (a good poll ends a backend's "full" mark);
- refusals by the dynamic cap or the tier rule are counted for the learner when they end in a
  429 (not while the request still waits, and not when its client left);
- with ``DYNAMIC_POLICY=predictive`` (``config.predictive`` set) PIG's pipeline still runs on
  every poll, for its state reasons and its intake rules (no metrics, every backend failing,
  backend waiting), but the cap it publishes is the predictive learner's, and an attempt the
  gate's counts would admit is also checked against the learner's predictions
  (:mod:`guard_core.predictive`); a refusal then carries a predicted ``Retry-After``. With
  several healthy backends the cap and that check are the pool's, per backend
  (:mod:`guard_core.pool_admission`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from guard_core import gate as gate_rules
from guard_core import predictive as predictive_rules
from guard_core import requests as request_rules
from guard_core._values import replace
from guard_core.decision import (
    Admission,
    DecisionSource,
    LimitReason,
    LoadState,
    PublishedDecision,
    Rejected,
)
from guard_core.evaluation import (
    BackendPoll,
    LearnerState,
    evaluate_round,
)
from guard_core.events import Arrived, RequestEvent
from guard_core.flow import FlowConfig, FlowState
from guard_core.gate import GateConfig, GateState
from guard_core.health import (
    BackendFailed,
    BackendFull,
    BackendSucceeded,
    HealthConfig,
    HealthEvent,
    HealthState,
    ProbeAbandoned,
    ProbeSent,
    apply_health,
    polled,
)
from guard_core.lanes import AdaptiveOutputConfig
from guard_core.placements import placed
from guard_core.policy import PolicyConfig
from guard_core.pool_admission import is_pool, pool_cap
from guard_core.predictive import Prediction, PredictiveConfig, PredictiveState
from guard_core.predictive_cap import published_cap
from guard_core.published import Published, publish
from guard_core.requests import Tracked
from guard_core.settings import default_of
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
    "GuardConfig",
    "GuardEvent",
    "GuardState",
    "GuardStep",
    "MetricsPolled",
    "apply",
    "apply_health_event",
    "apply_traffic_event",
    "fold",
    "refuses_at_once",
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
    #: Passive outlier ejection and the "full" hold (:mod:`guard_core.health`).
    health: HealthConfig = attrs.field(factory=HealthConfig)
    #: Priority bands and tenant fairness (:mod:`guard_core.flow`); ``None``: PIG's two tiers
    #: by the gate alone.
    flow: FlowConfig | None = None


@attrs.frozen
class MetricsPolled:
    """One poll round finished: every backend's sample or failure."""

    at: float
    polls: tuple[BackendPoll, ...]


#: Bytes per prompt token assumed without the predictive learner (its own default).
_DEFAULT_BYTES_PER_TOKEN: float = default_of(PredictiveConfig, "bytes_per_token")
_TRAFFIC_EVENTS = (BackendForwarded, BackendFinished, OutputIntentObserved, RefusedAfterAdmission)
_HEALTH_EVENTS = (BackendFailed, BackendSucceeded, BackendFull, ProbeSent, ProbeAbandoned)

#: Everything the guard applies: request events, polls, traffic counts, and a decision published
#: directly (a runtime that pins the cap without polling, as tests do).
GuardEvent = (
    RequestEvent | MetricsPolled | TrafficEvent | HealthEvent | gate_rules.DecisionPublished
)


@attrs.frozen(kw_only=True, slots=False)  # copied per request: see guard_core._values
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
    #: Each backend's health: failures in a row, ejection, probe, full mark.
    health: HealthState = attrs.field(factory=HealthState)
    #: Every request waiting for a slot or holding one, by id (:mod:`guard_core.requests`).
    requests: Mapping[int, Tracked] = attrs.field(factory=dict)
    #: Counts per priority band and tenant (:mod:`guard_core.flow`); ``None`` when unconfigured.
    flow: FlowState | None = None

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
        flow = None if config.flow is None else FlowState.initial(config.flow)
        return cls(
            config=config,
            gate=gate,
            learner=learner,
            predictive=predictive,
            published=Published(decision=gate.decision),
            flow=flow,
        )


@attrs.frozen
class GuardStep:
    state: GuardState
    #: The outcome of an admission attempt.
    outcome: Admission | None = None
    #: The decision a poll published.
    decision: PublishedDecision | None = None


def _poll(state: GuardState, event: MetricsPolled) -> GuardStep:
    if state.health.backends:
        good = (poll.name for poll in event.polls if poll.sample is not None)
        state = attrs.evolve(state, health=polled(state.health, good))
    if not state.config.learning:
        return GuardStep(state)
    gate = state.gate
    evaluated = evaluate_round(state.learner, gate, event.polls, at=event.at)
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
    if is_pool(predictive):
        prediction = pool_cap(predictive, at=at)
    else:
        prediction = published_cap(predictive, at=at)
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


def prompt_tokens_of(state: GuardState, body_bytes: int | None) -> float:
    """The prompt-size estimate of a body of ``body_bytes``: the predictive learner's (with the
    bytes per token it learned), else at the learner's default bytes per token (0: unknown)."""
    if state.predictive is not None:
        return state.predictive.prompt_tokens(body_bytes)
    if body_bytes is None:
        return 0.0
    return body_bytes / _DEFAULT_BYTES_PER_TOKEN


def apply_traffic_event(state: GuardState, event: TrafficEvent) -> GuardState:
    """:func:`apply` for a traffic event, which has no outcome: the new state only."""
    traffic = apply_traffic(state.traffic, event, state.config.adaptive_output)
    if isinstance(event, BackendForwarded) and event.body_bytes is not None:
        tokens = prompt_tokens_of(state, event.body_bytes)
        placements = placed(traffic.placements, event.key, event.backend, tokens)
        traffic = replace(traffic, placements=placements)
    predictive = state.predictive
    if (
        predictive is not None
        and isinstance(event, BackendForwarded)
        and event.request_id is not None
    ):
        predictive = predictive_rules.sent_to(predictive, event.request_id, event.backend)
        return replace(state, traffic=traffic, predictive=predictive)
    return replace(state, traffic=traffic)  # runs twice per forwarded request


def apply_health_event(state: GuardState, event: HealthEvent) -> GuardState:
    """:func:`apply` for a health event, which has no outcome: the new state only."""
    health = apply_health(state.health, event, state.config.health)
    return state if health is state.health else replace(state, health=health)


def apply(state: GuardState, event: GuardEvent) -> GuardStep:
    """Apply one event; attempts return their outcome, polls the decision they published."""
    if type(event) is Arrived:  # the most frequent event, on the refusal path: dispatched first
        state, outcome = request_rules.apply(state, event)
        return GuardStep(state, outcome=outcome)
    if isinstance(event, MetricsPolled):
        return _poll(state, event)
    if isinstance(event, _TRAFFIC_EVENTS):
        return GuardStep(apply_traffic_event(state, event))
    if isinstance(event, _HEALTH_EVENTS):
        return GuardStep(apply_health_event(state, event))
    if isinstance(event, gate_rules.DecisionPublished):
        return GuardStep(attrs.evolve(state, gate=gate_rules.apply(state.gate, event).state))
    state, outcome = request_rules.apply(state, event)
    return GuardStep(state, outcome=outcome)


def refuses_at_once(state: GuardState, attempt: Arrived) -> bool:
    """Whether ``attempt`` would be refused now, with no wait: the early-refusal peek the
    shell makes from a request's head before reading its body (nothing is applied)."""
    return isinstance(apply(state, attempt).outcome, Rejected)


def fold(state: GuardState, events: Iterable[GuardEvent]) -> GuardState:
    """The state after ``events``, applied in order from ``state``."""
    for event in events:
        state = apply(state, event).state
    return state
