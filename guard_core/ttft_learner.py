"""The TTFT learner: lower the cap when first tokens come late, probe back up when healthy.

Spec 5.4 (observation and assessment) and 5.5 step 2 (the learner).

Reads: the guard's own semantic TTFT histogram (cumulative) once it has any sample, the backends'
TTFT window before that; the load (running, decoding, waiting, preemptions, KV); demand (queue,
new rejects, tier demand); the previous published cap and the learner's previous state.
Guarantees:
- the source is semantic from the first semantic sample on, and never goes back;
- a window is the change since the previous poll of the same source; latency is smoothed
  0.7 / 0.3 across windows;
- the limit only falls after two high windows under qualified load, to
  ``floor(max(running, min_running) * r)`` with r = 0.92 / 0.86 / 0.78 / 0.70 for a signal at
  1x / 2x / 4x / 8x the target, never above the previous learned value;
- the limit only rises after three healthy windows, by 5 % (10 % when p95 <= 0.25 s), never
  above ``GLOBAL_LIMIT``. A TTFT signal never raises the cap.
"""

from __future__ import annotations

import enum
import math

import attrs

from guard_core import histogram
from guard_core.cap_learning import CapLearning
from guard_core.observations import Histogram
from guard_core.policy import PolicyConfig
from guard_core.tier import basic_limit

__all__ = ("TtftInputs", "TtftOutcome", "TtftSource", "TtftState", "learn_ttft")

_MIN_WINDOW_COUNT = 2
_P99_RELIABLE_COUNT = 10
_P99_WEIGHT = 0.5
_FAST_PROBE_P95_S = 0.25
_KV_PRESSURE = 0.70


class TtftSource(enum.StrEnum):
    NONE = ""
    SEMANTIC = "semantic"
    BACKEND = "backend"
    DISABLED = "disabled"


@attrs.frozen(kw_only=True)
class TtftState(CapLearning):
    """What the TTFT learner carries from one poll to the next: its cap's progress
    (:class:`~guard_core.cap_learning.CapLearning`; ``target_reason`` names the latency that
    drove the last cut, ``p95_latency`` or ``p99_latency``), its source and its latencies."""

    source: TtftSource = TtftSource.NONE
    #: The guard's semantic histogram as of the last poll (cumulative).
    semantic: Histogram | None = None
    smoothed_avg: float = 0.0
    smoothed_p95: float = 0.0
    smoothed_p99: float = 0.0
    high_count: int = 0
    tail_count: int = 0


@attrs.frozen(kw_only=True)
class TtftInputs:
    """The part of one poll the TTFT learner reads."""

    semantic: Histogram | None
    backend_window: Histogram | None
    previous_is_metrics: bool
    previous_cap: int
    running: int
    decode: int
    waiting: int
    preemption_delta: float
    kv_usage: float
    freeze: bool
    demand: bool


@attrs.frozen(kw_only=True)
class TtftOutcome:
    state: TtftState
    #: The TTFT component of the cap; ``None`` when the learner is off.
    limit: int | None
    yellow_ready: bool
    red_ready: bool
    healthy: bool
    #: Whether this poll had a latency window at all.
    window_valid: bool = False


def _smooth(previous: float, current: float) -> float:
    return current if previous <= 0 else 0.7 * previous + 0.3 * current


def _reduction_ratio(signal: float, target: float) -> float:
    if signal >= 8 * target:
        return 0.70
    if signal >= 4 * target:
        return 0.78
    if signal >= 2 * target:
        return 0.86
    return 0.92


@attrs.frozen(kw_only=True)
class _Observation:
    """The window of this poll and the smoothed latency after it."""

    source: TtftSource
    summary: histogram.LatencySummary | None
    avg: float
    p95: float
    p99: float

    @property
    def valid(self) -> bool:
        return self.summary is not None

    @property
    def count(self) -> float:
        return self.summary.count if self.summary is not None else 0.0


@attrs.frozen(kw_only=True)
class _Assessment:
    high: bool
    tail_high: bool
    yellow_ready: bool
    red_ready: bool
    healthy: bool
    signal: float
    high_count: int
    tail_count: int
    healthy_count: int


def _count(value: Histogram | None) -> float:
    return value.count if value is not None else 0.0


def _observe(previous: TtftState, prev: TtftState, inputs: TtftInputs) -> _Observation:
    """Pick the source, take this poll's window and smooth it (spec 5.4, first half)."""
    semantic_count = _count(inputs.semantic)
    previous_semantic_count = _count(previous.semantic)
    semantic = (
        semantic_count > 0 or previous.source is TtftSource.SEMANTIC or previous_semantic_count > 0
    )
    source = TtftSource.SEMANTIC if semantic else TtftSource.BACKEND
    window: Histogram | None = None
    if semantic and inputs.semantic is not None:
        if inputs.previous_is_metrics or previous_semantic_count == 0:
            window = histogram.window(previous.semantic, inputs.semantic)
    elif not semantic and inputs.previous_is_metrics:
        window = inputs.backend_window
    summary = histogram.summarise(window) if window is not None else None

    if summary is not None:
        avg = _smooth(prev.smoothed_avg, summary.avg)
        p95 = _smooth(prev.smoothed_p95, summary.p95)
        p99 = _smooth(prev.smoothed_p99, summary.p99)
    else:
        if semantic:
            preserve = (
                inputs.previous_is_metrics
                and previous.source is TtftSource.SEMANTIC
                and previous_semantic_count >= _MIN_WINDOW_COUNT
            )
        else:
            preserve = inputs.previous_is_metrics and previous.source in (
                TtftSource.NONE,
                TtftSource.BACKEND,
            )
        avg, p95, p99 = (
            (prev.smoothed_avg, prev.smoothed_p95, prev.smoothed_p99)
            if preserve
            else (0.0, 0.0, 0.0)
        )
    if semantic and semantic_count < _MIN_WINDOW_COUNT:
        avg = p95 = p99 = 0.0
    return _Observation(source=source, summary=summary, avg=avg, p95=p95, p99=p99)


def _representative(inputs: TtftInputs, *, base: int, previous_learned: int) -> bool:
    """Enough load that latency says something about the cap (not during a prefill burst)."""
    if inputs.freeze:
        return False
    basis = inputs.previous_cap
    if basis <= 0 or basis > base:
        basis = base
    if 0 < previous_learned < basis:
        basis = previous_learned
    threshold = min(max(math.ceil(0.65 * basis), 4), max(basis, 0))
    return inputs.running >= threshold or inputs.decode >= threshold


def _assess(
    config: PolicyConfig,
    prev: TtftState,
    observation: _Observation,
    inputs: TtftInputs,
    *,
    qualified: bool,
    min_running: int,
    counts: tuple[int, int, int],
) -> _Assessment:
    """High, tail-high or healthy, with the consecutive-window counters (spec 5.4 assessment)."""
    high_count, tail_count, healthy_count = counts
    pressure_free = (
        inputs.waiting == 0 and inputs.preemption_delta == 0 and inputs.kv_usage < _KV_PRESSURE
    )
    avg, p95, p99 = observation.avg, observation.p95, observation.p99
    valid, count, summary = observation.valid, observation.count, observation.summary
    p99_reliable = valid and count >= _P99_RELIABLE_COUNT
    p99_healthy = (
        p99 <= 0 or p99 <= config.ttft_p99_target_s or (not p99_reliable and prev.tail_count == 0)
    )
    target_s = config.ttft_target_s
    smoothed_healthy = pressure_free and 0 < p95 <= target_s and avg <= target_s and p99_healthy

    if summary is not None and qualified:
        p95_signal = p95 if p95 > 0 else summary.p95
        p99_signal = p99 if p99 > 0 else summary.p99
        high = p95_signal > target_s
        tail_high = p99_reliable and p99_signal > config.ttft_p99_target_s
        if high or tail_high:
            high_count = high_count + 1 if high else max(0, high_count - 1)
            tail_count = tail_count + 1 if tail_high else max(0, tail_count - 1)
            tail_red = tail_count >= 2 and p99_signal >= config.ttft_p99_red_s
            return _Assessment(
                high=high,
                tail_high=tail_high,
                yellow_ready=high_count >= 2 or tail_count >= 2,
                red_ready=(high_count >= 2 and p95_signal >= config.ttft_red_s) or tail_red,
                healthy=False,
                signal=max(p95_signal, p99_signal if tail_red else _P99_WEIGHT * p99_signal),
                high_count=high_count,
                tail_count=tail_count,
                healthy_count=0,
            )

    healthy = False
    if inputs.running < min_running:
        healthy = valid and count > 0 and smoothed_healthy
        healthy_count = healthy_count + 1 if healthy else 0
    elif not valid or count < _MIN_WINDOW_COUNT:
        healthy = smoothed_healthy
        if healthy and count > 0:
            healthy_count += 1
    elif smoothed_healthy:
        healthy = True
        healthy_count += 1
    else:
        healthy_count = 0
    return _Assessment(
        high=False,
        tail_high=False,
        yellow_ready=False,
        red_ready=False,
        healthy=healthy,
        signal=0.0,
        high_count=max(0, high_count - 1),
        tail_count=max(0, tail_count - 1),
        healthy_count=healthy_count,
    )


@attrs.frozen(kw_only=True)
class _Step:
    learned: int
    target: int
    limit: int
    healthy_count: int
    phase: str
    reason: str
    target_reason: str = ""


def _learn(  # noqa: PLR0915 - one rule ladder, read top to bottom as spec 5.5 step 2 a-e
    config: PolicyConfig,
    prev: TtftState,
    inputs: TtftInputs,
    observation: _Observation,
    verdict: _Assessment,
    *,
    previous_learned: int,
    recovery_limit: int,
    min_running: int,
    representative: bool,
) -> _Step:
    """The learner's decision for this poll (spec 5.5 step 2), first matching rule wins."""
    base = config.global_limit
    learned = previous_learned or base
    target = prev.target if inputs.previous_is_metrics and prev.target > 0 else learned
    healthy_count = verdict.healthy_count
    rate = 0.10 if 0 < observation.p95 <= _FAST_PROBE_P95_S else 0.05
    step_ratio = max(rate, config.capacity_step_up)

    def next_probe(value: int) -> int:
        if value >= base:
            return base
        return min(base, value + max(1, math.ceil(value * step_ratio)))

    latency_signal = verdict.high or verdict.tail_high
    thin = (
        inputs.running < min_running
        or not observation.valid
        or observation.count < _MIN_WINDOW_COUNT
    )
    limit = learned
    target_reason = ""
    if not latency_signal and not verdict.healthy and thin:
        phase, reason = "no_signal", "insufficient_latency_signal"
        target = learned
        if inputs.demand:
            limit = base
    elif latency_signal and not representative and not inputs.demand:
        phase, reason = "ttft_hold", "latency_signal_underutilized"
    elif latency_signal and not verdict.yellow_ready:
        phase, reason = "ttft_wait", "ttft_high_pending"
    elif latency_signal:
        reason = "ttft_red_latency" if verdict.red_ready else "ttft_above_target"
        target_reason = "p95_latency" if verdict.high else "p99_latency"
        ratio = _reduction_ratio(verdict.signal, config.ttft_target_s)
        target = min(max(math.floor(max(inputs.running, min_running) * ratio), 1), learned)
        phase = "ttft_down" if target < learned else "ttft_hold_high"
        learned = limit = min(learned, target)
    elif verdict.healthy:
        phase, reason = "ttft_healthy", "healthy"
        target = learned
        if learned < base:
            if inputs.running < min_running:
                target, reason = next_probe(learned), "healthy_low_load_probe"
            else:
                probe_limit = min(max(recovery_limit, min_running), learned)
                probe_threshold = min(max(math.ceil(0.5 * probe_limit), min_running), probe_limit)
                if inputs.running < probe_threshold:
                    healthy_count = 0
                    reason = "healthy_load_below_probe_threshold"
                else:
                    target, reason = next_probe(learned), "healthy_probe"
            if target > learned and healthy_count >= 3:
                learned = limit = target
                healthy_count = 0
                phase, reason = "ttft_probe_up", "healthy_window_satisfied"
            elif target > learned:
                reason = "healthy_window_accumulating"
    else:
        phase, reason = "ttft_hold", "ttft_not_healthy"

    return _Step(
        learned=learned,
        target=target,
        limit=limit,
        healthy_count=healthy_count,
        phase=phase,
        reason=reason,
        target_reason=target_reason,
    )


def learn_ttft(config: PolicyConfig, previous: TtftState, inputs: TtftInputs) -> TtftOutcome:
    """One poll of the TTFT learner."""
    base = config.global_limit
    if not config.ttft_enabled:
        state = TtftState(source=TtftSource.DISABLED, learned=base, target=base, phase="disabled")
        return TtftOutcome(
            state=state, limit=None, yellow_ready=False, red_ready=False, healthy=False
        )
    prev = previous if inputs.previous_is_metrics else TtftState(semantic=previous.semantic)
    observation = _observe(previous, prev, inputs)
    counts = (prev.high_count, prev.tail_count, prev.healthy_count)
    if observation.source is not prev.source:
        counts = (0, 0, 0)
    previous_learned = prev.learned if inputs.previous_is_metrics and prev.learned > 0 else 0
    recovery_limit = basic_limit(previous_learned or base, 0)
    min_running = recovery_limit if 1 <= recovery_limit <= 3 else 4
    representative = _representative(inputs, base=base, previous_learned=previous_learned)
    qualified = representative or inputs.demand or inputs.waiting > 0 or inputs.preemption_delta > 0
    verdict = _assess(
        config,
        prev,
        observation,
        inputs,
        qualified=qualified,
        min_running=min_running,
        counts=counts,
    )

    step = _learn(
        config,
        prev,
        inputs,
        observation,
        verdict,
        previous_learned=previous_learned,
        recovery_limit=recovery_limit,
        min_running=min_running,
        representative=representative,
    )
    state = TtftState(
        source=observation.source,
        semantic=inputs.semantic if inputs.semantic is not None else previous.semantic,
        smoothed_avg=observation.avg,
        smoothed_p95=observation.p95,
        smoothed_p99=observation.p99,
        high_count=verdict.high_count,
        tail_count=verdict.tail_count,
        healthy_count=step.healthy_count,
        learned=step.learned,
        target=step.target,
        phase=step.phase,
        reason=step.reason,
        target_reason=step.target_reason,
    )
    return TtftOutcome(
        state=state,
        limit=step.limit,
        yellow_ready=verdict.yellow_ready,
        red_ready=verdict.red_ready,
        healthy=verdict.healthy,
        window_valid=observation.valid,
    )
