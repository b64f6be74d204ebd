"""One request's story from a recording: what the guard saw and which rule decided it.

Reads: a recording's records (as :func:`guard_adapters.replay.replay` folds them), the guard's
configuration, and the id of one request: its ``X-Request-Id`` (the recording's ``trace_id``)
or the engine's number for it.
Guarantees:
- the story is recomputed by the same fold as ``replay``, so it tells what the recorded
  configuration (or the overrides) decides, step by step: each event of the request, the
  outcome the core gave it, and the figures the rule read at that instant (the cap, the state
  and its reasons, the in-flight and waiting counts per tier);
- a refusal names its rule (:func:`rule_text`) with those figures; under the predictive
  learner it also gives the binding constraint and the predictions;
- pure: no clock, no I/O; ``None`` when no request has that id.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from guard_adapters.explain import as_json, attempt_prediction
from guard_adapters.recording import Header, Record
from guard_adapters.replay import replay
from guard_core import (
    Admitted,
    Arrived,
    GuardConfig,
    GuardState,
    GuardStep,
    Queued,
    RejectCode,
    Rejected,
    RequestEvent,
    Tier,
)
from guard_core.gate import GateState, current_limit
from guard_core.tier import basic_limit

__all__ = ("RequestStory", "StoryStep", "explain_request", "render_story", "rule_text")

_EVENT_NAMES = {
    "Arrived": "arrived",
    "Retried": "retried",
    "Abandoned": "abandoned (the client left)",
    "Forwarded": "forwarded",
    "Refused": "refused (429 sent)",
    "FirstToken": "first token",
    "Finished": "finished",
}


@attrs.frozen(kw_only=True)
class StoryStep:
    """One event of the request and what the core made of it."""

    #: When (seconds since the guard started) and which event, in words.
    at: float
    event: str
    #: ``admitted``, ``waiting`` or ``refused`` for an attempt; ``None`` otherwise.
    outcome: str | None = None
    #: The refusal's code (a waiting request's latest one).
    code: RejectCode | None = None
    #: The rule that decided, in words, with the figures it read.
    rule: str = ""
    #: What the gate read, just before the event.
    cap: int = 0
    state: str = ""
    limit_reason: str = ""
    reasons: tuple[str, ...] = ()
    premium_inflight: int = 0
    basic_inflight: int = 0
    premium_waiting: int = 0
    basic_waiting: int = 0
    retry_after_s: int | None = None
    #: The predictive learner's verdict for the attempt (its JSON form).
    prediction: dict[str, Any] | None = None


@attrs.frozen(kw_only=True)
class RequestStory:
    trace_id: str
    request_id: int
    tier: Tier
    path: str
    body_bytes: int | None
    steps: tuple[StoryStep, ...]

    @property
    def verdict(self) -> str:
        """How it ended: admitted, refused with its code, abandoned, or still open."""
        for step in reversed(self.steps):
            if step.outcome == "refused" and step.code is not None:
                return f"refused: {step.code}"
            if step.outcome == "admitted":
                return "admitted"
            if step.event.startswith("abandoned"):
                return "abandoned"
        return "not settled in the recording"


def rule_text(gate: GateState, tier: Tier, code: RejectCode) -> str:
    """The rule behind ``code`` for a ``tier`` request, with the figures ``gate`` held."""
    limit, _closed = current_limit(gate)
    decision = gate.decision
    inflight = gate.inflight
    if code is RejectCode.BACKEND_UNAVAILABLE:
        return "no backend could take work (at start-up, or every poll failed): intake closed"
    if code is RejectCode.GLOBAL_DYNAMIC_LIMIT:
        if limit <= 0:
            return f"the learned cap was 0 (state {decision.state}): intake closed"
        return (
            f"{inflight} in flight had reached the learned cap of {limit} "
            f"(state {decision.state}, set by {decision.final_reason})"
        )
    if code is RejectCode.TIER_PRIORITY:
        return f"a basic request while {gate.premium_waiting} premium request(s) waited"
    if code is RejectCode.TIER_BASIC_LIMIT:
        allowed = basic_limit(limit, gate.premium_inflight)
        return (
            f"basic requests held {gate.basic_inflight} of the {max(allowed, 0)} slots not "
            f"reserved for premium (cap {limit}, {gate.premium_inflight} premium in flight)"
        )
    if code is RejectCode.GLOBAL_LIMIT:
        return f"{inflight} in flight had reached GLOBAL_LIMIT={gate.config.global_limit}"
    return "the trusted priority could not be written into the body (fail-closed injection)"


def _step(before: GuardState, event: RequestEvent, step: GuardStep, tier: Tier) -> StoryStep:
    gate = before.gate
    decision = gate.decision
    outcome = step.outcome
    figures: dict[str, Any] = {
        "at": event.at,
        "event": _EVENT_NAMES.get(type(event).__name__, type(event).__name__),
        "cap": decision.cap if gate.config.dynamic else gate.config.global_limit,
        "state": str(decision.state),
        "limit_reason": str(decision.final_reason),
        "reasons": tuple(str(r) for r in (*decision.red_reasons, *decision.yellow_reasons)),
        "premium_inflight": gate.premium_inflight,
        "basic_inflight": gate.basic_inflight,
        "premium_waiting": gate.premium_waiting,
        "basic_waiting": gate.basic_waiting,
    }
    prediction = attempt_prediction(before, step.state) if outcome is not None else None
    if prediction is not None:
        figures["prediction"] = as_json(prediction)
    if isinstance(outcome, Admitted):
        figures.update(outcome="admitted", rule="a slot was free")
    elif isinstance(outcome, Queued):
        figures.update(
            outcome="waiting",
            code=outcome.code,
            rule=f"no slot yet: {rule_text(gate, tier, outcome.code)}; it may wait "
            f"until {outcome.deadline:.3f} s",
        )
    elif isinstance(outcome, Rejected):
        figures.update(
            outcome="refused",
            code=outcome.code,
            rule=rule_text(gate, tier, outcome.code),
            retry_after_s=outcome.retry_after_s,
        )
    return StoryStep(**figures)


def explain_request(
    records: Iterable[Record | Header], config: GuardConfig, wanted: str
) -> RequestStory | None:
    """The story of the request whose ``trace_id`` (or engine number) is ``wanted``."""
    found: dict[str, Any] = {}
    steps: list[StoryStep] = []

    def watch(before: GuardState, event: RequestEvent, step: GuardStep) -> None:
        if not found:
            if not isinstance(event, Arrived) or wanted not in (
                event.trace_id,
                str(event.request_id),
            ):
                return
            found.update(
                trace_id=event.trace_id,
                request_id=event.request_id,
                tier=event.tier,
                path=event.path,
                body_bytes=event.body_bytes,
            )
        if event.request_id == found["request_id"]:
            steps.append(_step(before, event, step, found["tier"]))

    replay(records, config, watch=watch)
    if not found:
        return None
    return RequestStory(**found, steps=tuple(steps))


def render_story(story: RequestStory) -> str:
    """The story as text for a terminal."""
    name = (
        f"{story.trace_id} (engine #{story.request_id})"
        if story.trace_id
        else (f"#{story.request_id}")
    )
    size = "?" if story.body_bytes is None else str(story.body_bytes)
    lines = [
        f"request {name}: {story.tier} tier, path {story.path or '?'}, body {size} bytes",
        f"verdict: {story.verdict}",
    ]
    for step in story.steps:
        seen = (
            f"cap {step.cap}, state {step.state}; in flight premium {step.premium_inflight} "
            f"basic {step.basic_inflight}; waiting premium {step.premium_waiting} "
            f"basic {step.basic_waiting}"
        )
        head = f"  {step.at:10.3f} s  {step.event}"
        if step.outcome is not None:
            head += f" -> {step.outcome}"
        lines.append(head)
        if step.outcome is not None:
            lines.append(f"               gate: {seen}")
        if step.rule:
            lines.append(f"               rule: {step.rule}")
        if step.reasons and step.outcome is not None:
            lines.append(f"               state reasons: {', '.join(step.reasons)}")
        if step.retry_after_s is not None:
            lines.append(f"               Retry-After: {step.retry_after_s} s")
        if step.prediction is not None:
            lines.append(f"               predicted: {step.prediction}")
    return "\n".join(lines)
