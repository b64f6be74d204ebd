"""An online model of one engine's step time, fitted from what its metrics page shows.

Reads: one *interval* at a time, the deltas of a backend's counters between two polls: the mean
inter-token latency (seconds a decoding sequence waits for its next token), the mean number of
decoding sequences, the KV-cache usage and the prompt tokens the engine took in per second.
Guarantees:
- pure and deterministic; the state is a frozen value and :func:`observe` returns a new one;
- the model is continuous batching's cost law: a step that decodes ``D`` sequences over a KV
  cache ``u`` full costs ``a + d*D + k*u`` seconds, and prefill takes a share ``p * r`` of the
  engine's time when prompts arrive at ``r`` tokens per second, so the mean inter-token latency
  is ``m = (a + d*D + k*u) / (1 - p*r)``, i.e. ``m = a + d*D + k*u + p*(r*m)``: linear in the
  four coefficients, which recursive least squares with forgetting fits poll by poll;
- forgetting lets the coefficients follow a backend that drifts; a separate overall speed
  factor follows an engine that becomes uniformly slower or faster (thermal limits, a noisy
  neighbour, recovery) within a few polls; a weak pull towards the prior keeps directions the
  traffic does not excite defined while the load is steady;
- no coefficient is ever negative (non-negative least squares);
- predictions never use a negative coefficient and never return a non-positive time.
"""

from __future__ import annotations

import math

import attrs

__all__ = ("PRIOR", "EngineFit", "Interval", "observe")

#: Feature scales, so that the four fitted numbers have similar magnitudes: decoders per 100,
#: prompt tokens per step per 100.
_DECODER_SCALE = 100.0
_PROMPT_SCALE = 100.0
#: Weight of the prior, in intervals' worth of information per coefficient (scaled units), and
#: the smallest step base ever predicted.
_PRIOR_WEIGHT = 1e-3
_MIN_STEP_S = 1e-4
_ERROR_SMOOTHING = 0.8
#: How fast the overall speed factor follows the ratio of observed to predicted latency, its
#: bounds, and how many intervals the coefficients get before it starts to move.
_SCALE_GAIN = 0.5
_MAX_SCALE = 20.0
_SETTLED = 5

#: Before any observation: a deliberately slow engine (about a 32B model on one GPU), so a new
#: backend is approached from below. Scaled units: ``(a, 100 d, k, 100 p)``.
PRIOR = (0.03, 0.04, 0.02, 0.03)


@attrs.frozen
class Interval:
    """What one backend did between two polls (all means over the interval)."""

    #: Mean seconds between two tokens of one decoding sequence.
    inter_token_s: float
    #: Mean number of sequences decoding.
    decoders: float
    #: KV-cache usage in [0, 1].
    kv_usage: float
    #: Prompt tokens per second the engine took in.
    prompt_tps: float


def _features(decoders: float, kv_usage: float, prompt_per_step: float) -> tuple[float, ...]:
    return (1.0, decoders / _DECODER_SCALE, kv_usage, prompt_per_step / _PROMPT_SCALE)


def _solve(matrix: list[float], vector: list[float], free: list[int]) -> list[float] | None:
    """Solve the 4 x 4 system restricted to the ``free`` coefficients (the others are 0), by
    Gaussian elimination with partial pivoting."""
    n = len(free)
    rows = [[*(matrix[4 * i + j] for j in free), vector[i]] for i in free]
    for col in range(n):
        pivot = max(range(col, n), key=lambda row: abs(rows[row][col]))
        if abs(rows[pivot][col]) < 1e-15:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for row in range(col + 1, n):
            factor = rows[row][col] / rows[col][col]
            for k in range(col, n + 1):
                rows[row][k] -= factor * rows[col][k]
    solution = [0.0] * n
    for row in range(n - 1, -1, -1):
        total = rows[row][n] - sum(rows[row][k] * solution[k] for k in range(row + 1, n))
        solution[row] = total / rows[row][row]
    full = [0.0] * 4
    for index, value in zip(free, solution, strict=True):
        full[index] = value
    return full


def _solve_non_negative(matrix: list[float], vector: list[float]) -> tuple[float, ...] | None:
    """The least-squares coefficients under the constraint that none is negative: a coefficient
    that comes out negative is fixed at 0 and the rest solved again (an active-set method; four
    unknowns need at most four rounds). A cost cannot be negative, and letting one go negative
    to fit correlated features (decoders and KV usage rise together) would make predictions
    away from the fitted load wrong."""
    free = [0, 1, 2, 3]
    while free:
        solution = _solve(matrix, vector, free)
        if solution is None:
            return None
        negative = [i for i in free if solution[i] < 0]
        if not negative:
            return tuple(solution)
        worst = min(negative, key=lambda i: solution[i])
        free.remove(worst)
    return (0.0, 0.0, 0.0, 0.0)


def _prior_information() -> tuple[float, ...]:
    return tuple(_PRIOR_WEIGHT if i % 5 == 0 else 0.0 for i in range(16))


@attrs.frozen(kw_only=True)
class EngineFit:
    """The fitted coefficients, the weighted sums they solve, and how well the fit predicts."""

    #: ``(a, 100 d, k, 100 p)``: see the module docstring.
    theta: tuple[float, ...] = PRIOR
    #: Row-major 4 x 4 information matrix (forgotten sum of x x^T plus the prior's weight) and
    #: the matching forgotten sum of x y.
    information: tuple[float, ...] = attrs.field(factory=_prior_information)
    moments: tuple[float, ...] = tuple(_PRIOR_WEIGHT * t for t in PRIOR)
    #: The engine's overall speed factor against the coefficients (1: as fitted; 8: everything
    #: takes eight times as long).
    scale: float = 1.0
    observations: int = 0
    #: Smoothed relative error of the predictions made before each interval was folded in.
    relative_error: float = 0.0

    #: The coefficients in plain units, scale applied: step base, per decoder, per full KV
    #: cache, per prompt token (derived from ``theta`` and ``scale`` once, when built).
    coefficients: tuple[float, float, float, float] = attrs.field(init=False, eq=False)

    def __attrs_post_init__(self) -> None:
        theta, scale = self.theta, self.scale
        plain = (
            max(_MIN_STEP_S, scale * theta[0]),
            scale * max(0.0, theta[1]) / _DECODER_SCALE,
            scale * max(0.0, theta[2]),
            scale * max(0.0, theta[3]) / _PROMPT_SCALE,
        )
        object.__setattr__(self, "coefficients", plain)

    @property
    def step_base_s(self) -> float:
        return self.coefficients[0]

    @property
    def per_decoder_s(self) -> float:
        return self.coefficients[1]

    @property
    def per_kv_s(self) -> float:
        """Seconds per step added by a full KV cache (attention reads)."""
        return self.coefficients[2]

    @property
    def per_prompt_token_s(self) -> float:
        return self.coefficients[3]

    # -- predictions -------------------------------------------------------------------------------

    def decode_step_s(self, decoders: float, kv_usage: float) -> float:
        """One step's time without prefill work."""
        base, per_decoder, per_kv, _ = self.coefficients
        if decoders < 0:
            decoders = 0.0
        if kv_usage < 0:
            kv_usage = 0.0
        elif kv_usage > 1:
            kv_usage = 1.0
        return base + per_decoder * decoders + per_kv * kv_usage

    def inter_token_s(self, decoders: float, kv_usage: float, prompt_tps: float) -> float:
        """Mean inter-token latency with prompts arriving at ``prompt_tps``; ``inf`` when the
        prefill alone would take all of the engine's time."""
        share = self.coefficients[3] * prompt_tps if prompt_tps > 0 else 0.0
        if share >= 1.0:
            return math.inf
        return self.decode_step_s(decoders, kv_usage) / (1.0 - share)

    def prefill_s(self, tokens: float, *, decoders: float, kv_usage: float, chunk: int) -> float:
        """Seconds to prefill ``tokens`` queued prompt tokens while ``decoders`` sequences decode,
        ``chunk`` tokens per step (the engine's batched-token budget)."""
        if tokens <= 0:
            return 0.0
        per_step = max(1.0, chunk - decoders)
        steps = math.ceil(tokens / per_step)
        return steps * self.decode_step_s(decoders, kv_usage) + tokens * self.per_prompt_token_s

    def idle_prefill_s(self, tokens: float, *, chunk: int) -> float:
        """Seconds the same prompt would need on an idle engine."""
        if tokens <= 0:
            return 0.0
        return math.ceil(tokens / max(1, chunk)) * self.step_base_s + (
            tokens * self.per_prompt_token_s
        )


def observe(fit: EngineFit, interval: Interval, *, forgetting: float) -> EngineFit:
    """Fold one interval into the fit: exponentially forgotten least squares, pulled weakly
    towards :data:`PRIOR` so that a direction the traffic never excites stays defined."""
    y = interval.inter_token_s
    if not (math.isfinite(y) and y > 0):
        return fit
    x = _features(interval.decoders, interval.kv_usage, interval.prompt_tps * y)
    if not all(math.isfinite(v) for v in x):
        return fit
    structural = sum(max(0.0, t) * v for t, v in zip(fit.theta, x, strict=True))
    predicted = fit.scale * structural
    relative = (y - predicted) / y
    scale = fit.scale
    if fit.observations >= _SETTLED and structural > 0:
        # The whole engine running faster or slower (thermal limits, a noisy neighbour) shows
        # as one ratio; the scale follows it within a few polls, the coefficients keep their
        # shape.
        ratio = min(_MAX_SCALE, max(1 / _MAX_SCALE, y / structural))
        scale = min(_MAX_SCALE, max(1 / _MAX_SCALE, scale + _SCALE_GAIN * (ratio - scale)))
    y = y / scale
    keep = forgetting
    renew = (1.0 - forgetting) * _PRIOR_WEIGHT
    information = [
        keep * fit.information[4 * i + j] + x[i] * x[j] + (renew if i == j else 0.0)
        for i in range(4)
        for j in range(4)
    ]
    moments = [keep * fit.moments[i] + x[i] * y + renew * PRIOR[i] for i in range(4)]
    theta = _solve_non_negative(information, moments)
    if theta is None or not all(math.isfinite(t) for t in theta):
        return fit
    error = math.sqrt(
        _ERROR_SMOOTHING * fit.relative_error**2 + (1 - _ERROR_SMOOTHING) * relative * relative
    )
    return EngineFit(
        theta=theta,
        scale=scale,
        information=tuple(information),
        moments=tuple(moments),
        observations=fit.observations + 1,
        relative_error=error if fit.observations else abs(relative),
    )
