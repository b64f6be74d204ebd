"""The instruments the proxy adds to as things happen, and the page's fixed bucket lists.

Reads: nothing; the proxy calls ``inc``/``dec``/``observe`` on these as requests move.
Guarantees:
- the request path only ever adds to a number: one attribute lookup and one addition, no label
  lookup, no lock (trio runs the proxy and the scrape on one thread);
- histograms keep non-cumulative buckets; :meth:`EventHistogram.cumulative` turns them into
  the exposition's cumulative counts at scrape time;
- nothing here is a copy of core state: in-flight counts per backend, adaptive output samples
  and tier refusal deltas are the core's (``GuardState.traffic``, ``GuardState.published``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Final

from guard_core.backend_pick import REASONS
from guard_core.evaluation import SEMANTIC_TTFT_BUCKETS
from guard_core.lanes import Lane
from guard_core.tier import Tier

__all__ = (
    "BODY_BUCKETS_BYTES",
    "CONTENT_TYPE",
    "DISCONNECT_PHASES",
    "DURATION_BUCKETS_S",
    "PRIORITY_REWRITE_BUCKETS_S",
    "SEMANTIC_TTFT_SCAN_LIMIT_BYTES",
    "STATUS_CLASSES",
    "TIERS",
    "BackendMetrics",
    "EventCounter",
    "EventGauge",
    "EventHistogram",
    "LaneMetrics",
)

#: The ``Content-Type`` of the page, as PIG sends it.
CONTENT_TYPE: Final = "text/plain; version=0.0.4"
#: Buckets of every duration histogram (seconds): PIG uses one list for all of them.
DURATION_BUCKETS_S: Final = SEMANTIC_TTFT_BUCKETS
#: Buckets of ``pig_backend_priority_rewrite_duration_seconds``.
PRIORITY_REWRITE_BUCKETS_S: Final = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0,
)  # fmt: skip
#: Buckets of ``pig_request_body_bytes``.
BODY_BUCKETS_BYTES: Final = (16384, 65536, 131072, 524288, 1048576, 4194304, 16777216)
#: How far the semantic TTFT scanner reads without a useful event (spec 8.5).
SEMANTIC_TTFT_SCAN_LIMIT_BYTES: Final = 65536
#: ``pig_response_status_class_total``'s classes, by the status's hundreds digit (0: invalid).
STATUS_CLASSES: Final = ("0xx", "1xx", "2xx", "3xx", "4xx", "5xx")
DISCONNECT_PHASES: Final = ("queue", "upstream", "response")
TIERS: Final = (Tier.BASIC, Tier.PREMIUM)


class _Number:
    """One number the proxy adds to. ``inc`` is the whole hot-path cost."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float = 0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class EventCounter(_Number):
    """A count that only grows."""

    __slots__ = ()


class EventGauge(_Number):
    """A level the proxy moves up and down (in-flight counts)."""

    __slots__ = ()

    def dec(self, amount: float = 1) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class EventHistogram:
    """Observations in fixed buckets (non-cumulative here, made cumulative at scrape time)."""

    __slots__ = ("bounds", "buckets", "count", "max", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds: tuple[float, ...] = tuple(bounds)
        self.buckets = [0] * len(self.bounds)
        self.count = 0
        self.sum = 0.0
        self.max = 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        if value > self.max:  # noqa: PLR1730 - cheaper than calling max() on the hot path
            self.max = value
        # No len() call on the hot path; past the last bound only +Inf (the count) holds it.
        try:  # noqa: SIM105 - contextlib.suppress costs calls on every observation
            self.buckets[bisect_left(self.bounds, value)] += 1
        except IndexError:
            pass

    def observe_unknown(self) -> None:
        """Count an observation whose value is unknown: ``_count`` and ``+Inf`` only."""
        self.count += 1

    def cumulative(self) -> list[int]:
        running = 0
        result = []
        for value in self.buckets:
            running += value
            result.append(running)
        return result


class LaneMetrics:
    """Everything counted per lane (``pig_*{lane=...}``)."""

    __slots__ = ("accepted", "body_bytes", "duration", "inflight", "lane", "rejected", "statuses")

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        #: ``pig_requests_total{decision="accepted"}``.
        self.accepted = EventCounter()
        #: ``pig_requests_total{decision="rejected"}`` and ``pig_rejected_total{lane}``.
        self.rejected = EventCounter()
        self.inflight = EventGauge()
        #: ``pig_request_duration_seconds``; its count is ``pig_completed_total``.
        self.duration = EventHistogram(DURATION_BUCKETS_S)
        self.body_bytes = EventHistogram(BODY_BUCKETS_BYTES)
        #: ``pig_response_status_class_total``, indexed by the hundreds digit (0: invalid).
        self.statuses = [0] * len(STATUS_CLASSES)

    def complete(self, status: int, duration_s: float) -> None:
        """An admitted, accepted request finished with ``status`` (499: client went away)."""
        self.duration.observe(duration_s)
        self.statuses[status // 100 if 100 <= status <= 599 else 0] += 1

    def observe_body(self, content_length: int | None) -> None:
        """Record the request body size; an unknown length counts, but adds to no bucket."""
        if content_length is None or content_length < 0:
            self.body_bytes.observe_unknown()
        else:
            self.body_bytes.observe(content_length)


class BackendMetrics:
    """Everything counted per configured backend (``pig_backend_*{name=...}``); its in-flight
    count and its latest poll's figures are the core's."""

    __slots__ = (
        "accepted",
        "body_copy_errors",
        "completed",
        "name",
        "poll_failed",
        "proxy_errors",
        "routed",
        "upstream",
    )

    def __init__(self, name: str, upstream: str) -> None:
        self.name = name
        self.upstream = upstream
        #: ``pig_backend_requests_total{decision="accepted"}``: requests sent to it.
        self.accepted = EventCounter()
        #: ``pig_backend_requests_total{decision="failed"}``: failed *metrics polls* (PIG quirk).
        self.poll_failed = EventCounter()
        self.completed = EventCounter()
        self.proxy_errors = EventCounter()
        self.body_copy_errors = EventCounter()
        #: ``inference_guard_backend_routed_total{reason=...}``: picks of it, by what chose.
        self.routed = {reason: EventCounter() for reason in REASONS}
