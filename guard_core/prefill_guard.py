"""Prefill: which admitted requests are still reading their prompt, and the guard that stops a
burst of long prompts from looking like spare capacity (spec 4.5, 5.3, 5.5 step 7).

Reads: when each admitted request started and its body size (the grace period grows with it),
running and decoding requests, waiting, the smoothed generation rate and the previous learned
values.
Guarantees:
- a request is prefill-protected from admission until ``clamp(max(MIN, bytes / rate x
  multiplier), MAX)`` seconds later, or until it finishes, whichever is first;
- the guard acts only during a prefill transition, only lowers the cap, and never below
  ``min(max(4, MIN_LIMIT), cap so far)``; when it limits, it keeps at least a floor of 16-20 so a
  prefill burst never starves intake.
"""

from __future__ import annotations

import math

import attrs

from guard_core.policy import PolicyConfig
from guard_core.signals import PollSignals

__all__ = ("PrefillOutcome", "grace_s", "guard_prefill", "prefill_freeze")


def grace_s(config: PolicyConfig, body_bytes: int | None) -> float:
    """How long a newly admitted request counts as prefilling; 0 when the policy is off."""
    if not config.user_tps_enabled:
        return 0.0
    size = max(body_bytes or 0, 0)
    seconds = size / config.prefill_grace_bytes_per_s * config.prefill_grace_multiplier
    return min(max(config.prefill_grace_min_s, seconds), config.prefill_grace_max_s)


def prefill_freeze(running: int, protected: int) -> bool:
    """Enough requests are prefilling that per-user speed says nothing about capacity.

    >>> prefill_freeze(75, 1), prefill_freeze(75, 10), prefill_freeze(75, 20), prefill_freeze(4, 4)
    (False, False, True, True)
    """
    if protected <= 0:
        return False
    if protected >= running:
        return True
    needed = 2 if running < 16 else 4 if running < 32 else 8
    return protected >= needed and 4 * protected >= running


@attrs.frozen(kw_only=True)
class PrefillOutcome:
    limit: int
    reason: str


def guard_prefill(
    config: PolicyConfig,
    signals: PollSignals,
    *,
    qos_limit: int,
    observed_candidates: tuple[int, ...],
    learned: int,
    throughput_down: bool,
) -> PrefillOutcome:
    """One poll of the prefill guard. ``observed_candidates``: earlier learned values and caps."""
    base = qos_limit
    if not signals.transition:
        return PrefillOutcome(limit=base, reason="")
    h = config.pressure_headroom
    lowest = min(max(4, config.pressure_min_limit), base)
    rate_cap = math.floor(signals.smoothed_tps / config.user_tps_yellow)
    candidates = [v for v in (*observed_candidates, rate_cap) if 0 < v < base]
    observed = max(candidates, default=0)
    floor = 0
    if observed > 0:
        floor = min(max(math.ceil(0.33 * observed), 16), 20, config.global_limit)
    threshold = 16 if observed == 0 else min(max(math.ceil(0.75 * observed), 12), 24)

    limit, reason = base, ""

    def apply(value: int, why: str) -> None:
        nonlocal limit, reason
        value = max(value, lowest)
        if value < limit:
            limit, reason = value, why

    def raise_to_floor() -> None:
        nonlocal limit
        if limit < base:
            limit = min(max(limit, floor), base)

    running, waiting = signals.running, signals.waiting
    evidence = max(signals.protected, running - signals.decode)
    needed = max(min(max(math.ceil(0.2 * observed), 4), threshold), 2, h)
    if waiting > 0:
        if observed > 0:
            apply(math.floor(0.8 * observed) if observed >= 8 else observed, "prefill_waiting")
        if running >= threshold:
            apply(running - h - (waiting - 1), "prefill_waiting")
        raise_to_floor()
    elif observed > 0 and running >= observed and evidence >= needed and 4 * evidence >= running:
        apply(observed, "running_at_observed_cap")
        raise_to_floor()
    elif signals.protected >= threshold:
        apply(observed if observed > 0 else threshold + 4, "prefill_protected")
    if signals.pressure_free and not throughput_down and learned > 0 and learned > limit:
        limit, reason = min(learned, qos_limit), "throughput_floor"
    return PrefillOutcome(limit=limit, reason=reason)
