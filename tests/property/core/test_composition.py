"""Cap composition: the ordered minimum and the name of the first minimal component."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_core import COMPONENT_ORDER, CapComponents, LimitReason, PolicyConfigError, compose

optional_caps = st.none() | st.integers(-5, 600)


@st.composite
def components(draw: st.DrawFn) -> CapComponents:
    return CapComponents(
        hard_global=draw(st.integers(-5, 600)),
        state=draw(st.integers(-5, 600)),
        ttft=draw(optional_caps),
        throughput=draw(optional_caps),
        pressure=draw(optional_caps),
        prefill=draw(optional_caps),
        availability=draw(optional_caps),
    )


@given(components())
def test_cap_is_the_minimum_named_by_the_first_minimal_component(parts: CapComponents) -> None:
    result = compose(parts)
    present = [(name, max(0, value)) for name, value in parts.ordered() if value is not None]
    smallest = min(value for _, value in present)
    assert result.cap == smallest
    assert result.reason == next(name for name, value in present if value == smallest)
    assert [name for name, _ in parts.ordered()] == list(COMPONENT_ORDER)


@given(
    components(), st.sampled_from([LimitReason.BACKEND_WAITING, LimitReason.BACKEND_UNAVAILABLE])
)
def test_override_closes_intake_whatever_the_components(
    parts: CapComponents, override: LimitReason
) -> None:
    import attrs

    result = compose(attrs.evolve(parts, override=override))
    assert (result.cap, result.reason) == (0, override)


def test_ties_keep_the_earlier_component() -> None:
    parts = CapComponents(hard_global=512, state=512, ttft=40, throughput=40, pressure=41)
    assert (compose(parts).cap, compose(parts).reason) == (40, LimitReason.TTFT)


def test_first_component_at_or_below_zero_names_the_closed_intake() -> None:
    parts = CapComponents(hard_global=512, state=512, throughput=0, pressure=-3)
    assert (compose(parts).cap, compose(parts).reason) == (0, LimitReason.THROUGHPUT)


def test_hard_global_wins_when_nothing_is_lower() -> None:
    parts = CapComponents(hard_global=64, state=512, throughput=100)
    assert (compose(parts).cap, compose(parts).reason) == (64, LimitReason.HARD_GLOBAL)


def test_only_intake_reasons_may_override() -> None:
    with pytest.raises(PolicyConfigError):
        CapComponents(hard_global=1, state=1, override=LimitReason.TTFT)
