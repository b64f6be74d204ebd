"""Which backend an admitted request is sent to (spec 4.6).

Reads: one :class:`BackendView` per backend, in configuration order (the status of its latest
metrics poll, the guard's own in-flight count for it and its health), the current time as
``now``, the poll interval, and whether dynamic mode is on; :func:`backend_views` builds the
views from the value the latest poll published, the guard's traffic counts and its health
state (:mod:`guard_core.health`).
Guarantees:
- the result is an index into the given sequence, and ``None`` only when it is empty: a pool
  whose every backend is ejected, full or probing still gets one (an operator would rather try
  than refuse everything): a full one first, else the one whose backoff ends soonest;
- an ejected, full or probing backend is chosen only when every backend is; a half-open one
  takes part as any other, and a request chosen for it is its probe (:func:`is_probe`);
- in dynamic mode a failed or stale backend is chosen only when every backend health lets take
  work is failed or stale, and then the one with the fewest in-flight requests is taken;
  outside dynamic mode no such backend is skipped;
- among the rest the lowest score wins, and equal scores go to the earlier backend, so equal
  backends always give the first of them;
- a score never drops when a backend's running, waiting, in-flight or KV usage grows: more load
  never makes a backend more attractive.

Scoring: a backend with a usable generation rate gets a capacity estimate
``max(1, floor(rate * capacity_ratio / target_user_tps))`` and scores
``running + inflight - capacity + 4 * waiting + 2 * kv``; one without a rate scores
``running + 8 * waiting + inflight / 4 + 4 * kv``. The two scales are compared as they are,
as PIG does. The rate is the backend's own, from its latest good poll; a failed backend has
none.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs

from guard_core._errors import InvalidObservation, PolicyConfigError
from guard_core.health import Availability, BackendHealth, HealthState, availability
from guard_core.published import Published
from guard_core.traffic import TrafficState

__all__ = (
    "STALE_AFTER_POLLS",
    "BackendView",
    "backend_score",
    "backend_views",
    "choose_backend",
    "is_probe",
    "is_stale",
    "takes_work",
)

#: A status not refreshed for more than this many poll intervals is stale.
STALE_AFTER_POLLS = 3
#: What a backend's latest good poll gives its view.
_POLL_FIGURES = ("generation_tps", "running", "waiting", "kv_usage")


def _count(_instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if value < 0:
        raise InvalidObservation(f"{attribute.name} must be >= 0, got {value}")


def _finite_non_negative(
    _instance: object, attribute: attrs.Attribute[Any], value: float | None
) -> None:
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise InvalidObservation(f"{attribute.name} must be finite and >= 0, got {value}")


@attrs.frozen(kw_only=True)
class BackendView:
    """What the chooser knows about one backend."""

    name: str
    #: The latest metrics poll of this backend failed.
    failed: bool = False
    #: When its status was last refreshed (runtime monotonic seconds); ``None`` if never, and a
    #: never-refreshed status is never stale.
    updated_at: float | None = None
    #: Generated tokens per second at the latest poll; ``None`` when no valid rate is known.
    generation_tps: float | None = attrs.field(default=None, validator=_finite_non_negative)
    running: int = attrs.field(default=0, validator=_count)
    waiting: int = attrs.field(default=0, validator=_count)
    kv_usage: float = attrs.field(default=0.0, validator=_finite_non_negative)
    #: Requests this guard has in flight to the backend now.
    inflight: int = attrs.field(default=0, validator=_count)
    #: Its health (``None``: nothing was ever reported, it is available).
    health: BackendHealth | None = None


def backend_views(
    names: Sequence[str],
    published: Published,
    traffic: TrafficState,
    health: HealthState | None = None,
) -> tuple[BackendView, ...]:
    """The chooser's view of each backend in ``names``: its latest poll's figures (none when
    that poll failed or it was never polled), the requests in flight to it and its health."""
    views = []
    for name in names:
        figures = published.backend(name)
        polled: dict[str, Any] = {}
        if figures is not None:
            polled = {"failed": figures.failed, "updated_at": figures.updated_at}
            if not figures.failed:
                polled.update({key: getattr(figures, key) for key in _POLL_FIGURES})
        known = health.of(name) if health is not None else None
        views.append(
            BackendView(name=name, inflight=traffic.inflight_of(name), health=known, **polled)
        )
    return tuple(views)


def is_probe(view: BackendView, *, now: float) -> bool:
    """A request sent to this backend now is its half-open probe."""
    return availability(view.health, now=now) is Availability.PROBE


def takes_work(view: BackendView, *, now: float) -> bool:
    """Health lets the backend take a new request now (available, or half-open)."""
    return availability(view.health, now=now) in (Availability.AVAILABLE, Availability.PROBE)


def _held_back(backends: Sequence[BackendView], now: float) -> int:
    """Every backend is ejected, full or probing: a full one with the fewest in flight, else
    the one whose backoff ends soonest (a probing one counts as ending now)."""

    def rank(index: int) -> tuple[int, float, int]:
        view = backends[index]
        if availability(view.health, now=now) is Availability.FULL:
            return (0, 0.0, view.inflight)
        until = view.health.ejected_until if view.health is not None else None
        return (1, until if until is not None else now, view.inflight)

    return min(range(len(backends)), key=rank)


def is_stale(view: BackendView, *, now: float, poll_interval_s: float) -> bool:
    """True when the status is older than three poll intervals (never when never refreshed)."""
    if view.updated_at is None:
        return False
    return now - view.updated_at > STALE_AFTER_POLLS * poll_interval_s


def backend_score(
    view: BackendView, *, capacity_ratio: float = 0.42, target_user_tps: float = 25.0
) -> float:
    """The backend's score; lower is better. See the module notes for the two formulas."""
    kv = view.kv_usage
    if view.generation_tps is not None:
        capacity = max(1, math.floor(view.generation_tps * capacity_ratio / target_user_tps))
        return -(capacity - view.running - view.inflight) + 4 * view.waiting + 2 * kv
    return view.running + 8 * view.waiting + 0.25 * view.inflight + 4 * kv


def _check_settings(poll_interval_s: float, capacity_ratio: float, target_user_tps: float) -> None:
    if not poll_interval_s > 0:
        raise PolicyConfigError(f"poll_interval_s must be > 0, got {poll_interval_s}")
    if not 0 < capacity_ratio <= 1:
        raise PolicyConfigError(f"capacity_ratio must be in (0, 1], got {capacity_ratio}")
    if not target_user_tps > 0:
        raise PolicyConfigError(f"target_user_tps must be > 0, got {target_user_tps}")


def choose_backend(
    backends: Sequence[BackendView],
    *,
    now: float,
    poll_interval_s: float,
    dynamic: bool,
    capacity_ratio: float = 0.42,
    target_user_tps: float = 25.0,
    tried: frozenset[int] = frozenset(),
) -> int | None:
    """The index of the backend to use, or ``None`` when there are no backends at all.

    ``tried``: the backends a request already went to (a retry elsewhere); they are left out,
    and so is every backend health does not let take work: ``None`` when none is left.
    """
    _check_settings(poll_interval_s, capacity_ratio, target_user_tps)
    best: int | None = None
    best_score = 0.0
    ready = [
        index
        for index, view in enumerate(backends)
        if index not in tried and takes_work(view, now=now)
    ]
    if tried and not ready:
        return None
    for index in ready:
        view = backends[index]
        if dynamic and (view.failed or is_stale(view, now=now, poll_interval_s=poll_interval_s)):
            continue
        score = backend_score(view, capacity_ratio=capacity_ratio, target_user_tps=target_user_tps)
        if best is None or score < best_score:
            best, best_score = index, score
    if best is not None or not backends:
        return best
    if not ready:
        return _held_back(backends, now)
    # Every backend health lets take work was skipped: the least busy by this guard's count.
    return min(ready, key=lambda index: backends[index].inflight)
