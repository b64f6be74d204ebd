"""The guard's own ``/pig/metrics`` page: PIG's metric names, types and labels (spec 10.1-10.2).

Reads: event counts the proxy adds as things happen (through the attributes of
:class:`GuardMetrics`), each finished poll round (:meth:`GuardMetrics.record_poll`), and, at
scrape time only, the guard's state from a ``state_provider`` and the settings.
Guarantees:
- every metric of spec 10.2 is on the page with PIG's name, type and label names; the dynamic
  block is left out when dynamic mode is off (PIG has no controller then), and the info metrics
  that PIG prints only when set (the poll error, the TTFT source, the state reasons) follow the
  same rule;
- the text is written by ``prometheus_client`` from a private :class:`CollectorRegistry`;
  unlike PIG it carries ``# HELP``/``# TYPE`` lines, and counters carry no ``_created`` series
  because the collector builds its families itself;
- ``pig_rejected_total`` is one counter family holding both the unlabelled total and one sample
  per lane, which ``prometheus_client``'s own ``Counter`` cannot register;
- whatever can be read from the state is read at scrape time (queue, tiers, every
  ``pig_dynamic_*`` value, configuration echoes), so the request path only ever adds to a
  counter: one attribute lookup and one integer addition, no label lookup, no lock (trio runs
  the proxy and the scrape on one thread);
- histogram buckets are PIG's, and bounds are written in their shortest form (``le="1"``).

With ``DYNAMIC_POLICY=predictive`` a block of ``inference_guard_predictive_*`` families follows
the dynamic one: the predictions behind the latest cap and the latest verdict, the engine
model's fit, what the learner has learned of the traffic, and the refusals by binding
constraint; under PIG's learner the page is exactly PIG's.

Values the core does not keep and that are rebuilt here (see the comments where they are
emitted): the TTFT window of the latest poll, per-backend rates and TTFT windows, the tier
reject deltas and waiting counts at the poll, the capacity projection and the TTFT and pressure
target reasons.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import Final

import attrs
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from guard_adapters.config import Settings
from guard_adapters.status_line import (
    BackendDetail,
    RuntimeCounts,
    current_snapshot,
)
from guard_core import histogram as latency
from guard_core.composition import CapComponents
from guard_core.decision import PublishedDecision
from guard_core.evaluation import SEMANTIC_TTFT_BUCKETS, BackendPoll, Snapshot
from guard_core.gate import MAX_SHORT_WAIT_S, current_limit
from guard_core.guard import GuardState
from guard_core.lanes import Lane, Thresholds
from guard_core.normalise import BackendStatus, normalise
from guard_core.observations import Histogram
from guard_core.predictive import Binding, FitSummary, Prediction, PredictiveState
from guard_core.signals import Confidence, PollSignals
from guard_core.throughput_learner import ThroughputState
from guard_core.tier import Tier, basic_limit, premium_reserved
from guard_core.ttft_learner import TtftSource, TtftState

__all__ = (
    "BODY_BUCKETS_BYTES",
    "CONTENT_TYPE",
    "DURATION_BUCKETS_S",
    "PRIORITY_REWRITE_BUCKETS_S",
    "BackendMetrics",
    "BackendObservation",
    "EventCounter",
    "EventGauge",
    "EventHistogram",
    "GuardMetrics",
    "LaneMetrics",
)

#: The ``Content-Type`` of the page, as PIG sends it.
CONTENT_TYPE: Final = "text/plain; version=0.0.4"
#: Buckets of every duration histogram (seconds): PIG uses one list for all of them.
DURATION_BUCKETS_S: Final = SEMANTIC_TTFT_BUCKETS
#: Buckets of ``pig_backend_priority_rewrite_duration_seconds``.
PRIORITY_REWRITE_BUCKETS_S: Final = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.0,
    5.0,
)
#: Buckets of ``pig_request_body_bytes``.
BODY_BUCKETS_BYTES: Final = (16384, 65536, 131072, 524288, 1048576, 4194304, 16777216)
#: How far the semantic TTFT scanner reads without a useful event (spec 8.5).
SEMANTIC_TTFT_SCAN_LIMIT_BYTES: Final = 65536
#: ``JSON_CLASSIFY_LIMIT`` and ``BACKEND_PRIORITY_REWRITE_LIMIT`` when not set.
_DEFAULT_SLOTS: Final = 64
_STATUS_CLASSES: Final = ("0xx", "1xx", "2xx", "3xx", "4xx", "5xx")
_DISCONNECT_PHASES: Final = ("queue", "upstream", "response")
_TIERS: Final = (Tier.BASIC, Tier.PREMIUM)


# -- instruments the proxy adds to ------------------------------------------------------------


class EventCounter:
    """A count that only grows. ``inc`` is the whole hot-path cost."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float = 0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class EventGauge:
    """A level the proxy moves up and down (in-flight counts)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float = 0

    def inc(self, amount: float = 1) -> None:
        self.value += amount

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
        index = bisect_left(self.bounds, value)
        if index < len(self.buckets):
            self.buckets[index] += 1

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
        self.statuses = [0] * len(_STATUS_CLASSES)

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


@attrs.frozen(kw_only=True)
class BackendObservation:
    """One backend as its latest good poll showed it (routing mode only)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    generation_tps: float | None = None
    ttft: latency.LatencySummary | None = None


class BackendMetrics:
    """Everything counted per configured backend (``pig_backend_*{name=...}``)."""

    __slots__ = (
        "accepted",
        "body_copy_errors",
        "completed",
        "inflight",
        "name",
        "observed",
        "poll_failed",
        "proxy_errors",
        "upstream",
    )

    def __init__(self, name: str, upstream: str) -> None:
        self.name = name
        self.upstream = upstream
        self.inflight = EventGauge()
        #: ``pig_backend_requests_total{decision="accepted"}``: requests sent to it.
        self.accepted = EventCounter()
        #: ``pig_backend_requests_total{decision="failed"}``: failed *metrics polls* (PIG quirk).
        self.poll_failed = EventCounter()
        self.completed = EventCounter()
        self.proxy_errors = EventCounter()
        self.body_copy_errors = EventCounter()
        self.observed = BackendObservation()


@attrs.frozen(kw_only=True)
class _PollFigures:
    """What the latest poll round showed beyond the core's snapshot."""

    ok: bool = False
    error: str = ""
    ttft: latency.LatencySummary | None = None
    tier_reject_delta: tuple[int, int] = (0, 0)
    tier_waiting: tuple[int, int] = (0, 0)


# -- the exposition ---------------------------------------------------------------------------

_Labels = Mapping[str, str]


def _bound(value: float) -> str:
    """A bucket bound in its shortest form: ``1``, ``0.25``, ``1800``."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class _Page:
    """The families of one scrape, in order."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def _family(self, name: str, doc: str, kind: str) -> Metric:
        family = Metric(name, doc, kind)
        self.families.append(family)
        return family

    def gauge(self, name: str, doc: str, value: float) -> None:
        self._family(name, doc, "gauge").add_sample(name, {}, float(value))

    def flag(self, name: str, doc: str, value: bool) -> None:
        self.gauge(name, doc, 1 if value else 0)

    def table(self, rows: Iterable[tuple[str, str, float]]) -> None:
        """One unlabelled gauge per ``(name, doc, value)``; booleans are written 0/1."""
        for name, doc, value in rows:
            self.gauge(name, doc, value)

    def gauges(self, name: str, doc: str, rows: Iterable[tuple[_Labels, float]]) -> None:
        family = self._family(name, doc, "gauge")
        for labels, value in rows:
            family.add_sample(name, dict(labels), float(value))

    def info(self, name: str, doc: str, *label_sets: _Labels) -> None:
        """An info metric: a gauge at 1 per label set; left out when there is none."""
        if label_sets:
            self.gauges(name, doc, ((labels, 1) for labels in label_sets))

    def counter(self, name: str, doc: str, value: float) -> None:
        self.counters(name, doc, (({}, value),))

    def counters(self, name: str, doc: str, rows: Iterable[tuple[_Labels, float]]) -> None:
        family = self._family(name.removesuffix("_total"), doc, "counter")
        for labels, value in rows:
            family.add_sample(name, dict(labels), float(value))

    def summary(self, name: str, doc: str, count: float, total: float) -> None:
        family = self._family(name, doc, "summary")
        family.add_sample(name + "_count", {}, float(count))
        family.add_sample(name + "_sum", {}, float(total))

    def histogram(
        self,
        name: str,
        doc: str,
        rows: Iterable[tuple[_Labels, Sequence[float], Sequence[float], float, float]],
    ) -> None:
        """``rows``: (labels, bounds, cumulative counts, count, sum); ``+Inf`` is the count.

        PIG's order is kept: ``_count``, ``_sum``, then the buckets.
        """
        family = self._family(name, doc, "histogram")
        for labels, bounds, cumulative, count, total in rows:
            base = dict(labels)
            family.add_sample(name + "_count", base, float(count))
            family.add_sample(name + "_sum", base, float(total))
            for bound, value in zip(bounds, cumulative, strict=True):
                family.add_sample(name + "_bucket", {**base, "le": _bound(bound)}, float(value))
            family.add_sample(name + "_bucket", {**base, "le": "+Inf"}, float(count))

    def event_histogram(self, name: str, doc: str, histogram: EventHistogram) -> None:
        self.histogram(
            name,
            doc,
            (({}, histogram.bounds, histogram.cumulative(), histogram.count, histogram.sum),),
        )


class _Collector:
    """Adapts :class:`GuardMetrics` to the registry's collector protocol."""

    def __init__(self, metrics: GuardMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(self._metrics.families())


# A snapshot with every value at zero, standing in before the first good poll and after a round
# where every backend failed (PIG publishes an error snapshot with no learner detail then).
_NO_SIGNALS: Final = PollSignals(
    at=0.0,
    base=0,
    previous_is_metrics=False,
    previous_cap=0,
    running=0,
    waiting=0,
    kv_usage=0.0,
    decode=0,
    protected=0,
    freeze=False,
    transition=False,
    preemption_delta=0.0,
    generation_tps=None,
    smoothed_tps=0.0,
    qos_tps=0.0,
    qos_tps_valid=False,
    queue=0,
    reject_delta=0,
    tier_demand=False,
    capacity_demand=False,
    raw_capacity=0,
    safe_capacity=0,
    low_confidence_capacity=0,
    confidence=Confidence.NONE,
    estimate_representative=False,
    user_tps=None,
    representative_user_load=False,
    user_tps_yellow_count=0,
    user_tps_red_count=0,
    user_tps_yellow_ready=False,
    user_tps_red_ready=False,
    qos_healthy=False,
)
_NO_SNAPSHOT: Final = Snapshot(
    decision=PublishedDecision.startup(at=0.0),
    components=CapComponents(hard_global=0, state=0),
    signals=_NO_SIGNALS,
    generation_tokens=0.0,
    preemptions=0.0,
    dynamic_rejects=0,
    ttft=TtftState(),
    throughput=ThroughputState(),
    pressure_reason="",
    prefill_reason="",
)


# Stands in for the predictive learner's explanations before it has made one.
_NO_PREDICTION: Final = Prediction(
    user_tps=0.0,
    ttft_s=0.0,
    kv_usage=0.0,
    binding=Binding.NONE,
    fit=FitSummary(0.0, 0.0, 0.0, 0.0, 0.0, 0),
)


def _or_unknown(text: str) -> str:
    return text or "unknown"


def _latency(
    pick: Callable[[BackendMetrics], latency.LatencySummary | None],
    quantity: str,
    backend: BackendMetrics,
) -> float:
    summary = pick(backend)
    if summary is None:
        return 0.0
    return {"avg": summary.avg, "p95": summary.p95, "p99": summary.p99}[quantity]


def _zero(value: int | None) -> int:
    return 0 if value is None else value


def _cumulative_of(histogram: Histogram | None) -> tuple[list[float], float, float]:
    """Cumulative counts per duration bound, count and sum of a core histogram (or zeros)."""
    if histogram is None:
        return [0.0] * len(DURATION_BUCKETS_S), 0.0, 0.0
    per_bound = dict(histogram.finite_buckets)
    counts = []
    last = 0.0
    for bound in DURATION_BUCKETS_S:
        last = per_bound.get(bound, last)
        counts.append(last)
    return counts, histogram.count, histogram.sum


class GuardMetrics:
    """The guard's metrics: event instruments for the proxy, the state read at scrape time.

    ``state_provider`` returns the guard's current state; ``clock`` must be the clock the
    guard's events are stamped with (the ``at`` of every event), ``wall_clock`` gives Unix
    time. ``adaptive_output`` returns the number of remembered output-token samples and the
    output thresholds in force, when adaptive classification runs.
    """

    def __init__(  # noqa: PLR0915 - one flat list of every instrument, in page order
        self,
        settings: Settings,
        state_provider: Callable[[], GuardState],
        *,
        version: str,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        adaptive_output: Callable[[], tuple[int, Thresholds]] | None = None,
    ) -> None:
        self._settings = settings
        self._state = state_provider
        self._version = version
        self._clock = clock
        self._wall_clock = wall_clock
        self._started = clock()
        self._adaptive_output = adaptive_output
        self._routing = settings.backend_routing

        # runtime
        #: ``pig_rejected_total`` (no labels): 429s from the QoS gate or the priority rewrite.
        self.rejected = EventCounter()
        self.queue_total = EventCounter()
        #: Waits that ended without a slot, client cancels included.
        self.queue_timeout = EventCounter()
        #: ``pig_queue_wait_seconds``: every wait longer than 0, admitted or not.
        self.queue_wait = EventHistogram(())
        self.tier_accepted = {tier: EventCounter() for tier in _TIERS}
        self.tier_rejected = {tier: EventCounter() for tier in _TIERS}
        self.sse_keepalive_streams = EventCounter()
        self.sse_keepalive_comments = EventCounter()
        self.sse_bridge_streams = EventCounter()
        self.sse_bridge_upstream_errors = EventCounter()
        self.sse_bridge_invalid_upstream = EventCounter()
        self.sse_bridge_copy_errors = EventCounter()
        self.semantic_ttft_scan_limit = EventCounter()
        self.proxy_upstream_errors = EventCounter()
        self.proxy_body_copy_errors = EventCounter()
        self.client_disconnects = {phase: EventCounter() for phase in _DISCONNECT_PHASES}
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
        # lanes, in PIG's order (global first)
        self.lanes = {lane: LaneMetrics(lane) for lane in Lane}
        # the predictive learner: 429s by the constraint that refused them
        self.predictive_refusals = {binding: EventCounter() for binding in Binding}

        self._poll = _PollFigures()
        self._previous_statuses: dict[str, BackendStatus] = {}
        self._previous_semantic: Histogram | None = None
        self._tier_rejects_at_poll: tuple[float, float] | None = None

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    # -- poll rounds ---------------------------------------------------------------------------

    def record_poll(self, at: float, polls: Sequence[BackendPoll], state: GuardState) -> None:
        """Account for one finished poll round; ``state`` is the guard's state after it.

        Counts the round (ok when any backend answered) and each configured backend whose
        metrics fetch failed, and keeps what the core does not: per-backend rates and TTFT
        windows, the TTFT window behind the learner's smoothed values, the tier reject deltas
        and the tier waiting counts at the poll.
        """
        ok = any(poll.sample is not None for poll in polls)
        (self.dynamic_poll_ok if ok else self.dynamic_poll_failed).inc()
        windows: list[Histogram] = []
        for poll in polls:
            backend = self.backends.get(poll.name)
            previous = self._previous_statuses.get(poll.name)
            if poll.sample is None:
                self._previous_statuses[poll.name] = BackendStatus(at=at, failed=True)
                # A backend without a metrics URL counts as failed but is not a fetch failure.
                if self._routing and backend is not None and self._has_metrics_url(poll.name):
                    backend.poll_failed.inc()
                continue
            normalised = normalise(previous, poll.sample, at=at)
            self._previous_statuses[poll.name] = BackendStatus(
                at=at, failed=False, sample=poll.sample
            )
            if normalised.ttft_window is not None:
                windows.append(normalised.ttft_window)
            if self._routing and backend is not None:
                own = normalised.ttft_window
                backend.observed = BackendObservation(
                    running=int(normalised.running),
                    waiting=int(normalised.waiting),
                    kv_usage=normalised.kv_usage,
                    generation_tps=normalised.generation_tps,
                    ttft=latency.summarise(own) if own is not None else None,
                )

        semantic = state.learner.semantic_ttft
        if not ok:
            errors = "; ".join(f"{p.name}: {p.error}" if p.error else p.name for p in polls)
            self._poll = _PollFigures(error=errors or "no metrics source answered")
            return
        snapshot = current_snapshot(state)
        source = snapshot.ttft.source if snapshot is not None else TtftSource.NONE
        window: Histogram | None = None
        if source is TtftSource.SEMANTIC and semantic is not None:
            window = latency.window(self._previous_semantic, semantic)
        elif source is TtftSource.BACKEND:
            window = latency.merge(tuple(windows))
        self._previous_semantic = semantic

        rejects = (
            self.tier_rejected[Tier.BASIC].value,
            self.tier_rejected[Tier.PREMIUM].value,
        )
        before = self._tier_rejects_at_poll
        # As PIG: the whole count on the first good poll, and after a counter went backwards.
        delta = tuple(
            int(now - then) if before is not None and now >= then else int(now)
            for now, then in zip(rejects, before or (0.0, 0.0), strict=True)
        )
        self._tier_rejects_at_poll = rejects
        gate = state.gate
        self._poll = _PollFigures(
            ok=True,
            ttft=latency.summarise(window) if window is not None else None,
            tier_reject_delta=(delta[0], delta[1]),
            tier_waiting=(gate.basic_waiting, gate.premium_waiting),
        )

    def _has_metrics_url(self, name: str) -> bool:
        return any(b.name == name and b.metrics_url for b in self._settings.backends)

    def status_counts(self) -> RuntimeCounts:
        """The status line's inputs that only the runtime keeps."""
        details = {}
        for name, backend in self.backends.items():
            ttft = backend.observed.ttft
            details[name] = BackendDetail(
                inflight=int(backend.inflight.value),
                ttft_valid=ttft is not None,
                ttft_p95=ttft.p95 if ttft is not None else 0.0,
                ttft_p99=ttft.p99 if ttft is not None else 0.0,
            )
        return RuntimeCounts(tier_reject_delta=self._poll.tier_reject_delta, backends=details)

    # -- exposition ----------------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The page served at ``/pig/metrics`` (``Content-Type``: :data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry)

    def families(self) -> list[Metric]:
        """Every family of one scrape, in PIG's order: runtime, backends, dynamic, classifier,
        priority, lanes."""
        state = self._state()
        page = _Page()
        self._runtime(page, state)
        self._backend_families(page, state)
        if self._settings.dynamic_enabled:
            self._dynamic(page, state)
        if state.predictive is not None:
            self._predictive(page, state.predictive, state.verdict)
        self._classifier(page)
        self._priority(page)
        self._lane_families(page)
        return page.families

    def _runtime(self, page: _Page, state: GuardState) -> None:
        env = self._settings.env
        gate = state.gate
        page.info("pig_version_info", "The running version.", {"version": self._version})
        page.gauge(
            "pig_uptime_seconds",
            "Seconds since the guard started, rounded.",
            round(self._clock() - self._started),
        )
        lane_rows = [({"lane": str(lane)}, m.rejected.value) for lane, m in self.lanes.items()]
        page.counters(
            "pig_rejected_total",
            "429s from the QoS gate or the priority rewrite; with a lane label, per lane.",
            [({}, self.rejected.value), *lane_rows],
        )
        page.gauge("pig_queue_current", "Requests waiting for a slot now.", gate.waiting)
        page.counter("pig_queue_total", "Requests that waited for a slot.", self.queue_total.value)
        page.counter(
            "pig_queue_timeout_total",
            "Waits that ended without a slot, client cancels included.",
            self.queue_timeout.value,
        )
        page.summary(
            "pig_queue_wait_seconds",
            "Time spent waiting for a slot.",
            self.queue_wait.count,
            self.queue_wait.sum,
        )
        page.gauge(
            "pig_queue_wait_config_seconds",
            "PIG_QUEUE_WAIT_SECONDS.",
            env.pig_queue_wait_seconds,
        )
        page.gauge(
            "pig_queue_wait_effective_cap_seconds",
            "The longest wait actually allowed.",
            min(env.pig_queue_wait_seconds, MAX_SHORT_WAIT_S),
        )
        page.gauge(
            "pig_queue_poll_config_seconds",
            "PIG_QUEUE_POLL_MS, in seconds.",
            env.pig_queue_poll_ms / 1000,
        )
        # The tier gauges use the limit the gate enforces now (spec 10.3).
        limit, _closed = current_limit(gate)
        page.gauges(
            "pig_tier_inflight",
            "Admitted requests in flight per tier.",
            [({"tier": str(t)}, gate.inflight_of(t)) for t in _TIERS],
        )
        page.gauges(
            "pig_tier_waiting",
            "Requests waiting for a slot per tier.",
            [({"tier": str(t)}, gate.waiting_of(t)) for t in _TIERS],
        )
        page.counters(
            "pig_tier_requests_total",
            "Admission outcomes per tier.",
            [
                *(
                    ({"tier": str(t), "decision": "accepted"}, self.tier_accepted[t].value)
                    for t in _TIERS
                ),
                *(
                    ({"tier": str(t), "decision": "rejected"}, self.tier_rejected[t].value)
                    for t in _TIERS
                ),
            ],
        )
        page.gauge(
            "pig_tier_basic_limit",
            "Slots basic requests may hold under the current limit.",
            basic_limit(limit, gate.premium_inflight),
        )
        page.gauge(
            "pig_tier_premium_reserved_capacity",
            "Slots kept free for premium under the current limit.",
            premium_reserved(limit, gate.premium_inflight),
        )
        for name, doc, counter in (
            (
                "pig_sse_keepalive_streams_total",
                "Streams that got keep-alive comments.",
                self.sse_keepalive_streams,
            ),
            (
                "pig_sse_keepalive_comments_total",
                "Keep-alive comments written.",
                self.sse_keepalive_comments,
            ),
            (
                "pig_sse_bridge_streams_total",
                "Streams answered early with a bridge comment.",
                self.sse_bridge_streams,
            ),
            (
                "pig_sse_bridge_upstream_errors_total",
                "Upstream failures after a bridge.",
                self.sse_bridge_upstream_errors,
            ),
            (
                "pig_sse_bridge_invalid_upstream_total",
                "Bridged streams whose upstream answer was not a 200 event stream.",
                self.sse_bridge_invalid_upstream,
            ),
            (
                "pig_sse_bridge_copy_errors_total",
                "Copy errors on bridged streams.",
                self.sse_bridge_copy_errors,
            ),
            (
                "pig_request_semantic_ttft_scan_limit_total",
                "Streams scanned to the limit without a useful event.",
                self.semantic_ttft_scan_limit,
            ),
        ):
            page.counter(name, doc, counter.value)
        page.gauge(
            "pig_request_semantic_ttft_scan_limit_bytes",
            "How far a stream is scanned for its first useful event.",
            SEMANTIC_TTFT_SCAN_LIMIT_BYTES,
        )
        page.counter(
            "pig_proxy_upstream_errors_total",
            "Upstream connect or round-trip failures.",
            self.proxy_upstream_errors.value,
        )
        page.counter(
            "pig_proxy_body_copy_errors_total",
            "Response bodies cut by an upstream error.",
            self.proxy_body_copy_errors.value,
        )
        page.counters(
            "pig_client_disconnects_total",
            "Clients that went away, by phase (once per request).",
            [({"phase": p}, c.value) for p, c in self.client_disconnects.items()],
        )
        page.counter(
            "pig_client_disconnect_upstream_cancellations_total",
            "Upstream requests cancelled because the client went away.",
            self.client_disconnect_upstream_cancellations.value,
        )
        page.flag("pig_dynamic_enabled", "DYNAMIC_PIG_ENABLED.", env.dynamic_pig_enabled)
        page.flag("pig_dynamic_enforce", "DYNAMIC_PIG_ENFORCE.", env.dynamic_pig_enforce)
        page.counters(
            "pig_dynamic_poll_total",
            "Metrics poll rounds by result.",
            [
                ({"result": "ok"}, self.dynamic_poll_ok.value),
                ({"result": "failed"}, self.dynamic_poll_failed.value),
            ],
        )
        # The core counts these refusals itself (dynamic cap and tier rule), so the page and
        # the status line's reject= always agree.
        page.counter(
            "pig_dynamic_rejected_total",
            "Refusals by the dynamic cap or the tier rule.",
            state.learner.dynamic_rejects,
        )
        page.counter(
            "pig_backend_unavailable_total",
            "429s because no backend could take work.",
            self.backend_unavailable.value,
        )
        page.gauge("pig_backend_count", "Configured backends.", len(self._settings.backends))
        page.event_histogram(
            "pig_decision_duration_seconds",
            "Admission decision time, queue wait excluded.",
            self.decision_duration,
        )
        page.event_histogram(
            "pig_proxy_time_to_first_byte_seconds",
            "Time to the first byte written downstream.",
            self.proxy_ttfb,
        )
        # The core's own cumulative histogram (it feeds the TTFT learner) is the source.
        counts, count, total = _cumulative_of(state.learner.semantic_ttft)
        page.histogram(
            "pig_request_semantic_ttft_seconds",
            "Time from arrival to the first useful streamed event.",
            (({}, DURATION_BUCKETS_S, counts, count, total),),
        )
        page.event_histogram(
            "pig_proxy_total_duration_seconds",
            "Time spent in the proxy function.",
            self.proxy_total_duration,
        )
        page.event_histogram(
            "pig_internal_overhead_seconds",
            "Request time outside the queue and the proxy.",
            self.internal_overhead,
        )

    def _backend_families(self, page: _Page, state: GuardState) -> None:
        backends = list(self.backends.values())
        statuses = dict(state.learner.backends)

        def rows(value: Callable[[BackendMetrics], float]) -> list[tuple[_Labels, float]]:
            return [({"name": b.name}, value(b)) for b in backends]

        def failed(b: BackendMetrics) -> bool:
            status = statuses.get(b.name)
            return self._routing and status is not None and status.failed

        def observed(b: BackendMetrics) -> BackendObservation:
            # Outside backend routing the metrics URLs are not tied to backends: stay at 0.
            return b.observed if self._routing else BackendObservation()

        def ttft(b: BackendMetrics) -> latency.LatencySummary | None:
            return observed(b).ttft

        page.info(
            "pig_backend_info",
            "A configured backend.",
            *({"name": b.name, "upstream": b.upstream} for b in backends),
        )
        page.gauges(
            "pig_backend_inflight", "Requests in flight to it.", rows(lambda b: b.inflight.value)
        )
        page.counters(
            "pig_backend_requests_total",
            "Requests sent to it (accepted) and failed metrics polls (failed).",
            [
                *(({"name": b.name, "decision": "accepted"}, b.accepted.value) for b in backends),
                *(({"name": b.name, "decision": "failed"}, b.poll_failed.value) for b in backends),
            ],
        )
        page.counters(
            "pig_backend_completed_total",
            "Requests it completed.",
            rows(lambda b: b.completed.value),
        )
        page.counters(
            "pig_backend_proxy_errors_total",
            "Proxy errors talking to it.",
            rows(lambda b: b.proxy_errors.value),
        )
        page.counters(
            "pig_backend_body_copy_errors_total",
            "Body copy errors from it.",
            rows(lambda b: b.body_copy_errors.value),
        )
        page.gauges(
            "pig_backend_metrics_failed",
            "Its latest metrics poll failed.",
            rows(lambda b: 1 if failed(b) else 0),
        )
        page.gauges(
            "pig_backend_observed_running",
            "Running requests it reported.",
            rows(lambda b: observed(b).running),
        )
        page.gauges(
            "pig_backend_observed_waiting",
            "Waiting requests it reported.",
            rows(lambda b: observed(b).waiting),
        )
        page.gauges(
            "pig_backend_observed_kv_cache_usage",
            "KV-cache usage it reported.",
            rows(lambda b: observed(b).kv_usage),
        )
        page.gauges(
            "pig_backend_observed_generation_tokens_per_second",
            "Its generation rate over the last poll interval.",
            rows(lambda b: observed(b).generation_tps or 0.0),
        )
        page.gauges(
            "pig_backend_observed_generation_tokens_per_second_valid",
            "Whether its generation rate is valid.",
            rows(lambda b: 0 if observed(b).generation_tps is None else 1),
        )
        for name, doc, quantity in (
            (
                "pig_backend_observed_ttft_avg_seconds",
                "Its average TTFT over the last poll.",
                "avg",
            ),
            ("pig_backend_observed_ttft_p95_seconds", "Its p95 TTFT over the last poll.", "p95"),
            ("pig_backend_observed_ttft_p99_seconds", "Its p99 TTFT over the last poll.", "p99"),
        ):
            page.gauges(name, doc, rows(partial(_latency, ttft, quantity)))
        page.gauges(
            "pig_backend_observed_ttft_valid",
            "Whether its TTFT window is valid.",
            rows(lambda b: 0 if ttft(b) is None else 1),
        )

    def _dynamic(self, page: _Page, state: GuardState) -> None:
        decision = state.gate.decision
        snapshot = current_snapshot(state)
        published = snapshot is not None
        snap = snapshot if snapshot is not None else _NO_SNAPSHOT
        signals, ttft, throughput = snap.signals, snap.ttft, snap.throughput
        components = snap.components
        config = state.learner.config
        poll = self._poll if published else _PollFigures()
        # The TTFT window is not kept by the core; record_poll rebuilds it from the same
        # histograms (the guard's semantic one, or the backends' merged windows).
        window = poll.ttft
        rate = signals.generation_tps
        # Decisions are stamped on the guard's clock; turned into Unix time here.
        updated = int(self._wall_clock() - (self._clock() - decision.at))

        page.info(
            "pig_dynamic_state_info",
            "The published load state and where it came from.",
            {"state": str(decision.state), "source": str(decision.source)},
        )
        page.table((("pig_dynamic_last_update_seconds", "When it was published.", updated),))
        if self._poll.error and not published:
            page.info(
                "pig_dynamic_error_info",
                "Why the latest poll failed.",
                {"message": self._poll.error},
            )
        page.table(
            (
                ("pig_dynamic_observed_running", "Running requests.", decision.running),
                ("pig_dynamic_observed_waiting", "Waiting requests.", decision.waiting),
                ("pig_dynamic_observed_kv_cache_usage", "Highest KV usage.", decision.kv_usage),
                ("pig_dynamic_observed_preemptions", "Preemptions, cumulative.", snap.preemptions),
                (
                    "pig_dynamic_observed_generation_tokens_total",
                    "Generated tokens, cumulative.",
                    snap.generation_tokens,
                ),
                (
                    "pig_dynamic_observed_generation_tokens_per_second",
                    "Generation rate.",
                    rate or 0,
                ),
                (
                    "pig_dynamic_observed_generation_tokens_per_second_valid",
                    "The generation rate is valid.",
                    rate is not None,
                ),
                (
                    "pig_dynamic_observed_ttft_count",
                    "TTFT samples in the latest window.",
                    window.count if window is not None else 0,
                ),
                (
                    "pig_dynamic_observed_ttft_avg_seconds",
                    "Average TTFT of the latest window.",
                    window.avg if window is not None else 0,
                ),
                (
                    "pig_dynamic_observed_ttft_p95_seconds",
                    "p95 TTFT of the latest window.",
                    window.p95 if window is not None else 0,
                ),
                (
                    "pig_dynamic_observed_ttft_p99_seconds",
                    "p99 TTFT of the latest window.",
                    window.p99 if window is not None else 0,
                ),
                (
                    "pig_dynamic_observed_ttft_valid",
                    "The TTFT window is valid.",
                    window is not None,
                ),
            )
        )
        if ttft.source is not TtftSource.NONE:
            page.info(
                "pig_dynamic_observed_ttft_source_info",
                "Where TTFT is read from.",
                {"source": str(ttft.source)},
            )
        page.table(
            (
                ("pig_dynamic_observed_ttft_smoothed_avg_seconds", "Smoothed TTFT average.",
                 ttft.smoothed_avg),
                ("pig_dynamic_observed_ttft_smoothed_p95_seconds", "Smoothed TTFT p95.",
                 ttft.smoothed_p95),
                ("pig_dynamic_observed_ttft_smoothed_p99_seconds", "Smoothed TTFT p99.",
                 ttft.smoothed_p99),
                ("pig_dynamic_ttft_target_seconds", "DYNAMIC_TTFT_TARGET_SECONDS.",
                 config.ttft_target_s),
                ("pig_dynamic_ttft_red_seconds", "DYNAMIC_TTFT_RED_SECONDS.", config.ttft_red_s),
                ("pig_dynamic_ttft_p99_target_seconds", "DYNAMIC_TTFT_P99_TARGET_SECONDS.",
                 config.ttft_p99_target_s),
                ("pig_dynamic_ttft_p99_red_seconds", "DYNAMIC_TTFT_P99_RED_SECONDS.",
                 config.ttft_p99_red_s),
                ("pig_dynamic_ttft_enabled", "DYNAMIC_TTFT_ENABLED.", config.ttft_enabled),
                ("pig_dynamic_ttft_learned_limit", "TTFT learner: learned limit.", ttft.learned),
                ("pig_dynamic_ttft_target_limit", "TTFT learner: target limit.", ttft.target),
                ("pig_dynamic_ttft_limit", "TTFT component of the cap.", _zero(components.ttft)),
                ("pig_dynamic_ttft_high_count", "Consecutive high p95 windows.", ttft.high_count),
                ("pig_dynamic_ttft_p99_high_count", "Consecutive high p99 windows.",
                 ttft.tail_count),
                ("pig_dynamic_ttft_healthy_count", "Consecutive healthy TTFT windows.",
                 ttft.healthy_count),
            )
        )  # fmt: skip
        if ttft.phase:
            page.info(
                "pig_dynamic_ttft_learning_info", "TTFT learner state.", {"state": ttft.phase}
            )
        page.info(
            "pig_dynamic_ttft_learning_reason_info",
            "TTFT learner state, reason and target reason.",
            {
                "state": ttft.phase,
                "reason": _or_unknown(ttft.reason),
                # Not kept by the core: derived from which smoothed quantile is over target.
                "target_reason": _or_unknown(ttft.target_reason),
            },
        )
        page.table(
            (
                (
                    "pig_dynamic_observed_capacity_tokens_per_second",
                    "Smoothed generation rate behind the capacity estimate.",
                    signals.smoothed_tps,
                ),
            )
        )
        if published:
            page.info(
                "pig_dynamic_capacity_estimate_info",
                "How far the capacity estimate can be trusted.",
                {"confidence": str(signals.confidence)},
            )
        basic_delta, premium_delta = poll.tier_reject_delta
        basic_waiting, premium_waiting = poll.tier_waiting
        page.table(
            (
                ("pig_dynamic_capacity_representative_load", "The load is representative.",
                 signals.estimate_representative),
                ("pig_dynamic_capacity_demand_pressure", "Capacity demand pressure.",
                 signals.capacity_demand),
                ("pig_dynamic_tier_demand_pressure", "Basic tier held back by the cap.",
                 signals.tier_demand),
                ("pig_dynamic_tier_basic_rejected_delta", "Basic rejects since the last poll.",
                 basic_delta),
                ("pig_dynamic_tier_premium_rejected_delta", "Premium rejects since the last poll.",
                 premium_delta),
                ("pig_dynamic_tier_basic_waiting", "Basic requests waiting at the poll.",
                 basic_waiting),
                ("pig_dynamic_tier_premium_waiting", "Premium requests waiting at the poll.",
                 premium_waiting),
                ("pig_dynamic_capacity_raw_limit", "Capacity estimate, raw.",
                 signals.raw_capacity),
                ("pig_dynamic_capacity_safe_limit", "Capacity estimate, safe.",
                 signals.safe_capacity),
                ("pig_dynamic_capacity_low_confidence_limit",
                 "Capacity estimate bound when it is not trusted.",
                 signals.low_confidence_capacity),
            )
        )  # fmt: skip
        page.info(
            "pig_dynamic_capacity_learning_info",
            "Throughput learner mode and state.",
            {"mode": "clean_cap", "state": throughput.phase},
        )
        page.info(
            "pig_dynamic_capacity_learning_reason_info",
            "Throughput learner state, reason and target reason.",
            {
                "state": throughput.phase,
                "reason": _or_unknown(throughput.reason),
                "target_reason": _or_unknown(throughput.target_reason),
            },
        )
        page.table(
            (
                # The throughput learner keeps its projection for this gauge.
                ("pig_dynamic_capacity_projected_limit", "Throughput learner projection.",
                 snap.throughput.projected if published else 0),
                ("pig_dynamic_capacity_learned_limit", "Throughput learner: learned limit.",
                 throughput.learned),
                ("pig_dynamic_capacity_target_limit", "Throughput learner: target limit.",
                 throughput.target),
                ("pig_dynamic_capacity_healthy_count", "Consecutive healthy throughput polls.",
                 throughput.healthy_count),
                ("pig_dynamic_observed_single_user_tokens_per_second", "Per-user decode speed.",
                 signals.user_tps or 0),
                ("pig_dynamic_representative_user_tps_load", "Enough users to judge their speed.",
                 signals.representative_user_load),
                ("pig_dynamic_single_user_tps_yellow_count", "Consecutive slow polls (yellow).",
                 signals.user_tps_yellow_count),
                ("pig_dynamic_single_user_tps_red_count", "Consecutive slow polls (red).",
                 signals.user_tps_red_count),
                ("pig_dynamic_prefill_protected_running", "Running requests still prefilling.",
                 signals.protected),
                ("pig_dynamic_prefill_transition_active", "A prefill transition is on.",
                 signals.transition),
                ("pig_dynamic_prefill_settling_active", "Settling after a prefill transition.",
                 signals.transition and not signals.freeze),
                ("pig_dynamic_decode_running", "Running requests past prefill.", signals.decode),
                ("pig_dynamic_backend_count", "Backends polled.", decision.backend_count),
                ("pig_dynamic_backend_failed", "Backends whose poll failed.",
                 decision.backend_failed),
                ("pig_dynamic_rejected_delta", "Dynamic rejects since the last poll.",
                 signals.reject_delta),
                ("pig_dynamic_hard_global_limit", "GLOBAL_LIMIT component of the cap.",
                 components.hard_global),
                ("pig_dynamic_state_limit", "State component of the cap.", components.state),
                ("pig_dynamic_throughput_limit", "Throughput component of the cap.",
                 _zero(components.throughput)),
                ("pig_dynamic_availability_limit", "Availability component of the cap.",
                 _zero(components.availability)),
            )
        )  # fmt: skip
        page.info(
            "pig_dynamic_final_limit_info",
            "Which component set the cap.",
            {"reason": _or_unknown(str(decision.final_reason))},
        )
        page.table(
            (
                ("pig_dynamic_global_limit", "The published cap.", decision.cap),
                ("pig_dynamic_admission_limit", "The admission limit: the published cap.",
                 decision.cap),
                ("pig_dynamic_capacity_limit", "Throughput component of the cap.",
                 _zero(components.throughput)),
                ("pig_dynamic_pressure_limit", "Pressure component of the cap.",
                 _zero(components.pressure)),
            )
        )  # fmt: skip
        page.info(
            "pig_dynamic_pressure_limit_info",
            "Pressure guard reason and target reason.",
            {
                "reason": _or_unknown(snap.pressure_reason),
                # Not kept by the core: the overload that sets the target under severe pressure.
                "target_reason": _or_unknown(snap.pressure_target_reason),
            },
        )
        page.table(
            (("pig_dynamic_prefill_limit", "Prefill component of the cap.",
              _zero(components.prefill)),)
        )  # fmt: skip
        # The core's prefill guard has no target of its own: its target reason stays unknown.
        page.info(
            "pig_dynamic_prefill_limit_info",
            "Prefill guard reason and target reason.",
            {"reason": _or_unknown(snap.prefill_reason), "target_reason": "unknown"},
        )
        page.table(
            (
                ("pig_dynamic_pressure_limit_enabled", "DYNAMIC_PRESSURE_LIMIT_ENABLED.",
                 config.pressure_enabled),
                ("pig_dynamic_pressure_headroom", "DYNAMIC_PRESSURE_HEADROOM.",
                 config.pressure_headroom),
                ("pig_dynamic_pressure_min_limit", "DYNAMIC_PRESSURE_MIN_LIMIT.",
                 config.pressure_min_limit),
                ("pig_dynamic_pressure_learned_cap", "The persistent pressure cap (0: none).",
                 state.learner.pressure_cap),
                ("pig_dynamic_pressure_learn_ratio", "DYNAMIC_PRESSURE_LEARN_RATIO.",
                 config.pressure_learn_ratio),
                ("pig_dynamic_pressure_learn_min_running", "DYNAMIC_PRESSURE_LEARN_MIN_RUNNING.",
                 config.pressure_learn_min_running),
            )
        )  # fmt: skip
        page.table(
            ("pig_dynamic_single_user_tps" + suffix, f"DYNAMIC_SINGLE_USER_TPS{variable}.", value)
            for suffix, variable, value in (
                ("_enabled", "_ENABLED", config.user_tps_enabled),
                ("_yellow", "_YELLOW", config.user_tps_yellow),
                ("_red", "_RED", config.user_tps_red),
                ("_yellow_consecutive", "_YELLOW_CONSECUTIVE", config.user_tps_yellow_consecutive),
                ("_red_consecutive", "_RED_CONSECUTIVE", config.user_tps_red_consecutive),
                ("_prefill_grace_min_seconds", "_PREFILL_GRACE_MIN_SECONDS",
                 config.prefill_grace_min_s),
                ("_prefill_grace_max_seconds", "_PREFILL_GRACE_MAX_SECONDS",
                 config.prefill_grace_max_s),
                ("_prefill_grace_body_bytes_per_second",
                 "_PREFILL_GRACE_BODY_BYTES_PER_SECOND", config.prefill_grace_bytes_per_s),
                ("_prefill_grace_multiplier", "_PREFILL_GRACE_MULTIPLIER",
                 config.prefill_grace_multiplier),
                ("_capacity_learn_enabled", "_CAPACITY_LEARN_ENABLED",
                 config.capacity_learn_enabled),
                ("_capacity_ratio", "_CAPACITY_RATIO", config.capacity_ratio),
                ("_capacity_ratio_max", "_CAPACITY_RATIO_MAX", config.capacity_ratio_max),
                # PIG's name for the step-up setting.
                ("_capacity_probe_step_ratio", "_CAPACITY_RATIO_STEP_UP", config.capacity_step_up),
                ("_capacity_healthy_consecutive", "_CAPACITY_HEALTHY_CONSECUTIVE",
                 config.capacity_healthy_consecutive),
                ("_capacity_healthy_multiplier", "_CAPACITY_HEALTHY_MULTIPLIER",
                 config.capacity_healthy_multiplier),
                ("_capacity_smoothing", "_CAPACITY_SMOOTHING", config.capacity_smoothing),
            )
        )  # fmt: skip
        page.info(
            "pig_dynamic_reason_info",
            "One line per reason of the load state.",
            *({"state": "yellow", "reason": str(r)} for r in decision.yellow_reasons),
            *({"state": "red", "reason": str(r)} for r in decision.red_reasons),
        )

    def _predictive(self, page: _Page, model: PredictiveState, verdict: Prediction | None) -> None:
        """The predictive learner's explanation (``DYNAMIC_POLICY=predictive`` only)."""
        prefix = "inference_guard_predictive_"
        for which, prediction, what in (
            ("cap", model.last_cap, "the cap published at the latest poll"),
            ("verdict", verdict, "the latest admission attempt it judged"),
        ):
            shown = prediction or _NO_PREDICTION
            page.table(
                (
                    (f"{prefix}{which}_user_tokens_per_second",
                     f"Predicted per-user decode speed for {what}.", shown.user_tps),
                    (f"{prefix}{which}_ttft_seconds",
                     f"Predicted time to first token (queueing and interference) for {what}.",
                     shown.ttft_s),
                    (f"{prefix}{which}_kv_cache_usage",
                     f"Predicted KV-cache usage for {what}.", shown.kv_usage),
                )
            )  # fmt: skip
            page.info(
                f"{prefix}{which}_binding_info",
                f"The constraint that bound {what} (none: nothing did).",
                {"binding": str(shown.binding)},
            )
        page.gauge(
            prefix + "cap",
            "The cap the learner set at the latest poll (requests in flight), before PIG's"
            " intake rules and hard limits.",
            (model.last_cap or _NO_PREDICTION).cap,
        )
        fit = FitSummary.of(model.fit())
        page.table(
            (
                (prefix + "fit_step_base_seconds",
                 "Engine model: seconds of one step with nothing decoding.", fit.step_base_s),
                (prefix + "fit_per_decoder_seconds",
                 "Engine model: seconds each decoding sequence adds to a step.",
                 fit.per_decoder_s),
                (prefix + "fit_per_kv_seconds",
                 "Engine model: seconds a full KV cache adds to a step.", fit.per_kv_s),
                (prefix + "fit_per_prompt_token_seconds",
                 "Engine model: seconds of engine time each prompt token takes to prefill.",
                 fit.per_prompt_token_s),
                (prefix + "fit_relative_error",
                 "Engine model: smoothed relative error of its inter-token latency"
                 " predictions.", fit.relative_error),
                (prefix + "fit_observations",
                 "Engine model: poll intervals it has learned from.", fit.observations),
                (prefix + "bytes_per_token",
                 "Request body bytes per prompt token in use (learned, or"
                 " DYNAMIC_PREDICTIVE_BYTES_PER_TOKEN until learned).", model.ratio),
                (prefix + "bytes_per_token_learned",
                 "The bytes per token come from the backend's prompt-token counter.",
                 model.bytes_per_token is not None),
                (prefix + "decode_seconds",
                 "How long a forwarded request decodes, learned from the finished ones.",
                 model.decode_seconds),
                (prefix + "decoding",
                 "Forwarded requests that have had their first token.", model.decoders),
                (prefix + "prefilling",
                 "Forwarded requests still waiting for their first token.",
                 model.pending_count),
                (prefix + "prefill_tokens",
                 "Estimated prompt tokens of the requests still waiting for their first token.",
                 model.pending_tokens),
            )
        )  # fmt: skip
        page.counters(
            prefix + "refusals_total",
            "429s from admission by the constraint that refused them (none: the gate's"
            " tier, limit or intake rules).",
            (({"binding": str(b)}, c.value) for b, c in self.predictive_refusals.items()),
        )

    def _classifier(self, page: _Page) -> None:
        env = self._settings.env
        page.flag(
            "pig_json_classify_enabled",
            "CLASSIFY_OUTPUT_TOKENS.",
            bool(env.classify_output_tokens),
        )
        page.gauge(
            "pig_json_classify_body_bytes",
            "JSON_CLASSIFY_BODY_BYTES.",
            env.json_classify_body_bytes,
        )
        page.gauge(
            "pig_json_classifier_limit",
            "JSON_CLASSIFY_LIMIT: concurrent classifier slots.",
            env.json_classify_limit or self._default_slots(),
        )
        page.gauge(
            "pig_json_classifier_inflight",
            "Classifier slots in use.",
            self.classifier_inflight.value,
        )
        page.counter(
            "pig_json_classifier_rejected_total",
            "Classifications refused for want of a slot.",
            self.classifier_rejected.value,
        )
        page.info(
            "pig_path_info",
            "An admitted path (PIG_PATHS).",
            *({"path": path} for path in self._settings.paths.paths),
        )

    def _default_slots(self) -> int:
        limit = self._settings.env.global_limit
        return limit if 0 < limit < _DEFAULT_SLOTS else _DEFAULT_SLOTS

    def _priority(self, page: _Page) -> None:
        env = self._settings.env
        prefix = "pig_backend_priority_"
        page.flag(
            prefix + "injection_enabled",
            "BACKEND_PRIORITY_INJECTION_ENABLED.",
            bool(env.backend_priority_injection_enabled),
        )
        for suffix, variable, default in (
            ("body_bytes", "backend_priority_body_bytes", 33_554_432),
            ("buffer_bytes", "backend_priority_buffer_bytes", 0),
            ("stream_buffer_bytes", "backend_priority_stream_buffer_bytes", 2_097_152),
        ):
            page.gauge(prefix + suffix, f"{variable.upper()}.", getattr(env, variable, default))
        page.gauge(
            prefix + "rewrite_limit",
            "BACKEND_PRIORITY_REWRITE_LIMIT: concurrent rewrite slots.",
            env.backend_priority_rewrite_limit or self._default_slots(),
        )
        page.gauge(
            prefix + "rewrite_inflight",
            "Rewrite slots in use.",
            self.priority_rewrite_inflight.value,
        )
        page.counter(prefix + "rewrite_total", "Bodies rewritten.", self.priority_rewrites.value)
        page.counter(
            prefix + "skipped_total", "Bodies left as they were.", self.priority_skipped.value
        )
        page.counter(prefix + "failed_total", "Rewrites that failed.", self.priority_failed.value)
        page.event_histogram(
            prefix + "rewrite_duration_seconds",
            "Time spent rewriting a body.",
            self.priority_rewrite_duration,
        )
        page.gauge(
            prefix + "rewrite_duration_max_seconds",
            "Longest rewrite so far.",
            self.priority_rewrite_duration.max,
        )

    def _lane_families(self, page: _Page) -> None:
        env = self._settings.env
        lanes = list(self.lanes.values())
        page.counters(
            "pig_requests_total",
            "Admission outcomes per lane.",
            [
                row
                for m in lanes
                for row in (
                    ({"lane": str(m.lane), "decision": "accepted"}, m.accepted.value),
                    ({"lane": str(m.lane), "decision": "rejected"}, m.rejected.value),
                )
            ],
        )
        page.gauges(
            "pig_inflight",
            "Admitted requests in flight per lane.",
            [({"lane": str(m.lane)}, m.inflight.value) for m in lanes],
        )
        page.counters(
            "pig_completed_total",
            "Admitted requests completed per lane.",
            [({"lane": str(m.lane)}, m.duration.count) for m in lanes],
        )
        page.histogram(
            "pig_request_duration_seconds",
            "Duration of completed requests per lane.",
            (
                (
                    {"lane": str(m.lane)},
                    DURATION_BUCKETS_S,
                    m.duration.cumulative(),
                    m.duration.count,
                    m.duration.sum,
                )
                for m in lanes
            ),
        )
        page.counters(
            "pig_response_status_class_total",
            "Completed requests per lane and status class (0xx: invalid; 499 is 4xx).",
            [
                ({"lane": str(m.lane), "class": klass}, m.statuses[index])
                for m in lanes
                for index, klass in enumerate(_STATUS_CLASSES)
            ],
        )
        # The count (and +Inf) includes unknown lengths; the other buckets and the sum do not.
        page.histogram(
            "pig_request_body_bytes",
            "Request body sizes per lane.",
            (
                (
                    {"lane": str(m.lane)},
                    BODY_BUCKETS_BYTES,
                    m.body_bytes.cumulative(),
                    m.body_bytes.count,
                    m.body_bytes.sum,
                )
                for m in lanes
            ),
        )
        body = Thresholds(
            (
                env.medium_body_bytes,
                env.long_body_bytes,
                env.very_long_body_bytes,
            )
        )
        output = Thresholds(
            (
                env.medium_output_tokens,
                env.long_output_tokens,
                env.very_long_output_tokens,
            )
        )
        body_lanes = (Lane.MEDIUM_BODY, Lane.LONG_BODY, Lane.VERY_LONG_BODY)
        output_lanes = (Lane.MEDIUM_OUTPUT, Lane.LONG_OUTPUT, Lane.VERY_LONG_OUTPUT)
        page.gauges(
            "pig_body_threshold_bytes",
            "Lowest body size of each body lane.",
            [({"lane": str(lane)}, v) for lane, v in zip(body_lanes, body.values, strict=True)],
        )
        page.gauges(
            "pig_output_threshold_tokens",
            "Configured lowest output-token intent of each output lane.",
            [({"lane": str(lane)}, v) for lane, v in zip(output_lanes, output.values, strict=True)],
        )
        samples, effective = 0, output
        if self._adaptive_output is not None:
            samples, effective = self._adaptive_output()
        page.flag(
            "pig_adaptive_output_enabled",
            "ADAPTIVE_OUTPUT_CLASSIFICATION.",
            bool(env.adaptive_output_classification),
        )
        page.gauge("pig_adaptive_output_samples", "Output-token intents remembered.", samples)
        page.gauges(
            "pig_effective_output_threshold_tokens",
            "Output-lane thresholds in force.",
            [
                ({"lane": str(lane)}, v)
                for lane, v in zip(output_lanes, effective.values, strict=True)
            ],
        )
