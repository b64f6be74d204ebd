"""Rules for text settings, of the shape :mod:`guard_core.settings` applies.

Reads: one setting's value. Guarantees: ``broken`` returns the message for a value that breaks
the rule, or None, and never raises; values are quoted with :func:`shown`, cut to 60 characters.
"""

from __future__ import annotations

import re
from typing import Any, Final

import attrs

__all__ = ("IDENTIFIER", "Identifier", "OneOf", "shown")

#: An ASCII identifier: a letter or ``_``, then letters, digits or ``_``.
IDENTIFIER: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@attrs.frozen
class OneOf:
    """The value is one of ``choices``."""

    choices: tuple[str, ...]
    partner = None

    def broken(self, value: Any, _partner: Any, _partner_name: str) -> str | None:
        if value in self.choices:
            return None
        return f"must be {' or '.join(self.choices)}, got {shown(value)}"


@attrs.frozen
class Identifier:
    """The value is an ASCII identifier (:data:`IDENTIFIER`)."""

    partner = None

    def broken(self, value: Any, _partner: Any, _partner_name: str) -> str | None:
        if IDENTIFIER.fullmatch(value):
            return None
        return f"{shown(value)} must be a letter or '_' followed by letters, digits or '_'"
