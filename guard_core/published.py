"""The one value the core publishes after each poll round (what every reader of a poll reads).

Reads: the poll round (each backend's answer and the normalised sample the evaluation computed
for it), the decision the gate now holds and the snapshot behind it, the guard's cumulative
semantic TTFT histogram, its cumulative tier refusals and the tier queues at the poll, and the
value published after the previous round.
Guarantees:
- one frozen value per round, built by :func:`publish` from figures the evaluation already
  computed: nothing is normalised twice, and the metrics page, the status line and backend
  choice all read the same decision and the same snapshot;
- per backend: the figures of its latest good poll (running, waiting, KV usage, generation
  rate, its own TTFT window), whether its latest poll failed and when it was last polled; a
  backend whose poll fails keeps the figures of its previous good one;
- the TTFT window behind the learner's smoothed values: the guard's own semantic histogram
  since the previous good round when that is the learner's source, the backends' merged windows
  when they are;
- the tier refusals since the previous good round (the whole count on the first good round,
  as PIG), and the tier queues at the poll;
- after a round where every backend failed: no snapshot, the failures joined in ``error``,
  zero deltas and queues; the reference points of the deltas and the window are kept.
"""

from __future__ import annotations

import attrs

from guard_core import histogram
from guard_core.decision import PublishedDecision
from guard_core.evaluation import BackendPoll, Snapshot
from guard_core.histogram import LatencySummary
from guard_core.normalise import NormalisedSample
from guard_core.observations import Histogram
from guard_core.ttft_learner import TtftSource

__all__ = ("BackendFigures", "Published", "publish")


@attrs.frozen(kw_only=True)
class BackendFigures:
    """One backend as the core last saw it."""

    name: str
    #: Its latest poll failed.
    failed: bool = False
    #: When it was last polled (seconds since start).
    updated_at: float | None = None
    #: The figures of its latest good poll.
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    #: tok/s over its last poll interval; ``None`` when no valid rate was known.
    generation_tps: float | None = None
    #: Its own TTFT window over its last poll interval; ``None`` when not valid.
    ttft: LatencySummary | None = None


@attrs.frozen(kw_only=True)
class Published:
    """What the latest poll round published."""

    decision: PublishedDecision
    #: The learner's evaluation behind ``decision``; ``None`` before the first good round and
    #: after a round where every backend failed.
    snapshot: Snapshot | None = None
    #: Why the latest round failed ("" when a backend answered).
    error: str = ""
    #: Every backend polled so far, in the order first seen.
    backends: tuple[BackendFigures, ...] = ()
    #: The TTFT window behind the learner's smoothed values this round.
    ttft: LatencySummary | None = None
    #: Tier refusals since the previous good round: ``(basic, premium)``.
    tier_reject_delta: tuple[int, int] = (0, 0)
    #: Requests waiting per tier at the poll: ``(basic, premium)``.
    tier_waiting: tuple[int, int] = (0, 0)
    #: Reference points for the next round: the semantic histogram and the tier refusals at
    #: the latest good round (``None`` before the first).
    semantic_at_poll: Histogram | None = None
    tier_rejects_at_poll: tuple[int, int] | None = None

    def backend(self, name: str) -> BackendFigures | None:
        for figures in self.backends:
            if figures.name == name:
                return figures
        return None


def _figures(
    previous: BackendFigures | None,
    poll: BackendPoll,
    sample: NormalisedSample | None,
    *,
    at: float,
) -> BackendFigures:
    if sample is None:
        kept = previous or BackendFigures(name=poll.name)
        return attrs.evolve(kept, failed=True, updated_at=at)
    window = sample.ttft_window
    return BackendFigures(
        name=poll.name,
        failed=False,
        updated_at=at,
        running=int(sample.running),
        waiting=int(sample.waiting),
        kv_usage=sample.kv_usage,
        generation_tps=sample.generation_tps,
        ttft=histogram.summarise(window) if window is not None else None,
    )


def _delta(now: tuple[int, int], then: tuple[int, int] | None) -> tuple[int, int]:
    basic, premium = (
        count - before if then is not None and count >= before else count
        for count, before in zip(now, then or (0, 0), strict=True)
    )
    return basic, premium


def publish(
    previous: Published,
    polls: tuple[BackendPoll, ...],
    normalised: tuple[NormalisedSample | None, ...],
    *,
    decision: PublishedDecision,
    snapshot: Snapshot | None,
    semantic: Histogram | None,
    tier_rejects: tuple[int, int],
    tier_waiting: tuple[int, int],
    at: float,
) -> Published:
    """The value to publish after one round; ``normalised`` is aligned with ``polls``."""
    known = {figures.name: figures for figures in previous.backends}
    for poll, sample in zip(polls, normalised, strict=True):
        known[poll.name] = _figures(known.get(poll.name), poll, sample, at=at)
    backends = tuple(known.values())
    if all(sample is None for sample in normalised) or snapshot is None:
        errors = "; ".join(f"{p.name}: {p.error}" if p.error else p.name for p in polls)
        return attrs.evolve(
            previous,
            decision=decision,
            snapshot=None,
            error=errors or "no metrics source answered",
            backends=backends,
            ttft=None,
            tier_reject_delta=(0, 0),
            tier_waiting=(0, 0),
        )
    window: Histogram | None = None
    source = snapshot.ttft.source
    if source is TtftSource.SEMANTIC and semantic is not None:
        window = histogram.window(previous.semantic_at_poll, semantic)
    elif source is TtftSource.BACKEND:
        window = histogram.merge(
            tuple(s.ttft_window for s in normalised if s is not None and s.ttft_window is not None)
        )
    return Published(
        decision=decision,
        snapshot=snapshot,
        backends=backends,
        ttft=histogram.summarise(window) if window is not None else None,
        tier_reject_delta=_delta(tier_rejects, previous.tier_rejects_at_poll),
        tier_waiting=tier_waiting,
        semantic_at_poll=semantic,
        tier_rejects_at_poll=tier_rejects,
    )
