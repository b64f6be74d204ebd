"""Lanes from body size and output-token intent, static and adaptive (spec 6.4)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_core import Lane, LoadState, PolicyConfigError, body_lane, combine_lanes, output_lane
from guard_core.lanes import (
    DEFAULT_OUTPUT_THRESHOLDS,
    AdaptiveOutputConfig,
    AdaptiveOutputState,
    Thresholds,
)


@pytest.mark.parametrize(
    ("length", "lane"),
    [
        (None, Lane.UNKNOWN_BODY),
        (0, Lane.DEFAULT),
        (59_999, Lane.DEFAULT),
        (60_000, Lane.MEDIUM_BODY),
        (99_999, Lane.MEDIUM_BODY),
        (100_000, Lane.LONG_BODY),
        (524_287, Lane.LONG_BODY),
        (524_288, Lane.VERY_LONG_BODY),
    ],
)
def test_body_lanes(length: int | None, lane: Lane) -> None:
    assert body_lane(length) is lane


@pytest.mark.parametrize(
    ("tokens", "lane"),
    [
        (0, Lane.DEFAULT),
        (1023, Lane.DEFAULT),
        (1024, Lane.MEDIUM_OUTPUT),
        (4096, Lane.LONG_OUTPUT),
        (8191, Lane.LONG_OUTPUT),
        (8192, Lane.VERY_LONG_OUTPUT),
    ],
)
def test_output_lanes(tokens: int, lane: Lane) -> None:
    assert output_lane(tokens) is lane


def test_combining_takes_the_more_severe_and_keeps_the_body_lane_on_ties() -> None:
    assert combine_lanes(Lane.MEDIUM_BODY, Lane.VERY_LONG_OUTPUT) is Lane.VERY_LONG_OUTPUT
    assert combine_lanes(Lane.LONG_BODY, Lane.LONG_OUTPUT) is Lane.LONG_BODY
    assert combine_lanes(Lane.UNKNOWN_BODY, Lane.VERY_LONG_OUTPUT) is Lane.UNKNOWN_BODY
    assert combine_lanes(Lane.DEFAULT, None) is Lane.DEFAULT


@given(st.sampled_from(Lane), st.none() | st.sampled_from(Lane))
def test_combined_lane_is_one_of_the_two_and_at_least_as_severe(
    body: Lane, out: Lane | None
) -> None:
    combined = combine_lanes(body, out)
    assert combined in (body, out)
    assert combined.severity >= body.severity
    if out is not None:
        assert combined.severity >= out.severity


@pytest.mark.parametrize("values", [(0, 1, 2), (5, 5, 6), (3, 2, 4), (1, 2, 2)])
def test_thresholds_must_increase(values: tuple[int, int, int]) -> None:
    with pytest.raises(PolicyConfigError):
        Thresholds(values)


def test_adaptive_needs_min_samples() -> None:
    config = AdaptiveOutputConfig(min_samples=4)
    state = AdaptiveOutputState()
    for tokens in (5000, 6000, 7000):
        state = state.observe(tokens, config)
    assert state.learned(config) == DEFAULT_OUTPUT_THRESHOLDS
    state = state.observe(20_000, config)
    # n=4: median = sorted[1] = 6000, q0.9 = sorted[3] = 20000, q0.99 = 20000 (+1).
    assert state.learned(config).values == (6000, 20_000, 20_001)
    assert state.effective(config, LoadState.GREEN).values == (6000, 20_000, 20_001)
    assert state.effective(config, LoadState.YELLOW).values == (3512, 12_048, 14_097)
    assert state.effective(config, LoadState.RED) == DEFAULT_OUTPUT_THRESHOLDS


def test_adaptive_window_forgets_old_values_and_ignores_non_positive() -> None:
    config = AdaptiveOutputConfig(window=3, min_samples=0)
    state = AdaptiveOutputState()
    for tokens in (1, 2, 3, 0, -5, 4):
        state = state.observe(tokens, config)
    assert state.samples == (2, 3, 4)


@given(
    st.lists(st.integers(-10, 200_000), max_size=80),
    st.sampled_from(LoadState),
    st.integers(0, 40),
)
def test_adaptive_thresholds_stay_valid(
    values: list[int], state: LoadState, min_samples: int
) -> None:
    config = AdaptiveOutputConfig(window=50, min_samples=min_samples)
    adaptive = AdaptiveOutputState()
    for tokens in values:
        adaptive = adaptive.observe(tokens, config)
    assert len(adaptive.samples) <= 50
    learned = adaptive.learned(config).values
    effective = adaptive.effective(config, state).values
    static = config.static.values
    for s, lrn, eff in zip(static, learned, effective, strict=True):
        assert s <= eff <= lrn
    assert effective[0] < effective[1] < effective[2]
