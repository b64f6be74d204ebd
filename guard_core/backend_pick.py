"""Which backend of a pool one request goes to: the pool router or PIG's choice, over the state
the core keeps.

Reads: the pool's :class:`~guard_core.guard.GuardState` (published figures, requests in flight
per backend, health, the predictive learner), the backends' names in configuration order, the
request's affinity key and body size, the backends it already went to, and ``now``.
Guarantees:
- under :class:`Routing` with a ring (``PIG_ROUTING=guard``) the pool router
  (:func:`guard_core.pool_routing.route`) chooses, with the prompt tokens each backend is
  expected to hold cached for the request (:mod:`guard_core.placements`, from where the
  latest requests of its prefix key went); PIG's backend choice
  (:func:`guard_core.backend_choice.choose_backend`) does otherwise, and whenever the router
  finds no backend;
- a backend in ``tried`` is never picked; ``None`` when no backend may take the request;
- the pick says whether it is the backend's half-open probe, for the shell to tell the core,
  and what chose it: the pool router's rule (``affinity``, ``ranked``) or PIG's backend choice
  (``choice``);
- pure: the same inputs give the same pick.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import attrs

from guard_core.affinity import DEFAULT_BOUND, Ring
from guard_core.backend_choice import backend_views, choose_backend, is_probe
from guard_core.guard import GuardState, prompt_tokens_of
from guard_core.placements import cached_tokens
from guard_core.pool_routing import RouteReason, candidates, route

__all__ = ("CHOICE", "REASONS", "Pick", "Routing", "pick_backend")

#: What chose a pick the pool router did not make: PIG's backend choice.
CHOICE: Final = "choice"
#: Every reason a pick can give, the pool router's rules first.
REASONS: Final = (*(str(reason) for reason in RouteReason), CHOICE)


@attrs.frozen
class Routing:
    """How a pool routes: the affinity ring (None: PIG's choice alone), the load bound, and
    the poll interval and mode PIG's choice reads."""

    poll_interval_s: float
    dynamic: bool
    ring: Ring | None = None
    bound: float = DEFAULT_BOUND


@attrs.frozen
class Pick:
    """The backend's index in the names given, whether the request is its probe, and what
    chose it (one of :data:`REASONS`)."""

    index: int
    probe: bool
    reason: str = CHOICE


def pick_backend(
    state: GuardState,
    names: Sequence[str],
    routing: Routing,
    *,
    now: float,
    key: int | None = None,
    body_bytes: int | None = None,
    tried: frozenset[int] = frozenset(),
) -> Pick | None:
    """The backend for one request (see the module rules)."""
    policy = state.config.policy
    views = backend_views(names, state.published, state.traffic, state.health)
    chosen: int | None = None
    reason = CHOICE
    if routing.ring is not None:
        predictive = state.predictive
        capacity = None
        if predictive is not None and predictive.kv_per_token:
            capacity = 1.0 / predictive.kv_per_token  # the learned KV capacity, in tokens
        cached = cached_tokens(
            state.traffic.placements,
            key,
            names,
            prompt_tokens_of(state, body_bytes),
            capacity=capacity,
        )
        pool = candidates(
            views,
            now=now,
            predictive=predictive,
            body_bytes=body_bytes,
            tried=tried,
            capacity_ratio=policy.capacity_ratio,
            target_user_tps=policy.user_tps_yellow,
            cached=cached,
        )
        routed = route(pool, ring=routing.ring, key=key, bound=routing.bound)
        if routed is not None:
            chosen, reason = routed.index, str(routed.reason)
    if chosen is None:
        chosen = choose_backend(
            views,
            now=now,
            poll_interval_s=routing.poll_interval_s,
            dynamic=routing.dynamic,
            capacity_ratio=policy.capacity_ratio,
            target_user_tps=policy.user_tps_yellow,
            tried=tried,
        )
    if chosen is None:
        return None
    return Pick(chosen, is_probe(views[chosen], now=now), reason)
