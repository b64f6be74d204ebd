"""The predictive learner's outlook for one more request on one backend of a pool.

Reads: the predictive learner's state (:mod:`guard_core.predictive`: each backend's own
:class:`~guard_core.engine_fit.EngineFit`, its latest poll, and the requests the guard has
forwarded, prefilling or decoding), the backend's name, the requests in flight to it and to its
whole pool (the guard's own counts, :mod:`guard_core.traffic`), the request's body size and
``at``.

The learner tracks its requests for the pool as a whole, not per backend, so a backend's part
of the pool's prefill queue, decoders and recent prompt load is taken in proportion to its
share of the pool's requests in flight. Its step-time law is its own fit once it has one, else
the pool's most pessimistic fit (a backend that has not been seen working yet is judged like
the worst one, not like the learner's deliberately slow prior, so it still gets work to learn
from). KV usage is its latest poll's gauge plus the request's own tokens (when the KV per token
is learned).

Guarantees: pure and deterministic; the predicted speed is the per-user decode speed on that
backend with the request added (0 when prefill would take all its time), the predicted TTFT
the seconds from forwarding to its first token, and the excess the part of that beyond what its
prompt alone needs on an idle engine of that fit (what ``DYNAMIC_TTFT_TARGET_SECONDS`` bounds,
corrected by the learned TTFT ratio as admission is); ``within_target`` holds exactly when the
speed meets the learner's speed target and the excess is within the TTFT target. More load on
a backend (in flight, KV) never raises its predicted speed; a fit with slower steps never
predicts a faster speed for the same load.
"""

from __future__ import annotations

import math

import attrs

from guard_core.engine_fit import EngineFit
from guard_core.predictive import PredictiveState

__all__ = ("BackendOutlook", "outlook")


@attrs.frozen
class BackendOutlook:
    """What one more request would see on one backend, as the learner predicts it."""

    name: str
    #: Per-user decode speed (tok/s) of the sequences decoding there, with this request.
    user_tps: float
    #: Seconds from forwarding to this request's first token.
    ttft_s: float
    #: The part of ``ttft_s`` beyond its prompt's idle prefill (queueing and interference).
    ttft_excess_s: float
    #: The excess is within the learner's TTFT target.
    ttft_within: bool
    #: ... and the speed is at or above its speed target as well.
    within_target: bool


def _fit_of(state: PredictiveState, backend: str) -> EngineFit:
    own = state.fits.get(backend)
    if own is not None and own.observations > 0:
        return own
    return state.fit()


def _kv_usage(state: PredictiveState, backend: str, tokens: float) -> float:
    history = state.samples.get(backend, ())
    gauge = history[-1][1].kv_usage if history else None
    kv = gauge if gauge is not None else 0.0
    if state.kv_per_token is not None:
        kv += state.kv_per_token * tokens
    return min(1.0, max(0.0, kv))


def outlook(
    state: PredictiveState,
    backend: str,
    *,
    inflight: int,
    pool_inflight: int,
    body_bytes: int | None,
    at: float,
) -> BackendOutlook:
    """The predicted outcome of one more request of ``body_bytes`` sent to ``backend`` now.

    ``inflight`` is the requests in flight to that backend, ``pool_inflight`` to its whole pool
    (at least ``inflight``).
    """
    config = state.config
    inflight = max(0, inflight)
    pool = max(inflight, pool_inflight)
    share = inflight / pool if pool > 0 else 0.0
    tokens = state.prompt_tokens(body_bytes)
    fit = _fit_of(state, backend)
    pending_count = state.pending_count * share
    pending_tokens = state.pending_tokens * share
    decoders = max(0.0, inflight - pending_count)
    kv = _kv_usage(state, backend, tokens)
    prompt_tps = (state.admitted_decayed(at) * share + tokens) / state.horizon
    inter_token = fit.inter_token_s(decoders + pending_count + 1, kv, prompt_tps)
    speed = 0.0 if math.isinf(inter_token) else 1.0 / inter_token
    idle = fit.idle_prefill_s(tokens, chunk=config.batch_tokens)
    first = fit.prefill_s(
        pending_tokens + tokens, decoders=decoders, kv_usage=kv, chunk=config.batch_tokens
    )
    excess = max(0.0, first - idle) * (state.ttft_ratio or 1.0)
    ttft_within = excess <= config.ttft_target_s
    return BackendOutlook(
        name=backend,
        user_tps=speed,
        ttft_s=idle + excess,
        ttft_excess_s=excess,
        ttft_within=ttft_within,
        within_target=ttft_within and speed >= state.speed_target(),
    )
