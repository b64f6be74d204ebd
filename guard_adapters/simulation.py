"""Closed-loop simulation in virtual time: a request trace x the simulated engine x a policy.

Reads: a trace (:class:`~guard_adapters.traces.TraceRequest` values), a policy and an engine
profile. Nothing else: no I/O, no clock, no global randomness (tiers come from
:func:`~guard_adapters.traces.premium_flags` with the seed, the engine gets the same seed).

Policies:
- :class:`NoPolicy` forwards every request;
- :class:`Static` keeps a counter and refuses a request when ``limit`` are already in flight;
- :class:`Guard` is ``guard_core`` itself, driven by the live engine's request events: every
  arrival is ``Arrived``; a ``Queued`` request is ``Retried`` after every slot release and
  every poll and at :func:`~guard_core.next_check_at`; an admitted request is ``Forwarded``
  and ``Finished`` when the engine ends it (the core gives its slot back and ends its prefill
  grace in that one step); its ``FirstToken`` carries the seconds since it reached the guard;
  every ``poll_interval_s`` the engine's metrics become a ``BackendSample`` and a
  ``MetricsPolled``.

Guarantees:
- every trace request ends up exactly once as admitted or rejected, and every admitted one runs
  to its end (the simulation drains the engine after the last arrival);
- the same trace, policy, profile, seed and share always give the same result;
- the engine is stepped one scheduler step at a time only while a guard waiter could take a slot
  that a finishing request frees; otherwise it is advanced in one call to the next arrival, poll
  or sample, which keeps an hour of traffic to seconds of CPU.

Measures, per request: tier, admitted, TTFT (arrival at the guard to first token, waits
included), per-user speed ``(tokens - 1) / (last token - first token)`` for two tokens or more,
finished. Per second: the cap in force, admitted in flight, engine running and waiting, guard
waiters, and the time-weighted mean per-user speed of the requests decoding in that second (each
request contributes its own average speed). Summaries per tier: admitted, rejected, speed p5/p50,
TTFT p50/p95/p99 and goodput (requests finished at >= 20 tok/s with TTFT <= 1 s, per second of
the trace's arrival span).

Prompt-aware goodput relaxes only the TTFT bound, by the time the request's own prompt would need
on an idle engine of the profile (:func:`~guard_adapters.engine_model.idle_prefill_s` of its
uncached tokens): ``TTFT <= 1 s + idle prefill``, still >= 20 tok/s. A long prompt can never
start within 1 s, so the strict figure counts it as lost whatever the policy does; the
prompt-aware one asks only that queueing and interference stay within 1 s. For prompts of a few
hundred tokens the idle prefill is a few tens of milliseconds and the two figures nearly agree.

Prefix reuse (what is modelled): a trace whose requests carry ``hash_ids`` (Mooncake) gets one
:class:`~guard_adapters.prefix_cache.PrefixCache` of ``kv_capacity_tokens // 512`` blocks of
512 tokens for the run. When a request is submitted to the engine its leading blocks already in
the cache become its ``cached_prompt_tokens`` (held in KV, not prefilled: the engine model skips
their prefill time), and its blocks become the most recently used. The cache does not compete
with running sequences for KV space and counts a block as present from submission on, so reuse
is on the generous side of a busy real engine. Requests without ``hash_ids`` (Azure) are never
cached, as before.

Slowdowns: ``simulate(..., slowdowns=((at_s, duration_s, factor), ...))`` makes every engine
step ``factor`` times as long from ``at_s`` to ``at_s + duration_s`` (the engine's
``slow_down``, applied at those virtual instants inside the event loop); windows must not
overlap.

Polls: the guard's ``BackendSample`` carries what a vLLM page would: running, waiting, KV usage,
preemptions, prompt and generation token counters, and the TTFT and inter-token latency
histograms.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from guard_adapters.engine_model import (
    DEFAULT_PROFILE,
    ITL_BUCKETS,
    PROFILES,
    TTFT_BUCKETS,
    Engine,
    EngineMetrics,
    EngineProfile,
    RequestTooLong,
    SimRequest,
    TokenEvent,
    idle_prefill_s,
)
from guard_adapters.prefix_cache import MOONCAKE_BLOCK_TOKENS, PrefixCache
from guard_adapters.traces import TraceRequest, premium_flags
from guard_core import (
    Admitted,
    Arrived,
    BackendPoll,
    BackendSample,
    Finished,
    FirstToken,
    Flavour,
    Forwarded,
    GuardConfig,
    GuardState,
    Histogram,
    MetricsPolled,
    PredictiveConfig,
    Queued,
    Rejected,
    Retried,
    Tier,
    apply_guard_event,
    current_limit,
    next_check_at,
)

__all__ = (
    "GOOD_TPS",
    "GOOD_TTFT_S",
    "TIERS",
    "Guard",
    "NoPolicy",
    "Policy",
    "RequestOutcome",
    "SeriesPoint",
    "SimulationResult",
    "Slowdown",
    "Static",
    "TierSummary",
    "parse_policy",
    "quantile",
    "simulate",
    "summarise",
    "validate_slowdowns",
)

#: Goodput counts requests finished at this per-user speed or faster ...
GOOD_TPS: Final = 20.0
#: ... whose first token came within this many seconds of their arrival.
GOOD_TTFT_S: Final = 1.0
#: The rows of a summary: every request, then each tier.
TIERS: Final = ("all", "premium", "basic")

_INF: Final = math.inf
#: A rough size of a chat request's JSON body: bytes per prompt token, plus the envelope.
_BODY_BYTES_PER_TOKEN: Final = 4
_BODY_ENVELOPE_BYTES: Final = 200
_BACKEND: Final = "sim"


# -- policies ----------------------------------------------------------------------------------


def _body_bytes(prompt_tokens: int) -> int:
    """The size of a chat body for a prompt of this many tokens (what the guard would see)."""
    return prompt_tokens * _BODY_BYTES_PER_TOKEN + _BODY_ENVELOPE_BYTES


@attrs.frozen
class NoPolicy:
    """Forward everything."""

    @property
    def name(self) -> str:
        return "none"


@attrs.frozen
class Static:
    """At most ``limit`` requests in flight; any request beyond is refused at once."""

    limit: int = attrs.field(validator=attrs.validators.ge(0))

    @property
    def name(self) -> str:
        return f"static:{self.limit}"


@attrs.frozen
class Guard:
    """guard_core with these settings."""

    config: GuardConfig = attrs.field(factory=GuardConfig)
    label: str = "guard"

    @property
    def name(self) -> str:
        return self.label


Policy = NoPolicy | Static | Guard


def predictive_config(guard_config: GuardConfig) -> GuardConfig:
    """The same settings with the predictive learner selected (its settings kept if given)."""
    if guard_config.predictive is not None:
        return guard_config
    return attrs.evolve(guard_config, predictive=PredictiveConfig.from_policy(guard_config.policy))


def parse_policy(text: str, guard_config: GuardConfig | None = None) -> Policy:
    """``none``, ``static:N``, ``guard`` (PIG's learner) or ``predictive``, the guard with
    ``guard_config`` (default settings otherwise)."""
    spec = text.strip().lower()
    if spec == "none":
        return NoPolicy()
    config = guard_config if guard_config is not None else GuardConfig()
    if spec == "guard":
        return Guard(attrs.evolve(config, predictive=None))
    if spec == "predictive":
        return Guard(predictive_config(config), label="predictive")
    if spec.startswith("static:"):
        number = spec.removeprefix("static:").strip()
        if number.isdigit():
            return Static(int(number))
    raise ValueError(f"unknown policy {text!r}: use none, static:N (N >= 0), guard or predictive")


# -- results -----------------------------------------------------------------------------------


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
    #: Seconds the uncached part of its prompt alone takes to prefill on an idle engine of the
    #: profile (see :func:`~guard_adapters.engine_model.idle_prefill_s`); 0 when not computed.
    idle_prefill_s: float = 0.0

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

    def as_json(self) -> dict[str, dict[str, Any]]:
        return {tier: self.summary[tier].as_json() for tier in TIERS}


def summarise(outcomes: Sequence[RequestOutcome], duration_s: float) -> dict[str, TierSummary]:
    """The summary rows ``all``, ``premium`` and ``basic``."""
    return {
        "all": TierSummary.of(outcomes, duration_s),
        "premium": TierSummary.of([o for o in outcomes if o.tier is Tier.PREMIUM], duration_s),
        "basic": TierSummary.of([o for o in outcomes if o.tier is Tier.BASIC], duration_s),
    }


# -- the loop ----------------------------------------------------------------------------------


class _Req:
    """Mutable per-request bookkeeping while the simulation runs."""

    __slots__ = (
        "admitted",
        "admitted_at",
        "arrival",
        "cached",
        "cap",
        "failed",
        "finished",
        "first_at",
        "hash_ids",
        "inflight",
        "last_at",
        "output",
        "prompt",
        "reject_code",
        "rid",
        "tier",
        "tokens",
    )

    def __init__(self, rid: int, request: TraceRequest, tier: Tier) -> None:
        self.rid = rid
        self.arrival = request.arrival_s
        self.prompt = request.prompt_tokens
        self.output = request.output_tokens
        self.hash_ids = request.hash_ids
        self.cached = 0
        self.tier = tier
        self.admitted = False
        self.admitted_at: float | None = None
        self.inflight: int | None = None
        self.cap: int | None = None
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.tokens = 0
        self.finished = False
        self.failed = False
        self.reject_code: str | None = None

    def frozen(self, profile: EngineProfile) -> RequestOutcome:
        return RequestOutcome(
            request_id=self.rid,
            tier=self.tier,
            arrival_s=self.arrival,
            prompt_tokens=self.prompt,
            output_tokens=self.output,
            admitted=self.admitted,
            admitted_at=self.admitted_at,
            inflight_at_admission=self.inflight,
            cap_at_admission=self.cap,
            first_token_at=self.first_at,
            last_token_at=self.last_at,
            tokens=self.tokens,
            finished=self.finished,
            failed=self.failed,
            reject_code=self.reject_code,
            cached_prompt_tokens=self.cached,
            idle_prefill_s=idle_prefill_s(profile, max(1, self.prompt) - self.cached),
        )


class _Run:
    def __init__(
        self,
        trace: Sequence[TraceRequest],
        policy: Policy,
        profile: EngineProfile,
        *,
        seed: int,
        premium_share: float,
        poll_interval_s: float,
        sample_interval_s: float,
        slowdowns: Sequence[Slowdown] = (),
    ) -> None:
        flags = premium_flags(len(trace), premium_share, seed=seed)
        self.reqs = [
            _Req(i, r, Tier.PREMIUM if premium else Tier.BASIC)
            for i, (r, premium) in enumerate(zip(trace, flags, strict=True))
        ]
        self.policy = policy
        self.engine = Engine(profile, seed=seed, token_events=False)
        self.prefix_cache = _prefix_cache(trace, profile)
        #: (virtual time, speed factor from then on), in time order; the next one at ``slow_at``.
        self.slow_steps = _slowdown_steps(slowdowns)
        self.slow_at = 0
        self.poll_interval_s = poll_interval_s
        self.sample_interval_s = sample_interval_s
        self.guard: GuardState | None = None
        if isinstance(policy, Guard):
            self.guard = GuardState.initial(policy.config, at=0.0)
        self.limit = policy.limit if isinstance(policy, Static) else None
        self.inflight = 0
        #: request id -> (its latest Queued, when to retry it next), in arrival order.
        self.waiters: dict[int, tuple[Queued, float]] = {}
        self.samples: list[tuple[float, int | None, int, int, int, int]] = []
        self.polls = 0
        self.limit_reasons: dict[str, int] = {}
        self.refused = 0

    # -- policy actions --------------------------------------------------------------------------

    def _cap(self) -> int | None:
        if self.guard is not None:
            return current_limit(self.guard.gate)[0]
        return self.limit

    def _start(self, req: _Req, at: float) -> None:
        req.admitted = True
        req.admitted_at = at
        self.inflight += 1
        req.inflight = self.inflight
        req.cap = self._cap()
        if self.guard is not None:
            forwarded = Forwarded(at=at, request_id=req.rid)
            self.guard = apply_guard_event(self.guard, forwarded).state
        request = self._sim_request(req)
        try:
            self.engine.submit(request, at=at)
        except RequestTooLong:
            self.refused += 1
            req.failed = True
            self._end(req, at)

    def _sim_request(self, req: _Req) -> SimRequest:
        """What the engine is given for ``req``; its cached prefix is looked up now."""
        prompt = max(1, req.prompt)
        output = max(1, req.output)
        cache = self.prefix_cache
        # A request the engine will refuse as too long never computes, so never caches, a block.
        fits = prompt + output <= self.engine.profile.max_model_len
        if cache is not None and req.hash_ids and fits:
            req.cached = cache.lookup_and_insert(req.hash_ids, prompt)
        return SimRequest(
            request_id=req.rid,
            prompt_tokens=prompt,
            max_output_tokens=output,
            cached_prompt_tokens=req.cached,
        )

    def _next_slowdown_at(self) -> float:
        steps = self.slow_steps
        return steps[self.slow_at][0] if self.slow_at < len(steps) else _INF

    def _apply_slowdowns(self, at: float) -> None:
        """Set the engine's speed factor for every slowdown instant reached by ``at``."""
        steps = self.slow_steps
        while self.slow_at < len(steps) and steps[self.slow_at][0] <= at:
            when, factor = steps[self.slow_at]
            self.engine.slow_down(factor, at=when)
            self.slow_at += 1

    def _end(self, req: _Req, at: float) -> None:
        self.inflight -= 1
        if self.guard is None:
            return
        self.guard = apply_guard_event(self.guard, Finished(at=at, request_id=req.rid)).state
        if self.waiters:
            self._retry(at, everyone=True)

    def _settle(self, req: _Req, outcome: object, at: float) -> None:
        if isinstance(outcome, Admitted):
            self.waiters.pop(req.rid, None)
            self._start(req, at)
        elif isinstance(outcome, Queued):
            assert self.guard is not None
            check = next_check_at(outcome, now=at, config=self.guard.config.gate)
            self.waiters[req.rid] = (outcome, check)
        else:
            assert isinstance(outcome, Rejected)
            self.waiters.pop(req.rid, None)
            req.reject_code = str(outcome.code)

    def _arrive(self, req: _Req, at: float) -> None:
        if self.guard is not None:
            event = Arrived(
                at=at, request_id=req.rid, tier=req.tier, body_bytes=_body_bytes(req.prompt)
            )
            step = apply_guard_event(self.guard, event)
            self.guard = step.state
            self._settle(req, step.outcome, at)
        elif self.limit is None or self.inflight < self.limit:
            self._start(req, at)
        else:
            req.reject_code = "static_limit"

    def _retry(self, at: float, *, everyone: bool) -> None:
        for rid, (_, check) in list(self.waiters.items()):
            if rid not in self.waiters or (not everyone and check > at):
                continue
            assert self.guard is not None
            step = apply_guard_event(self.guard, Retried(at=at, request_id=rid))
            self.guard = step.state
            self._settle(self.reqs[rid], step.outcome, at)

    def _poll(self, at: float) -> None:
        assert self.guard is not None
        sample = _backend_sample(self.engine.metrics())
        poll = MetricsPolled(at, (BackendPoll(name=_BACKEND, sample=sample),))
        step = apply_guard_event(self.guard, poll)
        self.guard = step.state
        self.polls += 1
        if step.decision is not None:
            reason = str(step.decision.final_reason)
            self.limit_reasons[reason] = self.limit_reasons.get(reason, 0) + 1
        if self.waiters:
            self._retry(at, everyone=True)

    def _sample(self, at: float) -> None:
        m = self.engine.metrics()
        guard_waiting = self.guard.gate.waiting if self.guard is not None else 0
        self.samples.append((at, self._cap(), self.inflight, m.running, m.waiting, guard_waiting))

    def _engine_event(self, event: TokenEvent) -> None:
        req = self.reqs[event.request_id]
        at = event.at
        kind = event.kind
        if event.tokens:
            req.tokens += event.tokens
            req.last_at = at
        if kind == "first_token":
            req.first_at = at
            if self.guard is not None:
                seen = FirstToken(at=at, request_id=req.rid, seconds=at - req.arrival)
                self.guard = apply_guard_event(self.guard, seen).state
                if self.waiters and self.guard.predictive is not None:
                    # A prefill ended: the predictive learner's TTFT room may have come back.
                    self._retry(at, everyone=True)
        elif kind == "finished":
            req.finished = True
            self._end(req, at)
        elif kind == "failed":
            req.failed = True
            self._end(req, at)

    # -- the event loop --------------------------------------------------------------------------

    def run(self) -> tuple[float, float]:
        """Run to the end; return (the last arrival, when the last admitted request ended)."""
        reqs, engine = self.reqs, self.engine
        count = len(reqs)
        index = 0
        guarded = self.guard is not None
        next_poll = 0.0 if guarded else _INF
        next_sample = self.sample_interval_s
        end = 0.0
        while index < count or self.waiters or self.inflight:
            at = reqs[index].arrival if index < count else _INF
            at = min(at, next_poll, next_sample, self._next_slowdown_at())
            if self.waiters:
                at = min(at, *(check for _, check in self.waiters.values()))
                # A finishing request frees a slot a waiter may take at that very moment.
                engine_at = engine.next_event_at()
                if engine_at is not None and engine_at < at:
                    at = engine_at
            for event in engine.advance(at):
                end = max(end, event.at)
                self._engine_event(event)
            self._apply_slowdowns(at)
            if next_poll <= at:
                self._poll(at)
                next_poll += self.poll_interval_s
            if self.waiters:
                self._retry(at, everyone=False)
            while index < count and reqs[index].arrival <= at:
                self._arrive(reqs[index], at)
                index += 1
            if next_sample <= at:
                self._sample(at)
                next_sample += self.sample_interval_s
                if (
                    index >= count
                    and not self.waiters
                    and self.inflight
                    and engine.next_event_at() is None
                ):
                    break  # nothing can make progress any more (never expected)
        last_arrival = reqs[-1].arrival if reqs else 0.0
        return last_arrival, end

    def preemptions(self) -> int:
        return self.engine.metrics().preemptions_total


#: ``(at_s, duration_s, factor)``: engine steps take ``factor`` times as long over that window.
Slowdown = tuple[float, float, float]


def validate_slowdowns(slowdowns: Sequence[Slowdown]) -> tuple[Slowdown, ...]:
    """``slowdowns`` as floats, sorted by start; ``ValueError`` for a bad or overlapping window.

    ``at_s`` >= 0, ``duration_s`` > 0 and ``factor`` > 0, all finite; a window may start where
    the previous one ends, but not before.
    """
    windows: list[Slowdown] = []
    for item in slowdowns:
        try:
            at_s, duration_s, factor = (float(part) for part in item)
        except (TypeError, ValueError):
            raise ValueError(
                f"a slowdown is (at_s, duration_s, factor) numbers, got {item!r}"
            ) from None
        if not (math.isfinite(at_s) and at_s >= 0):
            raise ValueError(f"slowdown start must be a finite time >= 0 s, got {at_s!r}")
        if not (math.isfinite(duration_s) and duration_s > 0):
            raise ValueError(f"slowdown duration must be finite and > 0 s, got {duration_s!r}")
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"slowdown factor must be finite and > 0, got {factor!r}")
        windows.append((at_s, duration_s, factor))
    windows.sort()
    for (at_a, dur_a, _), (at_b, _, _) in itertools.pairwise(windows):
        if at_b < at_a + dur_a:
            raise ValueError(
                f"slowdowns overlap: the one from {at_b:g} s starts before the one from"
                f" {at_a:g} s ends ({at_a + dur_a:g} s)"
            )
    return tuple(windows)


def _slowdown_steps(slowdowns: Sequence[Slowdown]) -> list[tuple[float, float]]:
    """The instants the speed factor changes, and the factor from each on (1 after a window)."""
    steps: list[tuple[float, float]] = []
    for at_s, duration_s, factor in validate_slowdowns(slowdowns):
        steps.extend(((at_s, factor), (at_s + duration_s, 1.0)))
    return steps


def _prefix_cache(trace: Sequence[TraceRequest], profile: EngineProfile) -> PrefixCache | None:
    """A cache as large as the engine's KV, in 512-token blocks, when the trace names blocks."""
    if not any(request.hash_ids for request in trace):
        return None
    return PrefixCache(profile.kv_capacity_tokens // MOONCAKE_BLOCK_TOKENS, MOONCAKE_BLOCK_TOKENS)


def _backend_sample(m: EngineMetrics) -> BackendSample:
    """The engine's figures as the guard would parse them from its vLLM page."""
    return BackendSample(
        flavour=Flavour.VLLM,
        running=float(m.running),
        waiting=float(m.waiting),
        kv_usage=m.kv_usage,
        preemptions=float(m.preemptions_total),
        generation_tokens=float(m.generation_tokens_total),
        ttft=_histogram(TTFT_BUCKETS, m.ttft_bucket_counts, m.ttft_sum),
        prompt_tokens=float(m.prompt_tokens_total),
        inter_token_latency=_histogram(ITL_BUCKETS, m.itl_bucket_counts, m.itl_sum),
    )


def _histogram(bounds: Sequence[float], cumulative: Sequence[int], total: float) -> Histogram:
    buckets = tuple(zip((*bounds, _INF), map(float, cumulative), strict=True))
    return Histogram(buckets, float(cumulative[-1]), total)


def _user_tps_series(
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


def simulate(
    trace: Sequence[TraceRequest],
    policy: Policy | str,
    *,
    profile: EngineProfile | str = DEFAULT_PROFILE,
    seed: int = 0,
    premium_share: float = 0.0,
    poll_interval_s: float = 1.0,
    guard_config: GuardConfig | None = None,
    sample_interval_s: float = 1.0,
    slowdowns: Sequence[Slowdown] = (),
) -> SimulationResult:
    """Run ``trace`` through ``policy`` in front of a fresh simulated engine.

    ``policy`` may also be written as text (see :func:`parse_policy`); ``guard_config`` is then
    the guard's settings. ``trace`` must be sorted by arrival (as the loaders return it).
    ``slowdowns`` are ``(at_s, duration_s, factor)`` windows of a slower engine (see
    :func:`validate_slowdowns`).
    """
    if isinstance(policy, str):
        policy = parse_policy(policy, guard_config)
    if isinstance(profile, str):
        if profile not in PROFILES:
            raise ValueError(f"unknown engine profile {profile!r}: one of {', '.join(PROFILES)}")
        profile = PROFILES[profile]
    if not (poll_interval_s > 0 and sample_interval_s > 0):
        raise ValueError("poll and sample intervals must be > 0")
    if any(b.arrival_s < a.arrival_s for a, b in itertools.pairwise(trace)):
        raise ValueError("the trace must be sorted by arrival time")
    slowdowns = validate_slowdowns(slowdowns)
    run = _Run(
        trace,
        policy,
        profile,
        seed=seed,
        premium_share=premium_share,
        poll_interval_s=poll_interval_s,
        sample_interval_s=sample_interval_s,
        slowdowns=slowdowns,
    )
    last_arrival, end = run.run()
    outcomes = tuple(req.frozen(profile) for req in run.reqs)
    duration = last_arrival if last_arrival > 0 else end
    speeds = _user_tps_series(outcomes, sample_interval_s, len(run.samples))
    series = tuple(
        SeriesPoint(
            at=at,
            cap=cap,
            inflight=inflight,
            running=running,
            waiting=waiting,
            guard_waiting=guard_waiting,
            user_tps=speed,
        )
        for (at, cap, inflight, running, waiting, guard_waiting), speed in zip(
            run.samples, speeds, strict=True
        )
    )
    return SimulationResult(
        policy=policy.name,
        profile=profile.name,
        duration_s=duration,
        end_s=end,
        requests=outcomes,
        series=series,
        summary=summarise(outcomes, duration),
        polls=run.polls,
        limit_reasons=dict(sorted(run.limit_reasons.items(), key=lambda item: -item[1])),
        preemptions=run.preemptions(),
        engine_refused=run.refused,
    )
