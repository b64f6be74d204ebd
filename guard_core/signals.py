"""Signals derived once per poll and shared by every stage of the pipeline (spec 5.3).

Reads: nothing itself; :mod:`guard_core.evaluation` fills it from the aggregated poll, the gate's
counts and the previous snapshot.
Guarantees: a frozen value, so no stage can change what another stage sees.
"""

from __future__ import annotations

import enum

import attrs

__all__ = ("Confidence", "PollSignals")


class Confidence(enum.StrEnum):
    """How far the capacity estimate of this poll can be trusted (first match wins)."""

    NONE = "none"
    PRESSURE = "pressure"
    PREFILL = "prefill"
    STALE = "stale"
    LOW = "low"
    REPRESENTATIVE = "representative"
    SPARSE = "sparse"


@attrs.frozen(kw_only=True)
class PollSignals:
    at: float
    #: ``GLOBAL_LIMIT``.
    base: int
    previous_is_metrics: bool
    previous_cap: int
    running: int
    waiting: int
    kv_usage: float
    #: Requests past their prefill grace; ``running`` minus the prefill-protected ones.
    decode: int
    protected: int
    #: Meaningful prefill right now: per-user speed is not representative.
    freeze: bool
    #: Prefill now, or settling after it.
    transition: bool
    preemption_delta: float
    #: Generation tok/s this poll; ``None`` when no valid rate exists.
    generation_tps: float | None
    smoothed_tps: float
    qos_tps: float
    qos_tps_valid: bool
    #: Requests waiting in the guard's own short-wait queue.
    queue: int
    #: Dynamic rejects since the previous poll.
    reject_delta: int
    tier_demand: bool
    capacity_demand: bool
    # capacity estimate
    raw_capacity: int
    safe_capacity: int
    low_confidence_capacity: int
    confidence: Confidence
    estimate_representative: bool
    # per-user speed
    user_tps: float | None
    representative_user_load: bool
    user_tps_yellow_count: int
    user_tps_red_count: int
    user_tps_yellow_ready: bool
    user_tps_red_ready: bool
    qos_healthy: bool

    @property
    def pressure_free(self) -> bool:
        """No waiting, no new preemption, KV below 0.70."""
        return self.waiting == 0 and self.preemption_delta == 0 and self.kv_usage < 0.70
