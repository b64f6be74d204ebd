"""``guard_trio._observability.GuardMetrics``: the ``/pig/metrics`` page (spec 10.1-10.2).

The page is parsed back with ``prometheus_client``'s own text parser. Checks:

* every metric of spec 10.2 (the table below, written from the spec's inventory) is on the
  page with its type and label names, and nothing else is (no ``_created`` series);
* ``pig_rejected_total`` carries both the unlabelled total and one sample per lane;
* values follow the state the provider returns (a poll with waiting 3, tier counts, the
  semantic TTFT histogram, per-backend rates and TTFT windows, poll failures) and the event
  instruments the proxy adds to;
* histogram buckets are PIG's, cumulative, with bounds in their shortest form;
* static mode leaves the dynamic block out; the status-line figures come out of the value the
  core published (``runtime_counts``), and in-flight counts per backend out of the core's traffic
  state;
* calling every instrument never raises.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from functools import partial

import pytest
from prometheus_client.parser import text_string_to_metric_families

from guard_adapters.config import Settings, load_config
from guard_adapters.status_line import runtime_counts, status_line
from guard_core import (
    BackendPoll,
    BackendSample,
    Binding,
    GuardState,
    Histogram,
    Lane,
    MetricsPolled,
    Tier,
    apply_guard_event,
)
from guard_core.guard import GuardEvent
from guard_core.traffic import BackendForwarded, RefusedAfterAdmission
from guard_trio._observability import (
    CONTENT_TYPE,
    EventCounter,
    EventGauge,
    EventHistogram,
    GuardMetrics,
)
from tests.core_steps import attempt, with_first_tokens

# name, kind, label names. Kinds: C counter, G gauge, I info (a gauge at 1), H histogram,
# S summary-like (_count and _sum only). "?" marks the ones PIG prints only when set.
INVENTORY = """
pig_version_info                                    I version
pig_uptime_seconds                                  G
pig_rejected_total                                  C
pig_rejected_total                                  C lane
pig_queue_current                                   G
pig_queue_total                                     C
pig_queue_timeout_total                             C
pig_queue_wait_seconds                              S
pig_queue_wait_config_seconds                       G
pig_queue_wait_effective_cap_seconds                G
pig_queue_poll_config_seconds                       G
pig_tier_inflight                                   G tier
pig_tier_waiting                                    G tier
pig_tier_requests_total                             C tier,decision
pig_tier_basic_limit                                G
pig_tier_premium_reserved_capacity                  G
pig_sse_keepalive_streams_total                     C
pig_sse_keepalive_comments_total                    C
pig_sse_bridge_streams_total                        C
pig_sse_bridge_upstream_errors_total                C
pig_sse_bridge_invalid_upstream_total               C
pig_sse_bridge_copy_errors_total                    C
pig_request_semantic_ttft_scan_limit_total          C
pig_request_semantic_ttft_scan_limit_bytes          G
pig_proxy_upstream_errors_total                     C
pig_proxy_body_copy_errors_total                    C
pig_client_disconnects_total                        C phase
pig_client_disconnect_upstream_cancellations_total  C
pig_dynamic_enabled                                 G
pig_dynamic_enforce                                 G
pig_dynamic_poll_total                              C result
pig_dynamic_rejected_total                          C
pig_backend_unavailable_total                       C
pig_backend_count                                   G
pig_decision_duration_seconds                       H
pig_proxy_time_to_first_byte_seconds                H
pig_request_semantic_ttft_seconds                   H
pig_proxy_total_duration_seconds                    H
pig_internal_overhead_seconds                       H
pig_backend_info                                    I name,upstream
pig_backend_inflight                                G name
pig_backend_requests_total                          C name,decision
pig_backend_completed_total                         C name
pig_backend_proxy_errors_total                      C name
pig_backend_body_copy_errors_total                  C name
pig_backend_metrics_failed                          G name
pig_backend_observed_running                        G name
pig_backend_observed_waiting                        G name
pig_backend_observed_kv_cache_usage                 G name
pig_backend_observed_generation_tokens_per_second   G name
pig_backend_observed_generation_tokens_per_second_valid G name
pig_backend_observed_ttft_avg_seconds               G name
pig_backend_observed_ttft_p95_seconds               G name
pig_backend_observed_ttft_p99_seconds               G name
pig_backend_observed_ttft_valid                     G name
inference_guard_failure_mode_open                   G
inference_guard_backend_health_info                 I name,state
inference_guard_backend_consecutive_failures        G name
inference_guard_backend_ejections_total             C name
inference_guard_backend_probes_total                C name
inference_guard_backend_full_total                  C name
inference_guard_backend_routed_total                C name,reason
pig_dynamic_state_info                              I state,source
pig_dynamic_last_update_seconds                     G
pig_dynamic_error_info                              I? message
pig_dynamic_observed_running                        G
pig_dynamic_observed_waiting                        G
pig_dynamic_observed_kv_cache_usage                 G
pig_dynamic_observed_preemptions                    G
pig_dynamic_observed_generation_tokens_total        G
pig_dynamic_observed_generation_tokens_per_second   G
pig_dynamic_observed_generation_tokens_per_second_valid G
pig_dynamic_observed_ttft_count                     G
pig_dynamic_observed_ttft_avg_seconds               G
pig_dynamic_observed_ttft_p95_seconds               G
pig_dynamic_observed_ttft_p99_seconds               G
pig_dynamic_observed_ttft_valid                     G
pig_dynamic_observed_ttft_source_info               I? source
pig_dynamic_observed_ttft_smoothed_avg_seconds      G
pig_dynamic_observed_ttft_smoothed_p95_seconds      G
pig_dynamic_observed_ttft_smoothed_p99_seconds      G
pig_dynamic_ttft_target_seconds                     G
pig_dynamic_ttft_red_seconds                        G
pig_dynamic_ttft_p99_target_seconds                 G
pig_dynamic_ttft_p99_red_seconds                    G
pig_dynamic_ttft_enabled                            G
pig_dynamic_ttft_learned_limit                      G
pig_dynamic_ttft_target_limit                       G
pig_dynamic_ttft_limit                              G
pig_dynamic_ttft_high_count                         G
pig_dynamic_ttft_p99_high_count                     G
pig_dynamic_ttft_healthy_count                      G
pig_dynamic_ttft_learning_info                      I? state
pig_dynamic_ttft_learning_reason_info               I state,reason,target_reason
pig_dynamic_observed_capacity_tokens_per_second     G
pig_dynamic_capacity_estimate_info                  I? confidence
pig_dynamic_capacity_representative_load            G
pig_dynamic_capacity_demand_pressure                G
pig_dynamic_tier_demand_pressure                    G
pig_dynamic_tier_basic_rejected_delta               G
pig_dynamic_tier_premium_rejected_delta             G
pig_dynamic_tier_basic_waiting                      G
pig_dynamic_tier_premium_waiting                    G
pig_dynamic_capacity_raw_limit                      G
pig_dynamic_capacity_safe_limit                     G
pig_dynamic_capacity_low_confidence_limit           G
pig_dynamic_capacity_learning_info                  I mode,state
pig_dynamic_capacity_learning_reason_info           I state,reason,target_reason
pig_dynamic_capacity_projected_limit                G
pig_dynamic_capacity_learned_limit                  G
pig_dynamic_capacity_target_limit                   G
pig_dynamic_capacity_healthy_count                  G
pig_dynamic_observed_single_user_tokens_per_second  G
pig_dynamic_representative_user_tps_load            G
pig_dynamic_single_user_tps_yellow_count            G
pig_dynamic_single_user_tps_red_count               G
pig_dynamic_prefill_protected_running               G
pig_dynamic_prefill_transition_active               G
pig_dynamic_prefill_settling_active                 G
pig_dynamic_decode_running                          G
pig_dynamic_backend_count                           G
pig_dynamic_backend_failed                          G
pig_dynamic_rejected_delta                          G
pig_dynamic_hard_global_limit                       G
pig_dynamic_state_limit                             G
pig_dynamic_throughput_limit                        G
pig_dynamic_availability_limit                      G
pig_dynamic_final_limit_info                        I reason
pig_dynamic_global_limit                            G
pig_dynamic_admission_limit                         G
pig_dynamic_capacity_limit                          G
pig_dynamic_pressure_limit                          G
pig_dynamic_pressure_limit_info                     I reason,target_reason
pig_dynamic_prefill_limit                           G
pig_dynamic_prefill_limit_info                      I reason,target_reason
pig_dynamic_pressure_limit_enabled                  G
pig_dynamic_pressure_headroom                       G
pig_dynamic_pressure_min_limit                      G
pig_dynamic_pressure_learned_cap                    G
pig_dynamic_pressure_learn_ratio                    G
pig_dynamic_pressure_learn_min_running              G
pig_dynamic_single_user_tps_enabled                 G
pig_dynamic_single_user_tps_yellow                  G
pig_dynamic_single_user_tps_red                     G
pig_dynamic_single_user_tps_yellow_consecutive      G
pig_dynamic_single_user_tps_red_consecutive         G
pig_dynamic_single_user_tps_prefill_grace_min_seconds G
pig_dynamic_single_user_tps_prefill_grace_max_seconds G
pig_dynamic_single_user_tps_prefill_grace_body_bytes_per_second G
pig_dynamic_single_user_tps_prefill_grace_multiplier G
pig_dynamic_single_user_tps_capacity_learn_enabled  G
pig_dynamic_single_user_tps_capacity_ratio          G
pig_dynamic_single_user_tps_capacity_ratio_max      G
pig_dynamic_single_user_tps_capacity_probe_step_ratio G
pig_dynamic_single_user_tps_capacity_healthy_consecutive G
pig_dynamic_single_user_tps_capacity_healthy_multiplier G
pig_dynamic_single_user_tps_capacity_smoothing      G
pig_dynamic_reason_info                             I? state,reason
pig_json_classify_enabled                           G
pig_json_classify_body_bytes                        G
pig_json_classifier_limit                           G
pig_json_classifier_inflight                        G
pig_json_classifier_rejected_total                  C
pig_path_info                                       I path
pig_backend_priority_injection_enabled              G
pig_backend_priority_body_bytes                     G
pig_backend_priority_buffer_bytes                   G
pig_backend_priority_stream_buffer_bytes            G
pig_backend_priority_rewrite_limit                  G
pig_backend_priority_rewrite_inflight               G
pig_backend_priority_rewrite_total                  C
pig_backend_priority_skipped_total                  C
pig_backend_priority_failed_total                   C
pig_backend_priority_rewrite_duration_seconds       H
pig_backend_priority_rewrite_duration_max_seconds   G
pig_requests_total                                  C lane,decision
pig_inflight                                        G lane
pig_completed_total                                 C lane
pig_request_duration_seconds                        H lane
pig_response_status_class_total                     C lane,class
pig_request_body_bytes                              H lane
pig_body_threshold_bytes                            G lane
pig_output_threshold_tokens                         G lane
pig_adaptive_output_enabled                         G
pig_adaptive_output_samples                         G
pig_effective_output_threshold_tokens               G lane
"""


def inventory() -> list[tuple[str, str, bool, frozenset[str]]]:
    rows = []
    for text in INVENTORY.strip().splitlines():
        name, kind, *labels = text.split()
        names = frozenset(labels[0].split(",")) if labels else frozenset()
        rows.append((name, kind.rstrip("?"), kind.endswith("?"), names))
    return rows


TWO_BACKENDS = "a=http://a:8000|http://a:8000/metrics,b=http://b:8000|http://b:8000/metrics"
WALL = 1_700_000_000.0


class Rig:
    """Settings, a state the test moves by applying core events, and the metrics over it."""

    def __init__(self, env: dict[str, str]) -> None:
        self.settings: Settings = load_config(env)
        self.state = GuardState.initial(self.settings.guard_config(), at=0.0)
        self.now = 0.0
        self.metrics = GuardMetrics(
            self.settings,
            lambda: self.state,
            version="PIG-test",
            clock=lambda: self.now,
            wall_clock=lambda: WALL + self.now,
        )

    def poll(self, at: float, **samples: BackendSample | None) -> None:
        polls = tuple(
            BackendPoll(name=name, sample=sample, error="" if sample else "connection refused")
            for name, sample in samples.items()
        )
        self.now = at
        self.state = apply_guard_event(self.state, MetricsPolled(at, polls)).state
        self.metrics.record_poll(polls)

    def apply(self, *events: GuardEvent) -> None:
        for event in events:
            self.state = apply_guard_event(self.state, event).state

    def scrape(self) -> Page:
        return Page(self.metrics.exposition().decode())


class Page:
    """The parsed page: every sample by name, with its family's type."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.types: dict[str, str] = {}
        self.samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.types[sample.name] = family.type
                self.samples[sample.name].append((dict(sample.labels), sample.value))

    def value(self, metric: str, /, **labels: str) -> float:
        found = [v for got, v in self.samples[metric] if got == labels]
        assert len(found) == 1, (metric, labels, self.samples.get(metric))
        return found[0]

    def label_sets(self, name: str) -> set[frozenset[str]]:
        return {frozenset(k for k in labels if k != "le") for labels, _ in self.samples[name]}


def sample(
    running: int = 8,
    waiting: int = 0,
    kv: float = 0.2,
    tokens: float = 0.0,
    ttft: Histogram | None = None,
) -> BackendSample:
    return BackendSample(
        running=running, waiting=waiting, kv_usage=kv, generation_tokens=tokens, ttft=ttft
    )


def ttft_histogram(fast: float, slow: float) -> Histogram:
    """A cumulative engine TTFT histogram: ``fast`` samples at <= 0.5 s, ``slow`` at <= 2 s."""
    total = fast + slow
    return Histogram(
        ((0.5, fast), (2.0, total), (float("inf"), total)), total, fast * 0.3 + slow * 1.5
    )


@pytest.fixture
def routed() -> Rig:
    """Two backends, routing on; two polls, the second with 3 waiting on backend a."""
    rig = Rig({"BACKENDS": TWO_BACKENDS})
    rig.poll(1.0, a=sample(tokens=1000, ttft=ttft_histogram(4, 0)), b=sample(running=2))
    rig.poll(
        2.0,
        a=sample(waiting=3, tokens=1500, ttft=ttft_histogram(10, 2)),
        b=sample(running=2, tokens=0),
    )
    return rig


# -- inventory ---------------------------------------------------------------------------------


def test_every_metric_of_the_inventory_is_on_the_page(routed: Rig) -> None:
    page = routed.scrape()
    expected: dict[str, set[frozenset[str]]] = defaultdict(set)
    for name, _kind, _optional, labels in inventory():
        expected[name].add(labels)
    for name, kind, _optional, _labels in inventory():
        if name == "pig_dynamic_error_info":
            continue  # only after a failed round; see test_error_info_after_every_backend_failed
        if kind == "C":
            assert page.types.get(name) == "counter", name
            assert page.label_sets(name) == expected[name], (name, page.label_sets(name))
        elif kind in ("G", "I"):
            assert page.types.get(name) == "gauge", name
            assert page.label_sets(name) == expected[name], (name, page.label_sets(name))
            if kind == "I":
                assert name.endswith("_info")
                assert all(value == 1 for _, value in page.samples[name]), name
        elif kind == "H":
            for suffix in ("_count", "_sum", "_bucket"):
                assert page.types.get(name + suffix) == "histogram", name + suffix
                assert page.label_sets(name + suffix) == expected[name], name + suffix
        else:
            assert kind == "S"
            for suffix in ("_count", "_sum"):
                assert page.types.get(name + suffix) == "summary", name + suffix
            assert name + "_bucket" not in page.samples


def test_nothing_outside_the_inventory_is_on_the_page(routed: Rig) -> None:
    page = routed.scrape()
    known = {name for name, *_ in inventory()}
    for name in page.samples:
        base = name
        for suffix in ("_bucket", "_count", "_sum"):
            if name.endswith(suffix) and name.removesuffix(suffix) in known:
                base = name.removesuffix(suffix)
        assert base in known, name
    assert "_created" not in page.text


def test_rejected_total_has_the_plain_and_the_lane_form(routed: Rig) -> None:
    metrics = routed.metrics
    metrics.rejected.inc()
    metrics.rejected.inc()
    metrics.lanes[Lane.GLOBAL].rejected.inc()
    metrics.lanes[Lane.LONG_BODY].rejected.inc()
    page = routed.scrape()
    assert page.value("pig_rejected_total") == 2
    assert page.value("pig_rejected_total", lane="global") == 1
    assert page.value("pig_rejected_total", lane="long_body") == 1
    assert page.value("pig_requests_total", lane="long_body", decision="rejected") == 1
    assert {labels.get("lane") for labels, _ in page.samples["pig_rejected_total"]} == {
        None,
        *(str(lane) for lane in Lane),
    }


def test_content_type_is_pigs() -> None:
    assert CONTENT_TYPE == "text/plain; version=0.0.4"


# -- values follow the state -------------------------------------------------------------------


def test_dynamic_values_follow_a_poll_with_waiting(routed: Rig) -> None:
    page = routed.scrape()
    assert page.value("pig_dynamic_observed_waiting") == 3
    assert page.value("pig_dynamic_observed_running") == 10
    assert page.value("pig_dynamic_final_limit_info", reason="backend_waiting") == 1
    assert page.value("pig_dynamic_global_limit") == 0
    assert page.value("pig_dynamic_admission_limit") == 0
    assert page.value("pig_dynamic_state_info", state="red", source="metrics") == 1
    assert page.value("pig_dynamic_reason_info", state="red", reason="waiting") == 1
    assert page.value("pig_dynamic_backend_count") == 2
    assert page.value("pig_dynamic_backend_failed") == 0
    assert page.value("pig_dynamic_observed_generation_tokens_total") == 1500
    assert page.value("pig_dynamic_observed_generation_tokens_per_second") == 500
    assert page.value("pig_dynamic_observed_generation_tokens_per_second_valid") == 1
    assert page.value("pig_dynamic_hard_global_limit") == 512
    assert page.value("pig_dynamic_poll_total", result="ok") == 2
    assert page.value("pig_dynamic_last_update_seconds") == int(WALL + 2.0)
    # The backend TTFT window of the second poll: 6 fast and 2 slow samples.
    assert page.value("pig_dynamic_observed_ttft_source_info", source="backend") == 1
    assert page.value("pig_dynamic_observed_ttft_count") == 8
    assert page.value("pig_dynamic_observed_ttft_valid") == 1
    assert page.value("pig_dynamic_observed_ttft_p95_seconds") == 2.0
    assert page.value("pig_dynamic_ttft_enabled") == 1
    assert page.value("pig_dynamic_single_user_tps_capacity_ratio") == 0.42


def test_queue_and_tier_gauges_follow_the_gate() -> None:
    rig = Rig({"DYNAMIC_METRICS_URL": "http://vllm:8000/metrics", "GLOBAL_LIMIT": "8"})
    rig.poll(1.0, backend1=sample(running=1))
    for tier in (Tier.PREMIUM, Tier.BASIC):
        rig.state = attempt(rig.state, 1.5, tier).state
    page = rig.scrape()
    assert page.value("pig_tier_inflight", tier="premium") == 1
    assert page.value("pig_tier_inflight", tier="basic") == 1
    # Gate cap 8 with one premium in flight: basic may hold 6, premium keeps 2.
    assert page.value("pig_tier_basic_limit") == 6
    assert page.value("pig_tier_premium_reserved_capacity") == 2
    assert page.value("pig_queue_current") == 0
    # Backend waiting closes intake: the next basic request waits.
    rig.poll(2.0, backend1=sample(running=1, waiting=1))
    rig.state = attempt(rig.state, 2.1, Tier.BASIC).state
    page = rig.scrape()
    assert page.value("pig_queue_current") == 1
    assert page.value("pig_tier_waiting", tier="basic") == 1
    assert page.value("pig_tier_basic_limit") == 0


def test_semantic_ttft_histogram_is_the_cores() -> None:
    rig = Rig({"DYNAMIC_METRICS_URL": "http://vllm:8000/metrics"})
    rig.state = with_first_tokens(rig.state, 0.05, 0.3, 0.3, 7.0, 4000.0)
    page = rig.scrape()
    name = "pig_request_semantic_ttft_seconds"
    assert page.value(name + "_count") == 5
    assert page.value(name + "_sum") == pytest.approx(4007.65)
    assert page.value(name + "_bucket", le="0.1") == 1
    assert page.value(name + "_bucket", le="0.5") == 3
    assert page.value(name + "_bucket", le="10") == 4
    assert page.value(name + "_bucket", le="1800") == 4
    assert page.value(name + "_bucket", le="+Inf") == 5


def test_per_backend_values_in_routing_mode(routed: Rig) -> None:
    page = routed.scrape()
    assert page.value("pig_backend_info", name="a", upstream="http://a:8000") == 1
    assert page.value("pig_backend_observed_running", name="a") == 8
    assert page.value("pig_backend_observed_waiting", name="a") == 3
    assert page.value("pig_backend_observed_kv_cache_usage", name="a") == pytest.approx(0.2)
    assert page.value("pig_backend_observed_generation_tokens_per_second", name="a") == 500
    assert page.value("pig_backend_observed_generation_tokens_per_second_valid", name="a") == 1
    assert page.value("pig_backend_observed_ttft_valid", name="a") == 1
    assert page.value("pig_backend_observed_ttft_p95_seconds", name="a") == 2.0
    assert page.value("pig_backend_observed_ttft_avg_seconds", name="a") == pytest.approx(
        (6 * 0.3 + 2 * 1.5) / 8
    )
    assert page.value("pig_backend_observed_ttft_valid", name="b") == 0
    # A counter that goes backwards (b: 0 -> 0 is fine, a reset is not) gives no rate.
    routed.poll(3.0, a=sample(tokens=100), b=None)
    page = routed.scrape()
    assert page.value("pig_backend_observed_generation_tokens_per_second_valid", name="a") == 0
    assert page.value("pig_backend_metrics_failed", name="b") == 1
    assert page.value("pig_backend_metrics_failed", name="a") == 0
    assert page.value("pig_backend_requests_total", name="b", decision="failed") == 1
    assert page.value("pig_backend_requests_total", name="a", decision="failed") == 0


def test_error_info_after_every_backend_failed(routed: Rig) -> None:
    routed.poll(3.0, a=None, b=None)
    page = routed.scrape()
    assert page.value("pig_dynamic_poll_total", result="failed") == 1
    [(labels, value)] = page.samples["pig_dynamic_error_info"]
    assert value == 1
    assert "a: connection refused" in labels["message"]
    assert page.value("pig_dynamic_state_info", state="yellow", source="error") == 1
    assert page.value("pig_dynamic_final_limit_info", reason="backend_unavailable") == 1
    assert page.value("pig_dynamic_observed_running") == 0
    assert "pig_dynamic_capacity_estimate_info" not in page.samples
    # The next good round clears it.
    routed.poll(4.0, a=sample(tokens=2000), b=sample(running=2))
    assert "pig_dynamic_error_info" not in routed.scrape().samples


def test_static_mode_leaves_the_dynamic_block_out() -> None:
    rig = Rig({"BACKENDS": TWO_BACKENDS, "DYNAMIC_PIG_ENABLED": "false"})
    page = rig.scrape()
    assert page.value("pig_dynamic_enabled") == 0
    assert page.value("pig_dynamic_enforce") == 0
    assert not [name for name in page.samples if name.startswith("pig_dynamic_observed")]
    assert "pig_dynamic_state_info" not in page.samples
    assert page.value("pig_tier_basic_limit") == 511
    assert page.value("pig_backend_count") == 2


def test_outside_routing_per_backend_observations_stay_zero() -> None:
    rig = Rig({"DYNAMIC_METRICS_URL": "http://vllm:8000/metrics"})
    rig.poll(1.0, backend1=sample(running=5, tokens=10))
    rig.poll(2.0, backend1=None)
    page = rig.scrape()
    assert page.value("pig_backend_observed_running", name="backend1") == 0
    assert page.value("pig_backend_metrics_failed", name="backend1") == 0
    assert page.value("pig_backend_requests_total", name="backend1", decision="failed") == 0
    assert page.value("pig_dynamic_poll_total", result="failed") == 1


def test_uptime_is_whole_seconds_from_the_guards_clock() -> None:
    rig = Rig({})
    rig.now = 12.6
    assert rig.scrape().value("pig_uptime_seconds") == 13


# -- event instruments -------------------------------------------------------------------------


def test_event_counters_reach_the_page(routed: Rig) -> None:
    m = routed.metrics
    m.queue_total.inc()
    m.queue_timeout.inc()
    m.queue_wait.observe(0.25)
    m.queue_wait.observe(0.5)
    m.tier_accepted[Tier.PREMIUM].inc()
    m.tier_rejected[Tier.BASIC].inc(3)
    m.sse_keepalive_comments.inc(7)
    m.disconnect_upstream.inc()
    m.client_disconnect_upstream_cancellations.inc()
    m.backend_unavailable.inc()
    m.backends["a"].accepted.inc()
    routed.apply(BackendForwarded(1.0, "a"))
    m.backends["b"].proxy_errors.inc()
    m.classifier_rejected.inc()
    m.priority_skipped.inc()
    m.lanes[Lane.DEFAULT].accepted.inc()
    m.lanes[Lane.DEFAULT].inflight.inc()
    page = routed.scrape()
    assert page.value("pig_queue_total") == 1
    assert page.value("pig_queue_timeout_total") == 1
    assert page.value("pig_queue_wait_seconds_count") == 2
    assert page.value("pig_queue_wait_seconds_sum") == 0.75
    assert page.value("pig_tier_requests_total", tier="premium", decision="accepted") == 1
    assert page.value("pig_tier_requests_total", tier="basic", decision="rejected") == 3
    assert page.value("pig_sse_keepalive_comments_total") == 7
    assert page.value("pig_client_disconnects_total", phase="upstream") == 1
    assert page.value("pig_client_disconnects_total", phase="queue") == 0
    assert page.value("pig_client_disconnect_upstream_cancellations_total") == 1
    assert page.value("pig_backend_unavailable_total") == 1
    assert page.value("pig_backend_requests_total", name="a", decision="accepted") == 1
    assert page.value("pig_backend_inflight", name="a") == 1
    assert page.value("pig_backend_proxy_errors_total", name="b") == 1
    assert page.value("pig_json_classifier_rejected_total") == 1
    assert page.value("pig_backend_priority_skipped_total") == 1
    assert page.value("pig_requests_total", lane="default", decision="accepted") == 1
    assert page.value("pig_inflight", lane="default") == 1


def test_histograms_are_cumulative_with_pigs_bounds(routed: Rig) -> None:
    m = routed.metrics
    for seconds in (0.05, 0.1, 0.4, 3.0, 5000.0):
        m.decision_duration.observe(seconds)
    m.priority_rewrite_duration.observe(0.0003)
    m.priority_rewrite_duration.observe(0.04)
    page = routed.scrape()
    name = "pig_decision_duration_seconds"
    bounds = [labels["le"] for labels, _ in page.samples[name + "_bucket"]]
    assert bounds == [
        "0.1", "0.25", "0.5", "1", "2", "5", "10", "20", "30", "60", "120", "300", "600",
        "1800", "+Inf",
    ]  # fmt: skip
    values = [value for _, value in page.samples[name + "_bucket"]]
    assert values == sorted(values)
    assert page.value(name + "_bucket", le="0.1") == 2  # a bound is inclusive
    assert page.value(name + "_bucket", le="0.5") == 3
    assert page.value(name + "_bucket", le="1800") == 4
    assert page.value(name + "_bucket", le="+Inf") == 5
    assert page.value(name + "_count") == 5
    prefix = "pig_backend_priority_rewrite_duration"
    assert page.value(prefix + "_seconds_bucket", le="0.0005") == 1
    assert page.value(prefix + "_seconds_bucket", le="0.05") == 2
    assert page.value(prefix + "_max_seconds") == 0.04


def test_lane_completion_and_body_sizes(routed: Rig) -> None:
    lane = routed.metrics.lanes[Lane.MEDIUM_BODY]
    lane.complete(200, 1.5)
    lane.complete(499, 0.2)
    lane.complete(700, 0.2)
    lane.observe_body(70_000)
    lane.observe_body(None)
    page = routed.scrape()
    assert page.value("pig_completed_total", lane="medium_body") == 3
    assert page.value("pig_request_duration_seconds_count", lane="medium_body") == 3
    assert (
        page.value("pig_response_status_class_total", lane="medium_body", **{"class": "2xx"}) == 1
    )
    assert (
        page.value("pig_response_status_class_total", lane="medium_body", **{"class": "4xx"}) == 1
    )
    assert (
        page.value("pig_response_status_class_total", lane="medium_body", **{"class": "0xx"}) == 1
    )
    # The unknown length counts, but only in _count and +Inf.
    name = "pig_request_body_bytes"
    assert page.value(name + "_count", lane="medium_body") == 2
    assert page.value(name + "_sum", lane="medium_body") == 70_000
    assert page.value(name + "_bucket", lane="medium_body", le="131072") == 1
    assert page.value(name + "_bucket", lane="medium_body", le="16777216") == 1
    assert page.value(name + "_bucket", lane="medium_body", le="+Inf") == 2
    assert page.value("pig_body_threshold_bytes", lane="long_body") == 100_000
    assert page.value("pig_effective_output_threshold_tokens", lane="very_long_output") == 8192


def test_dynamic_rejects_come_from_the_core() -> None:
    rig = Rig({"DYNAMIC_METRICS_URL": "http://vllm:8000/metrics", "PIG_QUEUE_WAIT_SECONDS": "0"})
    rig.poll(1.0, backend1=sample(waiting=2))
    for _ in range(3):
        rig.state = attempt(rig.state, 1.1, Tier.BASIC).state
    assert rig.scrape().value("pig_dynamic_rejected_total") == 3


def test_status_counts_feed_the_status_line(routed: Rig) -> None:
    m = routed.metrics
    # Two basic refusals and three requests in flight to a: core state, changed by events.
    routed.apply(*(RefusedAfterAdmission(2.5, Tier.BASIC) for _ in range(2)))
    routed.apply(*(BackendForwarded(2.5, "a") for _ in range(3)))
    # Ten more fast TTFT samples on a since the last poll: p95 = p99 = 0.5 s.
    routed.poll(3.0, a=sample(tokens=2000, ttft=ttft_histogram(20, 2)), b=sample(running=2))
    counts = runtime_counts(routed.state, tuple(m.backends))
    assert counts.tier_reject_delta == (2, 0)
    assert counts.backends["a"].inflight == 3
    assert counts.backends["a"].ttft_valid
    line = status_line(
        routed.state,
        version="v",
        backend_names=tuple(m.backends),
        backend_unavailable_total=int(m.backend_unavailable.value),
        counts=counts,
    )
    assert " tier_reject_delta=2/0 " in line
    assert line.endswith("backend_detail={a:8r/0w/3i/ttft0.50/ttft990.50;b:2r/0w/0i}")
    page = routed.scrape()
    assert page.value("pig_dynamic_tier_basic_rejected_delta") == 2
    # The next round sees only what came since.
    routed.poll(4.0, a=sample(tokens=2500), b=sample(running=2))
    assert runtime_counts(routed.state, tuple(m.backends)).tier_reject_delta == (0, 0)


def test_calling_every_instrument_never_raises(routed: Rig) -> None:
    m = routed.metrics
    calls: list[Callable[[], None]] = []
    for value in vars(m).values():
        instruments = value.values() if isinstance(value, dict) else (value,)
        for instrument in instruments:
            if isinstance(instrument, EventCounter):
                calls.append(instrument.inc)
            elif isinstance(instrument, EventGauge):
                calls.extend((instrument.inc, instrument.dec, partial(instrument.set, 2)))
            elif isinstance(instrument, EventHistogram):
                calls.extend((partial(instrument.observe, 0.3), instrument.observe_unknown))
    for backend in m.backends.values():
        calls.extend((backend.accepted.inc, backend.completed.inc, backend.proxy_errors.inc))
    for lane in m.lanes.values():
        calls.extend((lane.accepted.inc, partial(lane.complete, 200, 0.1)))
        calls.extend((partial(lane.observe_body, None), partial(lane.observe_body, 10)))
    assert len(calls) > 40
    for call in calls:
        for _ in range(100):
            call()
    page = routed.scrape()
    assert page.value("pig_sse_bridge_copy_errors_total") == 100
    assert page.value("pig_completed_total", lane="global") == 100


# -- the predictive learner --------------------------------------------------------------------

PREDICTIVE_FAMILIES = """
inference_guard_predictive_cap_user_tokens_per_second       G
inference_guard_predictive_cap_ttft_seconds                 G
inference_guard_predictive_cap_kv_cache_usage               G
inference_guard_predictive_cap_binding_info                 I binding
inference_guard_predictive_verdict_user_tokens_per_second   G
inference_guard_predictive_verdict_ttft_seconds             G
inference_guard_predictive_verdict_kv_cache_usage           G
inference_guard_predictive_verdict_binding_info             I binding
inference_guard_predictive_cap                              G
inference_guard_predictive_fit_step_base_seconds            G
inference_guard_predictive_fit_per_decoder_seconds          G
inference_guard_predictive_fit_per_kv_seconds               G
inference_guard_predictive_fit_per_prompt_token_seconds     G
inference_guard_predictive_fit_relative_error               G
inference_guard_predictive_fit_observations                 G
inference_guard_predictive_bytes_per_token                  G
inference_guard_predictive_bytes_per_token_learned          G
inference_guard_predictive_decode_seconds                   G
inference_guard_predictive_decoding                         G
inference_guard_predictive_prefilling                       G
inference_guard_predictive_prefill_tokens                   G
inference_guard_predictive_refusals_total                   C binding
"""


def polled_rig(policy: str) -> Rig:
    rig = Rig({"DYNAMIC_METRICS_URL": "http://vllm:8000/metrics", "DYNAMIC_POLICY": policy})
    for second in range(1, 6):
        rig.poll(
            float(second),
            metrics1=BackendSample(
                running=8.0,
                waiting=0.0,
                kv_usage=0.2,
                generation_tokens=300.0 * second,
                prompt_tokens=2000.0 * second,
            ),
        )
    return rig


def predictive_rig() -> Rig:
    return polled_rig("predictive")


def test_the_predictive_block_has_its_families_and_nothing_else_changes() -> None:
    page = predictive_rig().scrape()
    prefix = "inference_guard_predictive_"
    added = {name for name in page.samples if name.startswith(prefix)}
    rows = [line.split() for line in PREDICTIVE_FAMILIES.strip().splitlines()]
    assert added == {row[0] for row in rows}
    for name, kind, *labels in rows:
        assert page.types[name] == ("counter" if kind == "C" else "gauge"), name
        assert page.label_sets(name) == {frozenset(labels[0].split(",")) if labels else frozenset()}
    # The rest of the page is PIG's, family for family, as under PIG's learner.
    pig = polled_rig("pig").scrape()
    assert {name for name in page.samples if not name.startswith(prefix)} == set(pig.samples)


def test_the_predictive_block_follows_the_learner() -> None:
    rig = predictive_rig()
    model = rig.state.predictive
    assert model is not None
    assert model.last_cap is not None
    page = rig.scrape()
    assert page.value("inference_guard_predictive_cap") == model.last_cap.cap
    assert page.value("inference_guard_predictive_cap_user_tokens_per_second") == (
        model.last_cap.user_tps
    )
    binding = str(model.last_cap.binding)
    assert page.value("inference_guard_predictive_cap_binding_info", binding=binding) == 1
    fit = model.fit()
    assert page.value("inference_guard_predictive_fit_observations") == fit.observations
    assert page.value("inference_guard_predictive_fit_relative_error") == fit.relative_error
    assert page.value("inference_guard_predictive_fit_step_base_seconds") == fit.step_base_s
    assert page.value("inference_guard_predictive_bytes_per_token") == 4.0  # nothing learned
    assert page.value("inference_guard_predictive_bytes_per_token_learned") == 0
    assert page.value("inference_guard_predictive_decode_seconds") == model.decode_seconds
    # No attempt judged yet: the verdict reads zero, bound by nothing.
    assert page.value("inference_guard_predictive_verdict_user_tokens_per_second") == 0
    assert page.value("inference_guard_predictive_verdict_binding_info", binding="none") == 1
    rig.state = attempt(rig.state, 5.5, Tier.BASIC, 4000).state
    page = rig.scrape()
    verdict = rig.state.verdict
    assert verdict is not None
    assert page.value("inference_guard_predictive_verdict_user_tokens_per_second") == (
        verdict.user_tps
    )
    assert page.value("inference_guard_predictive_prefilling") == 0  # asked, not forwarded


def test_refusals_are_counted_by_binding_constraint() -> None:
    rig = predictive_rig()
    rig.metrics.predictive_refusals[Binding.SPEED].inc()
    rig.metrics.predictive_refusals[Binding.SPEED].inc()
    rig.metrics.predictive_refusals[Binding.NONE].inc()
    page = rig.scrape()
    assert page.value("inference_guard_predictive_refusals_total", binding="predicted_speed") == 2
    assert page.value("inference_guard_predictive_refusals_total", binding="predicted_ttft") == 0
    assert page.value("inference_guard_predictive_refusals_total", binding="predicted_kv") == 0
    assert page.value("inference_guard_predictive_refusals_total", binding="none") == 1


def test_pigs_learner_has_no_predictive_block(routed: Rig) -> None:
    assert "inference_guard_predictive_" not in routed.scrape().text
