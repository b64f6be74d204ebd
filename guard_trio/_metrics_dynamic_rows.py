"""The page's table for the dynamic block (PIG's learner) and the predictive learner's block.

Reads: one :class:`~guard_trio._metrics_scrape.Scrape` per scrape (the getters' argument).
Guarantees: each row is one metric with PIG's name, type and label names (the
``inference_guard_predictive_*`` ones are this guard's own), in PIG's order; every value is
read from the value the core published after the latest poll (decision, snapshot, TTFT window,
tier deltas) or from the learner's and the predictive learner's state, never recomputed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from guard_core.predictive import Binding, FitSummary, Prediction
from guard_core.ttft_learner import TtftSource
from guard_trio._metrics_page import MetricRow, counter, gauge, info
from guard_trio._metrics_scrape import NO_PREDICTION, Scrape, or_unknown, zero

__all__ = ("DYNAMIC_ROWS", "PREDICTIVE_ROWS")

Row = MetricRow[Scrape]
Labels = tuple[dict[str, str], ...]


def _ttft_source(s: Scrape) -> Labels:
    source = s.ttft.source
    return () if source is TtftSource.NONE else ({"source": str(source)},)


def _reasons(s: Scrape) -> Labels:
    decision = s.decision
    return (
        *({"state": "yellow", "reason": str(r)} for r in decision.yellow_reasons),
        *({"state": "red", "reason": str(r)} for r in decision.red_reasons),
    )


_USER_TPS_SETTINGS: Final = (
    ("_enabled", "_ENABLED", "user_tps_enabled"),
    ("_yellow", "_YELLOW", "user_tps_yellow"),
    ("_red", "_RED", "user_tps_red"),
    ("_yellow_consecutive", "_YELLOW_CONSECUTIVE", "user_tps_yellow_consecutive"),
    ("_red_consecutive", "_RED_CONSECUTIVE", "user_tps_red_consecutive"),
    ("_prefill_grace_min_seconds", "_PREFILL_GRACE_MIN_SECONDS", "prefill_grace_min_s"),
    ("_prefill_grace_max_seconds", "_PREFILL_GRACE_MAX_SECONDS", "prefill_grace_max_s"),
    ("_prefill_grace_body_bytes_per_second", "_PREFILL_GRACE_BODY_BYTES_PER_SECOND",
     "prefill_grace_bytes_per_s"),
    ("_prefill_grace_multiplier", "_PREFILL_GRACE_MULTIPLIER", "prefill_grace_multiplier"),
    ("_capacity_learn_enabled", "_CAPACITY_LEARN_ENABLED", "capacity_learn_enabled"),
    ("_capacity_ratio", "_CAPACITY_RATIO", "capacity_ratio"),
    ("_capacity_ratio_max", "_CAPACITY_RATIO_MAX", "capacity_ratio_max"),
    # PIG's name for the step-up setting.
    ("_capacity_probe_step_ratio", "_CAPACITY_RATIO_STEP_UP", "capacity_step_up"),
    ("_capacity_healthy_consecutive", "_CAPACITY_HEALTHY_CONSECUTIVE",
     "capacity_healthy_consecutive"),
    ("_capacity_healthy_multiplier", "_CAPACITY_HEALTHY_MULTIPLIER",
     "capacity_healthy_multiplier"),
    ("_capacity_smoothing", "_CAPACITY_SMOOTHING", "capacity_smoothing"),
)  # fmt: skip


def _setting(name: str, variable: str, field: str) -> Row:
    """A gauge echoing one of the learner's settings."""
    return gauge(name, f"{variable}.", lambda s: getattr(s.policy, field))


DYNAMIC_ROWS: Final[tuple[Row, ...]] = (
    info("pig_dynamic_state_info", "The published load state and where it came from.",
         "source,state",
         lambda s: ({"state": str(s.decision.state), "source": str(s.decision.source)},)),
    gauge("pig_dynamic_last_update_seconds", "When it was published.", lambda s: s.updated),
    info("pig_dynamic_error_info", "Why the latest poll failed.", "message",
         lambda s: ({"message": s.published.error},)
         if s.published.error and not s.has_snapshot else ()),
    gauge("pig_dynamic_observed_running", "Running requests.", lambda s: s.decision.running),
    gauge("pig_dynamic_observed_waiting", "Waiting requests.", lambda s: s.decision.waiting),
    gauge("pig_dynamic_observed_kv_cache_usage", "Highest KV usage.",
          lambda s: s.decision.kv_usage),
    gauge("pig_dynamic_observed_preemptions", "Preemptions, cumulative.",
          lambda s: s.snap.preemptions),
    gauge("pig_dynamic_observed_generation_tokens_total", "Generated tokens, cumulative.",
          lambda s: s.snap.generation_tokens),
    gauge("pig_dynamic_observed_generation_tokens_per_second", "Generation rate.",
          lambda s: s.signals.generation_tps or 0),
    gauge("pig_dynamic_observed_generation_tokens_per_second_valid",
          "The generation rate is valid.", lambda s: s.signals.generation_tps is not None),
    gauge("pig_dynamic_observed_ttft_count", "TTFT samples in the latest window.",
          lambda s: s.window_value("count")),
    gauge("pig_dynamic_observed_ttft_avg_seconds", "Average TTFT of the latest window.",
          lambda s: s.window_value("avg")),
    gauge("pig_dynamic_observed_ttft_p95_seconds", "p95 TTFT of the latest window.",
          lambda s: s.window_value("p95")),
    gauge("pig_dynamic_observed_ttft_p99_seconds", "p99 TTFT of the latest window.",
          lambda s: s.window_value("p99")),
    gauge("pig_dynamic_observed_ttft_valid", "The TTFT window is valid.",
          lambda s: s.window is not None),
    info("pig_dynamic_observed_ttft_source_info", "Where TTFT is read from.", "source",
         _ttft_source),
    gauge("pig_dynamic_observed_ttft_smoothed_avg_seconds", "Smoothed TTFT average.",
          lambda s: s.ttft.smoothed_avg),
    gauge("pig_dynamic_observed_ttft_smoothed_p95_seconds", "Smoothed TTFT p95.",
          lambda s: s.ttft.smoothed_p95),
    gauge("pig_dynamic_observed_ttft_smoothed_p99_seconds", "Smoothed TTFT p99.",
          lambda s: s.ttft.smoothed_p99),
    _setting("pig_dynamic_ttft_target_seconds", "DYNAMIC_TTFT_TARGET_SECONDS", "ttft_target_s"),
    _setting("pig_dynamic_ttft_red_seconds", "DYNAMIC_TTFT_RED_SECONDS", "ttft_red_s"),
    _setting("pig_dynamic_ttft_p99_target_seconds", "DYNAMIC_TTFT_P99_TARGET_SECONDS",
             "ttft_p99_target_s"),
    _setting("pig_dynamic_ttft_p99_red_seconds", "DYNAMIC_TTFT_P99_RED_SECONDS",
             "ttft_p99_red_s"),
    _setting("pig_dynamic_ttft_enabled", "DYNAMIC_TTFT_ENABLED", "ttft_enabled"),
    gauge("pig_dynamic_ttft_learned_limit", "TTFT learner: learned limit.",
          lambda s: s.ttft.learned),
    gauge("pig_dynamic_ttft_target_limit", "TTFT learner: target limit.",
          lambda s: s.ttft.target),
    gauge("pig_dynamic_ttft_limit", "TTFT component of the cap.",
          lambda s: zero(s.components.ttft)),
    gauge("pig_dynamic_ttft_high_count", "Consecutive high p95 windows.",
          lambda s: s.ttft.high_count),
    gauge("pig_dynamic_ttft_p99_high_count", "Consecutive high p99 windows.",
          lambda s: s.ttft.tail_count),
    gauge("pig_dynamic_ttft_healthy_count", "Consecutive healthy TTFT windows.",
          lambda s: s.ttft.healthy_count),
    info("pig_dynamic_ttft_learning_info", "TTFT learner state.", "state",
         lambda s: ({"state": s.ttft.phase},) if s.ttft.phase else ()),
    info("pig_dynamic_ttft_learning_reason_info",
         "TTFT learner state, reason and target reason.", "reason,state,target_reason",
         # The target reason is derived from which smoothed quantile is over target.
         lambda s: ({"state": s.ttft.phase, "reason": or_unknown(s.ttft.reason),
                     "target_reason": or_unknown(s.ttft.target_reason)},)),
    gauge("pig_dynamic_observed_capacity_tokens_per_second",
          "Smoothed generation rate behind the capacity estimate.",
          lambda s: s.signals.smoothed_tps),
    info("pig_dynamic_capacity_estimate_info", "How far the capacity estimate can be trusted.",
         "confidence",
         lambda s: ({"confidence": str(s.signals.confidence)},) if s.has_snapshot else ()),
    gauge("pig_dynamic_capacity_representative_load", "The load is representative.",
          lambda s: s.signals.estimate_representative),
    gauge("pig_dynamic_capacity_demand_pressure", "Capacity demand pressure.",
          lambda s: s.signals.capacity_demand),
    gauge("pig_dynamic_tier_demand_pressure", "Basic tier held back by the cap.",
          lambda s: s.signals.tier_demand),
    gauge("pig_dynamic_tier_basic_rejected_delta", "Basic rejects since the last poll.",
          lambda s: s.published.tier_reject_delta[0]),
    gauge("pig_dynamic_tier_premium_rejected_delta", "Premium rejects since the last poll.",
          lambda s: s.published.tier_reject_delta[1]),
    gauge("pig_dynamic_tier_basic_waiting", "Basic requests waiting at the poll.",
          lambda s: s.published.tier_waiting[0]),
    gauge("pig_dynamic_tier_premium_waiting", "Premium requests waiting at the poll.",
          lambda s: s.published.tier_waiting[1]),
    gauge("pig_dynamic_capacity_raw_limit", "Capacity estimate, raw.",
          lambda s: s.signals.raw_capacity),
    gauge("pig_dynamic_capacity_safe_limit", "Capacity estimate, safe.",
          lambda s: s.signals.safe_capacity),
    gauge("pig_dynamic_capacity_low_confidence_limit",
          "Capacity estimate bound when it is not trusted.",
          lambda s: s.signals.low_confidence_capacity),
    info("pig_dynamic_capacity_learning_info", "Throughput learner mode and state.",
         "mode,state", lambda s: ({"mode": "clean_cap", "state": s.throughput.phase},)),
    info("pig_dynamic_capacity_learning_reason_info",
         "Throughput learner state, reason and target reason.", "reason,state,target_reason",
         lambda s: ({"state": s.throughput.phase, "reason": or_unknown(s.throughput.reason),
                     "target_reason": or_unknown(s.throughput.target_reason)},)),
    # The throughput learner keeps its projection for this gauge.
    gauge("pig_dynamic_capacity_projected_limit", "Throughput learner projection.",
          lambda s: s.throughput.projected if s.has_snapshot else 0),
    gauge("pig_dynamic_capacity_learned_limit", "Throughput learner: learned limit.",
          lambda s: s.throughput.learned),
    gauge("pig_dynamic_capacity_target_limit", "Throughput learner: target limit.",
          lambda s: s.throughput.target),
    gauge("pig_dynamic_capacity_healthy_count", "Consecutive healthy throughput polls.",
          lambda s: s.throughput.healthy_count),
    gauge("pig_dynamic_observed_single_user_tokens_per_second", "Per-user decode speed.",
          lambda s: s.signals.user_tps or 0),
    gauge("pig_dynamic_representative_user_tps_load", "Enough users to judge their speed.",
          lambda s: s.signals.representative_user_load),
    gauge("pig_dynamic_single_user_tps_yellow_count", "Consecutive slow polls (yellow).",
          lambda s: s.signals.user_tps_yellow_count),
    gauge("pig_dynamic_single_user_tps_red_count", "Consecutive slow polls (red).",
          lambda s: s.signals.user_tps_red_count),
    gauge("pig_dynamic_prefill_protected_running", "Running requests still prefilling.",
          lambda s: s.signals.protected),
    gauge("pig_dynamic_prefill_transition_active", "A prefill transition is on.",
          lambda s: s.signals.transition),
    gauge("pig_dynamic_prefill_settling_active", "Settling after a prefill transition.",
          lambda s: s.signals.transition and not s.signals.freeze),
    gauge("pig_dynamic_decode_running", "Running requests past prefill.",
          lambda s: s.signals.decode),
    gauge("pig_dynamic_backend_count", "Backends polled.", lambda s: s.decision.backend_count),
    gauge("pig_dynamic_backend_failed", "Backends whose poll failed.",
          lambda s: s.decision.backend_failed),
    gauge("pig_dynamic_rejected_delta", "Dynamic rejects since the last poll.",
          lambda s: s.signals.reject_delta),
    gauge("pig_dynamic_hard_global_limit", "GLOBAL_LIMIT component of the cap.",
          lambda s: s.components.hard_global),
    gauge("pig_dynamic_state_limit", "State component of the cap.",
          lambda s: s.components.state),
    gauge("pig_dynamic_throughput_limit", "Throughput component of the cap.",
          lambda s: zero(s.components.throughput)),
    gauge("pig_dynamic_availability_limit", "Availability component of the cap.",
          lambda s: zero(s.components.availability)),
    info("pig_dynamic_final_limit_info", "Which component set the cap.", "reason",
         lambda s: ({"reason": or_unknown(str(s.decision.final_reason))},)),
    gauge("pig_dynamic_global_limit", "The published cap.", lambda s: s.decision.cap),
    gauge("pig_dynamic_admission_limit", "The admission limit: the published cap.",
          lambda s: s.decision.cap),
    gauge("pig_dynamic_capacity_limit", "Throughput component of the cap.",
          lambda s: zero(s.components.throughput)),
    gauge("pig_dynamic_pressure_limit", "Pressure component of the cap.",
          lambda s: zero(s.components.pressure)),
    info("pig_dynamic_pressure_limit_info", "Pressure guard reason and target reason.",
         "reason,target_reason",
         # The target reason is the overload that sets the target under severe pressure.
         lambda s: ({"reason": or_unknown(s.snap.pressure_reason),
                     "target_reason": or_unknown(s.snap.pressure_target_reason)},)),
    gauge("pig_dynamic_prefill_limit", "Prefill component of the cap.",
          lambda s: zero(s.components.prefill)),
    # The core's prefill guard has no target of its own: its target reason stays unknown.
    info("pig_dynamic_prefill_limit_info", "Prefill guard reason and target reason.",
         "reason,target_reason",
         lambda s: ({"reason": or_unknown(s.snap.prefill_reason), "target_reason": "unknown"},)),
    _setting("pig_dynamic_pressure_limit_enabled", "DYNAMIC_PRESSURE_LIMIT_ENABLED",
             "pressure_enabled"),
    _setting("pig_dynamic_pressure_headroom", "DYNAMIC_PRESSURE_HEADROOM", "pressure_headroom"),
    _setting("pig_dynamic_pressure_min_limit", "DYNAMIC_PRESSURE_MIN_LIMIT",
             "pressure_min_limit"),
    gauge("pig_dynamic_pressure_learned_cap", "The persistent pressure cap (0: none).",
          lambda s: s.state.learner.pressure_cap),
    _setting("pig_dynamic_pressure_learn_ratio", "DYNAMIC_PRESSURE_LEARN_RATIO",
             "pressure_learn_ratio"),
    _setting("pig_dynamic_pressure_learn_min_running", "DYNAMIC_PRESSURE_LEARN_MIN_RUNNING",
             "pressure_learn_min_running"),
    *(
        _setting("pig_dynamic_single_user_tps" + suffix, f"DYNAMIC_SINGLE_USER_TPS{variable}",
                 field)
        for suffix, variable, field in _USER_TPS_SETTINGS
    ),
    info("pig_dynamic_reason_info", "One line per reason of the load state.", "reason,state",
         _reasons),
)  # fmt: skip

_PREDICTIVE: Final = "inference_guard_predictive_"


def _shown(which: str, s: Scrape) -> Prediction:
    model = s.state.predictive
    assert model is not None
    prediction = model.last_cap if which == "cap" else s.state.verdict
    return prediction or NO_PREDICTION


def _explanation(which: str, what: str) -> tuple[Row, ...]:
    """The prediction behind the latest cap (``cap``) or the latest verdict (``verdict``)."""
    prefix = f"{_PREDICTIVE}{which}_"
    return (
        gauge(prefix + "user_tokens_per_second",
              f"Predicted per-user decode speed for {what}.",
              lambda s: _shown(which, s).user_tps),
        gauge(prefix + "ttft_seconds",
              f"Predicted time to first token (queueing and interference) for {what}.",
              lambda s: _shown(which, s).ttft_s),
        gauge(prefix + "kv_cache_usage", f"Predicted KV-cache usage for {what}.",
              lambda s: _shown(which, s).kv_usage),
        info(prefix + "binding_info", f"The constraint that bound {what} (none: nothing did).",
             "binding", lambda s: ({"binding": str(_shown(which, s).binding)},)),
    )  # fmt: skip


def _fit(s: Scrape) -> FitSummary:
    model = s.state.predictive
    assert model is not None
    return FitSummary.of(model.fit())


def _model(field: str) -> Callable[[Scrape], Any]:
    def get(s: Scrape) -> Any:
        return getattr(s.state.predictive, field)

    return get


PREDICTIVE_ROWS: Final[tuple[Row, ...]] = (
    *_explanation("cap", "the cap published at the latest poll"),
    *_explanation("verdict", "the latest admission attempt it judged"),
    gauge(_PREDICTIVE + "cap",
          "The cap the learner set at the latest poll (requests in flight), before PIG's"
          " intake rules and hard limits.", lambda s: _shown("cap", s).cap),
    gauge(_PREDICTIVE + "fit_step_base_seconds",
          "Engine model: seconds of one step with nothing decoding.",
          lambda s: _fit(s).step_base_s),
    gauge(_PREDICTIVE + "fit_per_decoder_seconds",
          "Engine model: seconds each decoding sequence adds to a step.",
          lambda s: _fit(s).per_decoder_s),
    gauge(_PREDICTIVE + "fit_per_kv_seconds",
          "Engine model: seconds a full KV cache adds to a step.", lambda s: _fit(s).per_kv_s),
    gauge(_PREDICTIVE + "fit_per_prompt_token_seconds",
          "Engine model: seconds of engine time each prompt token takes to prefill.",
          lambda s: _fit(s).per_prompt_token_s),
    gauge(_PREDICTIVE + "fit_relative_error",
          "Engine model: smoothed relative error of its inter-token latency predictions.",
          lambda s: _fit(s).relative_error),
    gauge(_PREDICTIVE + "fit_observations", "Engine model: poll intervals it has learned from.",
          lambda s: _fit(s).observations),
    gauge(_PREDICTIVE + "bytes_per_token",
          "Request body bytes per prompt token in use (learned, or"
          " DYNAMIC_PREDICTIVE_BYTES_PER_TOKEN until learned).", _model("ratio")),
    gauge(_PREDICTIVE + "bytes_per_token_learned",
          "The bytes per token come from the backend's prompt-token counter.",
          lambda s: s.state.predictive is not None
          and s.state.predictive.bytes_per_token is not None),
    gauge(_PREDICTIVE + "decode_seconds",
          "How long a forwarded request decodes, learned from the finished ones.",
          _model("decode_seconds")),
    gauge(_PREDICTIVE + "decoding", "Forwarded requests that have had their first token.",
          _model("decoders")),
    gauge(_PREDICTIVE + "prefilling", "Forwarded requests still waiting for their first token.",
          _model("pending_count")),
    gauge(_PREDICTIVE + "prefill_tokens",
          "Estimated prompt tokens of the requests still waiting for their first token.",
          _model("pending_tokens")),
    counter(_PREDICTIVE + "refusals_total",
            "429s from admission by the constraint that refused them (none: the gate's"
            " tier, limit or intake rules).",
            lambda s: [({"binding": str(b)}, s.m.predictive_refusals[b].value) for b in Binding],
            "binding"),
)  # fmt: skip
