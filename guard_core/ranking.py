"""Ranking a pool's backends for one request by its predicted outcome there.

Reads: one :class:`Candidate` per backend of the pool, in configuration order: whether it may
take work at all (not ejected, not marked full), whether it has room (its own capacity is not
used up), its load (requests in flight to it), and what is known of the request's outcome
there: the predictive learner's :class:`~guard_core.backend_prediction.BackendOutlook`
(``DYNAMIC_POLICY=predictive``) or PIG's load score from :mod:`guard_core.backend_choice`
(lower is better).

The order (best first):

1. with an outlook: the backends whose predicted TTFT excess is within the target come first;
   among them, when the runtime knows each backend's pending prefill (the prompt tokens sent
   to it still without a first token: what a new request queues behind), the least pending
   first, then the lightest load (a faster engine clears its queue sooner, so it takes more
   of the work; the predicted speed still decides who has room), else by predicted per-user
   speed, fastest first; the others after them, by predicted TTFT, soonest first;
2. with a score only: by score, lowest first;
3. with neither: by pending prefill when known, least first, then by load, lightest first.

Equal ranks keep configuration order.

Guarantees: pure; :func:`best` returns an index into the candidates, never that of an
ineligible backend while an eligible one exists, preferring those with room, and ``None`` only
when no backend is eligible; a backend whose outlook predicts a slower speed (with the TTFT
within target on both, and no pending prefill known) ranks after one predicting a faster
one.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from guard_core.backend_choice import BackendView
from guard_core.backend_prediction import BackendOutlook

__all__ = ("Candidate", "best", "pig_room", "rank_key", "ranked")


@attrs.frozen(kw_only=True)
class Candidate:
    """One backend as the router sees it for one request."""

    name: str
    #: May take work at all (not ejected, not marked full by an engine's queue-full answer).
    eligible: bool = True
    #: Its own capacity has room for one more (predictive: the outlook is within target; PIG:
    #: :func:`pig_room`).
    room: bool = True
    #: Requests in flight to it.
    load: int = 0
    outlook: BackendOutlook | None = None
    #: PIG's :func:`~guard_core.backend_choice.backend_score` (lower is better).
    score: float | None = None
    #: Prompt tokens sent to it still waiting for their first token (``None``: not known).
    pending_tokens: float | None = None
    #: Prompt tokens of this request its prefix cache is expected to hold (0: none known).
    cached_tokens: float = 0.0


def pig_room(view: BackendView, *, target_user_tps: float) -> bool:
    """Under PIG's learner, whether a backend has room: its engine reports nothing waiting, and
    its running requests get at least ``target_user_tps`` each (its generation rate over its
    running count at the latest poll; an idle backend, or one without a rate, has room). A
    slow or throttled backend loses its room at a lighter load than its peers."""
    if view.waiting > 0:
        return False
    if view.running == 0 or view.generation_tps is None:
        return True
    return view.generation_tps / view.running >= target_user_tps


def rank_key(candidate: Candidate) -> tuple[int, float, float]:
    """The sort key of a candidate: smaller is better (see the module notes)."""
    seen = candidate.outlook
    if seen is not None:
        if not seen.ttft_within:
            return (1, seen.ttft_s, 0.0)
        if candidate.pending_tokens is None:
            return (0, -seen.user_tps, 0.0)
        return (0, candidate.pending_tokens, float(candidate.load))
    if candidate.score is not None:
        return (0, candidate.score, 0.0)
    return (0, candidate.pending_tokens or 0.0, float(candidate.load))


def ranked(candidates: Sequence[Candidate]) -> tuple[int, ...]:
    """Indices of the eligible candidates, best first: those with room, then the others."""
    order = sorted(
        (index for index, candidate in enumerate(candidates) if candidate.eligible),
        key=lambda index: (not candidates[index].room, rank_key(candidates[index]), index),
    )
    return tuple(order)


def best(candidates: Sequence[Candidate]) -> int | None:
    """The best-ranked eligible candidate (one with room when any has); ``None`` when none is
    eligible."""
    order = ranked(candidates)
    return order[0] if order else None
