"""The throughput learner: how many concurrent generations keep every user at the target speed.

Spec 5.3 (capacity estimate) and 5.5 step 4 (the learner and the throughput component).

Reads: the generation rate and its smoothed value, running and decoding requests, per-user speed,
demand (queue, new rejects, tier demand), pressure signals, the TTFT verdict, the previous
learned value, target and component, and the cap so far (``qos_limit``).
Guarantees:
- cold start: a fresh learner assumes ``min(50, GLOBAL_LIMIT)``;
- the component only falls in a *down* state (per-user speed below target with a lower estimate,
  or severe pressure), or with a lower ``qos_limit``; a down state never raises it;
- without demand the component holds (sticky); under demand it grows towards
  ``max(target, learned)`` by at most ``max(8, ceil(25 %))`` per poll;
- the learned value itself grows by ``max(1, ceil(step x learned))`` only after
  ``CAPACITY_HEALTHY_CONSECUTIVE`` healthy, demand-backed polls at 1.5 x the target speed.
"""

from __future__ import annotations

import math

import attrs

from guard_core.cap_learning import CapLearning
from guard_core.policy import PolicyConfig
from guard_core.pressure_guard import is_severe, overload_target
from guard_core.signals import Confidence, PollSignals

__all__ = ("DOWN_PHASES", "ThroughputOutcome", "ThroughputState", "learn_throughput")

_COLD_START = 50
_KV_YELLOW = 0.70
_SPARSE_FLOOR = 4
_DEMAND_FLOOR = 8

#: Phases in which the component may fall below its previous value.
DOWN_PHASES = frozenset({"pig_down", "pressure_down", "learn_down"})


@attrs.frozen(kw_only=True)
class ThroughputState(CapLearning):
    """What the throughput learner carries between polls: its cap's progress
    (:class:`~guard_core.cap_learning.CapLearning`), its component and its projection."""

    #: The active cap this stage contributed last poll (0: none yet).
    component: int = 0
    #: What the capacity estimate projected this poll (after the low-confidence bound and the
    #: raise to a healthy observed load).
    projected: int = 0


@attrs.frozen(kw_only=True)
class ThroughputOutcome:
    state: ThroughputState
    #: The throughput component of the cap; ``None`` when the user-TPS policy is off.
    component: int | None


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(value, high))


@attrs.frozen(kw_only=True)
class _Plan:
    """Where the learner starts this poll and what it aims for."""

    learned: int
    target: int
    target_reason: str
    projected: int
    healthy_count: int
    demand: bool
    has_decode: bool
    healthy_rep: bool
    user_tps: float
    healthy_target: float
    ttft_healthy: bool


def _plan(
    config: PolicyConfig, signals: PollSignals, prev: ThroughputState, *, ttft_healthy: bool
) -> _Plan:
    """Starting point, projection from the estimate, and the probe floors (spec 5.5 step 4)."""
    base = signals.base
    if signals.previous_is_metrics:
        learned = prev.learned if prev.learned > 0 else base
    else:
        learned = min(_COLD_START, base)
    target = prev.target if prev.target > 0 else learned
    target_reason = ""
    healthy_count = prev.healthy_count

    # Projection from the capacity estimate.
    projected = signals.safe_capacity
    if projected > 0:
        projected_reason = "estimate_safe"
    else:
        smoothed = signals.smoothed_tps
        projected = (
            _clamp(math.floor(smoothed * config.capacity_ratio / config.user_tps_yellow), 1, base)
            if smoothed > 0
            else 0
        )
        projected_reason = "smoothed_tps"
    low_confidence = signals.confidence in (Confidence.STALE, Confidence.LOW, Confidence.SPARSE)
    if low_confidence and projected > signals.low_confidence_capacity:
        projected, projected_reason = signals.low_confidence_capacity, "low_confidence_bound"
    if projected > target:
        target, target_reason = projected, projected_reason

    pressure_free = signals.pressure_free
    has_decode = signals.qos_tps_valid and signals.decode >= config.user_tps_min_running
    healthy_target = config.user_tps_yellow * config.capacity_healthy_multiplier
    user_tps = signals.user_tps if signals.user_tps is not None else 0.0
    demand = signals.queue > 0 or signals.reject_delta > 0 or signals.capacity_demand
    healthy_rep = (
        pressure_free
        and signals.estimate_representative
        and has_decode
        and ttft_healthy
        and user_tps >= healthy_target
    )
    if healthy_rep:
        observed = max(signals.running, signals.decode)
        step = max(math.ceil(0.25 * observed), _DEMAND_FLOOR if demand else _SPARSE_FLOOR)
        observed_target = observed + step
        if signals.raw_capacity > 0:
            observed_target = min(observed_target, signals.raw_capacity)
        observed_target = _clamp(observed_target, 1, base)
        projected = max(projected, observed_target)
        if observed_target > target:
            target, target_reason = observed_target, "healthy_observed_load"

    if (
        learned < _DEMAND_FLOOR
        and pressure_free
        and base >= _DEMAND_FLOOR
        and demand
        and has_decode
        and ttft_healthy
        and user_tps >= healthy_target
        and target < _DEMAND_FLOOR
    ):
        target, target_reason = _DEMAND_FLOOR, "demand_probe_floor"
    if (
        learned < _SPARSE_FLOOR
        and pressure_free
        and base >= _SPARSE_FLOOR
        and (
            demand
            or (
                has_decode
                and signals.decode <= _SPARSE_FLOOR
                and user_tps >= config.user_tps_yellow
            )
            or prev.phase == "sparse_probe"
        )
        and target < _SPARSE_FLOOR
    ):
        target, target_reason = _SPARSE_FLOOR, "sparse_probe_floor"

    return _Plan(
        learned=learned,
        target=target,
        target_reason=target_reason,
        projected=projected,
        healthy_count=healthy_count,
        demand=demand,
        has_decode=has_decode,
        healthy_rep=healthy_rep,
        user_tps=user_tps,
        healthy_target=healthy_target,
        ttft_healthy=ttft_healthy,
    )


def _decide(  # noqa: PLR0915 - one rule ladder, read top to bottom as spec 5.5 step 4 a-m
    config: PolicyConfig, signals: PollSignals, prev: ThroughputState, plan: _Plan
) -> ThroughputState:
    """The learner's decision, first matching rule wins (spec 5.5 step 4, a to m)."""
    base = signals.base
    ttft_healthy = plan.ttft_healthy
    learned, target, projected = plan.learned, plan.target, plan.projected
    healthy_count, demand, user_tps = plan.healthy_count, plan.demand, plan.user_tps
    target_reason, healthy_rep = plan.target_reason, plan.healthy_rep
    healthy_target, has_decode = plan.healthy_target, plan.has_decode
    pressure_free = signals.pressure_free
    waiting, preempted, kv = signals.waiting, signals.preemption_delta > 0, signals.kv_usage
    bad_pressure = waiting > 0 or preempted or kv >= _KV_YELLOW

    def decay() -> int:
        return max(0, healthy_count - 1)

    if signals.freeze:
        phase, reason = "prefill_freeze", "prefill_transition"
    elif bad_pressure:
        healthy_count = 0
        if not is_severe(signals, config):
            phase, reason = "pressure_hold", "pressure_not_representative"
        else:
            overload, _why = overload_target(signals, config, base)
            pressure_target = _clamp(overload if overload < base else target, 1, base)
            if pressure_target >= learned:
                phase, reason = "pressure_hold", "pressure_no_lower_target"
            else:
                learned = target = pressure_target
                phase, reason = "pressure_down", "severe_pressure"
    elif not has_decode:
        if target > learned and learned < _SPARSE_FLOOR and pressure_free:
            phase, reason = "sparse_probe", "low_traffic_probe_floor"
        else:
            target = learned
            phase, reason = "no_signal", "no_decode_signal"
    elif user_tps < config.user_tps_yellow and signals.user_tps_yellow_ready:
        healthy_count = 0
        if not signals.estimate_representative:
            phase, reason = "hold_underutilized", "pig_low_underutilized"
        elif 0 < projected < learned:
            learned = target = projected
            phase, reason = "pig_down", "pig_below_target"
        else:
            phase, reason = "pig_hold", "pig_low_without_lower_target"
    elif learned < _SPARSE_FLOOR and target > learned and healthy_rep and demand:
        observed = max(signals.running, signals.decode, _SPARSE_FLOOR)
        recovered = min(target, observed + max(math.ceil(0.25 * observed), _DEMAND_FLOOR))
        if recovered > learned:
            learned = target = recovered
            phase, reason = "sparse_recovery", "healthy_demand_recovery"
        else:
            phase, reason = "hold_near_target", "sparse_recovery_no_gain"
    elif (
        learned < _SPARSE_FLOOR
        and target > learned
        and target_reason == "sparse_probe_floor"
        and pressure_free
    ):
        phase, reason = "sparse_probe", "sparse_probe_floor"
    elif target > learned and target_reason == "demand_probe_floor" and pressure_free:
        phase, reason = "demand_probe", "demand_probe_floor"
    elif 0 < projected < learned and signals.estimate_representative:
        target = projected
        phase, reason = "green_hold", "lower_estimate_without_pressure"
        healthy_count = decay()
    elif projected <= learned:
        target = projected
        phase, reason = "converged", "at_or_above_target"
    elif not signals.estimate_representative:
        phase, reason = "hold_underutilized", "insufficient_representative_load"
        healthy_count = decay()
    elif user_tps < healthy_target or not ttft_healthy:
        phase = "hold_near_target"
        reason = "ttft_not_healthy" if not ttft_healthy else "healthy_margin_not_met"
        healthy_count = decay()
    elif not demand:
        phase, reason = "green_hold", "healthy_without_pressure"
        healthy_count = decay()
    else:
        healthy_count += 1
        if healthy_count < config.capacity_healthy_consecutive:
            phase, reason = "probe_wait", "healthy_window_accumulating"
        else:
            step = max(1, math.ceil(config.capacity_step_up * learned))
            learned = min(projected, learned + step)
            phase, reason, healthy_count = "probe_up", "healthy_window_satisfied", 0

    return ThroughputState(
        learned=learned,
        target=target,
        component=prev.component,
        healthy_count=healthy_count,
        phase=phase,
        reason=reason,
        target_reason=target_reason,
        projected=projected,
    )


def learn_throughput(
    config: PolicyConfig,
    signals: PollSignals,
    previous: ThroughputState,
    *,
    qos_limit: int,
    ttft_healthy: bool,
) -> ThroughputOutcome:
    """One poll of the throughput learner; ``qos_limit`` is the cap computed so far."""
    base = signals.base
    if not config.user_tps_enabled:
        return ThroughputOutcome(state=ThroughputState(), component=None)
    if not config.capacity_learn_enabled:
        state = ThroughputState(learned=base, target=base, component=base, phase="disabled")
        return ThroughputOutcome(
            state=state, component=_component(state, previous, signals, qos_limit)
        )

    prev = previous if signals.previous_is_metrics else ThroughputState()
    plan = _plan(config, signals, prev, ttft_healthy=ttft_healthy)
    state = _decide(config, signals, prev, plan)
    component = _component(state, prev, signals, qos_limit, demand=plan.demand)
    return ThroughputOutcome(state=attrs.evolve(state, component=component), component=component)


def _component(
    state: ThroughputState,
    previous: ThroughputState,
    signals: PollSignals,
    current: int,
    *,
    demand: bool = False,
) -> int:
    """The active cap: sticky without demand, growing in bounded steps under demand."""
    if current <= 0 or state.phase == "disabled":
        return current
    active = previous.component or state.learned or current
    active = _clamp(active, 1, current)
    if signals.freeze:
        return active
    target = _clamp(state.target or state.learned or active, 1, current)
    if state.phase in DOWN_PHASES:
        # A down state lowers the component; it never raises it, even when the learned value it
        # lowers is still above the current component.
        return min(active, _clamp(min(target, state.learned), 1, current))
    if not demand:
        return active
    recovery = _clamp(max(target, state.learned), 1, current)
    if recovery <= active:
        return active
    return min(recovery, active + max(8, math.ceil(0.25 * active)))
