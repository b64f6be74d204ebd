"""The predictive learner: admit a request when the engine model says everyone stays fast.

Selected by ``DYNAMIC_POLICY=predictive``; PIG's pipeline (:mod:`guard_core.evaluation`) is left
exactly as it is and still runs beside it, for its state reasons and its intake rules.

Reads:
- from every poll, per backend, the deltas of the engine's counters and histograms: generation
  and prompt tokens, the inter-token-latency histogram, running, waiting and KV usage;
- from the guard itself: each forwarded request's body size (its prompt estimate), the moment its
  first useful token came (measured from forwarding, so a short wait in the guard is never
  mistaken for engine latency), and its end.

Learns (per backend): an :class:`~guard_core.engine_fit.EngineFit` of the step-time law; the
body bytes per prompt token, from the engine's own prompt-token counter against the bodies whose
prefill ended in the same interval; KV usage per token in flight; how long a request decodes.

Guarantees:
- pure: every function takes the state and ``at`` and returns a new value; nothing is read from
  a clock;
- :func:`assess` forwards a request only when, with it, the predicted per-user decode speed of
  every decoding sequence stays at or above ``DYNAMIC_SINGLE_USER_TPS_YELLOW``, the predicted
  time to its first token beyond what its prompt alone needs on an idle engine (queueing and
  interference, plus what it already waited in the guard) stays within
  ``DYNAMIC_TTFT_TARGET_SECONDS``, and the predicted KV usage stays at or below
  ``DYNAMIC_PREDICTIVE_KV_LIMIT``; a basic request must also leave the premium reserve free;
- each verdict and each published cap carries its explanation (:class:`Prediction`): the
  predicted speed, TTFT and KV usage, the binding constraint, and the fit;
- with several backends the load is taken as spread evenly over the healthy ones and the most
  pessimistic backend's fit is used (a pool's own rules are :mod:`guard_core.pool_admission`);
- the published cap and the ``Retry-After`` of a refusal are :mod:`guard_core.predictive_cap`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from typing import Any

import attrs

from guard_core._errors import require
from guard_core._values import replace
from guard_core.engine_fit import EngineFit, Interval, observe
from guard_core.evaluation import BackendPoll
from guard_core.observations import BackendSample
from guard_core.policy import PolicyConfig
from guard_core.settings import (
    AtLeast,
    Greater,
    NotAbove,
    Within,
    default_of,
    require_valid,
    setting,
)
from guard_core.table import filed, forgotten

__all__ = (
    "Binding",
    "FitSummary",
    "Prediction",
    "PredictiveConfig",
    "PredictiveState",
    "SentLoad",
    "Verdict",
    "assess",
    "finished",
    "first_token",
    "forwarded",
    "polled",
    "sent_to",
)

#: Each interval the fit learns from spans this many polls (overlapping): a prompt is counted by
#: the engine when its prefill ends, so a one-poll interval sees prefill work and its tokens
#: fall on different sides of a poll; a longer span makes that boundary matter less.
_WINDOW_POLLS = 3
#: Smoothing of the learned ratios (per poll or per finished request).
_RATIO_SMOOTHING = 0.7
#: An interval is learned from only when the engine decoded at least this many tokens in it.
_MIN_INTERVAL_TOKENS = 20
#: Bytes-per-token samples need this many prompt tokens in the interval.
_MIN_PROMPT_TOKENS = 500
_MIN_HORIZON_S = 0.5
#: A finished request's decode time is taken within these bounds when learning its mean.
_MIN_DECODE_S = 0.5
_MAX_DECODE_S = 60.0
_MAX_HORIZON_S = 60.0
#: Without a body size, a request is taken to have this many prompt tokens.
_UNKNOWN_PROMPT_TOKENS = 512.0
#: On an engine that cannot reach the speed target for one user, the target becomes this share
#: of its best single-user speed (but never below the red floor).
_TARGET_SHARE = 0.95
_PRIOR_FIT = EngineFit()
#: The trust region of the fit: requests in flight (per backend) may reach
#: ``max(_TRUST_FLOOR, _TRUST_GROWTH x`` the most decoders seen``)``; what was seen decays by
#: ``_TRUST_DECAY`` per poll. A young fit extrapolates badly, so load grows like TCP's slow
#: start while the model learns it.
_TRUST_FLOOR = 8.0
_TRUST_GROWTH = 2.0
_TRUST_DECAY = 0.998
#: The TTFT correction learns only from requests predicted to wait at least this long (shorter
#: ones are dominated by one step's rounding), is bounded, and is smoothed per request.
_MIN_PREDICTED_FIRST_S = 0.1
_MAX_TTFT_RATIO = 5.0
_TTFT_RATIO_SMOOTHING = 0.95


class Binding(enum.StrEnum):
    """Which prediction refused (or limited) admission."""

    NONE = "none"
    SPEED = "predicted_speed"
    TTFT = "predicted_ttft"
    KV = "predicted_kv"
    #: More requests than the fit has seen the engine carry (it may double per poll).
    UNTRIED = "untried_load"


@attrs.frozen(kw_only=True)
class PredictiveConfig:
    """Settings of the predictive learner (``DYNAMIC_PREDICTIVE_*``)."""

    #: ``DYNAMIC_SINGLE_USER_TPS_YELLOW``: the per-user speed every decoding user keeps.
    user_tps_target: float = setting(
        default_of(PolicyConfig, "user_tps_yellow"),
        env="DYNAMIC_SINGLE_USER_TPS_YELLOW",
        rules=(Greater(0),),
    )
    #: ``DYNAMIC_SINGLE_USER_TPS_RED`` (never above the target): the floor the target gives way
    #: to on an engine that cannot reach it even for one user (a large model on one GPU).
    user_tps_floor: float = setting(
        default_of(PolicyConfig, "user_tps_red"), rules=(Greater(0), NotAbove("user_tps_target"))
    )
    #: ``DYNAMIC_TTFT_TARGET_SECONDS``: the most queueing and interference a first token may see.
    ttft_target_s: float = setting(
        default_of(PolicyConfig, "ttft_target_s"),
        env="DYNAMIC_TTFT_TARGET_SECONDS",
        rules=(Greater(0),),
    )
    #: The engine's token budget per step (vLLM ``max_num_batched_tokens``).
    batch_tokens: int = setting(2048, env="DYNAMIC_PREDICTIVE_BATCH_TOKENS", rules=(AtLeast(16),))
    #: Per-poll forgetting factor of the engine fit: lower follows changes faster.
    forgetting: float = setting(
        0.9, env="DYNAMIC_PREDICTIVE_FORGETTING", rules=(Within(0.5, 1, high_open=True),)
    )
    #: Highest predicted KV-cache usage a new request may bring the engine to.
    kv_limit: float = setting(
        0.9, env="DYNAMIC_PREDICTIVE_KV_LIMIT", rules=(Within(0, 1, low_open=True),)
    )
    #: Body bytes per prompt token assumed until the backend's counter has taught the real ratio
    #: (finite as well: the adapter reads only finite numbers).
    bytes_per_token: float = setting(
        4.0, env="DYNAMIC_PREDICTIVE_BYTES_PER_TOKEN", rules=(Greater(0),)
    )
    #: The window over which the prompt tokens forwarded count as the engine's prefill load (an
    #: exponential decay with this time constant): short enough that a burst of long prompts,
    #: which stalls every decoder while it is prefilled, is seen as the burst it is.
    horizon_s: float = setting(
        3.0,
        env="DYNAMIC_PREDICTIVE_HORIZON_SECONDS",
        rules=(Within(_MIN_HORIZON_S, _MAX_HORIZON_S),),
    )
    global_limit: int = setting(
        default_of(PolicyConfig, "global_limit"), env="GLOBAL_LIMIT", rules=(AtLeast(0),)
    )

    def __attrs_post_init__(self) -> None:
        require_valid(self)
        require(
            self.bytes_per_token < math.inf, "DYNAMIC_PREDICTIVE_BYTES_PER_TOKEN must be finite"
        )

    @classmethod
    def from_policy(cls, policy: PolicyConfig, **settings: Any) -> PredictiveConfig:
        """Targets shared with PIG's learner come from its settings; the rest as given."""
        return cls(
            user_tps_target=policy.user_tps_yellow,
            user_tps_floor=min(policy.user_tps_red, policy.user_tps_yellow),
            ttft_target_s=policy.ttft_target_s,
            global_limit=policy.global_limit,
            **settings,
        )


@attrs.frozen
class FitSummary:
    """The fit behind a prediction, in plain units."""

    step_base_s: float
    per_decoder_s: float
    per_kv_s: float
    per_prompt_token_s: float
    relative_error: float
    observations: int

    @classmethod
    def of(cls, fit: EngineFit) -> FitSummary:
        return cls(
            fit.step_base_s,
            fit.per_decoder_s,
            fit.per_kv_s,
            fit.per_prompt_token_s,
            fit.relative_error,
            fit.observations,
        )


@attrs.frozen(kw_only=True)
class Prediction:
    """Why the learner admitted, refused or capped: the predictions and the binding constraint."""

    user_tps: float
    ttft_s: float
    kv_usage: float
    binding: Binding
    fit: FitSummary
    #: The cap in requests in flight that keeps the speed target at the current prompt load.
    cap: int = 0


@attrs.frozen
class Verdict:
    admit: bool
    prediction: Prediction


@attrs.frozen
class _Tracked:
    tokens: float
    body_bytes: int | None
    forwarded_at: float
    #: Predicted seconds from forwarding to the first token, when it was forwarded.
    predicted_first_s: float = 0.0
    first_at: float | None = None
    #: The backend it was sent to, when the runtime said (:func:`sent_to`).
    backend: str | None = None


@attrs.frozen(slots=False)  # made several times per request: see guard_core._values
class SentLoad:
    """The running figures of the requests in flight sent to one backend (or, under ``None``,
    forwarded and not yet placed): what the pool rules read of each backend's own load, kept
    per event so that reading it never walks every request in flight."""

    count: int = 0
    #: Those still without a first token, and their prompt tokens; those decoding.
    pending_count: int = 0
    pending_tokens: float = 0.0
    decoders: int = 0
    #: Their prompt tokens, each decayed with the horizon from its forwarding, as of
    #: ``weight_at`` (a later reading decays the sum as a whole).
    weight: float = 0.0
    weight_at: float = 0.0

    def joined(self, tracked: _Tracked, horizon: float) -> SentLoad:
        """With ``tracked`` (forwarded, or placed here) added."""
        start = tracked.forwarded_at
        weight, weight_at = self.weight, self.weight_at
        if self.count == 0:
            weight, weight_at = 0.0, start
        elif start > weight_at:  # moved forward, so that no weight grows past its tokens
            weight *= math.exp((weight_at - start) / horizon)
            weight_at = start
        weight += tracked.tokens * math.exp((start - weight_at) / horizon)
        decoding = tracked.first_at is not None
        return SentLoad(
            self.count + 1,
            self.pending_count + (0 if decoding else 1),
            self.pending_tokens + (0.0 if decoding else tracked.tokens),
            self.decoders + (1 if decoding else 0),
            weight,
            weight_at,
        )

    def left(self, tracked: _Tracked, horizon: float) -> SentLoad:
        """With ``tracked`` (ended, or placed elsewhere) taken out; empty is exactly zero."""
        if self.count <= 1:
            return SentLoad()
        share = tracked.tokens * math.exp((tracked.forwarded_at - self.weight_at) / horizon)
        decoding = tracked.first_at is not None
        return SentLoad(
            self.count - 1,
            self.pending_count - (0 if decoding else 1),
            max(0.0, self.pending_tokens - (0.0 if decoding else tracked.tokens)),
            self.decoders - (1 if decoding else 0),
            max(0.0, self.weight - share),
            self.weight_at,
        )

    def first_token(self, tracked: _Tracked) -> SentLoad:
        """With ``tracked`` (pending here) decoding from now on."""
        return SentLoad(
            self.count,
            self.pending_count - 1,
            max(0.0, self.pending_tokens - tracked.tokens),
            self.decoders + 1,
            self.weight,
            self.weight_at,
        )

    def weight_as_of(self, at: float, horizon: float) -> float:
        return self.weight * math.exp(min(0.0, self.weight_at - at) / horizon)


def _moved(
    loads: Mapping[str | None, SentLoad],
    horizon: float,
    *,
    gone: tuple[str | None, _Tracked] | None = None,
    came: tuple[str | None, _Tracked] | None = None,
) -> dict[str | None, SentLoad]:
    """``loads`` with a request taken out of one backend's figures and/or added to another's."""
    changed = dict(loads)
    if gone is not None:
        name, tracked = gone
        left = changed.get(name, SentLoad()).left(tracked, horizon)
        if left.count:
            changed[name] = left
        else:
            changed.pop(name, None)
    if came is not None:
        name, tracked = came
        changed[name] = changed.get(name, SentLoad()).joined(tracked, horizon)
    return changed


@attrs.frozen(kw_only=True)
class PredictiveState:
    """Everything the predictive learner carries."""

    config: PredictiveConfig
    fits: Mapping[str, EngineFit] = attrs.field(factory=dict)
    #: The latest samples of each backend (up to ``_WINDOW_POLLS + 1``) and when they were taken.
    samples: Mapping[str, tuple[tuple[float, BackendSample], ...]] = attrs.field(factory=dict)
    healthy: int = 0
    #: Requests forwarded and not yet ended (never mutated in place).
    requests: Mapping[int, _Tracked] = attrs.field(factory=dict)
    #: The same requests' figures per backend they were sent to (``None``: not placed yet).
    loads: Mapping[str | None, SentLoad] = attrs.field(factory=dict)
    pending_tokens: float = 0.0
    pending_count: int = 0
    decoders: int = 0
    #: Sum of the first-token times of the decoding requests (their tokens so far follow).
    decoders_first_sum: float = 0.0
    inflight_prompt_tokens: float = 0.0
    #: Estimated prompt tokens forwarded, decayed with the horizon, as of ``admitted_at``.
    admitted_tokens: float = 0.0
    admitted_at: float = 0.0
    #: The same for premium requests alone: what basic requests leave room for.
    premium_tokens: float = 0.0
    premium_at: float = 0.0
    #: Observed over predicted time from forwarding to first token (smoothed): corrects the
    #: TTFT prediction for what the step law cannot see (prefix-cache hits, the real chunk
    #: size, scheduler details).
    ttft_ratio: float | None = None
    bytes_per_token: float | None = None
    #: Body bytes of requests whose first token came, cumulative, and at the latest poll.
    first_token_bytes: float = 0.0
    first_token_bytes_at_poll: float = 0.0
    kv_per_token: float | None = None
    #: Mean seconds from first token to end of the requests that finished.
    decode_s: float | None = None
    kv_usage: float = 0.0
    waiting: float = 0.0
    #: The latest poll showed requests waiting in an engine that the prefill the guard just
    #: sent does not explain (the pending prompt tokens fit in one step): seats or KV ran out.
    waiting_unexplained: bool = False
    #: The most decoders per backend the fit has seen in an interval (decaying slowly): its
    #: predictions are trusted up to twice that.
    trusted_decoders: float = 0.0
    inter_token_s: float | None = None
    #: The backends healthy at the latest poll, in poll order, and when each backend's fit last
    #: learned from an interval (the pool rules, :mod:`guard_core.pool_fit`, read them).
    backends: tuple[str, ...] = ()
    fitted_at: Mapping[str, float] = attrs.field(factory=dict)
    #: The explanation behind the latest published cap (the latest verdict is the guard's:
    #: ``GuardState.verdict``).
    last_cap: Prediction | None = None

    @classmethod
    def initial(cls, config: PredictiveConfig) -> PredictiveState:
        return cls(config=config)

    # -- derived figures -----------------------------------------------------------------------

    @property
    def ratio(self) -> float:
        if self.bytes_per_token is not None:
            return self.bytes_per_token
        return self.config.bytes_per_token

    @property
    def horizon(self) -> float:
        return self.config.horizon_s

    @property
    def decode_seconds(self) -> float:
        """How long a request decodes, learned from finished ones (the window until learned)."""
        return self.decode_s if self.decode_s is not None else 10.0

    def prompt_tokens(self, body_bytes: int | None) -> float:
        """The prompt estimate for a body of this size."""
        if body_bytes is None:
            return _UNKNOWN_PROMPT_TOKENS
        return max(1.0, body_bytes / self.ratio)

    def fit(self) -> EngineFit:
        """The most pessimistic backend's fit (the prior when none has been learned)."""
        fits = self.fits
        if not fits:
            return _PRIOR_FIT
        if len(fits) == 1:
            return next(iter(fits.values()))
        return max(fits.values(), key=lambda fit: fit.decode_step_s(32, 0.3))

    def speed_target(self, fit: EngineFit | None = None) -> float:
        """The per-user speed admission keeps: the yellow target, or, on an engine too slow to
        give even one user that (as fitted: ``fit``, by default :meth:`fit`), nearly its best
        single-user speed, never below the red floor."""
        config = self.config
        best = 1.0 / (fit or self.fit()).decode_step_s(1.0, self.kv_usage)
        if best >= config.user_tps_target / _TARGET_SHARE:
            return config.user_tps_target
        return max(config.user_tps_floor, min(config.user_tps_target, _TARGET_SHARE * best))

    def admitted_decayed(self, at: float) -> float:
        elapsed = max(0.0, at - self.admitted_at)
        return self.admitted_tokens * math.exp(-elapsed / self.horizon)

    def premium_decayed(self, at: float) -> float:
        elapsed = max(0.0, at - self.premium_at)
        return self.premium_tokens * math.exp(-elapsed / self.horizon)

    def first_token_s(self, queued_tokens: float, *, at: float) -> float:
        """Predicted seconds until ``queued_tokens`` more prompt tokens are prefilled."""
        share = max(1, self.healthy)
        fit = self.fit()
        kv = _kv_after(self, 0.0, at=at, share=share)
        return fit.prefill_s(
            self.pending_tokens / share + queued_tokens,
            decoders=self.decoders / share,
            kv_usage=kv,
            chunk=self.config.batch_tokens,
        )

    def kv_per_request(self, at: float) -> float:
        """The KV usage one request in flight holds, as learned (0 until learned)."""
        inflight = self.decoders + self.pending_count
        if self.kv_per_token is None or not inflight:
            return 0.0
        return self.kv_per_token * self.tokens_in_flight(at) / inflight

    def trusted_load(self) -> float:
        """The most requests in flight per backend the fit is trusted to predict (the trust
        region: it grows with the load seen, like TCP's slow start)."""
        return max(_TRUST_FLOOR, _TRUST_GROWTH * self.trusted_decoders)

    def tokens_in_flight(self, at: float) -> float:
        """Prompt plus generated tokens the forwarded requests hold, estimated."""
        generated = 0.0
        if self.inter_token_s and self.decoders:
            generated = max(0.0, self.decoders * at - self.decoders_first_sum) / self.inter_token_s
        return self.inflight_prompt_tokens + generated


def _replace(state: PredictiveState, **changes: Any) -> PredictiveState:
    """A copy with ``changes`` (the state has no validators: see guard_core._values); this runs
    several times per request."""
    return replace(state, **changes)


# -- request events --------------------------------------------------------------------------


def forwarded(
    state: PredictiveState,
    request_id: int,
    body_bytes: int | None,
    *,
    at: float,
    premium: bool = False,
) -> PredictiveState:
    """A request was forwarded: its prompt is queued for prefill."""
    if request_id in state.requests:
        return state
    tokens = state.prompt_tokens(body_bytes)
    tracked = _Tracked(tokens, body_bytes, at, state.first_token_s(tokens, at=at))
    requests = filed(state.requests, request_id, tracked)
    state = _replace(
        state,
        requests=requests,
        loads=_moved(state.loads, state.horizon, came=(None, tracked)),
        pending_tokens=state.pending_tokens + tokens,
        pending_count=state.pending_count + 1,
        inflight_prompt_tokens=state.inflight_prompt_tokens + tokens,
        admitted_tokens=state.admitted_decayed(at) + tokens,
        admitted_at=max(at, state.admitted_at),
    )
    if premium:
        state = _replace(
            state,
            premium_tokens=state.premium_decayed(at) + tokens,
            premium_at=max(at, state.premium_at),
        )
    return state


def sent_to(state: PredictiveState, request_id: int, backend: str) -> PredictiveState:
    """A forwarded request went to ``backend`` (a pool's rules then see each backend's own
    prefill queue and decoders; the single-engine rules never read it)."""
    tracked = state.requests.get(request_id)
    if tracked is None or tracked.backend == backend:
        return state
    placed = attrs.evolve(tracked, backend=backend)
    loads = _moved(
        state.loads, state.horizon, gone=(tracked.backend, tracked), came=(backend, placed)
    )
    return _replace(state, requests=filed(state.requests, request_id, placed), loads=loads)


def first_token(state: PredictiveState, request_id: int | None, *, at: float) -> PredictiveState:
    """A forwarded request's first useful token came: it decodes from now on."""
    if request_id is None:
        return state
    tracked = state.requests.get(request_id)
    if tracked is None or tracked.first_at is not None:
        return state
    requests = filed(state.requests, request_id, attrs.evolve(tracked, first_at=at))
    loads = dict(state.loads)
    loads[tracked.backend] = loads[tracked.backend].first_token(tracked)
    size = tracked.body_bytes if tracked.body_bytes is not None else tracked.tokens * state.ratio
    ttft_ratio = state.ttft_ratio
    if tracked.predicted_first_s >= _MIN_PREDICTED_FIRST_S:
        observed = (at - tracked.forwarded_at) / tracked.predicted_first_s
        observed = min(_MAX_TTFT_RATIO, max(1 / _MAX_TTFT_RATIO, observed))
        ttft_ratio = (
            observed
            if ttft_ratio is None
            else ttft_ratio * _TTFT_RATIO_SMOOTHING + observed * (1 - _TTFT_RATIO_SMOOTHING)
        )
    return _replace(
        state,
        ttft_ratio=ttft_ratio,
        requests=requests,
        loads=loads,
        pending_tokens=max(0.0, state.pending_tokens - tracked.tokens),
        pending_count=max(0, state.pending_count - 1),
        decoders=state.decoders + 1,
        decoders_first_sum=state.decoders_first_sum + at,
        first_token_bytes=state.first_token_bytes + size,
    )


def finished(state: PredictiveState, request_id: int, *, at: float) -> PredictiveState:
    """A forwarded request ended (any way); a decoded one teaches how long decoding lasts."""
    tracked = state.requests.get(request_id)
    if tracked is None:
        return state
    requests = forgotten(state.requests, request_id)
    changes: dict[str, Any] = {
        "requests": requests,
        "loads": _moved(state.loads, state.horizon, gone=(tracked.backend, tracked)),
        "inflight_prompt_tokens": max(0.0, state.inflight_prompt_tokens - tracked.tokens),
    }
    if tracked.first_at is None:
        changes["pending_tokens"] = max(0.0, state.pending_tokens - tracked.tokens)
        changes["pending_count"] = max(0, state.pending_count - 1)
    else:
        changes["decoders"] = max(0, state.decoders - 1)
        changes["decoders_first_sum"] = state.decoders_first_sum - tracked.first_at
        lasted = min(_MAX_DECODE_S, max(_MIN_DECODE_S, at - tracked.first_at))
        previous = state.decode_s
        changes["decode_s"] = (
            lasted
            if previous is None
            else previous * _RATIO_SMOOTHING + lasted * (1 - _RATIO_SMOOTHING)
        )
    if not requests:
        changes["decoders"] = 0
        changes["decoders_first_sum"] = 0.0
        changes["pending_tokens"] = 0.0
        changes["pending_count"] = 0
        changes["inflight_prompt_tokens"] = 0.0
    return _replace(state, **changes)


# -- polls -----------------------------------------------------------------------------------


def _delta(now: float | None, before: float | None) -> float | None:
    if now is None or before is None or now < before:
        return None
    return now - before


def _interval(
    before: tuple[float, BackendSample], sample: BackendSample, *, at: float
) -> Interval | None:
    """What the backend did since its previous sample, when enough decoding happened."""
    then, previous = before
    elapsed = at - then
    if elapsed <= 0:
        return None
    generated = _delta(sample.generation_tokens, previous.generation_tokens)
    if generated is None or generated < _MIN_INTERVAL_TOKENS:
        return None
    itl_now, itl_before = sample.inter_token_latency, previous.inter_token_latency
    inter_token: float | None = None
    if itl_now is not None and itl_before is not None:
        count = itl_now.count - itl_before.count
        total = itl_now.sum - itl_before.sum
        if count >= _MIN_INTERVAL_TOKENS and total > 0:
            inter_token = total / count
    rate = generated / elapsed
    if inter_token is None:
        # No latency histogram: the running gauge stands in for the decoders.
        running = [v for v in (sample.running, previous.running) if v is not None]
        if not running:
            return None
        inter_token = (sum(running) / len(running)) / rate
        if inter_token <= 0:
            return None
    prompt = _delta(sample.prompt_tokens, previous.prompt_tokens)
    usage = [v for v in (sample.kv_usage, previous.kv_usage) if v is not None]
    return Interval(
        inter_token_s=inter_token,
        decoders=rate * inter_token,
        kv_usage=sum(usage) / len(usage) if usage else 0.0,
        prompt_tps=(prompt or 0.0) / elapsed,
    )


def polled(state: PredictiveState, polls: tuple[BackendPoll, ...], *, at: float) -> PredictiveState:
    """Learn from one poll round."""
    config = state.config
    fits = dict(state.fits)
    samples = dict(state.samples)
    prompt_delta = 0.0
    healthy = 0
    usages: list[float] = []
    waiting = 0.0
    inter_tokens: list[float] = []
    seen: list[float] = []
    for poll in polls:
        sample = poll.sample
        if sample is None:
            continue
        healthy += 1
        history = samples.get(poll.name, ())
        if history:
            interval = _interval(history[0], sample, at=at)
            if interval is not None:
                fit = fits.get(poll.name, EngineFit())
                fits[poll.name] = observe(fit, interval, forgetting=config.forgetting)
                inter_tokens.append(interval.inter_token_s)
                seen.append(interval.decoders)
            prompt = _delta(sample.prompt_tokens, history[-1][1].prompt_tokens)
            if prompt is not None:
                prompt_delta += prompt
        samples[poll.name] = (*history, (at, sample))[-_WINDOW_POLLS - 1 :]
        if sample.kv_usage is not None:
            usages.append(sample.kv_usage)
        waiting += sample.waiting or 0.0
    changes: dict[str, Any] = {
        "fits": fits,
        "samples": samples,
        "healthy": healthy,
        "backends": tuple(poll.name for poll in polls if poll.sample is not None),
        # A fit that changed learned from an interval now.
        "fitted_at": {
            **state.fitted_at,
            **{name: at for name, fit in fits.items() if fit is not state.fits.get(name)},
        },
        "trusted_decoders": max([state.trusted_decoders * _TRUST_DECAY, *seen]),
    }
    if healthy:
        changes["waiting"] = waiting
        changes["waiting_unexplained"] = (
            waiting > 0 and state.pending_tokens / healthy <= config.batch_tokens
        )
        changes["kv_usage"] = max(usages) if usages else 0.0
    if inter_tokens:
        changes["inter_token_s"] = max(inter_tokens)
    bytes_delta = state.first_token_bytes - state.first_token_bytes_at_poll
    if prompt_delta >= _MIN_PROMPT_TOKENS and bytes_delta > 0:
        observed = bytes_delta / prompt_delta
        previous = state.bytes_per_token
        changes["bytes_per_token"] = (
            observed
            if previous is None
            else previous * _RATIO_SMOOTHING + observed * (1 - _RATIO_SMOOTHING)
        )
    changes["first_token_bytes_at_poll"] = state.first_token_bytes
    state = _replace(state, **changes)
    tokens = state.tokens_in_flight(at) / max(1, healthy)
    if healthy and usages and tokens >= 1000:
        observed_kv = state.kv_usage / tokens
        previous_kv = state.kv_per_token
        state = attrs.evolve(
            state,
            kv_per_token=observed_kv
            if previous_kv is None
            else previous_kv * _RATIO_SMOOTHING + observed_kv * (1 - _RATIO_SMOOTHING),
        )
    return state


# -- predictions -----------------------------------------------------------------------------


def _kv_after(state: PredictiveState, extra_tokens: float, *, at: float, share: int) -> float:
    """KV usage once ``extra_tokens`` more are held: from the learned usage per token when
    known (it follows every forward and end at once), else the latest poll's gauge."""
    if state.kv_per_token is None:
        return state.kv_usage
    return state.kv_per_token * (state.tokens_in_flight(at) + extra_tokens) / share


def _predict(
    state: PredictiveState,
    tokens: float,
    *,
    extra_decoders: int,
    extra_prompt_tokens: float,
    waited_s: float,
    at: float,
) -> Prediction:
    config = state.config
    share = max(1, state.healthy)
    fit = state.fit()
    decoders = (state.decoders + state.pending_count + 1 + extra_decoders) / share
    kv = _kv_after(state, tokens, at=at, share=share)
    load = state.admitted_decayed(at) + tokens + extra_prompt_tokens
    inter_token = fit.inter_token_s(decoders, kv, load / state.horizon / share)
    speed = 0.0 if math.isinf(inter_token) else 1.0 / inter_token
    queued = state.pending_tokens / share + tokens
    now_decoding = state.decoders / share
    ttft = fit.prefill_s(
        queued, decoders=now_decoding, kv_usage=kv, chunk=config.batch_tokens
    ) - fit.idle_prefill_s(tokens, chunk=config.batch_tokens)
    ttft = max(0.0, ttft) * (state.ttft_ratio or 1.0) + max(0.0, waited_s)
    if decoders > state.trusted_load():
        binding = Binding.UNTRIED
    elif speed < state.speed_target():
        binding = Binding.SPEED
    elif ttft > config.ttft_target_s:
        binding = Binding.TTFT
    elif kv > config.kv_limit:
        binding = Binding.KV
    else:
        binding = Binding.NONE
    return Prediction(
        user_tps=speed, ttft_s=ttft, kv_usage=kv, binding=binding, fit=FitSummary.of(fit)
    )


def assess(
    state: PredictiveState,
    body_bytes: int | None,
    *,
    reserve: int,
    waited_s: float,
    at: float,
) -> Verdict:
    """Whether a request of this body size may be forwarded now.

    ``reserve`` is the number of slots a basic request must leave for premium (0 for premium);
    they count as decoders in the speed prediction. ``waited_s`` is how long the request has
    already been held by the guard: it counts against the TTFT target.
    """
    tokens = state.prompt_tokens(body_bytes)
    # A basic request also leaves room for as much premium prompt load as came recently.
    extra = state.premium_decayed(at) if reserve > 0 else 0.0
    prediction = _predict(
        state,
        tokens,
        extra_decoders=reserve,
        extra_prompt_tokens=extra,
        waited_s=waited_s,
        at=at,
    )
    if state.decoders + state.pending_count == 0 and prediction.binding is not Binding.KV:
        # An idle engine takes any request: nothing running can be slowed, nothing queued.
        return Verdict(True, attrs.evolve(prediction, binding=Binding.NONE))
    return Verdict(prediction.binding is Binding.NONE, prediction)


#: Moved to :mod:`guard_core.predictive_cap`; still reachable here (PEP 562) for callers that
#: name them through this module.
_MOVED = frozenset({"cap_prediction", "published_cap", "retry_after_s", "speed_cap"})


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        from guard_core import predictive_cap  # noqa: PLC0415 (it imports this module)

        return getattr(predictive_cap, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
