"""The predictive learner's published cap, and how long a refused client should wait.

Reads: the predictive learner's state (:mod:`guard_core.predictive`: its fit, the requests in
flight and its recent prompt load) and ``at``; for a ``Retry-After``, the prediction that
refused.

Guarantees:
- pure: every function takes the state and ``at`` and returns a value;
- :func:`published_cap` is the most requests in flight (within ``GLOBAL_LIMIT`` and the
  learner's trust region, at least 1 when the limit allows) that keep the speed target at the
  current prompt load, with several backends the load spread evenly over the healthy ones on
  the most pessimistic backend's fit; its :class:`~guard_core.predictive.Prediction` says what
  bound it (:func:`cap_prediction`);
- :func:`speed_cap` never exceeds its ``limit`` and never grows when the fit's steps slow;
- :func:`retry_after_s` is whole seconds from 1 to 30.
"""

from __future__ import annotations

import math

from guard_core.engine_fit import EngineFit
from guard_core.predictive import Binding, FitSummary, Prediction, PredictiveState

__all__ = ("cap_prediction", "published_cap", "retry_after_s", "speed_cap")

_MAX_RETRY_AFTER_S = 30


def published_cap(state: PredictiveState, *, at: float) -> Prediction:
    """The most requests in flight that keep the speed target at the current prompt load.

    The per-request checks of :func:`~guard_core.predictive.assess` still apply under this
    cap; the cap is what the gate's tier rules (the premium reserve) are computed from, and
    what operators see.
    """
    config = state.config
    share = max(1, state.healthy)
    fit = state.fit()
    prompt_tps = state.admitted_decayed(at) / state.horizon / share
    per_request_kv = state.kv_per_request(at)
    limit = config.global_limit
    low = speed_cap(
        fit,
        target=state.speed_target(),
        prompt_tps=prompt_tps,
        per_request_kv=per_request_kv,
        limit=limit,
        share=share,
    )
    trusted = int(state.trusted_load() * share)
    untried = low > trusted
    cap = max(1, min(low, trusted)) if limit > 0 else 0
    per_backend = cap / share
    kv = min(1.0, per_request_kv * per_backend)
    inter_token = fit.inter_token_s(per_backend, kv, prompt_tps)
    return cap_prediction(
        state, fit, cap=cap, untried=untried, inter_token=inter_token, share=share
    )


def cap_prediction(
    state: PredictiveState,
    fit: EngineFit,
    *,
    cap: int,
    untried: bool,
    inter_token: float,
    share: int,
) -> Prediction:
    """The explanation of a published ``cap``: the speed it predicts (``inter_token`` seconds
    between tokens), the TTFT of the prompts queued now spread over ``share`` engines of
    ``fit``, and what bound it (the trust region when ``untried``, else the speed target
    below ``GLOBAL_LIMIT``)."""
    config = state.config
    return Prediction(
        user_tps=0.0 if math.isinf(inter_token) else 1.0 / inter_token,
        ttft_s=fit.prefill_s(
            state.pending_tokens / share,
            decoders=state.decoders / share,
            kv_usage=state.kv_usage,
            chunk=config.batch_tokens,
        ),
        kv_usage=state.kv_usage,
        binding=Binding.UNTRIED
        if untried
        else Binding.SPEED
        if cap < config.global_limit
        else Binding.NONE,
        fit=FitSummary.of(fit),
        cap=cap,
    )


def speed_cap(
    fit: EngineFit,
    *,
    target: float,
    prompt_tps: float,
    per_request_kv: float,
    limit: int,
    share: int = 1,
) -> int:
    """The most requests in flight (0 to ``limit``), spread evenly over ``share`` engines of this
    fit that each take prompts at ``prompt_tps``, that keep every decoding user at ``target``
    tokens per second or faster (a binary search: the predicted speed falls as load grows)."""

    def fast_enough(count: int) -> bool:
        per_backend = count / share
        kv = min(1.0, per_request_kv * per_backend)
        return 1.0 / fit.inter_token_s(per_backend, kv, prompt_tps) >= target

    low, high = 0, limit
    while low < high:
        middle = (low + high + 1) // 2
        if fast_enough(middle):
            low = middle
        else:
            high = middle - 1
    return low


def retry_after_s(state: PredictiveState, prediction: Prediction, *, at: float) -> int:
    """Whole seconds until the binding constraint is predicted to have room again (1 to 30)."""
    fit = state.fit()
    share = max(1, state.healthy)
    if prediction.binding is Binding.TTFT:
        seconds = fit.prefill_s(
            state.pending_tokens / share,
            decoders=state.decoders / share,
            kv_usage=state.kv_usage,
            chunk=state.config.batch_tokens,
        )
    else:
        # Speed or KV: room comes back as running requests finish; with an even spread of end
        # times, the first of ``n`` decoders ends after about horizon / n.
        running = max(1, state.decoders + state.pending_count)
        seconds = state.decode_seconds / running * max(1.0, _excess(state, prediction))
    return max(1, min(_MAX_RETRY_AFTER_S, math.ceil(seconds)))


def _excess(state: PredictiveState, prediction: Prediction) -> float:
    """How many requests must end before the prediction meets its target (at least 1)."""
    target = state.speed_target()
    if prediction.binding is Binding.SPEED and prediction.user_tps > 0:
        return max(1.0, (state.decoders + state.pending_count) * (1 - prediction.user_tps / target))
    return 1.0
