"""Versions 1 and 2 of the recording format: their request lines, read as request events.

Reads: the JSON object of one request line of a version-1 or version-2 recording (``arrival``,
``retry``, ``gone``, ``outcome``, ``first_token``, ``completion``); their ``scrape``,
``scrape_failed`` and ``decision`` lines are the current format's, read by
:mod:`guard_adapters.recording` as they are.
Guarantees:
- version 2 only added optional fields to version 1 (an outcome's ``retry_after_s`` and
  ``binding``), so one translation serves both;
- each line becomes the current line of the one :mod:`guard_core.events` value that says the
  same fact, which the current reader then checks field by field: ``arrival`` is ``arrived``,
  ``retry`` ``retried``, ``gone`` ``abandoned``, an ``outcome`` ``forwarded`` is
  ``forwarded`` and any other ``refused``, ``first_token`` stays, ``completion`` is
  ``finished``; ``id`` is ``request_id``;
- what the events do not carry is dropped: an outcome's ``waited_s`` (the arrival's ``at``
  says it); a tier other than ``premium`` reads as basic, as the replay of version 1 read it;
- a line without ``outcome`` raises :class:`ValueError`; nothing is guessed.
"""

from __future__ import annotations

from typing import Any

__all__ = ("KINDS", "translate")

_RENAMED = {
    "arrival": "arrived",
    "retry": "retried",
    "gone": "abandoned",
    "first_token": "first_token",
    "completion": "finished",
}
#: The request kinds of versions 1 and 2.
KINDS = frozenset({*_RENAMED, "outcome"})
#: The fields of an outcome that a forwarded request never had a use for.
_REFUSAL_ONLY = ("code", "retry_after_s", "binding")


def translate(payload: dict[str, Any]) -> dict[str, Any]:
    """The current line that says what a version-1 or -2 request line (with ``kind``) says."""
    line = dict(payload)
    kind = line.pop("kind")
    if "id" in line:
        line["request_id"] = line.pop("id")
    if kind == "arrival" and "tier" in line:
        line["tier"] = "premium" if line["tier"] == "premium" else "basic"
    if kind == "outcome":
        line.pop("waited_s", None)
        if "outcome" not in line:
            raise ValueError("missing 'outcome'")
        if line.pop("outcome") == "forwarded":
            kind = "forwarded"
            for name in _REFUSAL_ONLY:
                line.pop(name, None)
        else:
            kind = "refused"
    line["kind"] = _RENAMED.get(kind, kind)
    return line
