"""The predictive learner's outlook for one more request on one backend of a pool.

Reads: the predictive learner's state (:mod:`guard_core.predictive`: each backend's own
:class:`~guard_core.engine_fit.EngineFit`, its latest poll, and the requests the guard has
forwarded, prefilling or decoding), the backend's name, the requests in flight to it and to its
whole pool (the guard's own counts, :mod:`guard_core.traffic`), the request's body size and
``at``.

A backend's prefill queue (prompt tokens sent to it without a first token yet), decoders and
recent prompt load (the prompt tokens of its requests in flight, decayed with the horizon, as
its share of the pool's) are its own when the runtime says where each request went
(:func:`guard_core.predictive.sent_to`); otherwise the learner knows its requests for the pool
as a whole, and a backend's part is taken in proportion to its share of the pool's requests in
flight. Its step-time law is
:func:`guard_core.pool_fit.fit_for`: its own fit once that is trustworthy, else the pool's
reference fit (so a backend with a young, noisy or stale fit still gets work to learn from),
and its speed target is the learner's rule applied to that fit. KV usage is its latest poll's
gauge plus the request's own tokens (when the KV per token is learned).

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
from collections.abc import Mapping

import attrs

from guard_core.engine_fit import EngineFit
from guard_core.pool_fit import fit_for
from guard_core.predictive import PredictiveState

__all__ = ("BackendLoad", "BackendOutlook", "backend_loads", "kv_usage", "outlook")


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


@attrs.frozen
class BackendLoad:
    """What one backend carries of the requests the guard forwarded."""

    pending_count: float = 0.0
    pending_tokens: float = 0.0
    decoders: float = 0.0
    #: Its share of the pool's recent prompt load (0 to 1).
    prompt_share: float = 0.0


def backend_loads(state: PredictiveState, *, at: float) -> dict[str, BackendLoad] | None:
    """Each backend's own load, from the requests the runtime placed (:func:`sent_to`);
    ``None`` when no request in flight has a backend (the share rule applies then). Read from
    the learner's running figures per backend (``PredictiveState.loads``), so its cost is the
    number of backends, not of the requests in flight."""
    horizon = state.horizon
    weights = {name: load.weight_as_of(at, horizon) for name, load in state.loads.items()}
    total_weight = sum(weights.values())
    loads = {
        name: BackendLoad(
            load.pending_count,
            load.pending_tokens,
            load.decoders,
            weights[name] / total_weight if total_weight else 0.0,
        )
        for name, load in state.loads.items()
        if name is not None
    }
    return loads or None


def _shared_load(state: PredictiveState, *, inflight: int, pool_inflight: int) -> BackendLoad:
    pool = max(inflight, pool_inflight)
    share = inflight / pool if pool > 0 else 0.0
    pending_count = state.pending_count * share
    return BackendLoad(
        pending_count=pending_count,
        pending_tokens=state.pending_tokens * share,
        decoders=max(0.0, inflight - pending_count),
        prompt_share=share,
    )


def kv_usage(state: PredictiveState, backend: str, tokens: float) -> float:
    """The backend's KV usage once a request of ``tokens`` prompt tokens is added: its latest
    poll's gauge plus the request's share (when the KV per token is learned)."""
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
    fit: EngineFit | None = None,
    extra_decoders: float = 0.0,
    loads: Mapping[str, BackendLoad] | None = None,
) -> BackendOutlook:
    """The predicted outcome of one more request of ``body_bytes`` sent to ``backend`` now.

    ``inflight`` is the requests in flight to that backend, ``pool_inflight`` to its whole pool
    (at least ``inflight``); ``fit`` the backend's fit when the caller already chose it (by
    default :func:`~guard_core.pool_fit.fit_for`); ``extra_decoders`` more sequences counted
    as decoding there (a premium reserve); ``loads`` the backends' own loads when the caller
    already has them (:func:`backend_loads`).
    """
    config = state.config
    inflight = max(0, inflight)
    tokens = state.prompt_tokens(body_bytes)
    if fit is None:
        fit = fit_for(state, backend)
    if loads is None:
        loads = backend_loads(state, at=at)
    if loads is None:
        own = _shared_load(state, inflight=inflight, pool_inflight=pool_inflight)
    else:
        own = loads.get(backend, BackendLoad())
    pending_count, pending_tokens, decoders = own.pending_count, own.pending_tokens, own.decoders
    kv = kv_usage(state, backend, tokens)
    prompt_tps = (state.admitted_decayed(at) * own.prompt_share + tokens) / state.horizon
    load = decoders + pending_count + 1 + max(0.0, extra_decoders)
    inter_token = fit.inter_token_s(load, kv, prompt_tps)
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
        within_target=ttft_within and speed >= state.speed_target(fit),
    )
