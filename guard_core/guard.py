"""The whole guard as one reducer: the admission gate and the capacity learner together.

Reads: every observation the runtime makes, as an event stamped with ``at``: admission attempts
and their ends, metrics polls, first useful tokens, prefill starts and ends.
Guarantees:
- one state value, changed only by :func:`apply`, so a runtime has a single owner of the policy
  and a recording of the events replays to the same decisions;
- a poll's decision is published to the gate in the same step that evaluates it;
- refusals by the dynamic cap or the tier rule are counted for the learner when they end in a
  429 (not while the request still waits, and not when its client left).
"""

from __future__ import annotations

import attrs

from guard_core import gate as gate_rules
from guard_core.decision import Admission, LoadState, PublishedDecision, RejectCode, Rejected
from guard_core.evaluation import (
    BackendPoll,
    GateView,
    LearnerState,
    evaluate,
    observe_first_token,
)
from guard_core.gate import GateConfig, GateState
from guard_core.policy import PolicyConfig
from guard_core.prefill_guard import grace_s

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


@attrs.frozen
class PrefillStarted:
    """An admitted request was forwarded; it counts as prefilling for a grace period."""

    at: float
    request_id: int
    body_bytes: int | None


@attrs.frozen
class PrefillEnded:
    """An admitted request finished (any way), ending its prefill grace early."""

    at: float
    request_id: int


GuardEvent = (
    gate_rules.GateEvent | MetricsPolled | FirstTokenObserved | PrefillStarted | PrefillEnded
)


@attrs.frozen(kw_only=True)
class GuardState:
    config: GuardConfig
    gate: GateState
    learner: LearnerState

    @classmethod
    def initial(cls, config: GuardConfig, *, at: float) -> GuardState:
        gate = GateState.initial(config.gate, at=at)
        if config.gate.dynamic:
            gate = attrs.evolve(
                gate, decision=PublishedDecision.startup(at=at, failsafe=config.failsafe)
            )
        learner = LearnerState(config=config.policy, failsafe=config.failsafe)
        return cls(config=config, gate=gate, learner=learner)


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
    learner, decision = evaluate(state.learner, view, event.polls, at=event.at)
    gate = gate_rules.apply(gate, gate_rules.DecisionPublished(decision)).state
    return GuardStep(attrs.evolve(state, gate=gate, learner=learner), decision=decision)


def apply(state: GuardState, event: GuardEvent) -> GuardStep:
    """Apply one event; attempts return their outcome, polls the decision they published."""
    if isinstance(event, MetricsPolled):
        return _poll(state, event)
    learner = state.learner
    if isinstance(event, FirstTokenObserved):
        histogram = observe_first_token(learner.semantic_ttft, event.seconds)
        return GuardStep(
            attrs.evolve(state, learner=attrs.evolve(learner, semantic_ttft=histogram))
        )
    if isinstance(event, PrefillStarted):
        deadline = event.at + grace_s(learner.config, event.body_bytes)
        prefill = (*learner.prefill, (event.request_id, deadline))
        return GuardStep(attrs.evolve(state, learner=attrs.evolve(learner, prefill=prefill)))
    if isinstance(event, PrefillEnded):
        prefill = tuple(entry for entry in learner.prefill if entry[0] != event.request_id)
        return GuardStep(attrs.evolve(state, learner=attrs.evolve(learner, prefill=prefill)))
    step = gate_rules.apply(state.gate, event)
    outcome = step.outcome
    if isinstance(outcome, Rejected) and outcome.code in _DYNAMIC_REJECTS:
        learner = attrs.evolve(learner, dynamic_rejects=learner.dynamic_rejects + 1)
    return GuardStep(attrs.evolve(state, gate=step.state, learner=learner), outcome=outcome)
