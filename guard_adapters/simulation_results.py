"""What a simulation run gives: per request, per second and per tier (see simulation.py).

Reads: the outcomes the simulation loop froze, and the span the goodput is divided by.
Guarantees: plain frozen values and pure summaries; goodput counts requests finished at
:data:`GOOD_TPS` or faster whose first token came within :data:`GOOD_TTFT_S` of arrival (the
prompt-aware figure widens that bound by the request's own idle prefill); quantiles interpolate
linearly between closest ranks and are ``None`` without data; the per-second speed series is
each interval's overlap-weighted mean of the per-request speeds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import attrs

from guard_core import Tier

if TYPE_CHECKING:
    from guard_adapters.fairness_results import FairnessSummary

__all__ = (
    "GOOD_TPS",
    "GOOD_TTFT_S",
    "TIERS",
    "BackendLoad",
    "RequestOutcome",
    "SeriesPoint",
    "SimulationResult",
    "TierSummary",
    "quantile",
    "summarise",
    "user_tps_series",
)

#: Goodput counts requests finished at this per-user speed or faster ...
GOOD_TPS: Final = 20.0
#: ... whose first token came within this many seconds of their arrival.
GOOD_TTFT_S: Final = 1.0
#: The rows of a summary: every request, then each tier.
TIERS: Final = ("all", "premium", "basic")


@attrs.frozen(kw_only=True)
class RequestOutcome:
    """What happened to one trace request."""

    request_id: int
    tier: Tier
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    admitted: bool
    #: When the policy let it through (after any wait).
    admitted_at: float | None = None
    #: Admitted requests in flight right after this one was admitted, and the cap then in
    #: force (``None`` for the none policy).
    inflight_at_admission: int | None = None
    cap_at_admission: int | None = None
    first_token_at: float | None = None
    #: When its last token came (its end, for a finished request).
    last_token_at: float | None = None
    tokens: int = 0
    finished: bool = False
    #: The engine refused it (prompt plus output longer than the model allows) or died.
    failed: bool = False
    #: Why the policy refused it: a guard_core reject code, or ``static_limit``.
    reject_code: str | None = None
    #: Leading prompt tokens the prefix cache held when it reached the engine (0: none, or not
    #: submitted, or no ``hash_ids`` in the trace).
    cached_prompt_tokens: int = 0
    #: The backend of the pool it was submitted to (``None``: never submitted).
    backend: int | None = None
    #: Seconds the uncached part of its prompt alone takes to prefill on an idle engine of the
    #: profile (see :func:`~guard_adapters.engine_model.idle_prefill_s`); 0 when not computed.
    idle_prefill_s: float = 0.0
    #: Its tenant (``simulate --tenants``; "": none) and priority band name ("": the tier's).
    tenant: str = ""
    band: str = ""

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_at is None:
            return None
        return self.first_token_at - self.arrival_s

    @property
    def user_tps(self) -> float | None:
        """Per-user decode speed, for requests that got at least two tokens."""
        first, last = self.first_token_at, self.last_token_at
        if self.tokens < 2 or first is None or last is None or last <= first:
            return None
        return (self.tokens - 1) / (last - first)

    @property
    def good(self) -> bool:
        """Finished, first token within 1 s, and at least 20 tok/s (one-token answers pass)."""
        ttft = self.ttft_s
        if not self.finished or ttft is None or ttft > GOOD_TTFT_S:
            return False
        tps = self.user_tps
        return tps is None or tps >= GOOD_TPS

    @property
    def good_prompt_aware(self) -> bool:
        """Like :attr:`good`, with the TTFT bound widened by this prompt's idle prefill time."""
        ttft = self.ttft_s
        if not self.finished or ttft is None or ttft > GOOD_TTFT_S + self.idle_prefill_s:
            return False
        tps = self.user_tps
        return tps is None or tps >= GOOD_TPS


@attrs.frozen(kw_only=True)
class SeriesPoint:
    """The state at ``at`` (a whole number of sample intervals) and the second before it."""

    at: float
    #: The cap in force (``None``: no cap).
    cap: int | None
    inflight: int
    running: int
    waiting: int
    guard_waiting: int
    #: Time-weighted mean per-user speed of the requests decoding in the interval before.
    user_tps: float | None


def quantile(ordered: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks; ``None`` for no data."""
    if not ordered:
        return None
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@attrs.frozen(kw_only=True)
class TierSummary:
    requests: int
    admitted: int
    rejected: int
    user_tps_p5: float | None
    user_tps_p50: float | None
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    ttft_p99_s: float | None
    goodput_per_s: float
    #: Goodput counting :attr:`RequestOutcome.good_prompt_aware` requests.
    goodput_prompt_aware_per_s: float

    @classmethod
    def of(cls, outcomes: Sequence[RequestOutcome], duration_s: float) -> TierSummary:
        speeds = sorted(s for s in (o.user_tps for o in outcomes) if s is not None)
        ttfts = sorted(t for t in (o.ttft_s for o in outcomes) if t is not None)
        admitted = sum(o.admitted for o in outcomes)
        good = sum(o.good for o in outcomes)
        good_prompt_aware = sum(o.good_prompt_aware for o in outcomes)
        return cls(
            requests=len(outcomes),
            admitted=admitted,
            rejected=len(outcomes) - admitted,
            user_tps_p5=quantile(speeds, 0.05),
            user_tps_p50=quantile(speeds, 0.50),
            ttft_p50_s=quantile(ttfts, 0.50),
            ttft_p95_s=quantile(ttfts, 0.95),
            ttft_p99_s=quantile(ttfts, 0.99),
            goodput_per_s=good / duration_s if duration_s > 0 else 0.0,
            goodput_prompt_aware_per_s=good_prompt_aware / duration_s if duration_s > 0 else 0.0,
        )

    def as_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen(kw_only=True)
class SimulationResult:
    policy: str
    profile: str
    #: The span the goodput is divided by: the last arrival's time, or the end of the
    #: simulation for a trace whose requests all arrive at once.
    duration_s: float
    #: When the last admitted request ended.
    end_s: float
    requests: tuple[RequestOutcome, ...]
    series: tuple[SeriesPoint, ...]
    summary: Mapping[str, TierSummary]
    polls: int = 0
    #: Guard polls by the reason that set the published cap.
    limit_reasons: Mapping[str, int] = attrs.field(factory=dict)
    preemptions: int = 0
    #: Admitted requests the engine refused (too long for the model).
    engine_refused: int = 0
    #: How admitted requests were placed on the backends, and each backend's share.
    routing: str = ""
    backends: tuple[BackendLoad, ...] = ()
    #: Cached over prompt tokens of the requests submitted (``None``: none submitted).
    prefix_hit_rate: float | None = None
    #: Why the guard's router chose (``affinity`` / ``ranked``), counted.
    routes: Mapping[str, int] = attrs.field(factory=dict)
    #: Per-tenant figures when the run had tenants (``simulate --tenants``).
    fairness: FairnessSummary | None = None

    def as_json(self) -> dict[str, dict[str, Any]]:
        return {tier: self.summary[tier].as_json() for tier in TIERS}


@attrs.frozen(kw_only=True)
class BackendLoad:
    """What one backend of the pool did."""

    name: str
    #: Requests submitted to it.
    requests: int
    #: Share of the run (to the last request's end) it had at least one request.
    busy_share: float
    #: Cached over prompt tokens of its requests (``None``: it got none).
    prefix_hit_rate: float | None
    #: Its good requests (as :attr:`RequestOutcome.good`) per second of the arrival span.
    goodput_per_s: float

    def as_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def prefix_hit_rate(outcomes: Sequence[RequestOutcome]) -> float | None:
    """Cached over prompt tokens of the requests that reached a backend."""
    prompt = sum(max(1, o.prompt_tokens) for o in outcomes if o.backend is not None)
    cached = sum(o.cached_prompt_tokens for o in outcomes if o.backend is not None)
    return cached / prompt if prompt else None


def _busy_seconds(spans: list[tuple[float, float]]) -> float:
    """The length of the union of the spans."""
    total = 0.0
    reach = -math.inf
    for start, end in sorted(spans):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def backend_loads(
    outcomes: Sequence[RequestOutcome], names: Sequence[str], *, duration_s: float, end_s: float
) -> tuple[BackendLoad, ...]:
    """Per backend: requests, busy share, prefix hit rate and goodput."""
    rows = []
    for index, name in enumerate(names):
        mine = [o for o in outcomes if o.backend == index]
        spans = [
            (o.admitted_at, o.last_token_at)
            for o in mine
            if o.admitted_at is not None and o.last_token_at is not None
        ]
        good = sum(o.good for o in mine)
        rows.append(
            BackendLoad(
                name=name,
                requests=len(mine),
                busy_share=_busy_seconds(spans) / end_s if end_s > 0 else 0.0,
                prefix_hit_rate=prefix_hit_rate(mine),
                goodput_per_s=good / duration_s if duration_s > 0 else 0.0,
            )
        )
    return tuple(rows)


def summarise(outcomes: Sequence[RequestOutcome], duration_s: float) -> dict[str, TierSummary]:
    """The summary rows ``all``, ``premium`` and ``basic``."""
    return {
        "all": TierSummary.of(outcomes, duration_s),
        "premium": TierSummary.of([o for o in outcomes if o.tier is Tier.PREMIUM], duration_s),
        "basic": TierSummary.of([o for o in outcomes if o.tier is Tier.BASIC], duration_s),
    }


def user_tps_series(
    outcomes: Sequence[RequestOutcome], interval: float, points: int
) -> list[float | None]:
    """Per interval ``k`` (ending at ``(k + 1) * interval``), the overlap-weighted mean speed."""
    weight = [0.0] * points
    total = [0.0] * points
    for outcome in outcomes:
        speed = outcome.user_tps
        first, last = outcome.first_token_at, outcome.last_token_at
        if speed is None or first is None or last is None:
            continue
        k = int(first // interval)
        while k < points and k * interval < last:
            overlap = min(last, (k + 1) * interval) - max(first, k * interval)
            if overlap > 0:
                weight[k] += overlap
                total[k] += overlap * speed
            k += 1
    return [t / w if w > 0 else None for t, w in zip(total, weight, strict=True)]
