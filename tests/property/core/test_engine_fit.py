"""The online engine model (guard_core.engine_fit): it recovers a step-time law from intervals."""

from __future__ import annotations

import math
import random

from hypothesis import given
from hypothesis import strategies as st

from guard_core.engine_fit import PRIOR, EngineFit, Interval, observe

#: The default simulated profile's constants (a100-qwen2-7b): step base, per decoder, per full
#: KV cache (35 ns x 464,848 tokens), per prompt token.
A100 = (0.0115, 62e-6, 35e-9 * 464_848, 75e-6)
#: The tensor-parallel 32B profile: a much heavier per-decoder cost.
TP2 = (0.0307, 384e-6, 64e-9 * 67_328, 286e-6)


def _interval(law: tuple[float, ...], decoders: float, kv: float, prompt_tps: float) -> Interval:
    a, d, k, p = law
    inter_token = (a + d * decoders + k * kv) / (1 - p * prompt_tps)
    return Interval(inter_token, decoders, kv, prompt_tps)


def _fit(law: tuple[float, ...], *, seed: int, polls: int = 120, noise: float = 0.0) -> EngineFit:
    rng = random.Random(seed)
    fit = EngineFit()
    for _ in range(polls):
        decoders = rng.uniform(5, 80)
        kv = min(1.0, decoders * rng.uniform(500, 2000) / 464_848)
        prompt_tps = rng.uniform(0, 0.6 / law[3])
        interval = _interval(law, decoders, kv, prompt_tps)
        noisy = attrs_evolve_itl(interval, interval.inter_token_s * (1 + rng.gauss(0, noise)))
        fit = observe(fit, noisy, forgetting=0.95)
    return fit


def attrs_evolve_itl(interval: Interval, inter_token_s: float) -> Interval:
    return Interval(inter_token_s, interval.decoders, interval.kv_usage, interval.prompt_tps)


def test_a_new_fit_is_the_slow_prior() -> None:
    fit = EngineFit()
    assert fit.theta == PRIOR
    assert fit.observations == 0
    # The prior is slower than either real profile at every load: approached from below.
    for law in (A100, TP2):
        for decoders in (1, 32, 128):
            real = _interval(law, decoders, 0.2, 0.0).inter_token_s
            assert fit.inter_token_s(decoders, 0.2, 0.0) > real


def test_the_fit_recovers_both_profiles_from_noise_free_intervals() -> None:
    for law in (A100, TP2):
        fit = _fit(law, seed=1)
        for decoders in (10, 60, 150):
            for prompt_tps in (0.0, 0.3 / law[3]):
                real = _interval(law, decoders, 0.3, prompt_tps).inter_token_s
                assert math.isclose(
                    fit.inter_token_s(decoders, 0.3, prompt_tps), real, rel_tol=0.02
                )
        assert fit.relative_error < 0.01


def test_with_five_percent_noise_predictions_stay_within_ten_percent() -> None:
    fit = _fit(A100, seed=2, noise=0.05)
    for decoders in (20, 80, 120):
        real = _interval(A100, decoders, 0.2, 3000).inter_token_s
        assert math.isclose(fit.inter_token_s(decoders, 0.2, 3000), real, rel_tol=0.10)


def test_a_slowdown_is_followed_within_five_intervals() -> None:
    fit = _fit(A100, seed=3)
    slow = (*tuple(8 * c for c in A100[:3]), 8 * A100[3])
    rng = random.Random(4)
    for _ in range(5):
        decoders = rng.uniform(5, 20)
        fit = observe(fit, _interval(slow, decoders, 0.05, 200.0), forgetting=0.9)
    real = _interval(slow, 12, 0.05, 200.0).inter_token_s
    assert math.isclose(fit.inter_token_s(12, 0.05, 200.0), real, rel_tol=0.15)


@given(
    decoders=st.floats(0, 1000),
    kv=st.floats(-1, 2),
    prompt_tps=st.floats(0, 1e6),
    seed=st.integers(0, 50),
)
def test_predictions_are_positive_or_infinite(
    decoders: float, kv: float, prompt_tps: float, seed: int
) -> None:
    fit = _fit(TP2 if seed % 2 else A100, seed=seed, polls=20, noise=0.2)
    value = fit.inter_token_s(decoders, kv, prompt_tps)
    assert value > 0
    assert fit.decode_step_s(decoders, kv) > 0
    assert fit.prefill_s(1000, decoders=decoders, kv_usage=kv, chunk=2048) >= 0


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_unusable_intervals_change_nothing(inter_token_s: float) -> None:
    fit = EngineFit()
    if math.isfinite(inter_token_s) and inter_token_s > 0:
        return
    assert observe(fit, Interval(inter_token_s, 10, 0.1, 100), forgetting=0.9) == fit


def test_idle_prefill_counts_whole_chunks() -> None:
    fit = _fit(A100, seed=5)
    one_chunk = fit.idle_prefill_s(2048, chunk=2048)
    two_chunks = fit.idle_prefill_s(2049, chunk=2048)
    assert math.isclose(one_chunk, A100[0] + 2048 * A100[3], rel_tol=0.05)
    assert two_chunks > one_chunk + 0.5 * A100[0]
