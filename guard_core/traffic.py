"""What the guard counts of the traffic it serves, beyond the gate's slots.

Reads: events stamped with ``at``: a request sent to a backend and its end there, the
output-token intent a classified body declared, and a refusal after admission (the priority
rewrite's 429); plus the gate's own refusals, counted by :mod:`guard_core.guard`.
Guarantees:
- requests in flight per backend, by name: a finish for a backend with nothing in flight
  leaves it at zero;
- the adaptive output lanes' samples (:class:`~guard_core.lanes.AdaptiveOutputState`), changed
  only when the guard's config carries adaptive output settings;
- the tier refusals ``(basic, premium)`` only grow; they feed the published reject deltas;
- the placements of prefix keys (:mod:`guard_core.placements`), for the pool router; the
  forwarded event's placement is applied by :func:`guard_core.guard.apply_traffic_event`,
  which knows the prompt-size estimate.
"""

from __future__ import annotations

import attrs

from guard_core._values import replace
from guard_core.lanes import AdaptiveOutputConfig, AdaptiveOutputState
from guard_core.placements import Placements
from guard_core.tier import Tier

__all__ = (
    "BackendFinished",
    "BackendForwarded",
    "OutputIntentObserved",
    "RefusedAfterAdmission",
    "TrafficEvent",
    "TrafficState",
    "apply_traffic",
)


@attrs.frozen
class BackendForwarded:
    """A request was sent to backend ``backend`` (``request_id``: the guard's id of it, when the
    runtime passes it; the predictive learner then knows each backend's own requests).

    With the pool router's affinity on, the runtime also passes the request's prefix ``key``
    (``None``: it has none) and its ``body_bytes``: the placement is remembered
    (:mod:`guard_core.placements`), so a later request with the same key is expected to find
    its prefix cached there."""

    at: float
    backend: str
    request_id: int | None = None
    key: int | None = None
    body_bytes: int | None = None


@attrs.frozen
class BackendFinished:
    """A request sent to backend ``backend`` ended there (any way)."""

    at: float
    backend: str


@attrs.frozen
class OutputIntentObserved:
    """A classified request body asked for ``tokens`` output tokens."""

    at: float
    tokens: int


@attrs.frozen
class RefusedAfterAdmission:
    """An admitted request of ``tier`` was refused with a 429 before it was forwarded."""

    at: float
    tier: Tier


TrafficEvent = BackendForwarded | BackendFinished | OutputIntentObserved | RefusedAfterAdmission


@attrs.frozen(kw_only=True, slots=False)  # copied per request: see guard_core._values
class TrafficState:
    #: Requests in flight per backend: ``(name, count)`` pairs, in the order first sent to.
    inflight: tuple[tuple[str, int], ...] = ()
    adaptive: AdaptiveOutputState = attrs.field(factory=AdaptiveOutputState)
    #: Refusals (429s) per tier since start: ``(basic, premium)``.
    tier_rejects: tuple[int, int] = (0, 0)
    #: Where the latest requests of each prefix key went (changed only by forwarded requests
    #: that carry their body size: the pool router's affinity is on).
    placements: Placements = attrs.field(factory=Placements)

    def inflight_of(self, backend: str) -> int:
        for name, count in self.inflight:
            if name == backend:
                return count
        return 0

    def refused(self, tier: Tier) -> TrafficState:
        """One more refusal of ``tier`` (on the refusal path: a fast copy, no evolve)."""
        basic, premium = self.tier_rejects
        rejects = (basic, premium + 1) if tier is Tier.PREMIUM else (basic + 1, premium)
        return replace(self, tier_rejects=rejects)


def _moved(state: TrafficState, backend: str, by: int) -> TrafficState:
    # A fast copy (not attrs.evolve): this runs twice per forwarded request.
    inflight = state.inflight
    for index, (name, count) in enumerate(inflight):
        if name == backend:
            moved = (name, max(0, count + by))
            inflight = (*inflight[:index], moved, *inflight[index + 1 :])
            break
    else:
        inflight = (*inflight, (backend, max(0, by)))
    return replace(state, inflight=inflight)


def apply_traffic(
    state: TrafficState, event: TrafficEvent, adaptive: AdaptiveOutputConfig | None
) -> TrafficState:
    """Apply one traffic event; ``adaptive`` is the adaptive output settings (``None``: off)."""
    if isinstance(event, BackendForwarded):
        return _moved(state, event.backend, 1)
    if isinstance(event, BackendFinished):
        return _moved(state, event.backend, -1)
    if isinstance(event, OutputIntentObserved):
        if adaptive is None:
            return state
        return attrs.evolve(state, adaptive=state.adaptive.observe(event.tokens, adaptive))
    return state.refused(event.tier)
