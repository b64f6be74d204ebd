"""The predictive learner's running figures per backend (``PredictiveState.loads``) give what a
walk over every request in flight gives: counts exactly, token sums and prompt shares to
rounding, whatever the order of forwards, placements, first tokens and ends."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from guard_core.backend_prediction import BackendLoad, backend_loads
from guard_core.predictive import (
    PredictiveConfig,
    PredictiveState,
    finished,
    first_token,
    forwarded,
    sent_to,
)

_BACKENDS = ("a", "b", "c")
_STEP = st.tuples(
    st.sampled_from(("forward", "send", "first", "finish")),
    st.integers(min_value=0, max_value=3) | st.integers(min_value=0, max_value=12),
    st.sampled_from(_BACKENDS[:1]) | st.sampled_from(_BACKENDS),
    st.integers(min_value=0, max_value=200_000),
    st.floats(min_value=0.0, max_value=30.0),
)


def _walked(state: PredictiveState, at: float) -> dict[str, BackendLoad] | None:
    """The figures as a walk over every request in flight computes them (the rule the running
    figures keep)."""
    counts: dict[str, list[float]] = {}
    total = 0.0
    for tracked in state.requests.values():
        weight = tracked.tokens * math.exp(-max(0.0, at - tracked.forwarded_at) / state.horizon)
        total += weight
        if tracked.backend is None:
            continue
        row = counts.setdefault(tracked.backend, [0.0, 0.0, 0.0, 0.0])
        if tracked.first_at is None:
            row[0] += 1
            row[1] += tracked.tokens
        else:
            row[2] += 1
        row[3] += weight
    if not counts:
        return None
    return {
        name: BackendLoad(row[0], row[1], row[2], row[3] / total if total else 0.0)
        for name, row in counts.items()
    }


def _close(running: dict[str, BackendLoad] | None, walked: dict[str, BackendLoad] | None) -> None:
    if walked is None:
        assert running is None
        return
    assert running is not None
    assert running.keys() == walked.keys()
    for name, load in walked.items():
        got = running[name]
        assert got.pending_count == load.pending_count
        assert got.decoders == load.decoders
        assert got.pending_tokens == pytest.approx(load.pending_tokens, rel=1e-9, abs=1e-6)
        assert got.prompt_share == pytest.approx(load.prompt_share, rel=1e-9, abs=1e-12)


#: Two requests on one backend, one of them decoding and then ending beside the other; then
#: one placed elsewhere while decoding (the moves random steps rarely line up).
_DECODING_ENDS = [
    ("forward", 0, "a", 4_000, 0.0),
    ("forward", 1, "a", 8_000, 0.5),
    ("send", 0, "a", 0, 0.0),
    ("send", 1, "a", 0, 0.0),
    ("first", 0, "a", 0, 1.0),
    ("finish", 0, "a", 0, 1.0),
    ("first", 1, "a", 0, 1.0),
    ("forward", 2, "a", 2_000, 0.0),
    ("send", 2, "a", 0, 0.0),
    ("send", 1, "b", 0, 0.0),
    ("finish", 1, "b", 0, 2.0),
]


@settings(max_examples=300)
@given(steps=st.lists(_STEP, max_size=120), horizon=st.sampled_from((0.5, 10.0, 60.0)))
@example(steps=_DECODING_ENDS, horizon=10.0)
def test_running_loads_match_a_walk_over_the_requests_in_flight(
    steps: list[tuple[str, int, str, int, float]], horizon: float
) -> None:
    state = PredictiveState.initial(PredictiveConfig(horizon_s=horizon))
    at = 0.0
    for kind, request_id, backend, body_bytes, later in steps:
        at += later  # events come in time order, as the runtimes send them
        if kind == "forward":
            state = forwarded(state, request_id, body_bytes or None, at=at)
        elif kind == "send":
            state = sent_to(state, request_id, backend)
        elif kind == "first":
            state = first_token(state, request_id, at=at)
        else:
            state = finished(state, request_id, at=at)
        assert sum(load.count for load in state.loads.values()) == len(state.requests)
        _close(backend_loads(state, at=at), _walked(state, at))
        _close(backend_loads(state, at=at + 5.0), _walked(state, at + 5.0))
    for request_id in list(state.requests):
        state = finished(state, request_id, at=at)
    assert state.loads == {}  # nothing in flight: nothing left over, not even rounding


def test_reading_the_loads_costs_the_backends_not_the_requests() -> None:
    state = PredictiveState.initial(PredictiveConfig())
    for request_id in range(2_000):
        state = forwarded(state, request_id, 4_000, at=request_id * 0.01)
        state = sent_to(state, request_id, _BACKENDS[request_id % 3])
    assert len(state.loads) == 3  # one entry per backend: no request is walked to read them
    _close(backend_loads(state, at=30.0), _walked(state, 30.0))


def test_a_request_in_flight_for_ten_thousand_horizons_leaves_the_figures_finite() -> None:
    """The running weight is moved forward as requests come, so it never overflows however long
    one request stays in flight beside the others."""
    state = PredictiveState.initial(PredictiveConfig(horizon_s=0.5))
    state = sent_to(forwarded(state, 0, 4_000, at=0.0), 0, "a")
    for request_id in range(1, 2_001):
        at = request_id * 2.5  # 5,000 s in all: 10,000 horizons
        state = sent_to(forwarded(state, request_id, 4_000, at=at), request_id, "a")
        state = finished(state, request_id, at=at + 0.1)
    loads = backend_loads(state, at=5_000.0)
    assert loads is not None
    assert loads["a"].pending_count == 1
    assert math.isfinite(state.loads["a"].weight)
    _close(loads, _walked(state, 5_000.0))
