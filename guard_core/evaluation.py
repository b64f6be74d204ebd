"""One poll evaluation: backend samples in, a published decision out (spec 5).

Reads: the samples (or failures) of every backend polled this round, the learner's state from
earlier polls, and the gate's counts at the moment of the poll (queue, tiers, published cap).
Guarantees:
- every stage runs in PIG's order: signal state, TTFT learner, QoS base, throughput learner,
  user-TPS re-evaluation, pressure guard, prefill guard, intake guard, composition; each stage
  can only lower the running cap (``qos_limit``), and the published cap is the ordered minimum of
  the stage components, never above ``GLOBAL_LIMIT``;
- waiting inside any backend closes intake (``backend_waiting``) and every backend failing
  closes it with ``backend_unavailable``; in both cases every learned value is kept;
- the same state and inputs always give the same result.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs

from guard_core import normalise as norm
from guard_core.composition import CapComponents, compose
from guard_core.decision import (
    DecisionSource,
    LimitReason,
    LoadState,
    PublishedDecision,
    StateReason,
)
from guard_core.gate import GateState
from guard_core.intake_guard import guard_intake
from guard_core.observations import BackendSample, Histogram
from guard_core.policy import PolicyConfig
from guard_core.prefill_guard import guard_prefill, prefill_freeze
from guard_core.pressure_guard import guard_pressure
from guard_core.signal_state import SignalReasons, raw_signal_reasons, state_limit
from guard_core.signals import Confidence, PollSignals
from guard_core.throughput_learner import DOWN_PHASES, ThroughputState, learn_throughput
from guard_core.tier import basic_limit, premium_reserved
from guard_core.ttft_learner import TtftInputs, TtftOutcome, TtftState, learn_ttft

__all__ = (
    "SEMANTIC_TTFT_BUCKETS",
    "BackendPoll",
    "LearnerState",
    "Round",
    "Snapshot",
    "evaluate",
    "evaluate_round",
    "observe_first_token",
)

#: Bucket bounds (seconds) of the guard's own semantic TTFT histogram; no ``+Inf`` bucket.
SEMANTIC_TTFT_BUCKETS = (
    0.1,
    0.25,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
)
_COLD_START = 50
_REPRESENTATIVE_USERS = 4


@attrs.frozen(kw_only=True)
class BackendPoll:
    """One backend's answer to a poll: a sample, or the failure."""

    name: str
    sample: BackendSample | None
    error: str = ""


@attrs.frozen(kw_only=True)
class Snapshot:
    """Everything one successful poll evaluation produced, kept for the next poll."""

    decision: PublishedDecision
    components: CapComponents
    signals: PollSignals
    generation_tokens: float
    preemptions: float
    dynamic_rejects: int
    ttft: TtftState
    throughput: ThroughputState
    pressure_reason: str
    prefill_reason: str
    #: The overload behind a severe-pressure cut ("" otherwise).
    pressure_target_reason: str = ""


@attrs.frozen(kw_only=True, slots=False)  # copied per request: see guard_core._values
class LearnerState:
    """The learner between polls."""

    config: PolicyConfig
    failsafe: LoadState = LoadState.YELLOW
    backends: tuple[tuple[str, norm.BackendStatus], ...] = ()
    #: The latest successful evaluation; kept across failed polls.
    last: Snapshot | None = None
    #: The guard's own semantic TTFT observations (cumulative).
    semantic_ttft: Histogram | None = None
    #: Requests refused by the dynamic cap or the tier rule, since start (cumulative).
    dynamic_rejects: int = 0
    #: The persistent pressure cap (0: none).
    pressure_cap: int = 0
    #: Forwarded requests that may still be in their prefill grace: request id -> the grace's
    #: deadline. A finished request leaves it at once; a poll drops the deadlines it has passed.
    #: A mapping, so that a finish removes its entry without a pass over the others.
    prefill: Mapping[int, float] = attrs.field(factory=dict)

    def prefill_protected(self, at: float) -> int:
        return sum(1 for deadline in self.prefill.values() if deadline > at)


def observe_first_token(histogram: Histogram | None, seconds: float) -> Histogram:
    """Add one semantic TTFT observation to the guard's cumulative histogram."""
    if histogram is None:
        histogram = Histogram(tuple((b, 0.0) for b in SEMANTIC_TTFT_BUCKETS), 0.0, 0.0)
    buckets = tuple(
        (bound, count + 1 if seconds <= bound else count) for bound, count in histogram.buckets
    )
    return Histogram(buckets, histogram.count + 1, histogram.sum + max(seconds, 0.0))


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(value, high))


def _rates(
    aggregate: norm.Aggregate, prev: Snapshot | None, *, at: float
) -> tuple[float, float | None]:
    """Preemptions and generation tok/s since the previous poll (per backend when possible)."""
    preemption_delta = aggregate.preemption_delta
    if preemption_delta is None:
        if prev is not None and aggregate.preemptions >= prev.preemptions:
            preemption_delta = aggregate.preemptions - prev.preemptions
        else:
            preemption_delta = 0.0
    generation_tps = aggregate.generation_tps
    if generation_tps is None and prev is not None:
        elapsed = at - prev.decision.at
        if elapsed > 0 and aggregate.generation_tokens >= prev.generation_tokens:
            generation_tps = (aggregate.generation_tokens - prev.generation_tokens) / elapsed
    return preemption_delta, generation_tps


@attrs.frozen
class _Prefill:
    protected: int
    decode: int
    freeze: bool
    transition: bool


def _prefill_state(
    config: PolicyConfig,
    learner: LearnerState,
    *,
    running: int,
    waiting: int,
    generation_tps: float | None,
    at: float,
) -> _Prefill:
    """How many running requests are still prefilling, and whether that hides capacity."""
    if not config.user_tps_enabled:
        return _Prefill(0, running, False, False)
    protected = _clamp(learner.prefill_protected(at), 0, running)
    freeze = prefill_freeze(running, protected)
    prev = learner.last
    settling = (
        not freeze
        and prev is not None
        and prev.signals.transition
        and running > 0
        and generation_tps is not None
        and (waiting > 0 or generation_tps / running < config.user_tps_yellow)
    )
    return _Prefill(protected, running - protected, freeze, freeze or settling)


def _tier_demand(gate: GateState, prev: Snapshot | None, *, running: int, base: int) -> bool:
    """Basic traffic is being held back by the cap (not by a waiting premium request)."""
    limit = prev.decision.cap if prev is not None and prev.decision.cap > 0 else 0
    limit = limit or gate.decision.cap or base
    allowed_basic = basic_limit(limit, gate.premium_inflight)
    if allowed_basic <= 0 or gate.premium_waiting > 0:
        # A premium request waiting means basic is held back by priority, not by capacity.
        return False
    if gate.basic_inflight >= allowed_basic:
        return True
    reserved = premium_reserved(limit, gate.premium_inflight)
    reserve_idle = reserved > 0 and gate.premium_inflight == 0
    return reserve_idle and running >= allowed_basic


@attrs.frozen
class _Estimate:
    smoothed: float
    raw: int
    safe: int
    low_confidence: int
    confidence: Confidence
    representative: bool


def _estimate(
    config: PolicyConfig,
    prev: Snapshot | None,
    prefill: _Prefill,
    *,
    running: int,
    waiting: int,
    generation_tps: float | None,
    demand: bool,
) -> _Estimate:
    """The capacity estimate from the smoothed generation rate (spec 5.3)."""
    base = config.global_limit
    previous_smoothed = prev.signals.smoothed_tps if prev is not None else 0.0
    previous_learned = prev.throughput.learned if prev is not None else 0
    nothing = _Estimate(previous_smoothed, 0, 0, 0, Confidence.NONE, False)
    if not config.user_tps_enabled:
        return nothing
    smoothed = previous_smoothed
    if generation_tps is not None:
        if generation_tps >= previous_smoothed:
            smoothed = generation_tps
        else:
            weight = config.capacity_smoothing
            smoothed = previous_smoothed * weight + generation_tps * (1 - weight)
    decode = prefill.decode
    if (running == 0 or decode == 0 or prefill.freeze) and previous_smoothed > smoothed:
        smoothed = previous_smoothed
    if smoothed <= 0 or base <= 0:
        return attrs.evolve(nothing, smoothed=smoothed)
    raw = _clamp(math.floor(smoothed / config.user_tps_yellow), 1, base)
    safe = _clamp(math.floor(raw * config.capacity_ratio), 1, base)
    if previous_learned > 0:
        low_confidence = _clamp(min(previous_learned, safe), 1, base)
    else:
        low_confidence = min(_COLD_START, base, safe)
    if demand or waiting > 0:
        representative = True
    else:
        threshold = 8
        if previous_learned > 0:
            threshold = max(8, min(math.ceil(0.65 * previous_learned), previous_learned))
        load = max(running, decode)
        representative = load >= threshold or load >= previous_learned
    if waiting > 0:
        confidence = Confidence.PRESSURE
    elif prefill.freeze:
        confidence = Confidence.PREFILL
    elif generation_tps is None:
        confidence = Confidence.STALE
    elif decode < config.user_tps_min_running:
        confidence = Confidence.LOW
    elif representative:
        confidence = Confidence.REPRESENTATIVE
    else:
        confidence = Confidence.SPARSE
    return _Estimate(smoothed, raw, safe, low_confidence, confidence, representative)


def _derive(
    config: PolicyConfig,
    learner: LearnerState,
    gate: GateState,
    aggregate: norm.Aggregate,
    *,
    at: float,
) -> PollSignals:
    """Spec 5.3: the signals every stage reads."""
    prev = learner.last
    base = config.global_limit
    running, waiting = int(aggregate.running), int(aggregate.waiting)
    preemption_delta, generation_tps = _rates(aggregate, prev, at=at)
    prefill = _prefill_state(
        config, learner, running=running, waiting=waiting, generation_tps=generation_tps, at=at
    )
    # Counter deltas: the whole count on the first poll (PIG quirk 8).
    reject_delta = learner.dynamic_rejects
    if prev is not None and learner.dynamic_rejects >= prev.dynamic_rejects:
        reject_delta = learner.dynamic_rejects - prev.dynamic_rejects
    tier_demand = _tier_demand(gate, prev, running=running, base=base)
    capacity_demand = gate.waiting > 0 or reject_delta > 0 or tier_demand
    estimate = _estimate(
        config,
        prev,
        prefill,
        running=running,
        waiting=waiting,
        generation_tps=generation_tps,
        demand=capacity_demand,
    )
    rate = generation_tps if generation_tps is not None else 0.0
    qos_tps = max(rate, estimate.smoothed)
    qos_tps_valid = generation_tps is not None or estimate.smoothed > rate

    # Per-user speed, counted only under representative load.
    decode = prefill.decode
    representative_load = (
        waiting > 0 or decode >= _REPRESENTATIVE_USERS or running >= _REPRESENTATIVE_USERS
    )
    user_tps: float | None = None
    if (
        config.user_tps_enabled
        and not prefill.freeze
        and decode >= config.user_tps_min_running
        and qos_tps_valid
    ):
        user_tps = qos_tps / decode
    yellow_count = red_count = 0
    if representative_load and user_tps is not None:
        if user_tps < config.user_tps_yellow:
            yellow_count = (prev.signals.user_tps_yellow_count if prev is not None else 0) + 1
        if user_tps < config.user_tps_red:
            red_count = (prev.signals.user_tps_red_count if prev is not None else 0) + 1

    return PollSignals(
        at=at,
        base=base,
        previous_is_metrics=prev is not None,
        previous_cap=prev.decision.cap if prev is not None else 0,
        running=running,
        waiting=waiting,
        kv_usage=aggregate.kv_usage,
        decode=decode,
        protected=prefill.protected,
        freeze=prefill.freeze,
        transition=prefill.transition,
        preemption_delta=preemption_delta,
        generation_tps=generation_tps,
        smoothed_tps=estimate.smoothed,
        qos_tps=qos_tps,
        qos_tps_valid=qos_tps_valid,
        queue=gate.waiting,
        reject_delta=reject_delta,
        tier_demand=tier_demand,
        capacity_demand=capacity_demand,
        raw_capacity=estimate.raw,
        safe_capacity=estimate.safe,
        low_confidence_capacity=estimate.low_confidence,
        confidence=estimate.confidence,
        estimate_representative=estimate.representative,
        user_tps=user_tps,
        representative_user_load=representative_load,
        user_tps_yellow_count=yellow_count,
        user_tps_red_count=red_count,
        user_tps_yellow_ready=yellow_count >= config.user_tps_yellow_consecutive,
        user_tps_red_ready=red_count >= config.user_tps_red_consecutive,
        qos_healthy=user_tps is not None and user_tps >= config.user_tps_yellow,
    )


def _learn_ttft(
    config: PolicyConfig,
    learner: LearnerState,
    signals: PollSignals,
    aggregate: norm.Aggregate,
) -> TtftOutcome:
    demand = (
        signals.queue > 0
        or signals.reject_delta > 0
        or signals.tier_demand
        or signals.waiting > 0
        or signals.preemption_delta > 0
    )
    prev = learner.last
    return learn_ttft(
        config,
        prev.ttft if prev is not None else TtftState(),
        TtftInputs(
            semantic=learner.semantic_ttft,
            backend_window=aggregate.ttft_window,
            previous_is_metrics=prev is not None,
            previous_cap=signals.previous_cap,
            running=signals.running,
            decode=signals.decode,
            waiting=signals.waiting,
            preemption_delta=signals.preemption_delta,
            kv_usage=signals.kv_usage,
            freeze=signals.freeze,
            demand=demand,
        ),
    )


@attrs.frozen
class _Running:
    """The cap as it is lowered stage by stage, and the state reasons so far."""

    qos_limit: int
    state_limit: int
    reasons: SignalReasons


def _qos_base(
    config: PolicyConfig, signals: PollSignals, ttft: TtftOutcome, running: _Running
) -> tuple[_Running, bool]:
    """Step 3: slow users cap intake at what the rate supports; a TTFT cut applies here too."""
    user_tps = signals.user_tps
    enforce = (
        signals.representative_user_load
        and config.user_tps_enabled
        and not signals.freeze
        and signals.qos_tps_valid
        and user_tps is not None
        and (
            (user_tps < config.user_tps_red and signals.user_tps_red_ready)
            or (user_tps < config.user_tps_yellow and signals.user_tps_yellow_ready)
        )
    )
    qos_limit = running.state_limit
    if enforce:
        qos_limit = _clamp(_rate_limit(config, signals), 1, running.state_limit)
    reasons = running.reasons
    if ttft.limit is not None and 0 < ttft.limit < qos_limit:
        qos_limit = ttft.limit
        if ttft.red_ready or ttft.yellow_ready:
            reasons = reasons.with_reason(StateReason.TTFT_LATENCY_CAPACITY, red=ttft.red_ready)
    return _Running(qos_limit, running.state_limit, reasons), enforce


def _rate_limit(config: PolicyConfig, signals: PollSignals) -> int:
    return math.floor(signals.qos_tps / config.user_tps_yellow)


def _reevaluate_user_tps(config: PolicyConfig, signals: PollSignals, running: _Running) -> _Running:
    """Step 5: slow users under an enforced cap turn the state yellow or red."""
    user_tps = signals.user_tps
    if user_tps is None or running.qos_limit >= running.state_limit:
        return running
    reasons = running.reasons
    was_green = reasons.state is LoadState.GREEN
    red = user_tps < config.user_tps_red
    reasons = reasons.with_reason(StateReason.SINGLE_USER_TPS_CAPACITY, red=red)
    state_cap, qos_limit = running.state_limit, running.qos_limit
    if red or was_green:
        state_cap = state_limit(config.signals, reasons.state)
        qos_limit = min(qos_limit, _clamp(_rate_limit(config, signals), 1, state_cap))
    return _Running(qos_limit, state_cap, reasons)


def _normalise_polls(
    learner: LearnerState, polls: tuple[BackendPoll, ...], *, at: float
) -> tuple[LearnerState, tuple[norm.NormalisedSample | None, ...]]:
    """Each answering backend against its own previous poll (``None`` for a failed one, in
    the order of ``polls``); failures are remembered."""
    statuses = dict(learner.backends)
    normalised: list[norm.NormalisedSample | None] = []
    for poll in polls:
        previous = statuses.get(poll.name)
        if poll.sample is None:
            statuses[poll.name] = norm.BackendStatus(at=at, failed=True)
            normalised.append(None)
            continue
        normalised.append(norm.normalise(previous, poll.sample, at=at))
        statuses[poll.name] = norm.BackendStatus(at=at, failed=False, sample=poll.sample)
    return attrs.evolve(learner, backends=tuple(statuses.items())), tuple(normalised)


@attrs.frozen
class Round:
    """One evaluated poll round: the learner after it, its decision, and each backend's
    normalised sample (``None`` for a failed one) in the order of the polls."""

    learner: LearnerState
    decision: PublishedDecision
    normalised: tuple[norm.NormalisedSample | None, ...]


def evaluate(
    learner: LearnerState, gate: GateState, polls: tuple[BackendPoll, ...], *, at: float
) -> tuple[LearnerState, PublishedDecision]:
    """Evaluate one poll round and return the new learner state and the decision to publish."""
    result = evaluate_round(learner, gate, polls, at=at)
    return result.learner, result.decision


def evaluate_round(
    learner: LearnerState, gate: GateState, polls: tuple[BackendPoll, ...], *, at: float
) -> Round:
    """:func:`evaluate`, keeping the per-backend figures it computed on the way."""
    learner, normalised = _normalise_polls(learner, polls, at=at)
    learner, decision = _evaluate(learner, gate, normalised, at=at)
    return Round(learner, decision, normalised)


def _evaluate(
    learner: LearnerState,
    gate: GateState,
    normalised: tuple[norm.NormalisedSample | None, ...],
    *,
    at: float,
) -> tuple[LearnerState, PublishedDecision]:
    config = learner.config
    healthy = tuple(sample for sample in normalised if sample is not None)
    backend_count, backend_failed = len(normalised), len(normalised) - len(healthy)
    if not healthy:
        decision = PublishedDecision.all_polls_failed(
            at=at, backend_count=backend_count, failsafe=learner.failsafe
        )
        return learner, decision

    aggregate = norm.aggregate(healthy)
    signals = _derive(config, learner, gate, aggregate, at=at)
    prev = learner.last

    # 1-2. Signal state, with the TTFT learner's readiness.
    ttft = _learn_ttft(config, learner, signals, aggregate)
    reasons = raw_signal_reasons(
        config.signals,
        running=signals.running,
        waiting=signals.waiting,
        kv_usage=signals.kv_usage,
        preemption_delta=int(signals.preemption_delta),
        user_tps_yellow_ready=signals.user_tps_yellow_ready,
        user_tps_red_ready=signals.user_tps_red_ready,
        ttft_yellow_ready=ttft.yellow_ready,
        ttft_red_ready=ttft.red_ready,
    )
    cap = state_limit(config.signals, reasons.state)
    running = _Running(cap, cap, reasons)

    # 3. QoS base.
    running, enforce_qos = _qos_base(config, signals, ttft, running)

    # 4. Throughput learner.
    ttft_healthy = (
        ttft.limit is None
        or ttft.healthy
        or (not ttft.yellow_ready and not ttft.red_ready and not ttft.window_valid)
    )
    throughput = learn_throughput(
        config,
        signals,
        prev.throughput if prev is not None else ThroughputState(),
        qos_limit=running.qos_limit,
        ttft_healthy=ttft_healthy,
    )
    down = throughput.state.phase in DOWN_PHASES
    if throughput.component is not None and throughput.component < running.qos_limit:
        reasons = running.reasons
        if down:
            reasons = reasons.with_reason(StateReason.SINGLE_USER_TPS_CAPACITY, red=False)
        running = _Running(throughput.component, running.state_limit, reasons)

    # 5. User-TPS re-evaluation of the state limit.
    if enforce_qos:
        running = _reevaluate_user_tps(config, signals, running)

    # 6. Pressure guard.
    pressure = guard_pressure(
        config, signals, base=running.qos_limit, pressure_cap=learner.pressure_cap
    )
    reasons = running.reasons
    if pressure.adds_state_reason:
        reasons = reasons.with_reason(
            StateReason.SCHEDULER_PRESSURE_CAPACITY, red=reasons.state is LoadState.RED
        )
    running = _Running(min(running.qos_limit, pressure.limit), running.state_limit, reasons)

    # 7. Prefill guard.
    candidates: tuple[int, ...] = ()
    if prev is not None:
        candidates = (prev.throughput.learned, prev.throughput.target, prev.decision.cap)
    prefill = guard_prefill(
        config,
        signals,
        qos_limit=running.qos_limit,
        observed_candidates=candidates,
        learned=throughput.state.learned,
        throughput_down=down,
    )

    # 8. Intake guard.
    intake = guard_intake(
        waiting=signals.waiting,
        backend_count=backend_count,
        backend_failed=backend_failed,
        state_limit=running.state_limit,
    )
    pressure_component, prefill_component = pressure.limit, prefill.limit
    if intake.override is not None:
        pressure_component = prefill_component = 0
    if intake.override is LimitReason.BACKEND_WAITING and reasons.state is not LoadState.RED:
        reasons = reasons.with_reason(StateReason.BACKEND_WAITING_QUEUE, red=False)
    elif intake.override is LimitReason.BACKEND_UNAVAILABLE:
        reasons = reasons.with_reason(StateReason.BACKEND_UNAVAILABLE, red=False)

    # 9. Composition.
    components = CapComponents(
        hard_global=config.global_limit,
        state=running.state_limit,
        ttft=ttft.limit,
        throughput=throughput.component,
        pressure=pressure_component,
        prefill=prefill_component,
        availability=intake.availability,
        override=intake.override,
    )
    composed = compose(components)
    decision = PublishedDecision(
        at=at,
        source=DecisionSource.METRICS,
        cap=composed.cap,
        state=reasons.state,
        final_reason=composed.reason,
        yellow_reasons=reasons.yellow,
        red_reasons=reasons.red,
        running=signals.running,
        waiting=signals.waiting,
        kv_usage=signals.kv_usage,
        backend_count=backend_count,
        backend_failed=backend_failed,
    )
    snapshot = Snapshot(
        decision=decision,
        components=components,
        signals=signals,
        generation_tokens=aggregate.generation_tokens,
        preemptions=aggregate.preemptions,
        dynamic_rejects=learner.dynamic_rejects,
        ttft=ttft.state,
        throughput=throughput.state,
        pressure_reason=pressure.reason,
        prefill_reason=prefill.reason,
        pressure_target_reason=pressure.target_reason,
    )
    learner = attrs.evolve(
        learner,
        last=snapshot,
        pressure_cap=pressure.cap,
        prefill={rid: deadline for rid, deadline in learner.prefill.items() if deadline > at},
    )
    return learner, decision
