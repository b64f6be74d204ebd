"""The router of one pool: affinity first, else the best predicted outcome.

Reads: the pool's :class:`~guard_core.ranking.Candidate` values (configuration order), its
affinity :class:`~guard_core.affinity.Ring` (built once from the same names), the request's
affinity key (``None`` when it has none, or when affinity is off) and the load bound.

The order:

1. only eligible backends are considered (not ejected, not marked full); none: no route;
2. with a key, the backend consistent hashing with bounded loads gives it
   (:func:`guard_core.affinity.choose` over the eligible backends and their loads), when that
   backend has room (for the predictive learner: its outlook for this request is within the
   speed and TTFT targets) and the cache gain beats the load cost: the prompt tokens its
   prefix cache is expected to hold for this request (``Candidate.cached_tokens``) are at
   least the prefill it has queued beyond the best-ranked other backend with room
   (``Candidate.pending_tokens``, both in prompt tokens); it keeps the request's prefix cache
   warm where that saves more prefill than the queue in front of it costs (with neither figure
   known, both 0, affinity wins whenever it has room, as before);
3. otherwise the best-ranked eligible backend (:func:`guard_core.ranking.best`: those with
   room first, by pending prefill (when known) or predicted speed subject to TTFT, or by
   PIG's score), where a backend whose load would pass the same bound counts as having no
   room: ranking may send a slow backend less work, but never piles more than the bound on
   the fast ones, so a backend the model misjudges still gets requests to learn from and the
   pool is never narrowed to one engine.

Guarantees: pure and deterministic; the route names an eligible backend whenever one exists;
no choice carries a backend past the load bound while an eligible backend with room is within
it; the reason says which rule chose.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs

from guard_core import affinity
from guard_core.backend_choice import BackendView, backend_score, takes_work
from guard_core.backend_prediction import backend_loads, outlook
from guard_core.predictive import PredictiveState
from guard_core.ranking import Candidate, pig_room, ranked

__all__ = ("Route", "RouteReason", "candidates", "route")


class RouteReason(enum.StrEnum):
    AFFINITY = "affinity"
    RANKED = "ranked"


@attrs.frozen
class Route:
    """The chosen backend (an index into the candidates and its name) and why."""

    index: int
    name: str
    reason: RouteReason


def route(
    candidates: Sequence[Candidate],
    *,
    ring: affinity.Ring | None,
    key: int | None,
    bound: float = affinity.DEFAULT_BOUND,
) -> Route | None:
    """Where this request goes (see the module notes); ``None`` when no backend is eligible."""
    positions = {candidate.name: index for index, candidate in enumerate(candidates)}
    eligible = {c.name for c in candidates if c.eligible}
    bounded = list(candidates)
    if eligible:
        limit = affinity.load_bound(
            sum(max(0, c.load) for c in candidates if c.eligible), len(eligible), bound
        )
        bounded = [
            c if c.load + 1 <= limit or not c.room else attrs.evolve(c, room=False)
            for c in candidates
        ]
    order = ranked(bounded)
    if key is not None and ring is not None:
        loads = {c.name: c.load for c in candidates}
        name = affinity.choose(ring, key, loads, bound, eligible=eligible)
        if name is not None and name in positions:
            index = positions[name]
            chosen = candidates[index]
            other = next((bounded[i] for i in order if i != index), None)
            if chosen.room and _affinity_pays(chosen, other):
                return Route(index, name, RouteReason.AFFINITY)
    if not order:
        return None
    return Route(order[0], bounded[order[0]].name, RouteReason.RANKED)


def _affinity_pays(chosen: Candidate, other: Candidate | None) -> bool:
    """Whether the affine backend's expected cache gain beats its load cost against the best
    other backend with room (see the module notes)."""
    if other is None or not other.room:
        return True
    cost = (chosen.pending_tokens or 0.0) - (other.pending_tokens or 0.0)
    return chosen.cached_tokens >= cost


def candidates(
    views: Sequence[BackendView],
    *,
    now: float,
    predictive: PredictiveState | None,
    body_bytes: int | None,
    tried: frozenset[int] = frozenset(),
    capacity_ratio: float,
    target_user_tps: float,
    cached: Sequence[float] | None = None,
) -> tuple[Candidate, ...]:
    """The router's view of a pool for one request, from backend choice's views: eligible when
    health lets it take work and the request has not been there yet; room and rank from the
    predictive learner's outlook for this request when it runs, else from PIG's room rule and
    load score; ``cached``: the prompt tokens each backend's prefix cache is expected to hold
    for it (:func:`guard_core.placements.cached_tokens`; none known: 0)."""
    pool_inflight = sum(view.inflight for view in views)
    loads = backend_loads(predictive, at=now) if predictive is not None else None
    built = []
    for index, view in enumerate(views):
        eligible = index not in tried and takes_work(view, now=now)
        held = cached[index] if cached is not None else 0.0
        if predictive is not None:
            seen = outlook(
                predictive,
                view.name,
                inflight=view.inflight,
                pool_inflight=pool_inflight,
                body_bytes=body_bytes,
                at=now,
                loads=loads,
            )
            pending: float | None = None
            if loads is not None:
                own = loads.get(view.name)
                pending = own.pending_tokens if own is not None else 0.0
            built.append(
                Candidate(
                    name=view.name,
                    eligible=eligible,
                    room=seen.within_target,
                    load=view.inflight,
                    outlook=seen,
                    pending_tokens=pending,
                    cached_tokens=held,
                )
            )
        else:
            built.append(
                Candidate(
                    name=view.name,
                    eligible=eligible,
                    room=pig_room(view, target_user_tps=target_user_tps),
                    load=view.inflight,
                    score=backend_score(
                        view, capacity_ratio=capacity_ratio, target_user_tps=target_user_tps
                    ),
                    cached_tokens=held,
                )
            )
    return tuple(built)
