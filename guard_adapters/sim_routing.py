"""How a simulated pool routes an admitted request to one of its backends.

Reads: per request its prompt size, its Mooncake ``hash_ids`` (when the trace has them) and the
body size the guard saw; the requests in flight to each backend; the guard's state when the
policy is the guard (its published poll figures, its traffic counts and, with
``DYNAMIC_POLICY=predictive``, the predictive learner).

Routings:
- ``round-robin``: backend ``k mod n`` for the ``k``-th admitted request;
- ``least-loaded``: the fewest requests in flight, the first of equals;
- ``guard``: :func:`guard_core.pool_routing.route`: affinity with bounded loads on the request's
  prefix key, else the best-ranked backend. The prefix key is the hash of the leading
  ``affinity_blocks`` ``hash_ids`` (2 by default: 2 x 512 tokens at 4 bytes a token is the
  proxy's default 4,096 prefix bytes; in the Mooncake trace the first block is a system prompt
  every request shares, the second starts the conversation). Ranking under the predictive
  learner is by its per-backend outlook (:mod:`guard_core.backend_prediction`), a backend having
  room when that outlook is within the targets; under PIG's learner by PIG's
  :func:`~guard_core.backend_choice.backend_score`, a backend having room while its engine
  reports nothing waiting and serves its running requests at the speed target
  (:func:`~guard_core.ranking.pig_room`); without a guard (policies ``none`` and ``static``)
  by load.

Guarantees: pure; deterministic for a sequence of calls; every answer is an index into the
pool; a fresh router is made for each run (:func:`parse_routing`), so runs do not share state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final, Protocol

import attrs

from guard_adapters.affinity_key import key_of
from guard_core import GuardState
from guard_core import affinity as affinity_rules
from guard_core.backend_choice import backend_score, backend_views
from guard_core.backend_prediction import outlook
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


class Router(Protocol):
    name: str

    def choose(
        self,
        request: RoutedRequest,
        names: Sequence[str],
        loads: Sequence[int],
        guard: GuardState | None,
        *,
        at: float,
    ) -> int: ...

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

    def choose(
        self,
        request: RoutedRequest,
        names: Sequence[str],
        loads: Sequence[int],
        guard: GuardState | None,
        *,
        at: float,
    ) -> int:
        index = self._next % len(names)
        self._next += 1
        return index

    def reasons(self) -> Mapping[str, int]:
        return {}


class LeastLoaded:
    name = "least-loaded"

    def choose(
        self,
        request: RoutedRequest,
        names: Sequence[str],
        loads: Sequence[int],
        guard: GuardState | None,
        *,
        at: float,
    ) -> int:
        return min(range(len(names)), key=lambda index: (loads[index], index))

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
    ) -> None:
        affinity_rules.load_bound(0, 1, bound)  # checks the bound
        self.affinity_blocks = affinity_blocks
        self.bound = bound
        self._ring: affinity_rules.Ring | None = None
        self._reasons: dict[str, int] = {}

    def _candidates(
        self,
        request: RoutedRequest,
        names: Sequence[str],
        loads: Sequence[int],
        guard: GuardState | None,
        at: float,
    ) -> list[Candidate]:
        if guard is None:
            return [Candidate(name=n, load=load) for n, load in zip(names, loads, strict=True)]
        predictive = guard.predictive
        if predictive is not None:
            pool = sum(loads)
            candidates = []
            for name, load in zip(names, loads, strict=True):
                seen = outlook(
                    predictive,
                    name,
                    inflight=load,
                    pool_inflight=pool,
                    body_bytes=request.body_bytes,
                    at=at,
                )
                candidates.append(
                    Candidate(name=name, load=load, room=seen.within_target, outlook=seen)
                )
            return candidates
        policy = guard.config.policy
        views = backend_views(names, guard.published, guard.traffic)
        return [
            Candidate(
                name=view.name,
                load=view.inflight,
                room=pig_room(view, target_user_tps=policy.user_tps_yellow),
                score=backend_score(
                    view,
                    capacity_ratio=policy.capacity_ratio,
                    target_user_tps=policy.user_tps_yellow,
                ),
            )
            for view in views
        ]

    def choose(
        self,
        request: RoutedRequest,
        names: Sequence[str],
        loads: Sequence[int],
        guard: GuardState | None,
        *,
        at: float,
    ) -> int:
        if self._ring is None or self._ring.names != tuple(names):
            self._ring = affinity_rules.build_ring(names)
        key = prefix_key(request.hash_ids, self.affinity_blocks)
        candidates = self._candidates(request, names, loads, guard, at)
        chosen = route(candidates, ring=self._ring, key=key, bound=self.bound)
        if chosen is None:  # never in a simulation: every backend is eligible
            return 0
        reason = str(chosen.reason)
        self._reasons[reason] = self._reasons.get(reason, 0) + 1
        return chosen.index

    def reasons(self) -> Mapping[str, int]:
        return dict(self._reasons)


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
