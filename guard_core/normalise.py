"""Per-backend normalisation and aggregation of one poll (spec 5.1).

Reads: each backend's current sample and its previous status (the sample and time of its last
poll, and whether that poll failed).
Guarantees:
- rates and deltas come from one backend's own counters, before anything is summed, so one
  backend's counter reset (or first poll, or failed previous poll) makes only that backend's rate
  invalid for this poll and never disturbs the others;
- aggregation sums running, waiting, raw counters and the valid rates and deltas, takes the
  highest KV usage, and merges TTFT windows bound by bound; a rate or delta is valid in the
  aggregate when at least one backend's was.
"""

from __future__ import annotations

import attrs

from guard_core import histogram
from guard_core.observations import BackendSample, Histogram

__all__ = ("Aggregate", "BackendStatus", "NormalisedSample", "aggregate", "normalise")


@attrs.frozen(kw_only=True)
class BackendStatus:
    """What the learner remembers of one backend between polls."""

    at: float
    failed: bool
    sample: BackendSample | None = None


@attrs.frozen(kw_only=True)
class NormalisedSample:
    """One backend's poll with its rates computed against its own previous poll."""

    running: float
    waiting: float
    kv_usage: float
    preemptions: float
    generation_tokens: float
    #: tok/s over the last interval, or ``None`` when no valid rate exists this poll.
    generation_tps: float | None
    #: Preemptions since the last poll, or ``None`` when not computable this poll.
    preemption_delta: float | None
    #: TTFT observations since the last poll, or ``None``.
    ttft_window: Histogram | None


def _usable_previous(previous: BackendStatus | None) -> BackendSample | None:
    if previous is None or previous.failed:
        return None
    return previous.sample


def normalise(
    previous: BackendStatus | None, sample: BackendSample, *, at: float
) -> NormalisedSample:
    """Rates and deltas of ``sample`` against the same backend's previous poll."""
    before = _usable_previous(previous)
    generation = sample.generation_tokens
    rate: float | None = None
    if generation is None:
        rate = sample.generation_tps
    elif before is not None and before.generation_tokens is not None and previous is not None:
        elapsed = at - previous.at
        if elapsed > 0 and generation >= before.generation_tokens:
            rate = (generation - before.generation_tokens) / elapsed
    preemptions = sample.preemptions
    delta: float | None = None
    earlier = before.preemptions if before is not None else None
    if preemptions is not None and earlier is not None and preemptions >= earlier:
        delta = preemptions - earlier
    ttft_window: Histogram | None = None
    if sample.ttft is not None and before is not None and before.ttft is not None:
        ttft_window = histogram.window(before.ttft, sample.ttft)
    return NormalisedSample(
        running=sample.running or 0.0,
        waiting=sample.waiting or 0.0,
        kv_usage=sample.kv_usage or 0.0,
        preemptions=preemptions or 0.0,
        generation_tokens=generation or 0.0,
        generation_tps=rate,
        preemption_delta=delta,
        ttft_window=ttft_window,
    )


@attrs.frozen(kw_only=True)
class Aggregate(NormalisedSample):
    """The healthy backends of one poll, combined: one backend's figures, summed across them."""


def aggregate(samples: tuple[NormalisedSample, ...]) -> Aggregate:
    """Combine the normalised samples of the backends that answered this poll."""
    rates = [s.generation_tps for s in samples if s.generation_tps is not None]
    deltas = [s.preemption_delta for s in samples if s.preemption_delta is not None]
    windows = tuple(s.ttft_window for s in samples if s.ttft_window is not None)
    return Aggregate(
        running=sum(s.running for s in samples),
        waiting=sum(s.waiting for s in samples),
        kv_usage=max((s.kv_usage for s in samples), default=0.0),
        preemptions=sum(s.preemptions for s in samples),
        generation_tokens=sum(s.generation_tokens for s in samples),
        generation_tps=sum(rates) if rates else None,
        preemption_delta=sum(deltas) if deltas else None,
        ttft_window=histogram.merge(windows),
    )
