"""The predictive learner's admission for a pool of several backends: per backend, then summed.

Reads: the predictive learner's state (:mod:`guard_core.predictive`; the backends healthy at
its latest poll, each backend's fit as :func:`guard_core.pool_fit.fit_for` chooses it), the
requests in flight to each backend (the guard's own counts, :mod:`guard_core.traffic`), and for
one request its body size, the premium reserve it must leave, how long it waited in the guard
and ``at``.

With one backend the learner's own rules (:func:`guard_core.predictive_cap.published_cap` and
:func:`~guard_core.predictive.assess`) apply unchanged; these rules are only for a pool, where
judging the whole pool by its most pessimistic backend's fit lets one backend with a bad fit
(see :mod:`guard_core.pool_fit`) collapse the pool's cap.

- :func:`pool_cap`: the pool's cap is the sum over its healthy backends of each one's cap, the
  most requests in flight that keep its decoding users at the speed target (the learner's rule,
  :func:`~guard_core.predictive_cap.speed_cap`, on that backend's fit and speed target, with the
  pool's recent prompt load spread evenly), each within the learner's trust region; never more
  than ``GLOBAL_LIMIT``, at least 1 per backend when the limit allows.
- :func:`pool_assess`: a request is admitted when some healthy backend, with its own requests
  in flight and the request added, is predicted to keep its users at the speed target, its
  first token within the TTFT target (counting what it already waited) and its KV usage within
  the limit, inside the trust region; or when some backend is idle (nothing running can be
  slowed there) and its KV has room. The verdict explains the best backend's outlook.

Guarantees: pure and deterministic; the cap never exceeds ``GLOBAL_LIMIT``; a backend with no
traffic contributes by the pool's reference fit once some fit is trustworthy, so it never pins
the pool's cap to its own young or stale fit; a healthy idle backend whose KV has room always
admits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs

from guard_core.backend_prediction import (
    BackendLoad,
    BackendOutlook,
    backend_loads,
    kv_usage,
    outlook,
)
from guard_core.engine_fit import EngineFit
from guard_core.pool_fit import fit_for, reference_fit
from guard_core.predictive import (
    Binding,
    FitSummary,
    Prediction,
    PredictiveState,
    Verdict,
)
from guard_core.predictive_cap import cap_prediction, speed_cap

__all__ = ("even_spread", "is_pool", "pool_assess", "pool_cap")


def is_pool(state: PredictiveState) -> bool:
    """Whether the pool rules apply: more than one backend was healthy at the latest poll."""
    return len(state.backends) > 1


def _fits(state: PredictiveState) -> dict[str, EngineFit]:
    reference = reference_fit(state)
    return {name: fit_for(state, name, reference=reference) for name in state.backends}


def pool_cap(state: PredictiveState, *, at: float) -> Prediction:
    """The pool's cap: the sum of its backends' caps (see the module notes)."""
    config = state.config
    limit = config.global_limit
    fits = _fits(state)
    count = max(1, len(fits))
    prompt_tps = state.admitted_decayed(at) / state.horizon / count
    per_request_kv = state.kv_per_request(at)
    trusted = int(state.trusted_load())
    total = 0
    untried = False
    slowest: tuple[float, EngineFit] | None = None
    for fit in fits.values():
        own = speed_cap(
            fit,
            target=state.speed_target(fit),
            prompt_tps=prompt_tps,
            per_request_kv=per_request_kv,
            limit=limit,
        )
        untried = untried or own > trusted
        total += max(1, min(own, trusted))
        kv = min(1.0, per_request_kv * own)
        inter_token = fit.inter_token_s(max(1, own), kv, prompt_tps)
        if slowest is None or inter_token > slowest[0]:
            slowest = (inter_token, fit)
    cap = min(limit, total) if limit > 0 else 0
    shown = slowest[1] if slowest is not None else state.fit()
    inter_token = slowest[0] if slowest is not None else math.inf
    return cap_prediction(
        state, shown, cap=cap, untried=untried, inter_token=inter_token, share=count
    )


@attrs.frozen
class _Judged:
    admit: bool
    binding: Binding
    seen: BackendOutlook
    kv: float
    fit: EngineFit
    waited_s: float


def _judge(
    state: PredictiveState,
    name: str,
    fit: EngineFit,
    *,
    inflight: int,
    pool_inflight: int,
    body_bytes: int | None,
    extra_decoders: float,
    waited_s: float,
    at: float,
    loads: Mapping[str, BackendLoad] | None,
) -> _Judged:
    config = state.config
    seen = outlook(
        state,
        name,
        inflight=inflight,
        pool_inflight=pool_inflight,
        body_bytes=body_bytes,
        at=at,
        fit=fit,
        extra_decoders=extra_decoders,
        loads=loads,
    )
    kv = kv_usage(state, name, state.prompt_tokens(body_bytes))
    if inflight + 1 + extra_decoders > state.trusted_load():
        binding = Binding.UNTRIED
    elif seen.user_tps < state.speed_target(fit):
        binding = Binding.SPEED
    elif seen.ttft_excess_s + max(0.0, waited_s) > config.ttft_target_s:
        binding = Binding.TTFT
    elif kv > config.kv_limit:
        binding = Binding.KV
    else:
        binding = Binding.NONE
    if inflight == 0 and binding is not Binding.KV:
        binding = Binding.NONE  # an idle backend takes any request its KV has room for
    return _Judged(binding is Binding.NONE, binding, seen, kv, fit, max(0.0, waited_s))


def even_spread(state: PredictiveState) -> dict[str, int]:
    """The learner's requests in flight spread as evenly as counts allow over the healthy
    backends, the first ones taking the remainder (for when the per-backend counts are not
    known: a replayed recording holds no traffic events)."""
    names = state.backends
    if not names:
        return {}
    base, extra = divmod(len(state.requests), len(names))
    return {name: base + (1 if index < extra else 0) for index, name in enumerate(names)}


def pool_assess(
    state: PredictiveState,
    inflight: Mapping[str, int] | None,
    body_bytes: int | None,
    *,
    reserve: int,
    waited_s: float,
    at: float,
) -> Verdict:
    """Whether a request may be forwarded to the pool now (see the module notes).

    ``inflight`` gives the requests in flight per backend (a name missing counts 0; ``None``:
    not known, :func:`even_spread`); ``reserve`` the slots a basic request leaves for premium
    (spread over the backends as extra decoders), ``waited_s`` how long it was held in the
    guard.
    """
    if inflight is None:
        inflight = even_spread(state)
    fits = _fits(state)
    pool_inflight = sum(max(0, inflight.get(name, 0)) for name in fits)
    extra = max(0, reserve) / max(1, len(fits))
    loads = backend_loads(state, at=at)
    judged = [
        _judge(
            state,
            name,
            fit,
            inflight=max(0, inflight.get(name, 0)),
            pool_inflight=pool_inflight,
            body_bytes=body_bytes,
            extra_decoders=extra,
            waited_s=waited_s,
            at=at,
            loads=loads,
        )
        for name, fit in fits.items()
    ]
    if not judged:
        return Verdict(False, _explain(state, None))
    admitted = [j for j in judged if j.admit]
    chosen = max(admitted or judged, key=lambda j: (j.seen.ttft_within, j.seen.user_tps))
    return Verdict(bool(admitted), _explain(state, chosen))


def _explain(state: PredictiveState, judged: _Judged | None) -> Prediction:
    if judged is None:
        fit = state.fit()
        return Prediction(
            user_tps=0.0,
            ttft_s=0.0,
            kv_usage=state.kv_usage,
            binding=Binding.UNTRIED,
            fit=FitSummary.of(fit),
        )
    seen = judged.seen
    return Prediction(
        user_tps=seen.user_tps,
        ttft_s=seen.ttft_excess_s + judged.waited_s,
        kv_usage=judged.kv,
        binding=judged.binding,
        fit=FitSummary.of(judged.fit),
    )
