"""One scrape's view of what the page reads: the published core value, the state, the settings
and the event instruments, gathered once per scrape for the table's getters.

Reads: the :class:`~guard_trio._observability.GuardMetrics` being scraped (its instruments,
settings and clocks) and the guard's state from its ``state_provider``.
Guarantees:
- every poll figure comes from ``state.published`` (the decision, the snapshot behind it, the
  per-backend figures, the TTFT window, the tier deltas); nothing is recomputed here;
- before the first good poll, and after a round where every backend failed, the learner's
  values read as zeros (:data:`NO_SNAPSHOT`), as PIG publishes an error snapshot then;
- outside backend routing the per-backend poll figures read as zeros: the metrics URLs are not
  tied to backends then.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from guard_core.composition import CapComponents
from guard_core.decision import PublishedDecision
from guard_core.evaluation import Snapshot
from guard_core.gate import current_limit
from guard_core.histogram import LatencySummary
from guard_core.observations import Histogram
from guard_core.predictive import Binding, FitSummary, Prediction
from guard_core.published import BackendFigures
from guard_core.signals import Confidence, PollSignals
from guard_core.throughput_learner import ThroughputState
from guard_core.ttft_learner import TtftState
from guard_trio._metrics_instruments import DURATION_BUCKETS_S, BackendMetrics

if TYPE_CHECKING:
    from guard_adapters.config import Environment, Settings
    from guard_core.gate import GateState
    from guard_core.guard import GuardState
    from guard_core.policy import PolicyConfig
    from guard_core.published import Published
    from guard_trio._observability import GuardMetrics

__all__ = ("NO_PREDICTION", "NO_SNAPSHOT", "Scrape", "cumulative_of", "or_unknown", "zero")

# A snapshot with every value at zero, standing in before the first good poll and after a round
# where every backend failed (PIG publishes an error snapshot with no learner detail then).
_ZERO_SIGNALS: Final[dict[str, Any]] = {
    **dict.fromkeys(("at", "kv_usage", "preemption_delta", "smoothed_tps", "qos_tps"), 0.0),
    **dict.fromkeys(
        ("base", "previous_cap", "running", "waiting", "decode", "protected", "queue",
         "reject_delta", "raw_capacity", "safe_capacity", "low_confidence_capacity",
         "user_tps_yellow_count", "user_tps_red_count"),
        0,
    ),
    **dict.fromkeys(
        ("previous_is_metrics", "freeze", "transition", "qos_tps_valid", "tier_demand",
         "capacity_demand", "estimate_representative", "representative_user_load",
         "user_tps_yellow_ready", "user_tps_red_ready", "qos_healthy"),
        False,
    ),
    **dict.fromkeys(("generation_tps", "user_tps"), None),
    "confidence": Confidence.NONE,
}  # fmt: skip
NO_SIGNALS: Final = PollSignals(**_ZERO_SIGNALS)
NO_SNAPSHOT: Final = Snapshot(
    decision=PublishedDecision.startup(at=0.0),
    components=CapComponents(hard_global=0, state=0),
    signals=NO_SIGNALS,
    generation_tokens=0.0,
    preemptions=0.0,
    dynamic_rejects=0,
    ttft=TtftState(),
    throughput=ThroughputState(),
    pressure_reason="",
    prefill_reason="",
)


# Stands in for the predictive learner's explanations before it has made one.
NO_PREDICTION: Final = Prediction(
    user_tps=0.0,
    ttft_s=0.0,
    kv_usage=0.0,
    binding=Binding.NONE,
    fit=FitSummary(0.0, 0.0, 0.0, 0.0, 0.0, 0),
)


def or_unknown(text: str) -> str:
    return text or "unknown"


def zero(value: int | None) -> int:
    return 0 if value is None else value


def cumulative_of(histogram: Histogram | None) -> tuple[list[float], float, float]:
    """Cumulative counts per duration bound, count and sum of a core histogram (or zeros)."""
    if histogram is None:
        return [0.0] * len(DURATION_BUCKETS_S), 0.0, 0.0
    per_bound = dict(histogram.finite_buckets)
    counts = []
    last = 0.0
    for bound in DURATION_BUCKETS_S:
        last = per_bound.get(bound, last)
        counts.append(last)
    return counts, histogram.count, histogram.sum


_NOT_POLLED: Final = BackendFigures(name="")


class Scrape:
    """What the table's getters read, for one scrape."""

    m: GuardMetrics
    settings: Settings
    env: Environment
    state: GuardState
    gate: GateState
    published: Published
    decision: PublishedDecision
    has_snapshot: bool
    snap: Snapshot
    signals: PollSignals
    ttft: TtftState
    throughput: ThroughputState
    components: CapComponents
    policy: PolicyConfig
    window: LatencySummary | None
    limit: int
    routing: bool
    uptime: int
    #: The guard's clock now (seconds since start, the time its events carry).
    now: float
    updated: int
    backends: Sequence[BackendMetrics]

    def __init__(self, metrics: GuardMetrics) -> None:
        self.m = metrics
        settings = self.settings = metrics.settings
        self.env = settings.env
        state = metrics.state()
        self.state = state
        self.gate = state.gate
        published = self.published = state.published
        self.decision = published.decision
        self.has_snapshot = published.snapshot is not None
        snap = self.snap = published.snapshot or NO_SNAPSHOT
        self.signals = snap.signals
        self.ttft = snap.ttft
        self.throughput = snap.throughput
        self.components = snap.components
        self.policy = state.learner.config
        #: The TTFT window behind the learner's smoothed values at the latest good poll.
        self.window = published.ttft if self.has_snapshot else None
        #: The limit the gate enforces now (the tier gauges use it, spec 10.3).
        self.limit = current_limit(self.gate)[0]
        self.routing = settings.backend_routing
        now = self.now = metrics.clock()
        self.uptime = round(now - metrics.started)
        # Decisions are stamped on the guard's clock; turned into Unix time here.
        self.updated = int(metrics.wall_clock() - (now - self.decision.at))
        self.backends = tuple(metrics.backends.values())

    def of(self, backend: str) -> GuardState:
        """The state of the pool ``backend`` belongs to (the one state without pools)."""
        return self.m.state_of_backend(backend) if self.m.pooled else self.state

    def figures(self, backend: BackendMetrics) -> BackendFigures:
        """The backend's latest poll figures (zeros outside routing and before its first)."""
        if not self.routing:
            return _NOT_POLLED
        return self.of(backend.name).published.backend(backend.name) or _NOT_POLLED

    def latency(self, backend: BackendMetrics, quantity: str) -> float:
        summary = self.figures(backend).ttft
        if summary is None:
            return 0.0
        return {"avg": summary.avg, "p95": summary.p95, "p99": summary.p99}[quantity]

    def window_value(self, quantity: str) -> float:
        window = self.window
        return 0.0 if window is None else float(getattr(window, quantity))
