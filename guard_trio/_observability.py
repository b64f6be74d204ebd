"""The guard's own ``/pig/metrics`` page: PIG's metric names, types and labels (spec 10.1-10.2).

Reads: event counts the proxy adds as things happen (through the attributes of
:class:`GuardMetrics`), each finished poll round (:meth:`GuardMetrics.record_poll` counts it),
and, at scrape time only, the guard's state from a ``state_provider`` and the settings.
Guarantees:
- every metric of spec 10.2 is on the page with PIG's name, type and label names; the dynamic
  block is left out when dynamic mode is off (PIG has no controller then), and the info metrics
  that PIG prints only when set (the poll error, the TTFT source, the state reasons) follow the
  same rule;
- the page is the table of :mod:`guard_trio._metrics_rows` and
  :mod:`guard_trio._metrics_dynamic_rows` rendered in order (:data:`SECTIONS`), and
  docs/observability.md is generated from the same table (``python tools/gen_metrics_docs.py``);
- whatever can be read from the state is read at scrape time: every poll figure from the value
  the core published after the latest round (``GuardState.published``: decision, snapshot,
  per-backend figures, TTFT window, tier deltas), in-flight counts per backend and the adaptive
  output samples from ``GuardState.traffic``; the shell keeps no copy of core state, and the
  request path only ever adds to a counter (:mod:`guard_trio._metrics_instruments`).

With ``DYNAMIC_POLICY=predictive`` a block of ``inference_guard_predictive_*`` families follows
the dynamic one: the predictions behind the latest cap and the latest verdict, the engine
model's fit, what the learner has learned of the traffic, and the refusals by binding
constraint; under PIG's learner the page is exactly PIG's. With flow control configured
(``PIG_PRIORITY_BANDS``, ``PIG_TENANT_HEADER``) an ``inference_guard_flow_*`` block ends the
page (:mod:`guard_trio._metrics_flow_rows`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Final

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from guard_adapters.config import Backend, Settings
from guard_adapters.exchange import refusal_counts
from guard_adapters.outcome import Admission, Bridge, Disconnect, ExchangeOutcome
from guard_core import GuardError, RejectCode
from guard_core.evaluation import BackendPoll
from guard_core.guard import GuardState
from guard_core.lanes import Lane, body_lane
from guard_core.predictive import Binding
from guard_core.tier import Tier
from guard_trio._http import fetch
from guard_trio._metrics_dynamic_rows import DYNAMIC_ROWS, PREDICTIVE_ROWS
from guard_trio._metrics_flow_rows import FLOW_ROWS
from guard_trio._metrics_instruments import (
    BODY_BUCKETS_BYTES,
    CONTENT_TYPE,
    DISCONNECT_PHASES,
    DURATION_BUCKETS_S,
    PRIORITY_REWRITE_BUCKETS_S,
    TIERS,
    BackendMetrics,
    EventCounter,
    EventGauge,
    EventHistogram,
    LaneMetrics,
)
from guard_trio._metrics_page import Section, render
from guard_trio._metrics_rows import (
    BACKEND_ROWS,
    CLASSIFIER_ROWS,
    HEALTH_ROWS,
    LANE_ROWS,
    POOL_ROWS,
    PRIORITY_ROWS,
    RUNTIME_ROWS,
)
from guard_trio._metrics_scrape import Scrape

__all__ = (
    "BODY_BUCKETS_BYTES",
    "CONTENT_TYPE",
    "DURATION_BUCKETS_S",
    "PRIORITY_REWRITE_BUCKETS_S",
    "SECTIONS",
    "BackendMetrics",
    "EventCounter",
    "EventGauge",
    "EventHistogram",
    "GuardMetrics",
    "LaneMetrics",
)

#: The whole page, in PIG's order: runtime, backends, dynamic, predictive, classifier,
#: priority, lanes; this guard's backend health and failure mode after the backends (only with
#: several backends or ``PIG_FAILURE_MODE=open``).
SECTIONS: Final[tuple[Section[Scrape], ...]] = (
    Section("runtime", RUNTIME_ROWS),
    Section("backends", BACKEND_ROWS),
    Section("health", HEALTH_ROWS, lambda s: len(s.settings.backends) > 1 or s.settings.fail_open),
    Section("pools", POOL_ROWS, lambda s: s.m.pooled),
    Section("dynamic", DYNAMIC_ROWS, lambda s: s.settings.dynamic_enabled),
    Section("predictive", PREDICTIVE_ROWS, lambda s: s.state.predictive is not None),
    Section("classifier", CLASSIFIER_ROWS),
    Section("priority", PRIORITY_ROWS),
    Section("lanes", LANE_ROWS),
    Section("flow", FLOW_ROWS, lambda s: s.state.flow is not None),
)


class _Collector:
    """Adapts :class:`GuardMetrics` to the registry's collector protocol."""

    def __init__(self, metrics: GuardMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(self._metrics.families())


class GuardMetrics:
    """The guard's metrics: event instruments for the proxy, the state read at scrape time.

    ``state_provider`` returns the guard's current state; ``clock`` must be the clock the
    guard's events are stamped with (the ``at`` of every event), ``wall_clock`` gives Unix
    time.
    """

    settings: Settings
    state: Callable[[], GuardState]
    version: str
    clock: Callable[[], float]
    wall_clock: Callable[[], float]
    started: float
    rejected: EventCounter
    queue_wait: EventHistogram
    tier_accepted: dict[Tier, EventCounter]
    tier_rejected: dict[Tier, EventCounter]
    client_disconnects: dict[str, EventCounter]
    dynamic_poll_ok: EventCounter
    dynamic_poll_failed: EventCounter
    backends: dict[str, BackendMetrics]
    classifier_inflight: EventGauge
    priority_rewrite_inflight: EventGauge
    priority_rewrite_duration: EventHistogram
    lanes: dict[Lane, LaneMetrics]
    predictive_refusals: dict[Binding, EventCounter]
    #: ``PIG_POOLS``: whether there are pools, each pool's name and state, and the state of
    #: the pool a backend belongs to.
    pooled: bool
    pool_states: Callable[[], tuple[tuple[str, GuardState], ...]]
    state_of_backend: Callable[[str], GuardState]

    def __init__(
        self,
        settings: Settings,
        state_provider: Callable[[], GuardState],
        *,
        version: str,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.state = state_provider
        self.version = version
        self.clock = clock
        self.wall_clock = wall_clock
        self.started = clock()
        self._routing = settings.backend_routing

        # runtime
        #: ``pig_rejected_total`` (no labels): 429s from the QoS gate or the priority rewrite.
        self.rejected = EventCounter()
        self.queue_total = EventCounter()
        #: Waits that ended without a slot, client cancels included.
        self.queue_timeout = EventCounter()
        #: ``pig_queue_wait_seconds``: every wait longer than 0, admitted or not.
        self.queue_wait = EventHistogram(())
        self.tier_accepted = {tier: EventCounter() for tier in TIERS}
        self.tier_rejected = {tier: EventCounter() for tier in TIERS}
        self.sse_keepalive_streams = EventCounter()
        self.sse_keepalive_comments = EventCounter()
        self.sse_bridge_streams = EventCounter()
        self.sse_bridge_upstream_errors = EventCounter()
        self.sse_bridge_invalid_upstream = EventCounter()
        self.sse_bridge_copy_errors = EventCounter()
        self.semantic_ttft_scan_limit = EventCounter()
        self.proxy_upstream_errors = EventCounter()
        self.proxy_body_copy_errors = EventCounter()
        self.client_disconnects = {phase: EventCounter() for phase in DISCONNECT_PHASES}
        self.disconnect_queue = self.client_disconnects["queue"]
        self.disconnect_upstream = self.client_disconnects["upstream"]
        self.disconnect_response = self.client_disconnects["response"]
        self.client_disconnect_upstream_cancellations = EventCounter()
        self.dynamic_poll_ok = EventCounter()
        self.dynamic_poll_failed = EventCounter()
        self.backend_unavailable = EventCounter()
        self.decision_duration = EventHistogram(DURATION_BUCKETS_S)
        self.proxy_ttfb = EventHistogram(DURATION_BUCKETS_S)
        self.proxy_total_duration = EventHistogram(DURATION_BUCKETS_S)
        self.internal_overhead = EventHistogram(DURATION_BUCKETS_S)
        # per backend, in configuration order
        self.backends = {b.name: BackendMetrics(b.name, b.upstream) for b in settings.backends}
        # classifier
        self.classifier_inflight = EventGauge()
        self.classifier_rejected = EventCounter()
        # priority
        self.priority_rewrite_inflight = EventGauge()
        self.priority_rewrites = EventCounter()
        self.priority_skipped = EventCounter()
        self.priority_failed = EventCounter()
        self.priority_rewrite_duration = EventHistogram(PRIORITY_REWRITE_BUCKETS_S)
        self._priority_counters = {
            "rewritten": self.priority_rewrites,
            "skipped": self.priority_skipped,
            "failed": self.priority_failed,
        }
        self._body_thresholds = settings.lane_thresholds.body
        # lanes, in PIG's order (global first)
        self.lanes = {lane: LaneMetrics(lane) for lane in Lane}
        # the predictive learner: 429s by the constraint that refused them
        self.predictive_refusals = {binding: EventCounter() for binding in Binding}
        # flow control: admissions by band and outcome (bands are few and configured)
        self.band_outcomes: dict[tuple[str, str], EventCounter] = {}

        # With ``PIG_POOLS`` the server sets these; the PIG families describe the first pool.
        self.pooled, self.pool_states, self.state_of_backend = (
            False,
            lambda: (),
            lambda _name: state_provider(),
        )

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    def record_poll(self, polls: Sequence[BackendPoll]) -> None:
        """Count one finished poll round (ok when any backend answered) and each configured
        backend whose metrics fetch failed; everything else the page shows of a poll is read
        from the value the core published."""
        ok = any(poll.sample is not None for poll in polls)
        (self.dynamic_poll_ok if ok else self.dynamic_poll_failed).inc()
        if not self._routing:
            return
        for poll in polls:
            backend = self.backends.get(poll.name)
            # A backend without a metrics URL counts as failed but is not a fetch failure.
            if poll.sample is None and backend is not None and self._has_metrics_url(poll.name):
                backend.poll_failed.inc()

    def record_exchange(self, outcome: ExchangeOutcome) -> None:
        """Count how one exchange ended (each fact of the outcome moves its counters once);
        moments and levels (admissions accepted, in-flight gauges, keep-alive comments) are
        counted by the proxy as they happen."""
        if outcome.admitted_path:
            self.lanes[body_lane(outcome.body_bytes, self._body_thresholds)].observe_body(
                outcome.body_bytes
            )
        waited = outcome.waited_s
        if outcome.decision_s is not None:
            self.decision_duration.observe(outcome.decision_s)
            if waited > 0:
                self.queue_total.inc()
                self.queue_wait.observe(waited)
        if outcome.admission is Admission.ABANDONED:
            self.queue_timeout.inc()
        if outcome.band and outcome.admission is not None:
            key = (outcome.band, outcome.admission.value)
            counted = self.band_outcomes.get(key)
            if counted is None:
                counted = self.band_outcomes[key] = EventCounter()
            counted.inc()
        if outcome.disconnect is not None:
            self.client_disconnects[outcome.disconnect.value].inc()
            if outcome.disconnect is not Disconnect.QUEUE:
                self.client_disconnect_upstream_cancellations.inc()
        if outcome.code is not None and outcome.tier is not None:
            queued = outcome.admission is Admission.REFUSED and waited > 0
            self._count_refusal(outcome, outcome.tier, outcome.code, waited=queued)
        if outcome.served_s is not None:
            status = outcome.status
            self.lanes[outcome.lane].complete(status, outcome.served_s)
            self.lanes[Lane.GLOBAL].complete(status, outcome.served_s)
        if outcome.overhead_s is not None:
            self.internal_overhead.observe(outcome.overhead_s)
        self._count_relay(outcome)
        for name in outcome.priority:
            self._priority_counters[name].inc()
        if outcome.priority_rewrite_s is not None:
            self.priority_rewrite_duration.observe(outcome.priority_rewrite_s)

    def _count_refusal(
        self, outcome: ExchangeOutcome, tier: Tier, code: RejectCode, *, waited: bool
    ) -> None:
        """PIG's reject accounting (spec 4.4), and the predictive learner's by constraint."""
        counts = refusal_counts(tier, outcome.lane, code, waited=waited, binding=outcome.binding)
        if counts.queue_timeout:
            self.queue_timeout.inc()
        if counts.binding is not None:
            self.predictive_refusals[counts.binding].inc()
        if counts.backend_unavailable:
            self.backend_unavailable.inc()
        if counts.tier is not None:
            self.tier_rejected[counts.tier].inc()
            self.rejected.inc()
        if counts.lane is not None:
            self.lanes[counts.lane].rejected.inc()

    def _count_relay(self, outcome: ExchangeOutcome) -> None:
        """What the backend side of an exchange did."""
        if outcome.ttfb_s is not None:
            self.proxy_ttfb.observe(outcome.ttfb_s)
        if outcome.upstream_errors:
            self.proxy_upstream_errors.inc(outcome.upstream_errors)
        if outcome.mid_response_failure:
            self.proxy_body_copy_errors.inc()
        if outcome.keepalive_stream:
            self.sse_keepalive_streams.inc()
        bridge = outcome.bridge
        if bridge is not None:
            self.sse_bridge_streams.inc()
            if bridge is Bridge.INVALID_UPSTREAM:
                self.sse_bridge_invalid_upstream.inc()
            elif bridge is Bridge.UPSTREAM_ERROR:
                self.sse_bridge_upstream_errors.inc()
        backend = self.backends.get(outcome.backend) if outcome.backend is not None else None
        if backend is None:
            return
        backend.completed.inc()
        if outcome.proxy_s is not None:
            self.proxy_total_duration.observe(outcome.proxy_s)
        if outcome.backend_failed:
            backend.proxy_errors.inc()
            if outcome.mid_response_failure:
                backend.body_copy_errors.inc()

    def _has_metrics_url(self, name: str) -> bool:
        return any(b.name == name and b.metrics_url for b in self.settings.backends)

    # -- exposition ----------------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The page served at ``/pig/metrics`` (``Content-Type``: :data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry)

    def families(self) -> list[Metric]:
        """Every family of one scrape, in table order (:data:`SECTIONS`)."""
        return list(render(SECTIONS, Scrape(self)))


_BACKEND_PAGE_LIMIT = 16 * 1024 * 1024


async def backend_pages(local: bytes, backends: Sequence[Backend]) -> bytes:
    """``/v1/metrics``: the guard's own page, then each backend's (fetched now, 2 s each)."""
    parts = [local, b"\n# --- Backend Metrics ---\n"]
    fetched = 0
    for backend in backends:
        if not backend.metrics_url:
            parts.append(f"# backend {backend.name} metrics URL is empty\n".encode())
            continue
        parts.append(f"\n# --- backend {backend.name} {backend.metrics_url} ---\n".encode())
        try:
            response = await fetch(
                backend.metrics_url, timeout_s=2.0, max_bytes=_BACKEND_PAGE_LIMIT
            )
        except (trio.TooSlowError, GuardError) as exc:
            reason = "timed out" if isinstance(exc, trio.TooSlowError) else str(exc)
            parts.append(f"# failed to fetch backend metrics: {reason}\n".encode())
            continue
        if response.status != 200:
            parts.append(f"# backend metrics status {response.status}\n".encode())
            continue
        fetched += 1
        body = response.body
        parts.append(body if body.endswith(b"\n") else body + b"\n")
    if fetched == 0:
        parts.append(b"# no backend metrics were fetched\n")
    return b"".join(parts)
