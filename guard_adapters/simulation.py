"""Closed-loop simulation in virtual time: a request trace x the simulated engine x a policy.

Reads: a trace (:class:`~guard_adapters.traces.TraceRequest` values), a policy and an engine
profile. Nothing else: no I/O, no clock, no global randomness (tiers come from
:func:`~guard_adapters.traces.premium_flags` with the seed, the engine gets the same seed).

Policies:
- :class:`NoPolicy` forwards every request;
- :class:`Static` keeps a counter and refuses a request when ``limit`` are already in flight;
- :class:`Guard` is ``guard_core`` itself, driven by the live engine's request events: every
  arrival is ``Arrived``; a ``Queued`` request is ``Retried`` after every slot release and
  every poll and at :func:`~guard_core.next_check_at` (with flow control, in the core's fair
  order, :func:`~guard_core.flow.waiters_in_order`, once more when a wait ended, stopping a pass
  once no slot is free, as the live engine does); an admitted request is ``Forwarded`` and
  ``Finished`` (with the output tokens it generated) when the engine ends it (the core gives
  its slot back and ends its prefill grace in that one step); its ``FirstToken`` carries the
  seconds since it reached the guard; every ``poll_interval_s`` the engine's metrics become a
  ``BackendSample`` and a ``MetricsPolled``.

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
from collections.abc import Sequence
from typing import Final

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
from guard_adapters.engine_pool import EnginePool
from guard_adapters.fairness_results import HEAVY, summarise_tenants
from guard_adapters.prefix_cache import MOONCAKE_BLOCK_TOKENS, PrefixCache
from guard_adapters.sim_routing import RoutedRequest, Router, RoutingView, parse_routing
from guard_adapters.simulation_results import (
    GOOD_TPS,
    GOOD_TTFT_S,
    TIERS,
    RequestOutcome,
    SeriesPoint,
    SimulationResult,
    TierSummary,
    backend_loads,
    prefix_hit_rate,
    quantile,
    summarise,
    user_tps_series,
)
from guard_adapters.traces import TraceRequest, premium_flags, tenant_labels, thinned
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
from guard_core.flow import RETRY_PASSES, retry_has_room, waiters_in_order
from guard_core.traffic import BackendFinished, BackendForwarded

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


# -- the loop ----------------------------------------------------------------------------------


class _Req:
    """Mutable per-request bookkeeping while the simulation runs."""

    __slots__ = (
        "admitted",
        "admitted_at",
        "arrival",
        "backend",
        "band",
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
        "tenant",
        "tier",
        "tokens",
    )

    def __init__(
        self, rid: int, request: TraceRequest, tier: Tier, tenant: str = "", band: str = ""
    ) -> None:
        self.rid = rid
        self.tenant = tenant
        self.band = band
        self.arrival = request.arrival_s
        self.prompt = request.prompt_tokens
        self.output = request.output_tokens
        self.hash_ids = request.hash_ids
        self.cached = 0
        #: The backend it was submitted to (``None``: not submitted).
        self.backend: int | None = None
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
            backend=self.backend,
            idle_prefill_s=idle_prefill_s(profile, max(1, self.prompt) - self.cached),
            tenant=self.tenant,
            band=self.band,
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
        backends: int = 1,
        slow_backend: float = 1.0,
        router: Router | None = None,
        tenants: int = 0,
        heavy_share: float = 0.0,
        heavy_keep: float = 1.0,
    ) -> None:
        flags: Sequence[bool] = premium_flags(len(trace), premium_share, seed=seed)
        labels: Sequence[str] = [""] * len(trace)
        if tenants:
            labels = tenant_labels(len(trace), tenants, heavy_share, seed=seed)
        if tenants and heavy_keep < 1.0:
            kept = thinned(labels, HEAVY, heavy_keep, seed=seed)
            trace = [r for r, k in zip(trace, kept, strict=True) if k]
            flags = [f for f, k in zip(flags, kept, strict=True) if k]
            labels = [label for label, k in zip(labels, kept, strict=True) if k]
        flow = policy.config.flow if isinstance(policy, Guard) else None
        self.flow = flow is not None
        # The premium flag picks the first band, the rest go to the default one.
        top, rest = "", ""
        if flow is not None:
            top, rest = flow.bands.names[0], flow.bands.names[flow.bands.default]
        self.reqs = [
            _Req(i, r, Tier.PREMIUM if premium else Tier.BASIC, tenant, top if premium else rest)
            for i, (r, premium, tenant) in enumerate(zip(trace, flags, labels, strict=True))
        ]
        self.policy = policy
        engines = [Engine(profile, seed=seed + i, token_events=False) for i in range(backends)]
        factors = [1.0] * (backends - 1) + [slow_backend]
        self.engine = EnginePool(engines, factors)
        self.names = (
            (_BACKEND,) if backends == 1 else tuple(f"{_BACKEND}-{i}" for i in range(backends))
        )
        self.caches = [_prefix_cache(trace, profile) for _ in range(backends)]
        self.router = router
        #: Requests in flight per backend, and their prompt tokens still without a first token.
        self.loads = [0] * backends
        self.pending = [0] * backends
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
        backend = self._route(req, at)
        req.backend = backend
        self.loads[backend] += 1
        self.pending[backend] += req.prompt
        if self.guard is not None and len(self.names) > 1:
            sent = BackendForwarded(at=at, backend=self.names[backend], request_id=req.rid)
            self.guard = apply_guard_event(self.guard, sent).state
        request = self._sim_request(req)
        try:
            self.engine.submit(request, at=at, backend=backend)
        except RequestTooLong:
            self.refused += 1
            req.failed = True
            self._end(req, at)
            req.backend = None  # never reached the engine

    def _route(self, req: _Req, at: float) -> int:
        """The backend ``req`` goes to (always 0 for one backend)."""
        if self.router is None or len(self.names) == 1:
            return 0
        routed = RoutedRequest(
            prompt_tokens=req.prompt, body_bytes=_body_bytes(req.prompt), hash_ids=req.hash_ids
        )
        view = RoutingView(
            request=routed,
            names=self.names,
            loads=tuple(self.loads),
            pending_tokens=tuple(self.pending),
            guard=self.guard,
            cache_tokens=self.engine.profile.kv_capacity_tokens,
            at=at,
        )
        return self.router.choose(view)

    def _sim_request(self, req: _Req) -> SimRequest:
        """What the engine is given for ``req``; its cached prefix is looked up now."""
        prompt = max(1, req.prompt)
        output = max(1, req.output)
        cache = self.caches[req.backend or 0]
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
        if req.backend is not None:
            self.loads[req.backend] -= 1
            if req.first_at is None:
                self.pending[req.backend] -= req.prompt
        if self.guard is None:
            return
        if len(self.names) > 1 and req.backend is not None:
            ended = BackendFinished(at=at, backend=self.names[req.backend])
            self.guard = apply_guard_event(self.guard, ended).state
        done = Finished(at=at, request_id=req.rid, output_tokens=req.tokens)
        self.guard = apply_guard_event(self.guard, done).state
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
                at=at,
                request_id=req.rid,
                tier=req.tier,
                body_bytes=_body_bytes(req.prompt),
                band=req.band,
                tenant=req.tenant,
            )
            step = apply_guard_event(self.guard, event)
            self.guard = step.state
            self._settle(req, step.outcome, at)
        elif self.limit is None or self.inflight < self.limit:
            self._start(req, at)
        else:
            req.reject_code = "static_limit"

    def _retry(self, at: float, *, everyone: bool) -> None:
        for _ in range(RETRY_PASSES):
            ended = False
            for rid in self._retry_order():
                entry = self.waiters.get(rid)
                if entry is None or (not everyone and entry[1] > at):
                    continue
                assert self.guard is not None
                if self.flow and entry[1] > at and not retry_has_room(self.guard.gate):
                    continue  # no retry can be admitted: only the waits that end now
                step = apply_guard_event(self.guard, Retried(at=at, request_id=rid))
                self.guard = step.state
                self._settle(self.reqs[rid], step.outcome, at)
                ended = ended or not isinstance(step.outcome, Queued)
            # Flow control ranks waiters: as the live engine does, a wait that ended (a slot
            # taken or given up) wakes the others again, since one passed over may be next now,
            # once (``RETRY_PASSES``).
            if not (ended and self.waiters and self.flow):
                return
            everyone = True

    def _retry_order(self) -> tuple[int, ...]:
        """Waiters in arrival order; with flow control, in its fair order (as the engine)."""
        guard = self.guard
        if guard is None or guard.flow is None:
            return tuple(self.waiters)
        return waiters_in_order(guard.flow, guard.requests, guard.gate)

    def _poll(self, at: float) -> None:
        assert self.guard is not None
        polls = tuple(
            BackendPoll(name=name, sample=_backend_sample(m))
            for name, m in zip(self.names, self.engine.metrics(), strict=True)
        )
        poll = MetricsPolled(at, polls)
        step = apply_guard_event(self.guard, poll)
        self.guard = step.state
        self.polls += 1
        if step.decision is not None:
            reason = str(step.decision.final_reason)
            self.limit_reasons[reason] = self.limit_reasons.get(reason, 0) + 1
        if self.waiters:
            self._retry(at, everyone=True)

    def _sample(self, at: float) -> None:
        each = self.engine.metrics()
        running = sum(m.running for m in each)
        waiting = sum(m.waiting for m in each)
        guard_waiting = self.guard.gate.waiting if self.guard is not None else 0
        self.samples.append((at, self._cap(), self.inflight, running, waiting, guard_waiting))

    def _engine_event(self, event: TokenEvent) -> None:
        req = self.reqs[event.request_id]
        at = event.at
        kind = event.kind
        if event.tokens:
            req.tokens += event.tokens
            req.last_at = at
        if kind == "first_token":
            if req.first_at is None and req.backend is not None:
                self.pending[req.backend] -= req.prompt
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
        return sum(m.preemptions_total for m in self.engine.metrics())


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
    backends: int = 1,
    slow_backend: float = 1.0,
    routing: Router | str = "round-robin",
    tenants: int = 0,
    heavy_share: float = 0.0,
    heavy_keep: float = 1.0,
) -> SimulationResult:
    """Run ``trace`` through ``policy`` in front of a fresh simulated engine.

    ``policy`` may also be written as text (see :func:`parse_policy`); ``guard_config`` is then
    the guard's settings. ``trace`` must be sorted by arrival (as the loaders return it).
    ``slowdowns`` are ``(at_s, duration_s, factor)`` windows of a slower engine (see
    :func:`validate_slowdowns`).

    ``backends`` engines of the same profile make a pool (each its own prefix cache; the policy's
    cap is the pool's), ``slow_backend`` makes the last of them that many times slower for the
    whole run, and ``routing`` places each admitted request (see
    :mod:`guard_adapters.sim_routing`; a name gives a fresh router). One backend (the default)
    is exactly the single-engine simulation, whatever the routing.

    ``tenants`` (2 or more) labels each request with a tenant, ``t0`` (the heavy one) with
    chance ``heavy_share`` and one of the others uniformly otherwise
    (:func:`~guard_adapters.traces.tenant_labels`); the guard sees the label as its tenant key
    when its settings enable tenants, and the result gains per-tenant figures. ``heavy_keep``
    below 1 then keeps each of ``t0``'s requests with that chance only
    (:func:`~guard_adapters.traces.thinned`), every other request as it was: the same light
    traffic with the heavy tenant sending less.
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
    if backends < 1:
        raise ValueError(f"backends must be >= 1, got {backends}")
    if not 0.0 < heavy_keep <= 1.0:
        raise ValueError(f"heavy_keep must be in (0, 1], got {heavy_keep}")
    if not (math.isfinite(slow_backend) and slow_backend > 0):
        raise ValueError(f"slow_backend must be finite and > 0, got {slow_backend}")
    router = parse_routing(routing) if isinstance(routing, str) else routing
    run = _Run(
        trace,
        policy,
        profile,
        seed=seed,
        premium_share=premium_share,
        poll_interval_s=poll_interval_s,
        sample_interval_s=sample_interval_s,
        slowdowns=slowdowns,
        backends=backends,
        slow_backend=slow_backend,
        router=router,
        tenants=tenants,
        heavy_share=heavy_share,
        heavy_keep=heavy_keep,
    )
    last_arrival, end = run.run()
    outcomes = tuple(req.frozen(profile) for req in run.reqs)
    duration = last_arrival if last_arrival > 0 else end
    speeds = user_tps_series(outcomes, sample_interval_s, len(run.samples))
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
        routing=router.name,
        backends=backend_loads(outcomes, run.names, duration_s=duration, end_s=end),
        prefix_hit_rate=prefix_hit_rate(outcomes),
        routes=dict(router.reasons()),
        fairness=summarise_tenants(outcomes, duration) if tenants else None,
    )
