"""Backend health: passive outlier ejection with a doubling backoff, a half-open probe, and the
short "full" mark of an engine that refused a request.

Reads: events stamped with ``at`` that the shell reports per backend (by configured name): a
failure (:class:`Failure`: connect refused or timed out, reset or closed before the response
head, a 5xx the client did not cause, no head within the head timeout), a success (a response
head that is not such a 5xx), "full" (the engine refused the request unstarted: vLLM's 503 under
``--max-num-queued-reqs``, SGLang's queue-full 503), the probe sent to a half-open backend and
a probe that ended with no verdict (its client left first); plus the names of the backends whose
metrics poll just succeeded (:func:`polled`).
Guarantees:
- a backend is ejected only by ``eject_after`` failures in a row (``0``: never); any success
  resets the count; a "full" mark neither counts as a failure nor resets the count;
- the first ejection lasts ``backoff_s``, each ejection that follows without a healthy spell
  doubles it, never beyond ``backoff_max_s``; once a restored backend has answered well for
  ``backoff_max_s`` the doubling starts again from ``backoff_s``;
- when the backoff ends the backend is half-open: exactly one request may go to it as its probe
  (:class:`Availability.PROBE`, then :class:`Availability.PROBING` until a verdict); a success
  (or a "full" answer, which shows it alive) restores it, a failure ejects it again with the
  longer backoff, a probe with no verdict lets the next request be the probe;
- failures reported while a backend is ejected and its backoff runs (requests sent before the
  ejection) change nothing;
- "full" makes the backend unavailable for new requests until its next good poll or for
  ``full_hold_s``, whichever ends first;
- deterministic: the same events give the same states; the counters (ejections, probes, full
  marks) only grow.

Choosing among backends is :mod:`guard_core.backend_choice`'s; it reads :func:`availability`
and never refuses every backend of a pool (see there).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import attrs

from guard_core._values import replace
from guard_core.settings import AtLeast, Greater, NotAbove, require_valid, setting

__all__ = (
    "Availability",
    "BackendFailed",
    "BackendFull",
    "BackendHealth",
    "BackendSucceeded",
    "Failure",
    "HealthConfig",
    "HealthEvent",
    "HealthState",
    "ProbeAbandoned",
    "ProbeSent",
    "apply_health",
    "availability",
    "backoff_s",
    "polled",
)


class Failure(enum.StrEnum):
    """What went wrong with a request to a backend."""

    #: The connection was refused, failed or timed out: nothing was sent.
    CONNECT = "connect"
    #: The connection was reset or closed before the response head.
    RESET = "reset"
    #: A 5xx the client did not cause (a client-caused 500 rewritten to 400/422 is not one).
    SERVER_ERROR = "server_error"
    #: No response head within ``PIG_UPSTREAM_HEAD_TIMEOUT_SECONDS``.
    STALLED_HEAD = "stalled_head"


class Availability(enum.StrEnum):
    """Whether a backend may take a new request now."""

    AVAILABLE = "available"
    #: Half-open: the next request sent to it is its probe.
    PROBE = "probe"
    #: Half-open with its probe in flight: nothing else goes.
    PROBING = "probing"
    #: The engine refused a request as full; held back until its next good poll or the hold.
    FULL = "full"
    #: Ejected: its backoff has not ended.
    EJECTED = "ejected"


@attrs.frozen(kw_only=True)
class HealthConfig:
    """Passive outlier ejection's settings (active only where the shell has several backends)."""

    #: ``PIG_BACKEND_EJECT_FAILURES``: failures in a row that eject a backend; 0 never ejects.
    eject_after: int = setting(5, env="PIG_BACKEND_EJECT_FAILURES", rules=(AtLeast(0),))
    #: ``PIG_BACKEND_EJECT_SECONDS``: the first ejection's length.
    backoff_s: float = setting(
        5.0, env="PIG_BACKEND_EJECT_SECONDS", rules=(Greater(0), NotAbove("backoff_max_s"))
    )
    #: ``PIG_BACKEND_EJECT_MAX_SECONDS``: the longest ejection; also how long a restored backend
    #: must answer well before its backoff starts again from the first length.
    backoff_max_s: float = setting(120.0, env="PIG_BACKEND_EJECT_MAX_SECONDS", rules=(Greater(0),))
    #: ``PIG_BACKEND_FULL_HOLD_SECONDS``: how long an engine's "full" answer holds the backend
    #: back at most (its next good poll ends it sooner).
    full_hold_s: float = setting(1.0, env="PIG_BACKEND_FULL_HOLD_SECONDS", rules=(AtLeast(0),))

    def __attrs_post_init__(self) -> None:
        require_valid(self)


@attrs.frozen(kw_only=True)
class BackendHealth:
    """One backend's health."""

    name: str
    #: Failures in a row since the latest success (or ejection).
    failures: int = 0
    #: Ejections in a row without a healthy spell: the backoff's exponent.
    streak: int = 0
    #: When its current ejection's backoff ends; ``None`` while it is not ejected.
    ejected_until: float | None = None
    #: Half-open with its probe in flight.
    probing: bool = False
    #: When it was last restored from an ejection (``None`` once its streak was reset).
    restored_at: float | None = None
    #: Until when a "full" answer holds it back; ``None`` when not held.
    full_until: float | None = None
    #: Counters since start.
    ejections: int = 0
    probes: int = 0
    full_marks: int = 0


@attrs.frozen
class BackendFailed:
    """A request to ``backend`` failed as ``failure`` says."""

    at: float
    backend: str
    failure: Failure


@attrs.frozen
class BackendSucceeded:
    """``backend`` answered a request with a head that is not a server error."""

    at: float
    backend: str


@attrs.frozen
class BackendFull:
    """``backend``'s engine refused a request unstarted (its queue is full)."""

    at: float
    backend: str


@attrs.frozen
class ProbeSent:
    """A request went to half-open ``backend`` as its probe."""

    at: float
    backend: str


@attrs.frozen
class ProbeAbandoned:
    """The probe sent to ``backend`` ended with neither a success nor a failure."""

    at: float
    backend: str


HealthEvent = BackendFailed | BackendSucceeded | BackendFull | ProbeSent | ProbeAbandoned


@attrs.frozen
class HealthState:
    #: Every backend an event named, in the order first named.
    backends: tuple[BackendHealth, ...] = ()

    def of(self, name: str) -> BackendHealth | None:
        for health in self.backends:
            if health.name == name:
                return health
        return None

    def _with(self, health: BackendHealth) -> HealthState:
        kept = self.backends
        for index, old in enumerate(kept):
            if old.name == health.name:
                return HealthState((*kept[:index], health, *kept[index + 1 :]))
        return HealthState((*kept, health))


def backoff_s(config: HealthConfig, streak: int) -> float:
    """The length of the ``streak``-th ejection in a row (1 for the first)."""
    doubling = min(max(streak, 1) - 1, 64)  # 2**64 times any positive base is past any cap
    return min(config.backoff_max_s, config.backoff_s * 2.0**doubling)


def availability(health: BackendHealth | None, *, now: float) -> Availability:
    """Whether the backend may take a new request at ``now``."""
    if health is None:
        return Availability.AVAILABLE
    if health.ejected_until is not None:
        if now < health.ejected_until:
            return Availability.EJECTED
        return Availability.PROBING if health.probing else Availability.PROBE
    if health.full_until is not None and now < health.full_until:
        return Availability.FULL
    return Availability.AVAILABLE


def _eject(health: BackendHealth, at: float, config: HealthConfig) -> BackendHealth:
    streak = health.streak + 1
    return replace(
        health,
        failures=0,
        streak=streak,
        ejected_until=at + backoff_s(config, streak),
        probing=False,
        restored_at=None,
        full_until=None,
        ejections=health.ejections + 1,
    )


def _restore(health: BackendHealth, at: float) -> BackendHealth:
    return replace(health, failures=0, ejected_until=None, probing=False, restored_at=at)


def _failed(health: BackendHealth, at: float, config: HealthConfig) -> BackendHealth:
    if health.ejected_until is not None:
        if at < health.ejected_until and not health.probing:
            return health  # a request sent before the ejection: already accounted for
        return _eject(health, at, config)  # half-open: the probe (or a fallback) failed
    failures = health.failures + 1
    if config.eject_after > 0 and failures >= config.eject_after:
        return _eject(health, at, config)
    return replace(health, failures=failures)


def _succeeded(health: BackendHealth, at: float, config: HealthConfig) -> BackendHealth:
    if health.ejected_until is not None:
        return _restore(health, at)
    restored = health.restored_at
    if restored is not None and at - restored >= config.backoff_max_s:
        return replace(health, failures=0, streak=0, restored_at=None)
    if health.failures == 0:
        return health
    return replace(health, failures=0)


def _full(health: BackendHealth, at: float, config: HealthConfig) -> BackendHealth:
    if health.ejected_until is not None and (health.probing or at >= health.ejected_until):
        health = replace(_restore(health, at), failures=health.failures)  # it answered: alive
    return replace(health, full_until=at + config.full_hold_s, full_marks=health.full_marks + 1)


def apply_health(state: HealthState, event: HealthEvent, config: HealthConfig) -> HealthState:
    """Apply one health event."""
    health = state.of(event.backend) or BackendHealth(name=event.backend)
    if isinstance(event, BackendFailed):
        changed = _failed(health, event.at, config)
    elif isinstance(event, BackendSucceeded):
        changed = _succeeded(health, event.at, config)
    elif isinstance(event, BackendFull):
        changed = _full(health, event.at, config)
    elif isinstance(event, ProbeSent):
        if availability(health, now=event.at) is not Availability.PROBE:
            return state
        changed = replace(health, probing=True, probes=health.probes + 1)
    else:
        if not health.probing:
            return state
        changed = replace(health, probing=False)
    return state if changed is health else state._with(changed)


def polled(state: HealthState, good: Iterable[str]) -> HealthState:
    """After a poll round: the backends named in ``good`` answered it, which ends a full mark."""
    for name in good:
        health = state.of(name)
        if health is not None and health.full_until is not None:
            state = state._with(replace(health, full_until=None))
    return state
