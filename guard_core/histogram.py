"""Windows and quantiles of cumulative latency histograms (spec 5.1, 5.4).

Reads: two cumulative histograms of the same series (the previous and the current scrape), or
one window.
Guarantees:
- a window exists only when the series moved forward: no count, sum or bucket went down and at
  least one new observation arrived; otherwise there is no window (``None``), never a negative one;
- a quantile is the upper bound of the first bucket that holds it; when only the ``+Inf`` bucket
  holds it, twice the largest finite bound; with no finite bound at all, the average stands in.
"""

from __future__ import annotations

import math

import attrs

from guard_core.observations import Histogram

__all__ = ("LatencySummary", "merge", "summarise", "window")


def window(previous: Histogram | None, current: Histogram) -> Histogram | None:
    """Observations between two scrapes, or ``None`` when there is no valid window.

    With no previous scrape the whole current histogram is the window.
    """
    if previous is None:
        return current if current.count > 0 else None
    count = current.count - previous.count
    total = current.sum - previous.sum
    if count <= 0 or total < 0:
        return None
    earlier = dict(previous.buckets)
    buckets = []
    for bound, cumulative in current.buckets:
        delta = cumulative - earlier.get(bound, 0.0)
        if delta < 0:
            return None
        buckets.append((bound, delta))
    return Histogram(tuple(buckets), count, total)


def merge(histograms: tuple[Histogram, ...]) -> Histogram | None:
    """Add histograms bound by bound (several backends' windows into one)."""
    if not histograms:
        return None
    if len(histograms) == 1:
        return histograms[0]
    per_bound: dict[float, float] = {}
    for histogram in histograms:
        for bound, cumulative in histogram.buckets:
            per_bound[bound] = per_bound.get(bound, 0.0) + cumulative
    return Histogram(
        tuple(per_bound.items()),
        sum(h.count for h in histograms),
        sum(h.sum for h in histograms),
    )


@attrs.frozen
class LatencySummary:
    """Average and tail latency of one window, in seconds."""

    count: float
    avg: float
    p95: float
    p99: float


def _quantile(histogram: Histogram, q: float) -> float | None:
    needed = math.ceil(histogram.count * q)
    finite = histogram.finite_buckets
    if not finite:
        return None
    for bound, cumulative in histogram.buckets:
        if cumulative >= needed:
            return 2 * finite[-1][0] if math.isinf(bound) else bound
    return 2 * finite[-1][0]


def summarise(histogram: Histogram) -> LatencySummary | None:
    """Average, p95 and p99 of a window; ``None`` for an empty window."""
    if histogram.count <= 0:
        return None
    avg = histogram.sum / histogram.count
    p95 = _quantile(histogram, 0.95)
    if p95 is None:
        return LatencySummary(histogram.count, avg, avg, avg)
    p99 = _quantile(histogram, 0.99)
    return LatencySummary(histogram.count, avg, p95, p95 if p99 is None else p99)
