"""The page's table, outside the dynamic block: runtime, backends, classifier, priority, lanes.

Reads: one :class:`~guard_trio._metrics_scrape.Scrape` per scrape (the getters' argument).
Guarantees: each row is one metric of spec 10.2 with PIG's name, type and label names, in
PIG's order; the values are read from the published core value, the gate, the settings and the
event instruments, never recomputed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Final

from guard_core.gate import MAX_SHORT_WAIT_S, current_limit, failing_open
from guard_core.guard import GuardState
from guard_core.health import BackendHealth, availability
from guard_core.lanes import Lane, Thresholds
from guard_core.tier import basic_limit, premium_reserved
from guard_trio._metrics_instruments import (
    BODY_BUCKETS_BYTES,
    DURATION_BUCKETS_S,
    SEMANTIC_TTFT_SCAN_LIMIT_BYTES,
    STATUS_CLASSES,
    TIERS,
    BackendMetrics,
    EventHistogram,
    LaneMetrics,
)
from guard_trio._metrics_page import MetricRow, counter, gauge, histogram, info, summary
from guard_trio._metrics_scrape import Scrape, cumulative_of

__all__ = (
    "BACKEND_ROWS",
    "CLASSIFIER_ROWS",
    "HEALTH_ROWS",
    "LANE_ROWS",
    "POOL_ROWS",
    "PRIORITY_ROWS",
    "RUNTIME_ROWS",
)

Row = MetricRow[Scrape]
Getter = Callable[[Scrape], Any]
Pairs = list[tuple[dict[str, str], float]]

#: ``JSON_CLASSIFY_LIMIT`` and ``BACKEND_PRIORITY_REWRITE_LIMIT`` when not set.
_DEFAULT_SLOTS: Final = 64
_BODY_LANES: Final = (Lane.MEDIUM_BODY, Lane.LONG_BODY, Lane.VERY_LONG_BODY)
_OUTPUT_LANES: Final = (Lane.MEDIUM_OUTPUT, Lane.LONG_OUTPUT, Lane.VERY_LONG_OUTPUT)


def _event_histogram(pick: str) -> Getter:
    def get(s: Scrape) -> tuple[tuple[dict[str, str], Any, list[int], int, float]]:
        h: EventHistogram = getattr(s.m, pick)
        return (({}, h.bounds, h.cumulative(), h.count, h.sum),)

    return get


def _semantic_ttft(s: Scrape) -> tuple[tuple[dict[str, str], Any, list[float], float, float]]:
    # The core's own cumulative histogram (it feeds the TTFT learner) is the source.
    counts, count, total = cumulative_of(s.state.learner.semantic_ttft)
    return (({}, DURATION_BUCKETS_S, counts, count, total),)


def _tier_requests(s: Scrape) -> Pairs:
    return [
        *(({"tier": str(t), "decision": "accepted"}, s.m.tier_accepted[t].value) for t in TIERS),
        *(({"tier": str(t), "decision": "rejected"}, s.m.tier_rejected[t].value) for t in TIERS),
    ]


def _event_counter(name: str, help: str, pick: str) -> Row:
    return counter(name, help, lambda s: getattr(s.m, pick).value)


RUNTIME_ROWS: Final[tuple[Row, ...]] = (
    info("pig_version_info", "The running version.", "version",
         lambda s: ({"version": s.m.version},)),
    gauge("pig_uptime_seconds", "Seconds since the guard started, rounded.", lambda s: s.uptime),
    counter("pig_rejected_total",
            "429s from the QoS gate or the priority rewrite; with a lane label, per lane.",
            lambda s: [({}, s.m.rejected.value),
                       *(({"lane": str(lane)}, m.rejected.value) for lane, m in s.m.lanes.items())],
            "lane"),
    gauge("pig_queue_current", "Requests waiting for a slot now.", lambda s: s.gate.waiting),
    _event_counter("pig_queue_total", "Requests that waited for a slot.", "queue_total"),
    _event_counter("pig_queue_timeout_total",
                   "Waits that ended without a slot, client cancels included.", "queue_timeout"),
    summary("pig_queue_wait_seconds", "Time spent waiting for a slot.",
            lambda s: (s.m.queue_wait.count, s.m.queue_wait.sum)),
    gauge("pig_queue_wait_config_seconds", "PIG_QUEUE_WAIT_SECONDS.",
          lambda s: s.env.pig_queue_wait_seconds),
    gauge("pig_queue_wait_effective_cap_seconds", "The longest wait actually allowed.",
          lambda s: min(s.env.pig_queue_wait_seconds, MAX_SHORT_WAIT_S)),
    gauge("pig_queue_poll_config_seconds", "PIG_QUEUE_POLL_MS, in seconds.",
          lambda s: s.env.pig_queue_poll_ms / 1000),
    gauge("pig_tier_inflight", "Admitted requests in flight per tier.",
          lambda s: [({"tier": str(t)}, s.gate.inflight_of(t)) for t in TIERS], "tier"),
    gauge("pig_tier_waiting", "Requests waiting for a slot per tier.",
          lambda s: [({"tier": str(t)}, s.gate.waiting_of(t)) for t in TIERS], "tier"),
    counter("pig_tier_requests_total", "Admission outcomes per tier.", _tier_requests,
            "decision,tier"),
    gauge("pig_tier_basic_limit", "Slots basic requests may hold under the current limit.",
          lambda s: basic_limit(s.limit, s.gate.premium_inflight)),
    gauge("pig_tier_premium_reserved_capacity",
          "Slots kept free for premium under the current limit.",
          lambda s: premium_reserved(s.limit, s.gate.premium_inflight)),
    *(
        _event_counter(name, help, pick)
        for name, help, pick in (
            ("pig_sse_keepalive_streams_total", "Streams that got keep-alive comments.",
             "sse_keepalive_streams"),
            ("pig_sse_keepalive_comments_total", "Keep-alive comments written.",
             "sse_keepalive_comments"),
            ("pig_sse_bridge_streams_total", "Streams answered early with a bridge comment.",
             "sse_bridge_streams"),
            ("pig_sse_bridge_upstream_errors_total", "Upstream failures after a bridge.",
             "sse_bridge_upstream_errors"),
            ("pig_sse_bridge_invalid_upstream_total",
             "Bridged streams whose upstream answer was not a 200 event stream.",
             "sse_bridge_invalid_upstream"),
            ("pig_sse_bridge_copy_errors_total", "Copy errors on bridged streams.",
             "sse_bridge_copy_errors"),
            ("pig_request_semantic_ttft_scan_limit_total",
             "Streams scanned to the limit without a useful event.", "semantic_ttft_scan_limit"),
        )
    ),
    gauge("pig_request_semantic_ttft_scan_limit_bytes",
          "How far a stream is scanned for its first useful event.",
          lambda _s: SEMANTIC_TTFT_SCAN_LIMIT_BYTES),
    _event_counter("pig_proxy_upstream_errors_total", "Upstream connect or round-trip failures.",
                   "proxy_upstream_errors"),
    _event_counter("pig_proxy_body_copy_errors_total",
                   "Response bodies cut by an upstream error.", "proxy_body_copy_errors"),
    counter("pig_client_disconnects_total",
            "Clients that went away, by phase (once per request).",
            lambda s: [({"phase": p}, c.value) for p, c in s.m.client_disconnects.items()],
            "phase"),
    _event_counter("pig_client_disconnect_upstream_cancellations_total",
                   "Upstream requests cancelled because the client went away.",
                   "client_disconnect_upstream_cancellations"),
    gauge("pig_dynamic_enabled", "DYNAMIC_PIG_ENABLED.", lambda s: s.env.dynamic_pig_enabled),
    gauge("pig_dynamic_enforce", "DYNAMIC_PIG_ENFORCE.", lambda s: s.env.dynamic_pig_enforce),
    counter("pig_dynamic_poll_total", "Metrics poll rounds by result.",
            lambda s: [({"result": "ok"}, s.m.dynamic_poll_ok.value),
                       ({"result": "failed"}, s.m.dynamic_poll_failed.value)],
            "result"),
    # The core counts these refusals itself (dynamic cap and tier rule), so the page and the
    # status line's reject= always agree.
    counter("pig_dynamic_rejected_total", "Refusals by the dynamic cap or the tier rule.",
            lambda s: s.state.learner.dynamic_rejects),
    _event_counter("pig_backend_unavailable_total", "429s because no backend could take work.",
                   "backend_unavailable"),
    gauge("pig_backend_count", "Configured backends.", lambda s: len(s.settings.backends)),
    histogram("pig_decision_duration_seconds", "Admission decision time, queue wait excluded.",
              _event_histogram("decision_duration")),
    histogram("pig_proxy_time_to_first_byte_seconds", "Time to the first byte written downstream.",
              _event_histogram("proxy_ttfb")),
    histogram("pig_request_semantic_ttft_seconds",
              "Time from arrival to the first useful streamed event.", _semantic_ttft),
    histogram("pig_proxy_total_duration_seconds", "Time spent in the proxy function.",
              _event_histogram("proxy_total_duration")),
    histogram("pig_internal_overhead_seconds", "Request time outside the queue and the proxy.",
              _event_histogram("internal_overhead")),
)  # fmt: skip


def _per_backend(value: Callable[[Scrape, BackendMetrics], float]) -> Getter:
    """A getter of one ``{name}`` sample per configured backend."""

    def get(s: Scrape) -> Pairs:
        return [({"name": b.name}, value(s, b)) for b in s.backends]

    return get


def _backend_requests(s: Scrape) -> Pairs:
    return [
        *(({"name": b.name, "decision": "accepted"}, b.accepted.value) for b in s.backends),
        *(({"name": b.name, "decision": "failed"}, b.poll_failed.value) for b in s.backends),
    ]


def _rate(s: Scrape, b: BackendMetrics) -> float | None:
    return s.figures(b).generation_tps


BACKEND_ROWS: Final[tuple[Row, ...]] = (
    info("pig_backend_info", "A configured backend.", "name,upstream",
         lambda s: tuple({"name": b.name, "upstream": b.upstream} for b in s.backends)),
    gauge("pig_backend_inflight", "Requests in flight to it.",
          _per_backend(lambda s, b: s.of(b.name).traffic.inflight_of(b.name)), "name"),
    counter("pig_backend_requests_total",
            "Requests sent to it (accepted) and failed metrics polls (failed).",
            _backend_requests, "decision,name"),
    counter("pig_backend_completed_total", "Requests it completed.",
            _per_backend(lambda _s, b: b.completed.value), "name"),
    counter("pig_backend_proxy_errors_total", "Proxy errors talking to it.",
            _per_backend(lambda _s, b: b.proxy_errors.value), "name"),
    counter("pig_backend_body_copy_errors_total", "Body copy errors from it.",
            _per_backend(lambda _s, b: b.body_copy_errors.value), "name"),
    gauge("pig_backend_metrics_failed", "Its latest metrics poll failed.",
          _per_backend(lambda s, b: s.figures(b).failed), "name"),
    gauge("pig_backend_observed_running", "Running requests it reported.",
          _per_backend(lambda s, b: s.figures(b).running), "name"),
    gauge("pig_backend_observed_waiting", "Waiting requests it reported.",
          _per_backend(lambda s, b: s.figures(b).waiting), "name"),
    gauge("pig_backend_observed_kv_cache_usage", "KV-cache usage it reported.",
          _per_backend(lambda s, b: s.figures(b).kv_usage), "name"),
    gauge("pig_backend_observed_generation_tokens_per_second",
          "Its generation rate over the last poll interval.",
          _per_backend(lambda s, b: _rate(s, b) or 0.0), "name"),
    gauge("pig_backend_observed_generation_tokens_per_second_valid",
          "Whether its generation rate is valid.",
          _per_backend(lambda s, b: _rate(s, b) is not None), "name"),
    gauge("pig_backend_observed_ttft_avg_seconds", "Its average TTFT over the last poll.",
          _per_backend(lambda s, b: s.latency(b, "avg")), "name"),
    gauge("pig_backend_observed_ttft_p95_seconds", "Its p95 TTFT over the last poll.",
          _per_backend(lambda s, b: s.latency(b, "p95")), "name"),
    gauge("pig_backend_observed_ttft_p99_seconds", "Its p99 TTFT over the last poll.",
          _per_backend(lambda s, b: s.latency(b, "p99")), "name"),
    gauge("pig_backend_observed_ttft_valid", "Whether its TTFT window is valid.",
          _per_backend(lambda s, b: s.figures(b).ttft is not None), "name"),
)  # fmt: skip


def _backend_routed(s: Scrape) -> Pairs:
    return [
        ({"name": b.name, "reason": reason}, counter.value)
        for b in s.backends
        for reason, counter in b.routed.items()
    ]


def _health_of(s: Scrape, b: BackendMetrics) -> BackendHealth:
    return s.of(b.name).health.of(b.name) or BackendHealth(name=b.name)


_HEALTH: Final = "inference_guard_backend_"

#: Shown with several backends, or with ``PIG_FAILURE_MODE=open``: one series per configured
#: backend (the health state a fixed set of five), read from the core's health state.
HEALTH_ROWS: Final[tuple[Row, ...]] = (
    gauge("inference_guard_failure_mode_open",
          "1 while PIG_FAILURE_MODE=open forwards within GLOBAL_LIMIT for want of metrics.",
          lambda s: failing_open(s.gate)),
    info(_HEALTH + "health_info",
         "Its health now: available, probe (half-open), probing, full or ejected.", "name,state",
         lambda s: tuple({"name": b.name, "state": str(availability(_health_of(s, b), now=s.now))}
                         for b in s.backends)),
    gauge(_HEALTH + "consecutive_failures", "Failures in a row since its latest success.",
          _per_backend(lambda s, b: _health_of(s, b).failures), "name"),
    counter(_HEALTH + "ejections_total", "Times it was ejected after failures.",
            _per_backend(lambda s, b: _health_of(s, b).ejections), "name"),
    counter(_HEALTH + "probes_total", "Probe requests sent to it while half-open.",
            _per_backend(lambda s, b: _health_of(s, b).probes), "name"),
    counter(_HEALTH + "full_total", "Requests its engine refused as full (503 or 429).",
            _per_backend(lambda s, b: _health_of(s, b).full_marks), "name"),
    counter(_HEALTH + "routed_total",
            "Times it was picked, by what chose it: the pool router's prefix affinity or"
            " ranking (PIG_ROUTING=guard) or PIG's backend choice.", _backend_routed,
            "name,reason"),
)  # fmt: skip


def _default_slots(s: Scrape) -> int:
    limit = s.env.global_limit
    return limit if 0 < limit < _DEFAULT_SLOTS else _DEFAULT_SLOTS


CLASSIFIER_ROWS: Final[tuple[Row, ...]] = (
    gauge("pig_json_classify_enabled", "CLASSIFY_OUTPUT_TOKENS.",
          lambda s: bool(s.env.classify_output_tokens)),
    gauge("pig_json_classify_body_bytes", "JSON_CLASSIFY_BODY_BYTES.",
          lambda s: s.env.json_classify_body_bytes),
    gauge("pig_json_classifier_limit", "JSON_CLASSIFY_LIMIT: concurrent classifier slots.",
          lambda s: s.env.json_classify_limit or _default_slots(s)),
    gauge("pig_json_classifier_inflight", "Classifier slots in use.",
          lambda s: s.m.classifier_inflight.value),
    _event_counter("pig_json_classifier_rejected_total",
                   "Classifications refused for want of a slot.", "classifier_rejected"),
    info("pig_path_info", "An admitted path (PIG_PATHS).", "path",
         lambda s: tuple({"path": path} for path in s.settings.paths.paths)),
)  # fmt: skip

_PRIORITY: Final = "pig_backend_priority_"


def _env_value(variable: str, default: int) -> Getter:
    return lambda s: getattr(s.env, variable, default)


PRIORITY_ROWS: Final[tuple[Row, ...]] = (
    gauge(_PRIORITY + "injection_enabled", "BACKEND_PRIORITY_INJECTION_ENABLED.",
          lambda s: bool(s.env.backend_priority_injection_enabled)),
    *(
        gauge(_PRIORITY + suffix, f"{variable.upper()}.", _env_value(variable, default))
        for suffix, variable, default in (
            ("body_bytes", "backend_priority_body_bytes", 33_554_432),
            ("buffer_bytes", "backend_priority_buffer_bytes", 0),
            ("stream_buffer_bytes", "backend_priority_stream_buffer_bytes", 2_097_152),
        )
    ),
    gauge(_PRIORITY + "rewrite_limit", "BACKEND_PRIORITY_REWRITE_LIMIT: concurrent rewrite slots.",
          lambda s: s.env.backend_priority_rewrite_limit or _default_slots(s)),
    gauge(_PRIORITY + "rewrite_inflight", "Rewrite slots in use.",
          lambda s: s.m.priority_rewrite_inflight.value),
    _event_counter(_PRIORITY + "rewrite_total", "Bodies rewritten.", "priority_rewrites"),
    _event_counter(_PRIORITY + "skipped_total", "Bodies left as they were.", "priority_skipped"),
    _event_counter(_PRIORITY + "failed_total", "Rewrites that failed.", "priority_failed"),
    histogram(_PRIORITY + "rewrite_duration_seconds", "Time spent rewriting a body.",
              _event_histogram("priority_rewrite_duration")),
    gauge(_PRIORITY + "rewrite_duration_max_seconds", "Longest rewrite so far.",
          lambda s: s.m.priority_rewrite_duration.max),
)  # fmt: skip


def _per_lane(s: Scrape) -> Iterable[LaneMetrics]:
    return s.m.lanes.values()


def _lane_histogram(pick: str, bounds: tuple[float, ...]) -> Getter:
    def get(s: Scrape) -> list[tuple[dict[str, str], Any, list[int], int, float]]:
        series: list[tuple[dict[str, str], Any, list[int], int, float]] = []
        for m in _per_lane(s):
            h: EventHistogram = getattr(m, pick)
            series.append(({"lane": str(m.lane)}, bounds, h.cumulative(), h.count, h.sum))
        return series

    return get


def _thresholds(lanes: tuple[Lane, ...], values: Thresholds) -> Pairs:
    return [({"lane": str(lane)}, v) for lane, v in zip(lanes, values.values, strict=True)]


def _body_thresholds(s: Scrape) -> Thresholds:
    env = s.env
    return Thresholds((env.medium_body_bytes, env.long_body_bytes, env.very_long_body_bytes))


def _output_thresholds(s: Scrape) -> Thresholds:
    env = s.env
    return Thresholds(
        (env.medium_output_tokens, env.long_output_tokens, env.very_long_output_tokens)
    )


def _effective_output(s: Scrape) -> Thresholds:
    """The output thresholds in force: the adaptive ones when the core learns them."""
    config = s.state.config.adaptive_output
    if config is None:
        return _output_thresholds(s)
    return s.state.traffic.adaptive.effective(config, s.decision.state)


LANE_ROWS: Final[tuple[Row, ...]] = (
    counter("pig_requests_total", "Admission outcomes per lane.",
            lambda s: [row for m in _per_lane(s) for row in (
                ({"lane": str(m.lane), "decision": "accepted"}, m.accepted.value),
                ({"lane": str(m.lane), "decision": "rejected"}, m.rejected.value))],
            "decision,lane"),
    gauge("pig_inflight", "Admitted requests in flight per lane.",
          lambda s: [({"lane": str(m.lane)}, m.inflight.value) for m in _per_lane(s)], "lane"),
    counter("pig_completed_total", "Admitted requests completed per lane.",
            lambda s: [({"lane": str(m.lane)}, m.duration.count) for m in _per_lane(s)], "lane"),
    histogram("pig_request_duration_seconds", "Duration of completed requests per lane.",
              _lane_histogram("duration", DURATION_BUCKETS_S), "lane"),
    counter("pig_response_status_class_total",
            "Completed requests per lane and status class (0xx: invalid; 499 is 4xx).",
            lambda s: [({"lane": str(m.lane), "class": klass}, m.statuses[index])
                       for m in _per_lane(s) for index, klass in enumerate(STATUS_CLASSES)],
            "class,lane"),
    # The count (and +Inf) includes unknown lengths; the other buckets and the sum do not.
    histogram("pig_request_body_bytes", "Request body sizes per lane.",
              _lane_histogram("body_bytes", BODY_BUCKETS_BYTES), "lane"),
    gauge("pig_body_threshold_bytes", "Lowest body size of each body lane.",
          lambda s: _thresholds(_BODY_LANES, _body_thresholds(s)), "lane"),
    gauge("pig_output_threshold_tokens",
          "Configured lowest output-token intent of each output lane.",
          lambda s: _thresholds(_OUTPUT_LANES, _output_thresholds(s)), "lane"),
    gauge("pig_adaptive_output_enabled", "ADAPTIVE_OUTPUT_CLASSIFICATION.",
          lambda s: bool(s.env.adaptive_output_classification)),
    gauge("pig_adaptive_output_samples", "Output-token intents remembered.",
          lambda s: len(s.state.traffic.adaptive.samples)),
    gauge("pig_effective_output_threshold_tokens", "Output-lane thresholds in force.",
          lambda s: _thresholds(_OUTPUT_LANES, _effective_output(s)), "lane"),
)  # fmt: skip


def _per_pool(value: Callable[[GuardState], float]) -> Getter:
    """A getter of one ``{pool}`` sample per pool of ``PIG_POOLS``."""

    def get(s: Scrape) -> Pairs:
        return [({"pool": name}, value(state)) for name, state in s.m.pool_states()]

    return get


_POOL: Final = "inference_guard_pool_"

#: With ``PIG_POOLS``: each pool's own gate (its learned cap, in flight and waiting, by tier).
POOL_ROWS: Final[tuple[Row, ...]] = (
    gauge(_POOL + "limit", "The cap the pool's gate enforces now (learned, or GLOBAL_LIMIT).",
          _per_pool(lambda state: current_limit(state.gate)[0]), "pool"),
    gauge(_POOL + "inflight", "Admitted requests in flight in the pool.",
          _per_pool(lambda state: state.gate.inflight), "pool"),
    gauge(_POOL + "waiting", "Requests waiting for a slot of the pool.",
          _per_pool(lambda state: state.gate.waiting), "pool"),
    info(_POOL + "state_info", "The pool's load state (green, yellow, red).", "pool,state",
         lambda s: tuple({"pool": name, "state": str(state.published.decision.state)}
                         for name, state in s.m.pool_states())),
)  # fmt: skip
