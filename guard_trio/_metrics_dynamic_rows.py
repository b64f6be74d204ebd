"""The page's table for the dynamic block (PIG's learner) and the predictive learner's block.

Reads: one :class:`~guard_trio._metrics_scrape.Scrape` per scrape (the getters' argument).
Guarantees: each row is one metric with PIG's name, type and label names (the
``inference_guard_predictive_*`` ones are this guard's own), in PIG's order; every value is
read from the value the core published after the latest poll (decision, snapshot, TTFT window,
tier deltas) or from the learner's and the predictive learner's state, never recomputed. Most
of the dynamic block is a text table of ``name path help`` lines
(:func:`~guard_trio._metrics_page.gauge_table`); the rows that are more than one read
(info metrics, validity flags) are written out and placed by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from guard_core.cap_learning import CapLearning
from guard_core.predictive import Binding, FitSummary, Prediction
from guard_core.ttft_learner import TtftSource
from guard_trio._metrics_page import MetricRow, counter, gauge, gauge_table, info
from guard_trio._metrics_scrape import NO_PREDICTION, Scrape, or_unknown

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


def _learning(learner: CapLearning) -> Labels:
    return ({"state": learner.phase, "reason": or_unknown(learner.reason),
             "target_reason": or_unknown(learner.target_reason)},)  # fmt: skip


_SPECIAL: Final[tuple[Row, ...]] = (
    info("pig_dynamic_state_info", "The published load state and where it came from.",
         "source,state",
         lambda s: ({"state": str(s.decision.state), "source": str(s.decision.source)},)),
    info("pig_dynamic_error_info", "Why the latest poll failed.", "message",
         lambda s: ({"message": s.published.error},)
         if s.published.error and not s.has_snapshot else ()),
    gauge("pig_dynamic_observed_generation_tokens_per_second_valid",
          "The generation rate is valid.", lambda s: s.signals.generation_tps is not None),
    gauge("pig_dynamic_observed_ttft_valid", "The TTFT window is valid.",
          lambda s: s.window is not None),
    info("pig_dynamic_observed_ttft_source_info", "Where TTFT is read from.", "source",
         _ttft_source),
    info("pig_dynamic_ttft_learning_info", "TTFT learner state.", "state",
         lambda s: ({"state": s.ttft.phase},) if s.ttft.phase else ()),
    # The target reason is derived from which smoothed quantile is over target.
    info("pig_dynamic_ttft_learning_reason_info",
         "TTFT learner state, reason and target reason.", "reason,state,target_reason",
         lambda s: _learning(s.ttft)),
    info("pig_dynamic_capacity_estimate_info", "How far the capacity estimate can be trusted.",
         "confidence",
         lambda s: ({"confidence": str(s.signals.confidence)},) if s.has_snapshot else ()),
    info("pig_dynamic_capacity_learning_info", "Throughput learner mode and state.",
         "mode,state", lambda s: ({"mode": "clean_cap", "state": s.throughput.phase},)),
    info("pig_dynamic_capacity_learning_reason_info",
         "Throughput learner state, reason and target reason.", "reason,state,target_reason",
         lambda s: _learning(s.throughput)),
    # The throughput learner keeps its projection for this gauge.
    gauge("pig_dynamic_capacity_projected_limit", "Throughput learner projection.",
          lambda s: s.throughput.projected if s.has_snapshot else 0),
    gauge("pig_dynamic_prefill_settling_active", "Settling after a prefill transition.",
          lambda s: s.signals.transition and not s.signals.freeze),
    info("pig_dynamic_final_limit_info", "Which component set the cap.", "reason",
         lambda s: ({"reason": or_unknown(str(s.decision.final_reason))},)),
    # The target reason is the overload that sets the target under severe pressure.
    info("pig_dynamic_pressure_limit_info", "Pressure guard reason and target reason.",
         "reason,target_reason",
         lambda s: ({"reason": or_unknown(s.snap.pressure_reason),
                     "target_reason": or_unknown(s.snap.pressure_target_reason)},)),
    # The core's prefill guard has no target of its own: its target reason stays unknown.
    info("pig_dynamic_prefill_limit_info", "Prefill guard reason and target reason.",
         "reason,target_reason",
         lambda s: ({"reason": or_unknown(s.snap.prefill_reason), "target_reason": "unknown"},)),
    info("pig_dynamic_reason_info", "One line per reason of the load state.", "reason,state",
         _reasons),
)  # fmt: skip

# name, what it reads (a trailing ? reads None as 0), help. "policy." reads the settings.
DYNAMIC_ROWS: Final[tuple[Row, ...]] = gauge_table(
    """
@pig_dynamic_state_info
pig_dynamic_last_update_seconds             updated                  When it was published.
@pig_dynamic_error_info
pig_dynamic_observed_running                decision.running         Running requests.
pig_dynamic_observed_waiting                decision.waiting         Waiting requests.
pig_dynamic_observed_kv_cache_usage         decision.kv_usage        Highest KV usage.
pig_dynamic_observed_preemptions            snap.preemptions         Preemptions, cumulative.
pig_dynamic_observed_generation_tokens_total  snap.generation_tokens  Generated tokens, cumulative.
pig_dynamic_observed_generation_tokens_per_second  signals.generation_tps?  Generation rate.
@pig_dynamic_observed_generation_tokens_per_second_valid
pig_dynamic_observed_ttft_count             window.count?            TTFT samples in the latest window.
pig_dynamic_observed_ttft_avg_seconds       window.avg?              Average TTFT of the latest window.
pig_dynamic_observed_ttft_p95_seconds       window.p95?              p95 TTFT of the latest window.
pig_dynamic_observed_ttft_p99_seconds       window.p99?              p99 TTFT of the latest window.
@pig_dynamic_observed_ttft_valid
@pig_dynamic_observed_ttft_source_info
pig_dynamic_observed_ttft_smoothed_avg_seconds  ttft.smoothed_avg    Smoothed TTFT average.
pig_dynamic_observed_ttft_smoothed_p95_seconds  ttft.smoothed_p95    Smoothed TTFT p95.
pig_dynamic_observed_ttft_smoothed_p99_seconds  ttft.smoothed_p99    Smoothed TTFT p99.
pig_dynamic_ttft_target_seconds             policy.ttft_target_s     DYNAMIC_TTFT_TARGET_SECONDS.
pig_dynamic_ttft_red_seconds                policy.ttft_red_s        DYNAMIC_TTFT_RED_SECONDS.
pig_dynamic_ttft_p99_target_seconds         policy.ttft_p99_target_s  DYNAMIC_TTFT_P99_TARGET_SECONDS.
pig_dynamic_ttft_p99_red_seconds            policy.ttft_p99_red_s    DYNAMIC_TTFT_P99_RED_SECONDS.
pig_dynamic_ttft_enabled                    policy.ttft_enabled      DYNAMIC_TTFT_ENABLED.
pig_dynamic_ttft_learned_limit              ttft.learned             TTFT learner: learned limit.
pig_dynamic_ttft_target_limit               ttft.target              TTFT learner: target limit.
pig_dynamic_ttft_limit                      components.ttft?         TTFT component of the cap.
pig_dynamic_ttft_high_count                 ttft.high_count          Consecutive high p95 windows.
pig_dynamic_ttft_p99_high_count             ttft.tail_count          Consecutive high p99 windows.
pig_dynamic_ttft_healthy_count              ttft.healthy_count       Consecutive healthy TTFT windows.
@pig_dynamic_ttft_learning_info
@pig_dynamic_ttft_learning_reason_info
pig_dynamic_observed_capacity_tokens_per_second  signals.smoothed_tps  Smoothed generation rate behind the capacity estimate.
@pig_dynamic_capacity_estimate_info
pig_dynamic_capacity_representative_load    signals.estimate_representative  The load is representative.
pig_dynamic_capacity_demand_pressure        signals.capacity_demand  Capacity demand pressure.
pig_dynamic_tier_demand_pressure            signals.tier_demand      Basic tier held back by the cap.
pig_dynamic_tier_basic_rejected_delta       published.tier_reject_delta.0  Basic rejects since the last poll.
pig_dynamic_tier_premium_rejected_delta     published.tier_reject_delta.1  Premium rejects since the last poll.
pig_dynamic_tier_basic_waiting              published.tier_waiting.0  Basic requests waiting at the poll.
pig_dynamic_tier_premium_waiting            published.tier_waiting.1  Premium requests waiting at the poll.
pig_dynamic_capacity_raw_limit              signals.raw_capacity     Capacity estimate, raw.
pig_dynamic_capacity_safe_limit             signals.safe_capacity    Capacity estimate, safe.
pig_dynamic_capacity_low_confidence_limit   signals.low_confidence_capacity  Capacity estimate bound when it is not trusted.
@pig_dynamic_capacity_learning_info
@pig_dynamic_capacity_learning_reason_info
@pig_dynamic_capacity_projected_limit
pig_dynamic_capacity_learned_limit          throughput.learned       Throughput learner: learned limit.
pig_dynamic_capacity_target_limit           throughput.target        Throughput learner: target limit.
pig_dynamic_capacity_healthy_count          throughput.healthy_count  Consecutive healthy throughput polls.
pig_dynamic_observed_single_user_tokens_per_second  signals.user_tps?  Per-user decode speed.
pig_dynamic_representative_user_tps_load    signals.representative_user_load  Enough users to judge their speed.
pig_dynamic_single_user_tps_yellow_count    signals.user_tps_yellow_count  Consecutive slow polls (yellow).
pig_dynamic_single_user_tps_red_count       signals.user_tps_red_count  Consecutive slow polls (red).
pig_dynamic_prefill_protected_running       signals.protected        Running requests still prefilling.
pig_dynamic_prefill_transition_active       signals.transition       A prefill transition is on.
@pig_dynamic_prefill_settling_active
pig_dynamic_decode_running                  signals.decode           Running requests past prefill.
pig_dynamic_backend_count                   decision.backend_count   Backends polled.
pig_dynamic_backend_failed                  decision.backend_failed  Backends whose poll failed.
pig_dynamic_rejected_delta                  signals.reject_delta     Dynamic rejects since the last poll.
pig_dynamic_hard_global_limit               components.hard_global   GLOBAL_LIMIT component of the cap.
pig_dynamic_state_limit                     components.state         State component of the cap.
pig_dynamic_throughput_limit                components.throughput?   Throughput component of the cap.
pig_dynamic_availability_limit              components.availability?  Availability component of the cap.
@pig_dynamic_final_limit_info
pig_dynamic_global_limit                    decision.cap             The published cap.
pig_dynamic_admission_limit                 decision.cap             The admission limit: the published cap.
pig_dynamic_capacity_limit                  components.throughput?   Throughput component of the cap.
pig_dynamic_pressure_limit                  components.pressure?     Pressure component of the cap.
@pig_dynamic_pressure_limit_info
pig_dynamic_prefill_limit                   components.prefill?      Prefill component of the cap.
@pig_dynamic_prefill_limit_info
pig_dynamic_pressure_limit_enabled          policy.pressure_enabled  DYNAMIC_PRESSURE_LIMIT_ENABLED.
pig_dynamic_pressure_headroom               policy.pressure_headroom  DYNAMIC_PRESSURE_HEADROOM.
pig_dynamic_pressure_min_limit              policy.pressure_min_limit  DYNAMIC_PRESSURE_MIN_LIMIT.
pig_dynamic_pressure_learned_cap            state.learner.pressure_cap  The persistent pressure cap (0: none).
pig_dynamic_pressure_learn_ratio            policy.pressure_learn_ratio  DYNAMIC_PRESSURE_LEARN_RATIO.
pig_dynamic_pressure_learn_min_running      policy.pressure_learn_min_running  DYNAMIC_PRESSURE_LEARN_MIN_RUNNING.
pig_dynamic_single_user_tps_enabled         policy.user_tps_enabled  DYNAMIC_SINGLE_USER_TPS_ENABLED.
pig_dynamic_single_user_tps_yellow          policy.user_tps_yellow   DYNAMIC_SINGLE_USER_TPS_YELLOW.
pig_dynamic_single_user_tps_red             policy.user_tps_red      DYNAMIC_SINGLE_USER_TPS_RED.
pig_dynamic_single_user_tps_yellow_consecutive  policy.user_tps_yellow_consecutive  DYNAMIC_SINGLE_USER_TPS_YELLOW_CONSECUTIVE.
pig_dynamic_single_user_tps_red_consecutive  policy.user_tps_red_consecutive  DYNAMIC_SINGLE_USER_TPS_RED_CONSECUTIVE.
pig_dynamic_single_user_tps_prefill_grace_min_seconds  policy.prefill_grace_min_s  DYNAMIC_SINGLE_USER_TPS_PREFILL_GRACE_MIN_SECONDS.
pig_dynamic_single_user_tps_prefill_grace_max_seconds  policy.prefill_grace_max_s  DYNAMIC_SINGLE_USER_TPS_PREFILL_GRACE_MAX_SECONDS.
pig_dynamic_single_user_tps_prefill_grace_body_bytes_per_second  policy.prefill_grace_bytes_per_s  DYNAMIC_SINGLE_USER_TPS_PREFILL_GRACE_BODY_BYTES_PER_SECOND.
pig_dynamic_single_user_tps_prefill_grace_multiplier  policy.prefill_grace_multiplier  DYNAMIC_SINGLE_USER_TPS_PREFILL_GRACE_MULTIPLIER.
pig_dynamic_single_user_tps_capacity_learn_enabled  policy.capacity_learn_enabled  DYNAMIC_SINGLE_USER_TPS_CAPACITY_LEARN_ENABLED.
pig_dynamic_single_user_tps_capacity_ratio  policy.capacity_ratio    DYNAMIC_SINGLE_USER_TPS_CAPACITY_RATIO.
pig_dynamic_single_user_tps_capacity_ratio_max  policy.capacity_ratio_max  DYNAMIC_SINGLE_USER_TPS_CAPACITY_RATIO_MAX.
pig_dynamic_single_user_tps_capacity_probe_step_ratio  policy.capacity_step_up  DYNAMIC_SINGLE_USER_TPS_CAPACITY_RATIO_STEP_UP.
pig_dynamic_single_user_tps_capacity_healthy_consecutive  policy.capacity_healthy_consecutive  DYNAMIC_SINGLE_USER_TPS_CAPACITY_HEALTHY_CONSECUTIVE.
pig_dynamic_single_user_tps_capacity_healthy_multiplier  policy.capacity_healthy_multiplier  DYNAMIC_SINGLE_USER_TPS_CAPACITY_HEALTHY_MULTIPLIER.
pig_dynamic_single_user_tps_capacity_smoothing  policy.capacity_smoothing  DYNAMIC_SINGLE_USER_TPS_CAPACITY_SMOOTHING.
@pig_dynamic_reason_info
""",  # noqa: E501 - a table, one metric a line
    _SPECIAL,
)

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


def _fit_reader(field: str) -> Callable[[Scrape], float]:
    return lambda s: float(getattr(_fit(s), field))


_PREDICTIVE_SPECIAL: Final[tuple[Row, ...]] = (
    *_explanation("cap", "the cap published at the latest poll"),
    *_explanation("verdict", "the latest admission attempt it judged"),
    gauge(_PREDICTIVE + "cap",
          "The cap the learner set at the latest poll (requests in flight), before PIG's"
          " intake rules and hard limits.", lambda s: _shown("cap", s).cap),
    *(
        gauge(_PREDICTIVE + "fit_" + name, "Engine model: " + help_text,
              _fit_reader(field))
        for name, field, help_text in (
            ("step_base_seconds", "step_base_s", "seconds of one step with nothing decoding."),
            ("per_decoder_seconds", "per_decoder_s",
             "seconds each decoding sequence adds to a step."),
            ("per_kv_seconds", "per_kv_s", "seconds a full KV cache adds to a step."),
            ("per_prompt_token_seconds", "per_prompt_token_s",
             "seconds of engine time each prompt token takes to prefill."),
            ("relative_error", "relative_error",
             "smoothed relative error of its inter-token latency predictions."),
            ("observations", "observations", "poll intervals it has learned from."),
        )
    ),
    gauge(_PREDICTIVE + "bytes_per_token_learned",
          "The bytes per token come from the backend's prompt-token counter.",
          lambda s: s.state.predictive is not None
          and s.state.predictive.bytes_per_token is not None),
    counter(_PREDICTIVE + "refusals_total",
            "429s from admission by the constraint that refused them (none: the gate's"
            " tier, limit or intake rules).",
            lambda s: [({"binding": str(b)}, s.m.predictive_refusals[b].value) for b in Binding],
            "binding"),
)  # fmt: skip

PREDICTIVE_ROWS: Final[tuple[Row, ...]] = gauge_table(
    """
@inference_guard_predictive_cap_user_tokens_per_second
@inference_guard_predictive_cap_ttft_seconds
@inference_guard_predictive_cap_kv_cache_usage
@inference_guard_predictive_cap_binding_info
@inference_guard_predictive_verdict_user_tokens_per_second
@inference_guard_predictive_verdict_ttft_seconds
@inference_guard_predictive_verdict_kv_cache_usage
@inference_guard_predictive_verdict_binding_info
@inference_guard_predictive_cap
@inference_guard_predictive_fit_step_base_seconds
@inference_guard_predictive_fit_per_decoder_seconds
@inference_guard_predictive_fit_per_kv_seconds
@inference_guard_predictive_fit_per_prompt_token_seconds
@inference_guard_predictive_fit_relative_error
@inference_guard_predictive_fit_observations
inference_guard_predictive_bytes_per_token  state.predictive.ratio  Request body bytes per prompt token in use (learned, or DYNAMIC_PREDICTIVE_BYTES_PER_TOKEN until learned).
@inference_guard_predictive_bytes_per_token_learned
inference_guard_predictive_decode_seconds  state.predictive.decode_seconds  How long a forwarded request decodes, learned from the finished ones.
inference_guard_predictive_decoding  state.predictive.decoders  Forwarded requests that have had their first token.
inference_guard_predictive_prefilling  state.predictive.pending_count  Forwarded requests still waiting for their first token.
inference_guard_predictive_prefill_tokens  state.predictive.pending_tokens  Estimated prompt tokens of the requests still waiting for their first token.
@inference_guard_predictive_refusals_total
""",  # noqa: E501 - a table, one metric a line
    _PREDICTIVE_SPECIAL,
)
