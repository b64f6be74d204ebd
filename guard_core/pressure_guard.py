"""The pressure guard: cap intake just under what the engine carried when it started to strain.

Spec 5.5 step 6.

Reads: running, decoding, waiting, new preemptions, KV usage, per-user speed, capacity demand, the
cap so far (``base``) and the persistent pressure cap learned on earlier polls.
Guarantees:
- it only lowers the cap, never below ``DYNAMIC_PRESSURE_MIN_LIMIT`` (unless the cap so far is
  lower);
- under severe pressure (a preemption, or two or more waiting or KV at 0.80 with at least 16
  running) it learns a pressure cap of 75 % of running and applies it;
- the learned pressure cap climbs back in steps of ``headroom + 1`` while the backend is healthy
  under demand, and is dropped once within ``max(2, 2 %)`` of the base.
"""

from __future__ import annotations

import math

import attrs

from guard_core.policy import PolicyConfig
from guard_core.signals import PollSignals

__all__ = ("PressureOutcome", "guard_pressure", "is_severe", "overload_target")

_KV_YELLOW = 0.70
_KV_RED = 0.80

#: Reasons that make the pressure guard add ``scheduler_pressure_capacity`` to the state.
STATE_REASONS = frozenset(
    {
        "severe_pressure",
        "waiting_pressure",
        "kv_pressure",
        "healthy_kv_headroom",
        "backend_waiting",
        "backend_unavailable",
    }
)


def is_severe(signals: PollSignals, config: PolicyConfig) -> bool:
    """Preemption, or (two or more waiting or KV at 0.80) with enough running to learn from."""
    preempted = signals.preemption_delta > 0
    strained = preempted or signals.waiting >= 2 or signals.kv_usage >= _KV_RED
    return strained and (preempted or signals.running >= config.pressure_learn_min_running)


def overload_target(signals: PollSignals, config: PolicyConfig, base: int) -> tuple[int, str]:
    """The cap the current overload calls for, and its reason; ``(base, "")`` if none applies."""
    h = config.pressure_headroom
    low = min(config.pressure_min_limit, base)
    target, reason = base, ""

    def lower(value: int, why: str) -> None:
        nonlocal target, reason
        value = min(max(value, low), base)
        if value < target:
            target, reason = value, why

    running = signals.running
    if signals.waiting > 0:
        lower(running - max(1, math.ceil(0.5 * signals.waiting)) - h, "backend_waiting")
    if signals.preemption_delta > 0:
        lower(running - max(2 * h, h + 1), "preemption")
    if signals.kv_usage >= _KV_RED:
        lower(running - max(2 * h, h + 1), "kv_red")
    elif signals.kv_usage >= _KV_YELLOW:
        lower(running - h, "kv_yellow")
    user_tps = signals.user_tps
    if signals.user_tps_red_ready and user_tps is not None and 0 < user_tps < config.user_tps_red:
        lower(signals.decode - max(2 * h, h + 1), "pig_red")
    return target, reason


@attrs.frozen(kw_only=True)
class PressureOutcome:
    limit: int
    #: The persistent pressure cap for the next poll (0: none).
    cap: int
    reason: str
    #: Whether ``scheduler_pressure_capacity`` joins the state reasons.
    adds_state_reason: bool
    #: Under severe pressure, the overload that set the target (``preemption``, ``kv_red`` ...).
    target_reason: str = ""


def _recovered_cap(
    config: PolicyConfig, signals: PollSignals, *, base: int, pressure_cap: int
) -> int:
    """A learned pressure cap climbs back while users stay fast under demand."""
    cap = pressure_cap
    rate = signals.generation_tps
    if (
        config.user_tps_enabled
        and signals.waiting == 0
        and signals.capacity_demand
        and 0 < cap < base
        and rate is not None
        and signals.decode >= config.user_tps_min_running
        and rate / signals.decode >= config.user_tps_yellow
    ):
        step = config.pressure_headroom + 1
        stepped = cap + step
        if signals.running >= cap:
            stepped = max(stepped, signals.running + step)
        cap = min(base, stepped)
    return cap


def guard_pressure(
    config: PolicyConfig, signals: PollSignals, *, base: int, pressure_cap: int
) -> PressureOutcome:
    """One poll of the pressure guard."""
    if not config.pressure_enabled or base <= 0 or signals.running <= 0:
        return PressureOutcome(limit=base, cap=pressure_cap, reason="", adds_state_reason=False)
    if signals.freeze:
        return PressureOutcome(
            limit=base, cap=pressure_cap, reason="prefill_transition", adds_state_reason=False
        )
    h = config.pressure_headroom
    running, waiting, kv = signals.running, signals.waiting, signals.kv_usage
    cap = _recovered_cap(config, signals, base=base, pressure_cap=pressure_cap)

    floor = config.pressure_min_limit
    limit, reason = base, ""

    def apply(value: int, why: str) -> None:
        nonlocal limit, reason
        value = max(value, min(floor, base))
        if value < limit:
            limit, reason = value, why

    def learn() -> int | None:
        nonlocal cap
        if running < config.pressure_learn_min_running:
            return None
        learned = max(math.floor(config.pressure_learn_ratio * running), floor)
        if cap == 0 or cap > learned:
            cap = learned
        return learned

    target_reason = ""
    if is_severe(signals, config):
        learned = learn()
        if learned is not None:
            apply(learned, "severe_pressure")
        target, target_reason = overload_target(signals, config, base)
        if target < base:
            apply(target, "severe_pressure")
    if cap > 0:
        kv_pressure = kv >= _KV_YELLOW
        recovered = cap >= base or (
            signals.qos_healthy
            and waiting == 0
            and signals.preemption_delta == 0
            and not kv_pressure
            and running < cap
            and base - cap <= max(2 * h, math.ceil(0.02 * base), 2)
        )
        if recovered:
            cap = base
        else:
            apply(cap, "learned_cap")
    if waiting > 0 and waiting >= config.signals.waiting_yellow:
        learn()
        apply(running - waiting - h, "waiting_pressure")
    if signals.qos_healthy and kv >= _KV_YELLOW:
        apply(math.floor(running * _KV_YELLOW / kv) - h, "healthy_kv_headroom")
    elif not signals.qos_healthy:
        if kv >= _KV_RED:
            learn()
            apply(running - max(2 * h, h + 1), "kv_pressure")
        elif kv >= _KV_YELLOW:
            learn()
            apply(running - h, "kv_pressure")

    if reason == "learned_cap":
        adds = (
            waiting > 0
            or signals.preemption_delta > 0
            or kv >= _KV_YELLOW
            or (running >= limit and signals.capacity_demand)
        )
    else:
        adds = reason in STATE_REASONS
    return PressureOutcome(
        limit=limit, cap=cap, reason=reason, adds_state_reason=adds, target_reason=target_reason
    )
