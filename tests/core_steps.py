"""Test helpers that drive guard_core as a runtime does: one request event at a time."""

from __future__ import annotations

import attrs

from guard_core import (
    Arrived,
    GateConfig,
    GateState,
    GuardState,
    GuardStep,
    PublishedDecision,
    Tier,
    apply_guard_event,
)
from guard_core.evaluation import observe_first_token


def fresh_id(state: GuardState) -> int:
    """An id no request the state knows has."""
    return max(state.requests, default=0) + 1


def attempt(state: GuardState, at: float, tier: Tier, body_bytes: int | None = None) -> GuardStep:
    """A new request asks for a slot (an :class:`~guard_core.Arrived` with a fresh id)."""
    event = Arrived(at=at, request_id=fresh_id(state), tier=tier, body_bytes=body_bytes)
    return apply_guard_event(state, event)


def with_first_tokens(state: GuardState, *seconds: float) -> GuardState:
    """The state after first tokens that came ``seconds`` after their requests arrived: what
    each :class:`~guard_core.FirstToken` of a forwarded request adds to the semantic TTFT
    histogram (the reducer's own function), without admitting anyone, so it works whatever the
    gate would say."""
    learner = state.learner
    histogram = learner.semantic_ttft
    for value in seconds:
        histogram = observe_first_token(histogram, value)
    return attrs.evolve(state, learner=attrs.evolve(learner, semantic_ttft=histogram))


def gate_holding(*, cap: int = 0, **counts: int) -> GateState:
    """A gate whose published cap is ``cap`` and whose in-flight and waiting counts are
    ``counts`` (``premium_inflight``, ``basic_waiting``, ...): what a poll evaluation reads."""
    decision = PublishedDecision.static(at=0.0, global_limit=cap)
    return GateState(config=GateConfig(), decision=decision, **counts)
