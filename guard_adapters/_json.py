"""A JSON object from outside input, or the caller's own error.

Reads: a text (or UTF-8 bytes), what it is in words, and the caller's exception type.
Guarantees: :func:`json_object` returns the decoded object when the text is exactly one JSON
object; otherwise it raises ``error("<what> is not JSON")`` or
``error("<what> is not a JSON object")``, without the decoder's exception chained.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def json_object(text: str | bytes, what: str, error: Callable[[str], Exception]) -> dict[str, Any]:
    """``text`` decoded as a JSON object; ``error`` with a message naming ``what`` otherwise."""
    try:
        parsed = json.loads(text)
    except ValueError:
        raise error(f"{what} is not JSON") from None
    if not isinstance(parsed, dict):
        raise error(f"{what} is not a JSON object")
    return parsed
