"""Versions 1 and 2 of the recording format: their request lines, read as request events.

Reads: the JSON objects of a version-1 or version-2 recording's request lines (``arrival``,
``retry``, ``gone``, ``outcome``, ``first_token``, ``completion``); their ``scrape``,
``scrape_failed`` and ``decision`` lines are the current format's, read by
:mod:`guard_adapters.recording`.
Guarantees:
- version 2 only added optional fields to version 1 (an outcome's ``retry_after_s`` and
  ``binding``), so one reader serves both;
- each line becomes the one :mod:`guard_core.events` value that says the same fact, so an
  older recording replays through the same fold as a current one: ``arrival`` is
  :class:`~guard_core.Arrived`, ``retry`` :class:`~guard_core.Retried`, ``gone``
  :class:`~guard_core.Abandoned`, an ``outcome`` ``forwarded`` :class:`~guard_core.Forwarded`
  and any other :class:`~guard_core.Refused`, ``first_token`` :class:`~guard_core.FirstToken`,
  ``completion`` :class:`~guard_core.Finished`;
- what the events do not carry is dropped: an outcome's ``waited_s`` (the arrival's ``at``
  says it); a tier other than ``premium`` reads as basic, as the replay of version 1 read it;
- a field of the wrong type, a missing field or an extra one raises a ``cattrs`` validation
  error, which the caller reports with the line's number.
"""

from __future__ import annotations

from typing import Any

import attrs
import cattrs
from cattrs.strategies import configure_tagged_union

from guard_core import (
    Abandoned,
    Arrived,
    Binding,
    Finished,
    FirstToken,
    Forwarded,
    Refused,
    RejectCode,
    RequestEvent,
    Retried,
    Tier,
)

__all__ = ("KINDS", "read_request")


@attrs.frozen(kw_only=True)
class _Arrival:
    at: float
    id: int
    tier: str
    path: str = ""
    body_bytes: int | None = None


@attrs.frozen(kw_only=True)
class _Retry:
    at: float
    id: int


@attrs.frozen(kw_only=True)
class _Gone:
    at: float
    id: int


@attrs.frozen(kw_only=True)
class _Outcome:
    at: float
    id: int
    outcome: str
    code: str | None = None
    waited_s: float = 0.0
    retry_after_s: int | None = None
    binding: str | None = None


@attrs.frozen(kw_only=True)
class _FirstToken:
    at: float
    id: int
    seconds: float


@attrs.frozen(kw_only=True)
class _Completion:
    at: float
    id: int
    status: int = 0


_Line = _Arrival | _Retry | _Gone | _Outcome | _FirstToken | _Completion
_KIND_OF: dict[type, str] = {
    _Arrival: "arrival",
    _Retry: "retry",
    _Gone: "gone",
    _Outcome: "outcome",
    _FirstToken: "first_token",
    _Completion: "completion",
}
#: The request kinds of versions 1 and 2.
KINDS = frozenset(_KIND_OF.values())

_converter = cattrs.Converter(forbid_extra_keys=True)
configure_tagged_union(_Line, _converter, tag_generator=_KIND_OF.__getitem__, tag_name="kind")


def _event(line: _Line) -> RequestEvent:
    at = line.at
    if isinstance(line, _Arrival):
        tier = Tier.PREMIUM if line.tier == "premium" else Tier.BASIC
        return Arrived(
            at=at, request_id=line.id, tier=tier, body_bytes=line.body_bytes, path=line.path
        )
    if isinstance(line, _Retry):
        return Retried(at=at, request_id=line.id)
    if isinstance(line, _Gone):
        return Abandoned(at=at, request_id=line.id)
    if isinstance(line, _FirstToken):
        return FirstToken(at=at, request_id=line.id, seconds=line.seconds)
    if isinstance(line, _Completion):
        return Finished(at=at, request_id=line.id, status=line.status)
    if line.outcome == "forwarded":
        return Forwarded(at=at, request_id=line.id)
    return Refused(
        at=at,
        request_id=line.id,
        code=None if line.code is None else RejectCode(line.code),
        retry_after_s=line.retry_after_s,
        binding=None if line.binding is None else Binding(line.binding),
    )


def read_request(payload: dict[str, Any]) -> RequestEvent:
    """The request event a version-1 or -2 line (a JSON object with ``kind``) records."""
    return _event(_converter.structure(payload, _Line))  # type: ignore[arg-type]
