"""Which step-time fit a pool's rules use for each backend: its own once it is trustworthy.

Reads: the predictive learner's state (:mod:`guard_core.predictive`): each backend's own
:class:`~guard_core.engine_fit.EngineFit` (how many intervals it learned from and its smoothed
relative error) and when each fit last learned from an interval (``fitted_at``).

A backend's own fit is *trustworthy* when it has learned from at least
:data:`MIN_TRUSTED_OBSERVATIONS` intervals, its smoothed relative error is at most
:data:`MAX_TRUSTED_ERROR`, and it is *fresh*: it learned within :data:`STALE_AFTER_S` of the
freshest fit of the pool. A backend that got little traffic learns from few, noisy intervals
(one decoding sequence beside a long prefill), and a router or admission rule that believes
such a fit keeps work away from it, so the fit is never corrected (fit starvation). Until its
own fit is trustworthy again, a backend is judged by the pool's *reference fit*: among the
trustworthy fits, the median by the step time at a moderate load (the lower of the two middle
ones), so it gets work and its fit learns; a fit that aged out gets work again and is refreshed
by it. When no fit of the pool is trustworthy yet, each backend keeps the cold-start rule: its
own fit once it has one, else the learner's most pessimistic (its deliberately slow prior
before any).

Guarantees: pure and deterministic; :func:`fit_for` is a backend's own fit exactly when that is
trustworthy; the reference fit is one of the trustworthy fits, or ``None`` when there is none;
a backend with no traffic never makes the fit of another backend worse.
"""

from __future__ import annotations

from typing import Final

from guard_core.engine_fit import EngineFit
from guard_core.predictive import PredictiveState

__all__ = (
    "MAX_TRUSTED_ERROR",
    "MIN_TRUSTED_OBSERVATIONS",
    "STALE_AFTER_S",
    "fit_for",
    "reference_fit",
    "trustworthy",
)

#: Intervals a fit needs before its own predictions are believed (its speed factor starts to
#: move after five; twice that lets it settle).
MIN_TRUSTED_OBSERVATIONS: Final = 10
#: The largest smoothed relative error of a believed fit: above it the fit mispredicts its own
#: backend's latency by more than a quarter.
MAX_TRUSTED_ERROR: Final = 0.25
#: A fit that has not learned for this long while another backend's has is stale.
STALE_AFTER_S: Final = 60.0
#: The load at which fits are compared (decoders, KV usage).
_COMPARE_DECODERS: Final = 32.0
_COMPARE_KV: Final = 0.3


def _freshest(state: PredictiveState) -> float | None:
    return max(state.fitted_at.values(), default=None)


def trustworthy(state: PredictiveState, backend: str) -> bool:
    """Whether ``backend``'s own fit is believed (see the module notes)."""
    fit = state.fits.get(backend)
    if fit is None or fit.observations < MIN_TRUSTED_OBSERVATIONS:
        return False
    if fit.relative_error > MAX_TRUSTED_ERROR:
        return False
    learned = state.fitted_at.get(backend)
    freshest = _freshest(state)
    if learned is None or freshest is None:
        return False
    return freshest - learned <= STALE_AFTER_S


def reference_fit(state: PredictiveState) -> EngineFit | None:
    """The median trustworthy fit of the pool by its step time at a moderate load (the lower
    middle one of an even count); ``None`` when no fit is trustworthy."""
    trusted = sorted(
        (fit for name, fit in state.fits.items() if trustworthy(state, name)),
        key=lambda fit: fit.decode_step_s(_COMPARE_DECODERS, _COMPARE_KV),
    )
    if not trusted:
        return None
    return trusted[(len(trusted) - 1) // 2]


def fit_for(
    state: PredictiveState, backend: str, *, reference: EngineFit | None = None
) -> EngineFit:
    """The fit the pool rules use for ``backend``: its own when trustworthy, else the reference
    fit (``reference`` when given, computed otherwise), else its own once it has learned at
    all, else the learner's most pessimistic fit."""
    own = state.fits.get(backend)
    if own is not None and trustworthy(state, backend):
        return own
    if reference is None:
        reference = reference_fit(state)
    if reference is not None:
        return reference
    if own is not None and own.observations > 0:
        return own
    return state.fit()
