"""The decision vocabulary: load states, reasons, the published decision and request outcomes.

Reads: nothing; these are values only.
Guarantees: every value is frozen and hashable; string-valued enums carry the exact label strings
PIG uses in logs, metrics and the status line, so they can be written out with ``str(member)``.
"""

from __future__ import annotations

import enum

import attrs

from guard_core.tier import Tier

__all__ = (
    "Admission",
    "Admitted",
    "DecisionSource",
    "LimitReason",
    "LoadState",
    "PublishedDecision",
    "Queued",
    "RejectCode",
    "Rejected",
    "StateReason",
)


class LoadState(enum.StrEnum):
    """The load state of the backends as of the latest poll."""

    #: No signal is at or above its yellow threshold.
    GREEN = "green"
    #: At least one yellow reason and no red reason.
    YELLOW = "yellow"
    #: At least one red reason.
    RED = "red"
    #: Dynamic mode is off; the gate uses ``GLOBAL_LIMIT`` only.
    DISABLED = "disabled"

    @classmethod
    def from_reasons(
        cls, yellow: tuple[StateReason, ...], red: tuple[StateReason, ...]
    ) -> LoadState:
        """Red if any red reason, yellow if any yellow reason, green otherwise."""
        if red:
            return cls.RED
        if yellow:
            return cls.YELLOW
        return cls.GREEN


class DecisionSource(enum.StrEnum):
    """Where a published decision came from."""

    #: Nothing polled yet; intake is closed until the first good poll.
    STARTUP = "startup"
    #: Evaluated from a successful metrics poll.
    METRICS = "metrics"
    #: Every metrics URL failed at the latest poll.
    ERROR = "error"
    #: Dynamic mode is off (or not enforced); the cap is ``GLOBAL_LIMIT``.
    STATIC = "static"


class LimitReason(enum.StrEnum):
    """Which component set the published cap (the final-limit reason)."""

    HARD_GLOBAL = "hard_global"
    STATE = "state"
    TTFT = "ttft"
    THROUGHPUT = "throughput"
    PRESSURE = "pressure"
    PREFILL = "prefill"
    AVAILABILITY = "availability"
    BACKEND_WAITING = "backend_waiting"
    BACKEND_UNAVAILABLE = "backend_unavailable"
    DISABLED = "disabled"
    NONE = "none"
    #: The predictive learner's cap (``DYNAMIC_POLICY=predictive``): the predicted per-user
    #: speed at the current prompt load.
    PREDICTED_SPEED = "predicted_speed"


class StateReason(enum.StrEnum):
    """Why the load state is yellow or red; a decision lists these per colour, in order."""

    KV_CACHE = "kv_cache"
    RUNNING = "running"
    WAITING = "waiting"
    PREEMPTIONS = "preemptions"
    SINGLE_USER_TPS = "single_user_tps"
    TTFT_LATENCY = "ttft_latency"
    TTFT_LATENCY_CAPACITY = "ttft_latency_capacity"
    SINGLE_USER_TPS_CAPACITY = "single_user_tps_capacity"
    SCHEDULER_PRESSURE_CAPACITY = "scheduler_pressure_capacity"
    BACKEND_WAITING_QUEUE = "backend_waiting_queue"
    BACKEND_UNAVAILABLE = "backend_unavailable"


class RejectCode(enum.StrEnum):
    """Why one request was refused a slot. Never shown to the client."""

    #: The ``GLOBAL_LIMIT`` token pool is empty.
    GLOBAL_LIMIT = "global_limit"
    #: In-flight requests have reached the published dynamic cap.
    GLOBAL_DYNAMIC_LIMIT = "global_dynamic_limit"
    #: A basic request while a premium request is waiting.
    TIER_PRIORITY = "tier_priority"
    #: The basic tier has used every slot not reserved for premium.
    TIER_BASIC_LIMIT = "tier_basic_limit"
    #: No backend can take work (start-up, every poll failed, or none usable).
    BACKEND_UNAVAILABLE = "backend_unavailable"
    #: The trusted priority could not be written into the body in fail-closed mode.
    BACKEND_PRIORITY_INJECTION = "backend_priority_injection"


@attrs.frozen(kw_only=True)
class PublishedDecision:
    """What the guard published after a poll: the cap every admission is checked against.

    Only the fields the gate and the short-wait rule read live here; the learning pipeline keeps
    its own richer state.
    """

    #: When the decision was published (seconds on the runtime's monotonic clock).
    at: float
    source: DecisionSource
    #: The admission cap: at most this many admitted requests in flight. 0 closes intake.
    cap: int = attrs.field(validator=attrs.validators.ge(0))
    state: LoadState
    final_reason: LimitReason
    yellow_reasons: tuple[StateReason, ...] = ()
    red_reasons: tuple[StateReason, ...] = ()
    #: Summed backend ``running`` and ``waiting`` at the poll, and the highest KV-cache usage.
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    #: Backends polled and how many of them failed.
    backend_count: int = 0
    backend_failed: int = 0

    @classmethod
    def startup(cls, *, at: float, failsafe: LoadState = LoadState.YELLOW) -> PublishedDecision:
        """The decision before the first poll: intake closed, reason ``backend_unavailable``."""
        return cls._closed(at=at, source=DecisionSource.STARTUP, failsafe=failsafe)

    @classmethod
    def all_polls_failed(
        cls, *, at: float, backend_count: int, failsafe: LoadState = LoadState.YELLOW
    ) -> PublishedDecision:
        """The decision after a poll where every metrics source failed: intake closed."""
        return cls._closed(
            at=at,
            source=DecisionSource.ERROR,
            failsafe=failsafe,
            failed=backend_count,
        )

    @classmethod
    def _closed(
        cls,
        *,
        at: float,
        source: DecisionSource,
        failsafe: LoadState,
        failed: int = 0,
    ) -> PublishedDecision:
        """Intake closed in the ``failsafe`` state; ``failed`` backends polled, all failed."""
        return cls(
            at=at,
            source=source,
            cap=0,
            state=failsafe,
            final_reason=LimitReason.BACKEND_UNAVAILABLE,
            yellow_reasons=(StateReason.BACKEND_UNAVAILABLE,),
            backend_count=failed,
            backend_failed=failed,
        )

    @classmethod
    def static(cls, *, at: float, global_limit: int) -> PublishedDecision:
        """The decision in static mode: the cap is ``GLOBAL_LIMIT`` and never changes."""
        return cls(
            at=at,
            source=DecisionSource.STATIC,
            cap=global_limit,
            state=LoadState.DISABLED,
            final_reason=LimitReason.DISABLED,
        )

    @property
    def backend_unavailable(self) -> bool:
        """True when no backend can take work according to this decision (spec 4.1)."""
        if self.backend_count > 0 and self.backend_failed >= self.backend_count:
            return True
        return (
            StateReason.BACKEND_UNAVAILABLE in self.yellow_reasons
            or StateReason.BACKEND_UNAVAILABLE in self.red_reasons
        )


@attrs.frozen
class Admitted:
    """The request holds a slot of ``tier`` and may be forwarded now."""

    tier: Tier


@attrs.frozen
class Queued:
    """The request may wait until ``deadline`` for a slot; ``code`` is the latest refusal.

    The runtime keeps this value and hands it back on every retry, so the core needs no table
    of waiters.
    """

    tier: Tier
    deadline: float
    code: RejectCode
    #: The request's body size and when it reached the guard, for a learner that weighs each
    #: request (the predictive one); ``None`` when not known.
    body_bytes: int | None = None
    arrived_at: float | None = None


@attrs.frozen
class Rejected:
    """The request gets a 429. ``code`` is for metrics and logs only."""

    code: RejectCode
    #: Whole seconds the client should wait before retrying, when a learner predicted it.
    retry_after_s: int | None = None


#: The three outcomes of an admission attempt.
Admission = Admitted | Queued | Rejected
