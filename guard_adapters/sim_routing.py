"""How a simulated pool routes an admitted request to one of its backends.

Reads: one :class:`RoutingView` per admitted request: its prompt size, its Mooncake
``hash_ids`` (when the trace has them) and the body size the guard saw; per backend the
requests in flight and the prompt tokens sent to it still without a first token; the size of a
backend's prefix cache; the guard's state when the policy is the guard (its published poll
figures, its traffic counts and, with ``DYNAMIC_POLICY=predictive``, the predictive learner).

Routings:
- ``round-robin``: backend ``k mod n`` for the ``k``-th admitted request;
- ``least-loaded``: the fewest requests in flight, the first of equals;
- ``guard``: :func:`guard_core.pool_routing.route`: affinity with bounded loads on the request's
  prefix key where its cache gain beats the prefill queued in front, else the best-ranked
  backend. The prefix key is the hash of the leading ``affinity_blocks`` ``hash_ids`` (2 by
  default: 2 x 512 tokens at 4 bytes a token is the proxy's default 4,096 prefix bytes; in the
  Mooncake trace the first block is a system prompt every request shares, the second starts
  the conversation). The router remembers where the last ``memory`` keys went (the backend,
  the prompt size, and the prompt tokens that backend had been sent by then): a request is
  expected to find the earlier prompt (at most its own) cached on that backend while the prompt
  tokens sent there since fit in its cache (the learned KV capacity, else the view's size).
  Ranking under the predictive learner is by its per-backend outlook
  (:mod:`guard_core.backend_prediction`), a backend having room when that outlook is within
  the targets, and among those by pending prefill; under PIG's learner by PIG's
  :func:`~guard_core.backend_choice.backend_score`, a backend having room while its engine
  reports nothing waiting and serves its running requests at the speed target
  (:func:`~guard_core.ranking.pig_room`); without a guard (policies ``none`` and ``static``)
  by pending prefill, then load.

Guarantees: pure apart from each router's own memory; deterministic for a sequence of calls;
every answer is an index into the pool; a fresh router is made for each run
(:func:`parse_routing`), so runs do not share state; the guard router's memory never holds
more than ``memory`` keys.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final, Protocol

import attrs

from guard_adapters.affinity_key import key_of
from guard_core import GuardState
from guard_core import affinity as affinity_rules
from guard_core.backend_choice import backend_score, backend_views
from guard_core.backend_prediction import backend_loads, outlook
from guard_core.placements import DEFAULT_MEMORY, Placements, cached_tokens, placed
from guard_core.pool_routing import route
from guard_core.ranking import Candidate, pig_room

__all__ = (
    "DEFAULT_AFFINITY_BLOCKS",
    "ROUTINGS",
    "GuardRouting",
    "LeastLoaded",
    "RoundRobin",
    "RoutedRequest",
    "Router",
    "RoutingView",
    "parse_routing",
    "prefix_key",
)

#: Leading ``hash_ids`` blocks a simulated request's prefix key covers.
DEFAULT_AFFINITY_BLOCKS: Final = 2
ROUTINGS: Final = ("round-robin", "least-loaded", "guard")


@attrs.frozen
class RoutedRequest:
    """What a router knows of the request it places."""

    prompt_tokens: int
    body_bytes: int
    hash_ids: tuple[int, ...] = ()


@attrs.frozen(kw_only=True)
class RoutingView:
    """Everything a router may read to place one admitted request, at ``at``."""

    request: RoutedRequest
    #: The pool's backends, in configuration order, and per backend (aligned with ``names``)
    #: its requests in flight and the prompt tokens sent to it still without a first token.
    names: tuple[str, ...]
    loads: tuple[int, ...]
    pending_tokens: tuple[int, ...] = ()
    #: The guard's state, when the policy is the guard (``None`` otherwise).
    guard: GuardState | None = None
    #: Prompt tokens one backend's prefix cache holds (``None``: not known).
    cache_tokens: int | None = None
    at: float = 0.0

    def pending_of(self, index: int) -> float | None:
        """The backend's pending prefill, ``None`` when the view has no such figures."""
        return float(self.pending_tokens[index]) if self.pending_tokens else None


class Router(Protocol):
    name: str

    def choose(self, view: RoutingView) -> int: ...

    def reasons(self) -> Mapping[str, int]: ...


def prefix_key(hash_ids: Sequence[int], blocks: int = DEFAULT_AFFINITY_BLOCKS) -> int | None:
    """The affinity key of a request whose prompt has these blocks; ``None`` without blocks."""
    if not hash_ids or blocks < 1:
        return None
    material = ",".join(str(block) for block in hash_ids[:blocks]).encode("ascii")
    return key_of("prefix", material)


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, view: RoutingView) -> int:
        index = self._next % len(view.names)
        self._next += 1
        return index

    def reasons(self) -> Mapping[str, int]:
        return {}


class LeastLoaded:
    name = "least-loaded"

    def choose(self, view: RoutingView) -> int:
        loads = view.loads
        return min(range(len(view.names)), key=lambda index: (loads[index], index))

    def reasons(self) -> Mapping[str, int]:
        return {}


class GuardRouting:
    """The guard's router (see the module notes)."""

    name = "guard"

    def __init__(
        self,
        *,
        affinity_blocks: int = DEFAULT_AFFINITY_BLOCKS,
        bound: float = affinity_rules.DEFAULT_BOUND,
        memory: int = DEFAULT_MEMORY,
    ) -> None:
        affinity_rules.load_bound(0, 1, bound)  # checks the bound
        self.affinity_blocks = affinity_blocks
        self.bound = bound
        self.memory = memory
        self._ring: affinity_rules.Ring | None = None
        self._reasons: dict[str, int] = {}
        #: Where the latest requests of each prefix key went (the core's estimate of a warm
        #: cache, the same one the live proxy keeps per pool).
        self._placements = Placements(memory=memory)

    def _cached(self, view: RoutingView, key: int | None) -> tuple[float, ...]:
        """The prompt tokens of this request each backend's prefix cache is expected to hold
        (:func:`guard_core.placements.cached_tokens`, with the learned KV capacity, else the
        view's cache size)."""
        capacity: float | None = view.cache_tokens
        predictive = view.guard.predictive if view.guard is not None else None
        if predictive is not None and predictive.kv_per_token:
            capacity = 1.0 / predictive.kv_per_token
        return cached_tokens(
            self._placements, key, view.names, view.request.prompt_tokens, capacity=capacity
        )

    def _candidates(self, view: RoutingView, cached: Sequence[float]) -> list[Candidate]:
        guard = view.guard
        rows = list(zip(view.names, view.loads, strict=True))
        if guard is None:
            return [
                Candidate(
                    name=name,
                    load=load,
                    pending_tokens=view.pending_of(index),
                    cached_tokens=cached[index],
                )
                for index, (name, load) in enumerate(rows)
            ]
        predictive = guard.predictive
        if predictive is not None:
            pool = sum(view.loads)
            loads = backend_loads(predictive, at=view.at)
            candidates = []
            for index, (name, load) in enumerate(rows):
                seen = outlook(
                    predictive,
                    name,
                    inflight=load,
                    pool_inflight=pool,
                    body_bytes=view.request.body_bytes,
                    at=view.at,
                    loads=loads,
                )
                candidates.append(
                    Candidate(
                        name=name,
                        load=load,
                        room=seen.within_target,
                        outlook=seen,
                        pending_tokens=view.pending_of(index),
                        cached_tokens=cached[index],
                    )
                )
            return candidates
        policy = guard.config.policy
        views = backend_views(view.names, guard.published, guard.traffic)
        return [
            Candidate(
                name=seen.name,
                load=seen.inflight,
                room=pig_room(seen, target_user_tps=policy.user_tps_yellow),
                score=backend_score(
                    seen,
                    capacity_ratio=policy.capacity_ratio,
                    target_user_tps=policy.user_tps_yellow,
                ),
                pending_tokens=view.pending_of(index),
                cached_tokens=cached[index],
            )
            for index, seen in enumerate(views)
        ]

    def choose(self, view: RoutingView) -> int:
        names = view.names
        if self._ring is None or self._ring.names != names:
            self._ring = affinity_rules.build_ring(names)
            self._placements = Placements(memory=self.memory)
        key = prefix_key(view.request.hash_ids, self.affinity_blocks)
        candidates = self._candidates(view, self._cached(view, key))
        chosen = route(candidates, ring=self._ring, key=key, bound=self.bound)
        index = 0 if chosen is None else chosen.index  # None never: every backend is eligible
        if chosen is not None:
            reason = str(chosen.reason)
            self._reasons[reason] = self._reasons.get(reason, 0) + 1
        self._placements = placed(self._placements, key, names[index], view.request.prompt_tokens)
        return index

    def reasons(self) -> Mapping[str, int]:
        return dict(self._reasons)

    def remembered(self) -> int:
        """How many prefix keys' placements the router holds (at most ``memory``)."""
        return len(self._placements.keys)


def parse_routing(
    text: str, *, affinity_blocks: int = DEFAULT_AFFINITY_BLOCKS, bound: float | None = None
) -> Router:
    """A fresh router for ``round-robin``, ``least-loaded`` or ``guard``."""
    spec = text.strip().lower()
    if spec == "round-robin":
        return RoundRobin()
    if spec == "least-loaded":
        return LeastLoaded()
    if spec == "guard":
        return GuardRouting(
            affinity_blocks=affinity_blocks,
            bound=affinity_rules.DEFAULT_BOUND if bound is None else bound,
        )
    raise ValueError(f"unknown routing {text!r}: use {', '.join(ROUTINGS)}")
