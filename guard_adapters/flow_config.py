"""``PIG_PRIORITY_BANDS`` and ``PIG_TENANT_WEIGHTS`` read as values, every problem reported.

Reads: the two variables' text. ``PIG_PRIORITY_BANDS`` is a comma-separated list of bands,
highest priority first, each ``name`` followed by optional ``:key=value`` parts: ``reserve``
(a share of the cap below 1, or whole slots), ``wait`` (seconds, the band's longest short wait;
0 refuses at once), ``priority`` (an integer: the value backend priority injection writes for
the band) and ``default`` (no value: the band of requests whose tier header names no
band). For example ``premium:reserve=0.1,standard:default,batch:wait=0``.
``PIG_TENANT_WEIGHTS`` is ``name=weight,...`` (weights > 0; a tenant not listed weighs 1).
Guarantees: each parser returns its value and the list of problems found (all of them, each
naming the entry); the value is ``None`` when the text is empty (unset: PIG's two tiers, all
weights 1) or when there is any problem; nothing raises for any text.
"""

from __future__ import annotations

import math

from guard_core._errors import PolicyConfigError
from guard_core.bands import Band, BandSpec

__all__ = ("parse_bands", "parse_weights")

_KEYS = ("reserve", "wait", "priority", "default")


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _band(number: int, entry: str, problems: list[str]) -> tuple[Band, bool] | None:
    name, *parts = (part.strip() for part in entry.split(":"))
    name = name.lower()
    reserve: float | None = None
    wait: float | None = None
    priority: int | None = None
    default = False
    found = len(problems)
    for part in parts:
        key, equals, value = (piece.strip() for piece in part.partition("="))
        key = key.lower()
        if key not in _KEYS:
            problems.append(f"band {number} ({entry!r}): unknown option {key!r} (use {_KEYS})")
        elif key == "default":
            if equals:
                problems.append(f"band {number} ({entry!r}): 'default' takes no value")
            default = True
        elif key == "priority":
            try:
                priority = int(value)
            except ValueError:
                problems.append(f"band {number} ({entry!r}): priority must be an integer")
        elif (parsed := _number(value)) is None:
            problems.append(f"band {number} ({entry!r}): {key} must be a number, got {value!r}")
        elif key == "reserve":
            reserve = parsed
        else:
            wait = parsed
    if len(problems) > found:
        return None
    try:
        return Band(name, reserve=reserve, wait_s=wait, priority=priority), default
    except PolicyConfigError as error:
        problems.append(f"band {number} ({entry!r}): {error}")
        return None


def parse_bands(text: str) -> tuple[BandSpec | None, list[str]]:
    """``PIG_PRIORITY_BANDS`` as a :class:`~guard_core.bands.BandSpec`, or its problems."""
    entries = [entry.strip() for entry in text.split(",") if entry.strip()]
    if not entries:
        return None, []
    problems: list[str] = []
    bands: list[Band] = []
    defaults: list[str] = []
    for number, entry in enumerate(entries, start=1):
        parsed = _band(number, entry, problems)
        if parsed is None:
            continue
        band, default = parsed
        bands.append(band)
        if default:
            defaults.append(band.name)
    if len(defaults) > 1:
        problems.append(f"only one band may be the default, got {', '.join(defaults)}")
    if problems:
        return None, problems
    try:
        spec = BandSpec.of(bands, defaults[0] if defaults else None)
    except PolicyConfigError as error:
        return None, [str(error)]
    return spec, []


def parse_weights(text: str) -> tuple[tuple[tuple[str, float], ...] | None, list[str]]:
    """``PIG_TENANT_WEIGHTS`` as ``(name, weight)`` pairs, or its problems."""
    entries = [entry.strip() for entry in text.split(",") if entry.strip()]
    if not entries:
        return None, []
    problems: list[str] = []
    weights: dict[str, float] = {}
    for number, entry in enumerate(entries, start=1):
        name, equals, value = (piece.strip() for piece in entry.partition("="))
        weight = _number(value) if equals else None
        if not name or weight is None or weight <= 0:
            problems.append(f"entry {number} ({entry!r}) is not name=weight with a weight > 0")
        elif name in weights:
            problems.append(f"entry {number} names tenant {name!r} a second time")
        else:
            weights[name] = weight
    if problems:
        return None, problems
    return tuple(weights.items()), []
