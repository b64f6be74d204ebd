"""The admission gate: who may hold a slot now, who may wait briefly, who is refused (spec 4).

Reads: the latest :class:`~guard_core.decision.PublishedDecision`, the per-tier in-flight and
waiting counts it keeps itself, and the request's tier. Time enters only as ``at`` on events.
Guarantees:
- in-flight never exceeds ``GLOBAL_LIMIT``, nor (in dynamic mode) the published cap at the
  moment of admission; a later, lower cap never evicts anyone;
- counts never go negative: releasing or abandoning what is not held raises
  :class:`~guard_core.InvalidObservation` and the state given stays valid;
- every attempt ends in exactly one :class:`Admitted` or :class:`Rejected`; a :class:`Queued`
  attempt stays counted as waiting until its retry admits it, its retry rejects it, or it is
  abandoned;
- premium may use the whole cap; basic never takes a slot reserved for premium and is refused
  with ``tier_priority`` while any premium request waits;
- a refused request waits at most as long as :func:`~guard_core.short_wait.short_wait_s` allows
  (spec 4.3), and a request's own ``wait_cap_s`` (its priority band's wait) only shortens it;
- the failure mode (``PIG_FAILURE_MODE``) decides only what a decision that says no backend is
  usable (no metrics yet, every metrics source failing) does: ``close`` (the default, PIG's)
  refuses every attempt with ``backend_unavailable``; ``open`` admits within ``GLOBAL_LIMIT``
  and the tier rules as static mode does (:func:`failing_open` says when); any other decision
  is enforced the same in both modes.
"""

from __future__ import annotations

import attrs

from guard_core._errors import InvalidObservation
from guard_core._values import replace
from guard_core.decision import (
    Admission,
    Admitted,
    PublishedDecision,
    Queued,
    RejectCode,
    Rejected,
)
from guard_core.settings import AtLeast, Greater, default_of, require_valid, setting
from guard_core.short_wait import MAX_SHORT_WAIT_S, short_wait_s
from guard_core.signal_state import SignalThresholds
from guard_core.tier import Tier, basic_limit

__all__ = (
    "MAX_SHORT_WAIT_S",
    "DecisionPublished",
    "GateConfig",
    "GateEvent",
    "GateState",
    "GateStep",
    "SlotReleased",
    "SlotRequested",
    "WaitAbandoned",
    "WaitRetried",
    "apply",
    "current_limit",
    "failing_open",
    "next_check_at",
    "refuse",
    "refused_at_once",
    "short_wait_s",
)


@attrs.frozen(kw_only=True)
class GateConfig:
    """The settings the gate reads, with PIG's defaults and ranges.

    Only ``queue_wait_s`` is read from its variable as it is; the others are copies of settings
    :class:`~guard_core.SignalThresholds` owns, or follow from several variables.
    """

    #: ``GLOBAL_LIMIT``: the hard in-flight cap for admitted requests.
    global_limit: int = setting(default_of(SignalThresholds, "global_limit"), rules=(AtLeast(0),))
    #: Dynamic mode enabled *and* enforced; otherwise the cap is ``global_limit``.
    dynamic: bool = True
    #: ``PIG_QUEUE_WAIT_SECONDS``; the effective wait is at most 0.5 s.
    queue_wait_s: float = setting(0.5, env="PIG_QUEUE_WAIT_SECONDS", rules=(AtLeast(0),))
    #: ``PIG_QUEUE_POLL_MS``; the fallback re-check period is ten times this, within [50 ms, 1 s].
    #: (The adapter reads the variable itself: a value that is not positive is allowed while the
    #: wait is 0, and then stands for PIG's fallback.)
    queue_poll_ms: int = setting(100, rules=(Greater(0),))
    #: ``DYNAMIC_KV_RED``; 0 turns the KV rule of the short wait off.
    kv_red: float = setting(default_of(SignalThresholds, "kv_red"), rules=(AtLeast(0),))
    #: ``DYNAMIC_WAITING_RED``; 0 turns the waiting rule of the short wait off.
    waiting_red: int = setting(default_of(SignalThresholds, "waiting_red"), rules=(AtLeast(0),))
    #: ``PIG_FAILURE_MODE=open``: with no usable metrics, admit within ``GLOBAL_LIMIT``.
    fail_open: bool = False

    def __attrs_post_init__(self) -> None:
        require_valid(self)

    @property
    def fallback_check_s(self) -> float:
        """How long a waiter sleeps without a wake-up before it retries anyway."""
        return min(1.0, max(0.05, self.queue_poll_ms * 10 / 1000))


@attrs.frozen(kw_only=True, slots=False)  # copied per request: see guard_core._values
class GateState:
    """Slots held and requests waiting, per tier, under the latest published decision."""

    config: GateConfig
    decision: PublishedDecision
    premium_inflight: int = 0
    basic_inflight: int = 0
    premium_waiting: int = 0
    basic_waiting: int = 0

    @classmethod
    def initial(cls, config: GateConfig, *, at: float) -> GateState:
        """A gate before the first poll: closed in dynamic mode, ``GLOBAL_LIMIT`` in static."""
        if config.dynamic:
            decision = PublishedDecision.startup(at=at)
        else:
            decision = PublishedDecision.static(at=at, global_limit=config.global_limit)
        return cls(config=config, decision=decision)

    @property
    def inflight(self) -> int:
        return self.premium_inflight + self.basic_inflight

    @property
    def waiting(self) -> int:
        return self.premium_waiting + self.basic_waiting

    def inflight_of(self, tier: Tier) -> int:
        return self.premium_inflight if tier is Tier.PREMIUM else self.basic_inflight

    def waiting_of(self, tier: Tier) -> int:
        return self.premium_waiting if tier is Tier.PREMIUM else self.basic_waiting


# -- events ------------------------------------------------------------------------------------


@attrs.frozen
class SlotRequested:
    """A new admitted-path request asks for a slot."""

    at: float
    tier: Tier
    #: The request body's size, for a learner that weighs each request; ``None`` if unknown.
    body_bytes: int | None = None
    #: A shorter short wait for this request (its priority band's ``wait``); ``None``: none.
    wait_cap_s: float | None = None


@attrs.frozen
class WaitRetried:
    """A waiting request tries again (after a wake-up, the fallback timer or its deadline)."""

    at: float
    queued: Queued


@attrs.frozen
class WaitAbandoned:
    """A waiting request's client went away; it leaves the queue without an outcome."""

    at: float
    queued: Queued


@attrs.frozen
class SlotReleased:
    """An admitted request finished (any way at all) and gives its slot back."""

    at: float
    tier: Tier


@attrs.frozen
class DecisionPublished:
    """A poll published a new decision."""

    decision: PublishedDecision

    @property
    def at(self) -> float:
        return self.decision.at


GateEvent = SlotRequested | WaitRetried | WaitAbandoned | SlotReleased | DecisionPublished


@attrs.frozen
class GateStep:
    """The state after an event, and the admission outcome when the event was an attempt."""

    state: GateState
    outcome: Admission | None = None


# -- pure rules --------------------------------------------------------------------------------


def current_limit(state: GateState) -> tuple[int, RejectCode | None]:
    """The cap in force and, when it is closed, the code every attempt gets (spec 4.1)."""
    config = state.config
    if not config.dynamic:
        return config.global_limit, None
    decision = state.decision
    if decision.cap <= 0:
        if decision.backend_unavailable:
            if config.fail_open:
                return config.global_limit, None
            return decision.cap, RejectCode.BACKEND_UNAVAILABLE
        return decision.cap, RejectCode.GLOBAL_DYNAMIC_LIMIT
    return decision.cap, None


def failing_open(state: GateState) -> bool:
    """``PIG_FAILURE_MODE=open`` is in force now: the decision says no backend is usable, and
    the gate admits within ``GLOBAL_LIMIT`` instead of closing."""
    config = state.config
    decision = state.decision
    return (
        config.fail_open and config.dynamic and decision.cap <= 0 and decision.backend_unavailable
    )


def _refusal(state: GateState, tier: Tier) -> RejectCode | None:
    """Why ``tier`` cannot take a slot now, or ``None`` when it can (spec 4.2)."""
    limit, closed = current_limit(state)
    if closed is not None:
        return closed
    inflight = state.inflight
    if state.config.dynamic and inflight >= limit:
        return RejectCode.GLOBAL_DYNAMIC_LIMIT
    if tier is Tier.BASIC:
        if state.premium_waiting > 0:
            return RejectCode.TIER_PRIORITY
        allowed = basic_limit(limit, state.premium_inflight)
        if allowed <= 0 or state.basic_inflight >= allowed:
            return RejectCode.TIER_BASIC_LIMIT
    if inflight >= state.config.global_limit:
        return RejectCode.GLOBAL_LIMIT
    return None


def next_check_at(queued: Queued, *, now: float, config: GateConfig) -> float:
    """When a waiter should retry if nothing wakes it earlier: its deadline or the fallback."""
    return min(queued.deadline, now + config.fallback_check_s)


# -- reducer -----------------------------------------------------------------------------------


def _with_counts(state: GateState, tier: Tier, *, inflight: int, waiting: int) -> GateState:
    if tier is Tier.PREMIUM:
        return replace(
            state,
            premium_inflight=state.premium_inflight + inflight,
            premium_waiting=state.premium_waiting + waiting,
        )
    return replace(
        state,
        basic_inflight=state.basic_inflight + inflight,
        basic_waiting=state.basic_waiting + waiting,
    )


def _request(state: GateState, event: SlotRequested) -> GateStep:
    code = _refusal(state, event.tier)
    if code is None:
        return GateStep(
            _with_counts(state, event.tier, inflight=1, waiting=0), Admitted(event.tier)
        )
    return refuse(state, event, code)


def refused_at_once(state: GateState, tier: Tier) -> RejectCode | None:
    """Why a new ``tier`` request with no wait cap of its own is refused now with no wait, or
    None when it would be admitted or would wait: what :func:`apply` does with its
    :class:`SlotRequested`, without building the step (the refusal path asks this first)."""
    code = _refusal(state, tier)
    if code is None or short_wait_s(state.decision, code, state.config) > 0:
        return None
    return code


def refuse(state: GateState, event: SlotRequested | WaitRetried, code: RejectCode) -> GateStep:
    """The attempt cannot take a slot now, for reason ``code``: it waits briefly or is refused.

    The gate's own rules call this; a learner that refuses a request the counts would admit
    (the predictive one) calls it too, so short waits and deadlines stay the gate's.
    """
    if isinstance(event, WaitRetried):
        queued = event.queued
        tier = queued.tier
        if event.at >= queued.deadline or short_wait_s(state.decision, code, state.config) <= 0:
            return GateStep(_with_counts(state, tier, inflight=0, waiting=-1), Rejected(code))
        if code is queued.code:
            return GateStep(state, queued)  # still waiting for the same reason: nothing moves
        return GateStep(state, attrs.evolve(queued, code=code))
    wait = short_wait_s(state.decision, code, state.config)
    if event.wait_cap_s is not None:
        wait = min(wait, event.wait_cap_s)
    if wait <= 0:
        return GateStep(state, Rejected(code))
    fresh = Queued(
        event.tier, event.at + wait, code, body_bytes=event.body_bytes, arrived_at=event.at
    )
    return GateStep(_with_counts(state, event.tier, inflight=0, waiting=1), fresh)


def _check_waiting(state: GateState, queued: Queued) -> None:
    if state.waiting_of(queued.tier) <= 0:
        raise InvalidObservation(f"no {queued.tier} request is waiting")


def _retry(state: GateState, event: WaitRetried) -> GateStep:
    queued = event.queued
    _check_waiting(state, queued)
    tier = queued.tier
    # A waiter does not count against itself: a premium waiter must not see its own wait as a
    # reason to refuse anyone, and the tier rule only looks at premium waiters for basic.
    code = _refusal(state, tier)
    if code is None:
        return GateStep(_with_counts(state, tier, inflight=1, waiting=-1), Admitted(tier))
    return refuse(state, event, code)


def _abandon(state: GateState, event: WaitAbandoned) -> GateStep:
    _check_waiting(state, event.queued)
    return GateStep(_with_counts(state, event.queued.tier, inflight=0, waiting=-1))


def _release(state: GateState, event: SlotReleased) -> GateStep:
    if state.inflight_of(event.tier) <= 0:
        raise InvalidObservation(f"release of a {event.tier} slot that is not held")
    return GateStep(_with_counts(state, event.tier, inflight=-1, waiting=0))


def _publish(state: GateState, event: DecisionPublished) -> GateStep:
    return GateStep(attrs.evolve(state, decision=event.decision))


def apply(state: GateState, event: GateEvent) -> GateStep:
    """Apply one event to the gate; attempts (request and retry) also return their outcome."""
    if isinstance(event, SlotRequested):
        return _request(state, event)
    if isinstance(event, WaitRetried):
        return _retry(state, event)
    if isinstance(event, SlotReleased):
        return _release(state, event)
    if isinstance(event, WaitAbandoned):
        return _abandon(state, event)
    return _publish(state, event)
