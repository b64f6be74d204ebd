"""Settings fields that carry their environment variable and their range rules.

Reads: nothing. The core configs declare each setting once with :func:`setting` (its default,
the variable it is read from, its range rules and when they apply); the config adapter reads the
same fields to default, check and build the configs from the environment.
Guarantees:
- :func:`problems` applies a config class's rules to a mapping of field values and returns one
  :class:`Problem` per broken rule, in field order, each naming its variables and the bad value;
  it never raises, and a field missing from the mapping (or a rule's partner missing) is skipped;
- :func:`require_valid` holds a built config to exactly those rules: it raises
  :class:`~guard_core.PolicyConfigError` listing every problem, or returns;
- a rule is in force only while its ``when`` field is true, and a field's own rules are skipped
  while it equals its ``unless_same_as`` field (that field's rules already report the value).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import attrs

from guard_core._errors import PolicyConfigError

__all__ = (
    "AtLeast",
    "Below",
    "Greater",
    "NotAbove",
    "Problem",
    "Rule",
    "Within",
    "default_of",
    "problems",
    "require_valid",
    "setting",
    "variable",
)

#: ``metadata`` keys of a field made by :func:`setting`.
ENV = "env"
RULES = "rules"
WHEN = "when"
UNLESS_SAME_AS = "unless_same_as"


def _number(value: object) -> str:
    return repr(value) if isinstance(value, float) else str(value)


@attrs.frozen
class AtLeast:
    """The value is ``>= bound``."""

    bound: float
    partner = None

    def broken(self, value: Any, _partner: Any, _partner_name: str) -> str | None:
        if value >= self.bound:
            return None
        return f"must be >= {self.bound:g}, got {_number(value)}"


@attrs.frozen
class Greater:
    """The value is ``> bound``."""

    bound: float
    partner = None

    def broken(self, value: Any, _partner: Any, _partner_name: str) -> str | None:
        if value > self.bound:
            return None
        return f"must be > {self.bound:g}, got {_number(value)}"


@attrs.frozen
class Within:
    """The value lies in the interval from ``low`` to ``high``, each end closed unless open."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False
    partner = None

    def broken(self, value: Any, _partner: Any, _partner_name: str) -> str | None:
        low_ok = value > self.low if self.low_open else value >= self.low
        high_ok = value < self.high if self.high_open else value <= self.high
        if low_ok and high_ok:
            return None
        left = "(" if self.low_open else "["
        right = ")" if self.high_open else "]"
        return f"must be in {left}{self.low:g}, {self.high:g}{right}, got {_number(value)}"


@attrs.frozen
class NotAbove:
    """The value is not above the field ``partner`` of the same config."""

    partner: str

    def broken(self, value: Any, partner: Any, partner_name: str) -> str | None:
        if not value > partner:
            return None
        return f"must not be above {partner_name} ({_number(partner)}), got {_number(value)}"


@attrs.frozen
class Below:
    """The value is strictly below the field ``partner`` of the same config."""

    partner: str

    def broken(self, value: Any, partner: Any, partner_name: str) -> str | None:
        if value < partner:
            return None
        return f"must be below {partner_name} ({_number(partner)}), got {_number(value)}"


class Rule(Protocol):
    """What a rule offers: the field it compares with, if any, and the message for a value
    that breaks it (None when the value keeps it). Adapters may add rules of this shape."""

    @property
    def partner(self) -> str | None: ...

    def broken(self, value: Any, partner: Any, partner_name: str) -> str | None: ...


@attrs.frozen
class Problem:
    """One broken rule: the variables involved (the first leads the message) and what is wrong."""

    variables: tuple[str, ...]
    text: str

    def __str__(self) -> str:
        return f"{self.variables[0]}: {self.text}"


def setting(
    default: Any,
    *,
    env: str | None = None,
    rules: tuple[Rule, ...] = (),
    when: str | None = None,
    unless_same_as: str | None = None,
) -> Any:
    """An attrs field with its default and its range rules, read from the variable ``env``.

    A field without ``env`` is not read from the environment: the adapter fills it from
    another config's setting (the gate's copy of ``GLOBAL_LIMIT``, say).

    ``when`` names a boolean field of the same config: the rules apply only while it is true.
    ``unless_same_as`` names the field this one follows by default.
    """
    metadata = {ENV: env, RULES: rules, WHEN: when, UNLESS_SAME_AS: unless_same_as}
    return attrs.field(default=default, metadata=metadata)


def default_of(cls: type, name: str) -> Any:
    """The default of field ``name`` of ``cls``, for a config that shares another's setting."""
    default = attrs.fields_dict(cls)[name].default
    assert not isinstance(default, attrs.Factory)  # type: ignore[arg-type]
    return default


def variable(field: attrs.Attribute[Any]) -> str:
    """The variable a field is read from; a field without one is named after itself."""
    name = field.metadata.get(ENV)
    return name if isinstance(name, str) else field.name


def problems(cls: type, values: Mapping[str, Any]) -> list[Problem]:
    """Every rule of ``cls``'s fields that ``values`` (field name -> value) breaks."""
    fields = {field.name: field for field in attrs.fields(cls)}
    found: list[Problem] = []
    for field in fields.values():
        rules: tuple[Rule, ...] = field.metadata.get(RULES, ())
        if not rules or field.name not in values:
            continue
        when = field.metadata.get(WHEN)
        if when is not None and not values.get(when, True):
            continue
        value = values[field.name]
        same_as = field.metadata.get(UNLESS_SAME_AS)
        if same_as is not None and same_as in values and value == values[same_as]:
            continue
        for rule in rules:
            partner = rule.partner
            if partner is not None and partner not in values:
                continue
            partner_name = variable(fields[partner]) if partner is not None else ""
            text = rule.broken(value, values.get(partner) if partner else None, partner_name)
            if text is not None:
                names = (variable(field), partner_name) if partner else (variable(field),)
                found.append(Problem(names, text))
    return found


def require_valid(config: object) -> None:
    """Raise :class:`~guard_core.PolicyConfigError` unless ``config`` keeps its fields' rules."""
    cls: Any = type(config)
    found = problems(cls, {f.name: getattr(config, f.name) for f in attrs.fields(cls)})
    if found:
        raise PolicyConfigError("; ".join(str(problem) for problem in found))
