"""Load state from raw signals (spec 3), thresholds (spec 2.6) and state caps (spec 5.5 step 1)."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_core import InvalidObservation, LoadState, PolicyConfigError, StateReason
from guard_core.signal_state import (
    SignalReasons,
    SignalThresholds,
    raw_signal_reasons,
    state_limit,
)

KV = StateReason.KV_CACHE
RUN = StateReason.RUNNING
WAIT = StateReason.WAITING
PRE = StateReason.PREEMPTIONS
TPS = StateReason.SINGLE_USER_TPS
TTFT = StateReason.TTFT_LATENCY
RAW_ORDER = (KV, RUN, WAIT, PRE, TPS, TTFT)
RANK = {LoadState.GREEN: 0, LoadState.YELLOW: 1, LoadState.RED: 2}
DEFAULTS = SignalThresholds()


def reasons(thresholds: SignalThresholds = DEFAULTS, **signals: Any) -> SignalReasons:
    quiet: dict[str, Any] = {"running": 0, "waiting": 0, "kv_usage": 0.0, "preemption_delta": 0}
    return raw_signal_reasons(thresholds, **{**quiet, **signals})


def colour_of(result: SignalReasons, reason: StateReason) -> str | None:
    if reason in result.red:
        return "red"
    if reason in result.yellow:
        return "yellow"
    return None


# -- defaults and literal thresholds ------------------------------------------------------------


def test_defaults_match_pig() -> None:
    t = SignalThresholds()
    assert (t.kv_yellow, t.kv_red) == (0.70, 0.80)
    assert (t.running_yellow, t.running_red) == (0, 0)
    assert (t.waiting_yellow, t.waiting_red) == (1, 2)
    assert t.preemption_delta_red == 1
    assert (t.global_limit, t.green_limit, t.yellow_limit, t.red_limit) == (512, 512, 512, 512)


def test_quiet_poll_is_green() -> None:
    result = reasons()
    assert result == SignalReasons((), ())
    assert result.state is LoadState.GREEN


@pytest.mark.parametrize(
    ("kv", "expected"),
    [
        (0.0, None),
        (0.69, None),
        (0.6999, None),
        (0.70, "yellow"),
        (0.79, "yellow"),
        (0.80, "red"),
        (0.95, "red"),
        (1.0, "red"),
    ],
)
def test_kv_cache_thresholds(kv: float, expected: str | None) -> None:
    assert colour_of(reasons(kv_usage=kv), KV) == expected


@pytest.mark.parametrize(
    ("waiting", "expected"), [(0, None), (1, "yellow"), (2, "red"), (50, "red")]
)
def test_waiting_thresholds(waiting: int, expected: str | None) -> None:
    assert colour_of(reasons(waiting=waiting), WAIT) == expected


@pytest.mark.parametrize("running", [0, 1, 16, 512, 10_000])
def test_running_is_off_by_default(running: int) -> None:
    assert colour_of(reasons(running=running), RUN) is None


@pytest.mark.parametrize(
    ("running", "expected"), [(7, None), (8, "yellow"), (15, "yellow"), (16, "red"), (99, "red")]
)
def test_running_when_configured(running: int, expected: str | None) -> None:
    t = SignalThresholds(running_yellow=8, running_red=16)
    assert colour_of(reasons(t, running=running), RUN) == expected


def test_running_red_only() -> None:
    t = SignalThresholds(running_yellow=0, running_red=16)
    assert colour_of(reasons(t, running=15), RUN) is None
    assert colour_of(reasons(t, running=16), RUN) == "red"


@pytest.mark.parametrize(("delta", "expected"), [(0, None), (1, "red"), (7, "red")])
def test_preemptions_default(delta: int, expected: str | None) -> None:
    assert colour_of(reasons(preemption_delta=delta), PRE) == expected


def test_preemptions_threshold_and_off() -> None:
    three = SignalThresholds(preemption_delta_red=3)
    assert colour_of(reasons(three, preemption_delta=2), PRE) is None
    assert colour_of(reasons(three, preemption_delta=3), PRE) == "red"
    off = SignalThresholds(preemption_delta_red=0)
    assert colour_of(reasons(off, preemption_delta=100), PRE) is None


def test_preemptions_are_never_yellow() -> None:
    for delta in range(5):
        assert PRE not in reasons(preemption_delta=delta).yellow


def test_kv_off_and_kv_red_only() -> None:
    off = SignalThresholds(kv_yellow=0, kv_red=0)
    assert colour_of(reasons(off, kv_usage=1.0), KV) is None
    red_only = SignalThresholds(kv_yellow=0, kv_red=0.80)
    assert colour_of(reasons(red_only, kv_usage=0.75), KV) is None
    assert colour_of(reasons(red_only, kv_usage=0.80), KV) == "red"


def test_waiting_zero_thresholds_turn_it_off() -> None:
    off = SignalThresholds(waiting_yellow=0, waiting_red=0)
    assert colour_of(reasons(off, waiting=0), WAIT) is None
    assert colour_of(reasons(off, waiting=10), WAIT) is None
    red_only = SignalThresholds(waiting_yellow=0, waiting_red=3)
    assert colour_of(reasons(red_only, waiting=2), WAIT) is None
    assert colour_of(reasons(red_only, waiting=3), WAIT) == "red"


@pytest.mark.parametrize(
    ("yellow_ready", "red_ready", "expected"),
    [(False, False, None), (True, False, "yellow"), (False, True, "red"), (True, True, "red")],
)
def test_assessment_readiness(yellow_ready: bool, red_ready: bool, expected: str | None) -> None:
    tps = reasons(user_tps_yellow_ready=yellow_ready, user_tps_red_ready=red_ready)
    assert colour_of(tps, TPS) == expected
    assert colour_of(tps, TTFT) is None
    ttft = reasons(ttft_yellow_ready=yellow_ready, ttft_red_ready=red_ready)
    assert colour_of(ttft, TTFT) == expected
    assert colour_of(ttft, TPS) is None


def test_reasons_keep_the_fixed_order() -> None:
    t = SignalThresholds(running_yellow=8, running_red=16)
    all_yellow = reasons(
        t, kv_usage=0.75, running=8, waiting=1, user_tps_yellow_ready=True, ttft_yellow_ready=True
    )
    assert all_yellow.yellow == (KV, RUN, WAIT, TPS, TTFT)
    assert all_yellow.red == ()
    assert all_yellow.state is LoadState.YELLOW
    all_red = reasons(
        t,
        kv_usage=0.9,
        running=16,
        waiting=2,
        preemption_delta=1,
        user_tps_red_ready=True,
        ttft_red_ready=True,
    )
    assert all_red.red == RAW_ORDER
    assert all_red.yellow == ()
    assert all_red.state is LoadState.RED
    mixed = reasons(t, kv_usage=0.9, running=8, waiting=2, ttft_yellow_ready=True)
    assert mixed.yellow == (RUN, TTFT)
    assert mixed.red == (KV, WAIT)


# -- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {"kv_yellow": 0.9},  # above the default red 0.80
        {"kv_yellow": 0.7, "kv_red": 0.0},
        {"running_yellow": 5},  # above the default red 0
        {"running_yellow": 10, "running_red": 9},
        {"waiting_yellow": 3},  # above the default red 2
        {"kv_yellow": -0.1},
        {"kv_red": -0.1},
        {"kv_red": math.nan},
        {"kv_yellow": math.nan},
        {"running_red": -1},
        {"waiting_yellow": -1},
        {"waiting_red": -1},
        {"preemption_delta_red": -1},
        {"global_limit": -1},
        {"green_limit": -1},
        {"yellow_limit": -1},
        {"red_limit": -1},
    ],
)
def test_invalid_thresholds_are_rejected(changes: dict[str, Any]) -> None:
    with pytest.raises(PolicyConfigError):
        SignalThresholds(**changes)


def test_equal_yellow_and_red_are_allowed() -> None:
    t = SignalThresholds(
        kv_yellow=0.8, kv_red=0.8, waiting_yellow=2, running_yellow=4, running_red=4
    )
    # Equal thresholds: the signal goes straight to red.
    assert reasons(t, kv_usage=0.8, waiting=2, running=4).red == (KV, RUN, WAIT)


@pytest.mark.parametrize(
    ("kwargs", "limits"),
    [
        ({}, (512, 512, 512)),
        ({"green": 100}, (100, 100, 100)),
        ({"green": 100, "yellow": 50}, (100, 50, 50)),
        ({"green": 100, "yellow": 50, "red": 10}, (100, 50, 10)),
        ({"red": 10}, (512, 512, 10)),
        ({"yellow": 30}, (512, 30, 30)),
        ({"green": 1000}, (512, 512, 512)),  # capped at GLOBAL_LIMIT
        ({"green": 0}, (0, 0, 0)),
        ({"yellow": 2000, "red": 600}, (512, 512, 512)),
    ],
)
def test_state_limit_defaulting(kwargs: dict[str, int], limits: tuple[int, int, int]) -> None:
    t = SignalThresholds.from_global_limit(512, **kwargs)
    assert (t.green_limit, t.yellow_limit, t.red_limit) == limits
    assert state_limit(t, LoadState.GREEN) == limits[0]
    assert state_limit(t, LoadState.YELLOW) == limits[1]
    assert state_limit(t, LoadState.RED) == limits[2]
    assert state_limit(t, LoadState.DISABLED) == limits[0]


def test_from_global_limit_running_red_follows_yellow() -> None:
    t = SignalThresholds.from_global_limit(64, running_yellow=12)
    assert (t.running_yellow, t.running_red) == (12, 12)
    t = SignalThresholds.from_global_limit(64, running_yellow=12, running_red=20)
    assert (t.running_yellow, t.running_red) == (12, 20)
    t = SignalThresholds.from_global_limit(64)
    assert (t.running_yellow, t.running_red) == (0, 0)
    assert t.global_limit == 64
    assert (t.kv_yellow, t.kv_red, t.waiting_yellow, t.waiting_red) == (0.70, 0.80, 1, 2)


@pytest.mark.parametrize(
    "kwargs",
    [{"green": -1}, {"yellow": -1}, {"red": -5}, {"kv_yellow": 0.9}, {"waiting_red": -1}],
)
def test_from_global_limit_validates(kwargs: dict[str, Any]) -> None:
    with pytest.raises(PolicyConfigError):
        SignalThresholds.from_global_limit(512, **kwargs)
    with pytest.raises(PolicyConfigError):
        SignalThresholds.from_global_limit(-1)


def test_state_limit_is_capped_when_built_directly() -> None:
    t = SignalThresholds(global_limit=100, green_limit=512, yellow_limit=80, red_limit=200)
    assert state_limit(t, LoadState.GREEN) == 100
    assert state_limit(t, LoadState.YELLOW) == 80
    assert state_limit(t, LoadState.RED) == 100
    assert state_limit(t, LoadState.DISABLED) == 100


# -- SignalReasons values -----------------------------------------------------------------------


def test_with_reason_adds_yellow_then_red() -> None:
    start = SignalReasons((KV,), ())
    added = start.with_reason(StateReason.BACKEND_WAITING_QUEUE, False)
    assert added == SignalReasons((KV, StateReason.BACKEND_WAITING_QUEUE), ())
    assert added.state is LoadState.YELLOW
    assert start == SignalReasons((KV,), ())  # unchanged
    red = added.with_reason(StateReason.SCHEDULER_PRESSURE_CAPACITY, red=True)
    assert red.red == (StateReason.SCHEDULER_PRESSURE_CAPACITY,)
    assert red.state is LoadState.RED


def test_with_reason_never_duplicates_or_downgrades() -> None:
    value = SignalReasons((WAIT,), (KV,))
    assert value.with_reason(WAIT, False) is value
    assert value.with_reason(KV, False) is value
    assert value.with_reason(KV, True) is value


def test_with_reason_red_moves_a_yellow_reason() -> None:
    value = SignalReasons((KV, WAIT, TTFT), (PRE,))
    moved = value.with_reason(WAIT, red=True)
    assert moved == SignalReasons((KV, TTFT), (PRE, WAIT))
    assert moved.state is LoadState.RED


def test_green_to_red_through_with_reason() -> None:
    value = SignalReasons()
    assert value.state is LoadState.GREEN
    value = value.with_reason(StateReason.SINGLE_USER_TPS_CAPACITY, red=False)
    assert value.state is LoadState.YELLOW
    value = value.with_reason(StateReason.SINGLE_USER_TPS_CAPACITY, red=True)
    assert value == SignalReasons((), (StateReason.SINGLE_USER_TPS_CAPACITY,))


@pytest.mark.parametrize(
    ("yellow", "red"), [((KV,), (KV,)), ((KV, KV), ()), ((), (WAIT, WAIT)), ((KV, WAIT), (WAIT,))]
)
def test_inconsistent_reason_lists_cannot_be_built(
    yellow: tuple[StateReason, ...], red: tuple[StateReason, ...]
) -> None:
    with pytest.raises(InvalidObservation):
        SignalReasons(yellow, red)


def test_values_are_frozen() -> None:
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        DEFAULTS.kv_red = 0.5  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        SignalReasons().yellow = (KV,)  # type: ignore[misc]


# -- properties ---------------------------------------------------------------------------------


@st.composite
def pairs(draw: st.DrawFn, values: st.SearchStrategy[Any]) -> tuple[Any, Any]:
    a, b = draw(values), draw(values)
    return min(a, b), max(a, b)


@st.composite
def thresholds(draw: st.DrawFn) -> SignalThresholds:
    kv_yellow, kv_red = draw(pairs(st.sampled_from([0.0, 0.5, 0.7, 0.8, 0.9, 1.0])))
    running_yellow, running_red = draw(pairs(st.integers(0, 40)))
    waiting_yellow, waiting_red = draw(pairs(st.integers(0, 6)))
    return SignalThresholds(
        kv_yellow=kv_yellow,
        kv_red=kv_red,
        running_yellow=running_yellow,
        running_red=running_red,
        waiting_yellow=waiting_yellow,
        waiting_red=waiting_red,
        preemption_delta_red=draw(st.integers(0, 4)),
    )


signals = st.fixed_dictionaries(
    {
        "running": st.integers(0, 60),
        "waiting": st.integers(0, 8),
        "kv_usage": st.floats(0.0, 1.2, allow_nan=False),
        "preemption_delta": st.integers(0, 6),
        "user_tps_yellow_ready": st.booleans(),
        "user_tps_red_ready": st.booleans(),
        "ttft_yellow_ready": st.booleans(),
        "ttft_red_ready": st.booleans(),
    }
)


@given(thresholds(), signals)
def test_reasons_are_consistent(t: SignalThresholds, given_signals: dict[str, Any]) -> None:
    result = raw_signal_reasons(t, **given_signals)
    assert not set(result.yellow) & set(result.red)
    assert result.state is (
        LoadState.RED if result.red else LoadState.YELLOW if result.yellow else LoadState.GREEN
    )
    assert (result.state is LoadState.RED) == bool(result.red)
    for colour in (result.yellow, result.red):
        assert list(colour) == [r for r in RAW_ORDER if r in colour]
    assert PRE not in result.yellow


@given(thresholds(), signals, st.data())
def test_raising_a_signal_never_lowers_the_state(
    t: SignalThresholds, before: dict[str, Any], data: st.DataObject
) -> None:
    name = data.draw(st.sampled_from(sorted(before)))
    value = before[name]
    if isinstance(value, bool):
        raised: object = True
    elif isinstance(value, int):
        raised = value + data.draw(st.integers(0, 20))
    else:
        raised = value + data.draw(st.floats(0.0, 1.0, allow_nan=False))
    low = raw_signal_reasons(t, **before)
    high = raw_signal_reasons(t, **{**before, name: raised})
    assert RANK[high.state] >= RANK[low.state]
    # Reason by reason, too: a colour never weakens.
    strength = {None: 0, "yellow": 1, "red": 2}
    for reason in RAW_ORDER:
        assert strength[colour_of(high, reason)] >= strength[colour_of(low, reason)]


@given(
    st.lists(st.tuples(st.sampled_from(list(StateReason)), st.booleans()), max_size=20),
    thresholds(),
    signals,
)
def test_adding_reasons_keeps_the_lists_consistent(
    additions: list[tuple[StateReason, bool]], t: SignalThresholds, start: dict[str, Any]
) -> None:
    value = raw_signal_reasons(t, **start)
    for reason, red in additions:
        before = value
        value = value.with_reason(reason, red)
        assert not set(value.yellow) & set(value.red)
        assert len(set(value.yellow)) == len(value.yellow)
        assert len(set(value.red)) == len(value.red)
        assert reason in (value.red if red else value.yellow + value.red)
        assert RANK[value.state] >= RANK[before.state]
        assert set(before.red) <= set(value.red)
        assert set(before.yellow) | set(before.red) <= set(value.yellow) | set(value.red)


@given(
    st.integers(0, 2000),
    st.none() | st.integers(0, 3000),
    st.none() | st.integers(0, 3000),
    st.none() | st.integers(0, 3000),
    st.sampled_from(list(LoadState)),
)
def test_state_limit_never_exceeds_global_limit(
    global_limit: int, green: int | None, yellow: int | None, red: int | None, state: LoadState
) -> None:
    t = SignalThresholds.from_global_limit(global_limit, green=green, yellow=yellow, red=red)
    assert 0 <= state_limit(t, state) <= global_limit
    expected_green = min(global_limit if green is None else green, global_limit)
    assert state_limit(t, LoadState.GREEN) == expected_green
    if yellow is None:
        assert state_limit(t, LoadState.YELLOW) == expected_green
    if red is None:
        assert state_limit(t, LoadState.RED) == state_limit(t, LoadState.YELLOW)
