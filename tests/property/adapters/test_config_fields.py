"""The configs' own fields are the one source of the variables' defaults and ranges.

Every variable a core config (or the body rewrite) reads has its default on that config's field,
and :func:`~guard_adapters.config.load_config` reports a value breaking one of the field's rules
with the variable's name and the rule's own message.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from guard_adapters.config import CONFIG_FIELDS, VARIABLES, ConfigError, Environment, load_config
from guard_core.settings import RULES, AtLeast, Greater, Within, variable

#: Every stage on: dynamic mode (so the pressure, user-TPS and TTFT stages), the adaptive
#: output thresholds and the predictive learner.
ALL_ON = {
    "DYNAMIC_METRICS_URL": "http://engine:8000/metrics",
    "CLASSIFY_OUTPUT_TOKENS": "1",
    "ADAPTIVE_OUTPUT_CLASSIFICATION": "1",
    "DYNAMIC_POLICY": "predictive",
}
_ENV_FIELDS = attrs.fields_dict(Environment)


def _env_field(name: str) -> attrs.Attribute[Any]:
    return _ENV_FIELDS[name.lower()]


def test_every_config_variable_is_read_with_its_fields_default() -> None:
    empty = Environment()
    for name, field in CONFIG_FIELDS.items():
        assert name in VARIABLES
        if isinstance(_env_field(name).default, attrs.Factory):  # type: ignore[arg-type]
            continue  # follows another variable (the slot counts, the stage switches)
        assert getattr(empty, name.lower()) == field.default, name


def _single_value_cases() -> list[tuple[str, Any, str]]:
    """(variable, bad value, expected message) for each one-value rule of a config field."""
    cases = []
    for name, field in CONFIG_FIELDS.items():
        if _env_field(name).converter is not None:
            continue  # a value that is not positive means the default (the TTFT thresholds)
        for rule in field.metadata.get(RULES, ()):
            if isinstance(rule, AtLeast | Greater):
                bad = rule.bound - 1
            elif isinstance(rule, Within):
                bad = rule.low - 1
            else:
                continue
            value = float(bad) if field.type in (float, "float") else int(bad)
            cases.append((name, value, f"{variable(field)}: {rule.broken(value, None, '')}"))
    return cases


@pytest.mark.parametrize(("name", "value", "message"), _single_value_cases())
def test_a_value_breaking_a_fields_rule_is_reported_with_its_message(
    name: str, value: float, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config({**ALL_ON, name: str(value)})
    assert [m for m in caught.value.messages if m.startswith(f"{name}: ")] == [message]


def test_the_single_value_rules_cover_the_stages() -> None:
    names = {name for name, _, _ in _single_value_cases()}
    for expected in (
        "GLOBAL_LIMIT",
        "PIG_QUEUE_WAIT_SECONDS",
        "DYNAMIC_KV_RED",
        "DYNAMIC_PRESSURE_LEARN_RATIO",
        "DYNAMIC_SINGLE_USER_TPS_CAPACITY_HEALTHY_MULTIPLIER",
        "ADAPTIVE_OUTPUT_WINDOW",
        "DYNAMIC_PREDICTIVE_HORIZON_SECONDS",
    ):
        assert expected in names
