"""guard_core._values.replace gives what attrs.evolve gives, for slotted and dict-backed states."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_core._values import replace
from guard_core.evaluation import LearnerState
from guard_core.gate import GateState
from guard_core.guard import GuardState
from guard_core.policy import PolicyConfig
from guard_core.requests import Tracked
from guard_core.tier import Tier
from guard_core.traffic import TrafficState


@attrs.frozen
class Slotted:
    a: int = 0
    b: tuple[int, ...] = ()
    c: str = ""


@attrs.frozen(slots=False)
class Plain:
    a: int = 0
    b: tuple[int, ...] = ()
    c: str = ""


_CHANGES = st.dictionaries(
    st.sampled_from(("a", "b", "c")), st.integers() | st.tuples(st.integers()) | st.text()
)


@pytest.mark.parametrize("cls", [Slotted, Plain])
@given(start=st.tuples(st.integers(), st.tuples(st.integers()), st.text()), changes=_CHANGES)
def test_replace_equals_evolve(
    cls: type, start: tuple[object, ...], changes: dict[str, object]
) -> None:
    value = cls(*start)
    copied = replace(value, **changes)
    assert copied == attrs.evolve(value, **changes)
    assert type(copied) is cls
    assert value == cls(*start)  # the original is untouched


@pytest.mark.parametrize("cls", [Slotted, Plain])
def test_an_unknown_field_is_an_error_as_in_evolve(cls: type) -> None:
    with pytest.raises(TypeError):
        attrs.evolve(cls(), d=1)
    with pytest.raises(TypeError, match="no field"):
        replace(cls(), d=1)


def test_the_copy_stays_frozen() -> None:
    copied = replace(Plain(), a=2)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        copied.a = 3  # type: ignore[misc]


def test_the_per_request_states_are_dict_backed() -> None:
    """The states copied on every request take the fast copy (guard_core._values)."""
    for cls in (GuardState, GateState, LearnerState, Tracked):
        assert "__slots__" not in vars(cls), cls
    learner = LearnerState(config=PolicyConfig())
    assert replace(learner, dynamic_rejects=3) == attrs.evolve(learner, dynamic_rejects=3)
    tracked = Tracked(tier=Tier.BASIC, arrived_at=1.0)
    assert replace(tracked, forwarded=True) == attrs.evolve(tracked, forwarded=True)
    assert replace(TrafficState(), tier_rejects=(1, 2)) == TrafficState(tier_rejects=(1, 2))
