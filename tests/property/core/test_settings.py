"""Settings fields carry their variable, default and rules; one checker applies them anywhere."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_core import PolicyConfigError
from guard_core.gate import GateConfig
from guard_core.lanes import AdaptiveOutputConfig
from guard_core.policy import PolicyConfig
from guard_core.predictive import PredictiveConfig
from guard_core.settings import (
    AtLeast,
    Below,
    Greater,
    NotAbove,
    Problem,
    Within,
    problems,
    require_valid,
    setting,
)
from guard_core.signal_state import SignalThresholds

CONFIGS = (SignalThresholds, PolicyConfig, GateConfig, AdaptiveOutputConfig, PredictiveConfig)


@attrs.frozen(kw_only=True)
class Toy:
    on: bool = setting(True, env="TOY_ON")
    low: int = setting(1, env="TOY_LOW", rules=(AtLeast(0), NotAbove("high")), when="on")
    high: int = setting(5, env="TOY_HIGH", rules=(Greater(0),), unless_same_as="low")
    ratio: float = setting(0.5, env="TOY_RATIO", rules=(Within(0, 1, high_open=True),))

    def __attrs_post_init__(self) -> None:
        require_valid(self)


@attrs.frozen
class Pair:
    small: int = setting(0, rules=(Below("big"),))
    big: int = setting(1, env="PAIR_BIG")


def values(**changes: Any) -> dict[str, Any]:
    return {**attrs.asdict(Toy()), **changes}


def test_each_rule_names_its_variables_and_the_bad_value() -> None:
    assert problems(Toy, values(low=-1)) == [Problem(("TOY_LOW",), "must be >= 0, got -1")]
    assert problems(Toy, values(low=6)) == [
        Problem(("TOY_LOW", "TOY_HIGH"), "must not be above TOY_HIGH (5), got 6")
    ]
    assert problems(Toy, values(ratio=1.0)) == [
        Problem(("TOY_RATIO",), "must be in [0, 1), got 1.0")
    ]
    assert problems(Toy, values(high=-2, low=-3)) == [
        Problem(("TOY_LOW",), "must be >= 0, got -3"),
        Problem(("TOY_HIGH",), "must be > 0, got -2"),
    ]
    # A field without a variable is named after itself.
    assert [str(p) for p in problems(Pair, {"small": 5, "big": 5})] == [
        "small: must be below PAIR_BIG (5), got 5"
    ]


def test_rules_apply_only_while_their_switch_is_on() -> None:
    assert problems(Toy, values(on=False, low=-1)) == []
    Toy(on=False, low=-1)


def test_a_value_equal_to_the_one_it_follows_is_reported_there_only() -> None:
    # TOY_HIGH = 0 breaks its own rule, but it equals TOY_LOW, whose rules hold the value.
    assert problems(Toy, values(low=0, high=0)) == []
    assert problems(Toy, values(low=1, high=0)) == [
        Problem(("TOY_LOW", "TOY_HIGH"), "must not be above TOY_HIGH (0), got 1"),
        Problem(("TOY_HIGH",), "must be > 0, got 0"),
    ]
    assert problems(Toy, values(low=-1, high=-1)) == [Problem(("TOY_LOW",), "must be >= 0, got -1")]


def test_missing_fields_and_partners_are_skipped() -> None:
    assert problems(Toy, {"low": 9}) == []
    assert problems(Toy, {"high": -1}) == [Problem(("TOY_HIGH",), "must be > 0, got -1")]


def test_a_built_config_is_held_to_the_same_rules() -> None:
    with pytest.raises(PolicyConfigError) as caught:
        Toy(low=-1, ratio=2.0)
    assert (
        str(caught.value) == "TOY_LOW: must be >= 0, got -1; TOY_RATIO: must be in [0, 1), got 2.0"
    )


@given(
    st.integers(-3, 8),
    st.integers(-3, 8),
    st.floats(-1, 2, allow_nan=False),
    st.booleans(),
)
def test_building_fails_exactly_when_problems_are_found(
    low: int, high: int, ratio: float, on: bool
) -> None:
    found = problems(Toy, values(low=low, high=high, ratio=ratio, on=on))
    if not found:
        Toy(low=low, high=high, ratio=ratio, on=on)
        return
    with pytest.raises(PolicyConfigError) as caught:
        Toy(low=low, high=high, ratio=ratio, on=on)
    assert str(caught.value) == "; ".join(map(str, found))


@pytest.mark.parametrize("cls", CONFIGS)
def test_the_core_defaults_keep_their_own_rules(cls: type) -> None:
    fields = attrs.fields(cls)
    defaults = {f.name: f.default for f in fields if not isinstance(f.default, attrs.Factory)}  # type: ignore[arg-type]
    assert problems(cls, defaults) == []


def test_configs_that_share_a_variable_agree_on_its_default() -> None:
    seen: dict[str, Any] = {}
    for cls in CONFIGS:
        for field in attrs.fields(cls):
            name = field.metadata.get("env")
            if name is None:
                continue
            assert seen.setdefault(name, field.default) == field.default, name
    assert seen["GLOBAL_LIMIT"] == 512
    assert math.isclose(seen["DYNAMIC_KV_RED"], 0.80)
