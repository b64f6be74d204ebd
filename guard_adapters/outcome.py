"""How one exchange ended, as one frozen value, and the request id that names it.

Reads: what the shell noted while it served one request (the admission, the backend, the
times, what went wrong), and the client's ``X-Request-Id`` header.
Guarantees:
- :class:`ExchangeNotes` is the one mutable record of an exchange in progress; the shell sets
  its fields as things happen and calls :meth:`ExchangeNotes.outcome` once, at the end, for the
  :class:`ExchangeOutcome` it hands to its listeners (the metrics page, the admin stream): the
  notes themselves, frozen in place, so ending an exchange copies nothing;
- the notes hold facts, never counts derived from them: which counter a fact moves is the
  listener's rule (``guard_trio._observability.GuardMetrics.record_exchange``);
- :func:`client_trace_id` accepts a client's id only when it is one header of 1 to 128
  characters from a safe set (letters, digits and ``._:@/+=-``), so an id can go into a log
  line, a header and a JSON message unescaped; anything else gets the guard's own id.
"""

from __future__ import annotations

import enum
import itertools
import re
from collections.abc import Sequence

import attrs

from guard_core.decision import RejectCode
from guard_core.lanes import Lane
from guard_core.predictive import Binding
from guard_core.tier import Tier

__all__ = (
    "Admission",
    "Bridge",
    "Disconnect",
    "ExchangeNotes",
    "ExchangeOutcome",
    "TraceIds",
    "client_trace_id",
)

_SAFE_ID = re.compile(rb"[A-Za-z0-9._:@/+=\-]{1,128}\Z")


class Admission(enum.Enum):
    """How an admission ended (only requests on an admitted path have one)."""

    ADMITTED = "admitted"
    REFUSED = "refused"
    #: The client left while it waited for a slot.
    ABANDONED = "abandoned"


class Disconnect(enum.Enum):
    """When a client left mid-exchange (the ``phase`` of ``pig_client_disconnects_total``)."""

    QUEUE = "queue"
    UPSTREAM = "upstream"
    RESPONSE = "response"


class Bridge(enum.Enum):
    """An early-bridged stream (spec 8.4), and how its backend answered."""

    OPENED = "opened"
    #: The backend's answer was no 200 event stream: the client got an empty stream.
    INVALID_UPSTREAM = "invalid_upstream"
    #: The backend failed before its head: the client's stream was ended.
    UPSTREAM_ERROR = "upstream_error"


@attrs.define(slots=True, kw_only=True)
class ExchangeNotes:
    """One exchange in progress; see the module rules."""

    #: The id the client was answered with (``X-Request-Id``): its own or the guard's.
    trace_id: str = ""
    #: The engine's id of the request (its events' ``request_id``), when it asked for a slot.
    request_id: int | None = None
    #: The request took the admitted path (so its body size and tier are counted).
    admitted_path: bool = False
    tier: Tier | None = None
    #: Its flow-control band and tenant ("" without flow control, or no tenant header value).
    band: str = ""
    tenant: str = ""
    #: The lane it was counted in (its body lane, combined with its output lane when known).
    lane: Lane = Lane.DEFAULT
    #: The declared body size (None: unknown, e.g. chunked).
    body_bytes: int | None = None
    admission: Admission | None = None
    #: Why the client got a refusal (an admission refusal or a failed priority injection).
    code: RejectCode | None = None
    #: The predictive learner's constraint behind an admission refusal.
    binding: Binding | None = None
    waited_s: float = 0.0
    #: The admission decision's own time, the wait excluded.
    decision_s: float | None = None
    #: The backend it was forwarded to.
    backend: str | None = None
    #: The status the client got (0: none was sent).
    status: int = 0
    #: From forwarding to the backend's response head.
    ttfb_s: float | None = None
    #: From forwarding to the end of the relay.
    proxy_s: float | None = None
    #: Arrival to end of an admitted request, and the part of it outside the wait and the relay.
    served_s: float | None = None
    overhead_s: float | None = None
    #: Backend failures: before the client saw a response (or no head in time), and mid-body.
    upstream_errors: int = 0
    #: ``upstream_errors`` that ended the exchange (the backend's own error count).
    backend_failed: bool = False
    mid_response_failure: bool = False
    disconnect: Disconnect | None = None
    #: SSE keep-alive comments were allowed for the stream.
    keepalive_stream: bool = False
    bridge: Bridge | None = None
    #: Priority injection outcomes (``rewritten``, ``skipped``, ``failed``), in order.
    priority: tuple[str, ...] = ()
    priority_rewrite_s: float | None = None

    def note_priority(self, name: str) -> None:
        self.priority = (*self.priority, name)

    def outcome(self) -> ExchangeOutcome:
        """These notes, frozen in place: from now on they are the exchange's outcome and no
        field can change (an :class:`ExchangeOutcome` has exactly the notes' slots, so the
        object only changes class; no field is copied)."""
        self.__class__ = ExchangeOutcome
        assert isinstance(self, ExchangeOutcome)
        return self


@attrs.frozen(kw_only=True)
class ExchangeOutcome(ExchangeNotes):
    """How one exchange ended (the fields of :class:`ExchangeNotes`, frozen)."""

    @property
    def refused(self) -> bool:
        return self.code is not None


class TraceIds:
    """The ids of requests: the client's (:func:`client_trace_id`) or the guard's own, a
    per-process ``prefix`` (the shell draws it at random) and a count in hexadecimal."""

    __slots__ = ("_numbers", "_prefix")

    def __init__(self, prefix: str) -> None:
        self._prefix = f"ig-{prefix}-"
        self._numbers = itertools.count(1)

    def __call__(self, values: Sequence[bytes]) -> str:
        return client_trace_id(values) or f"{self._prefix}{next(self._numbers):x}"


def client_trace_id(values: Sequence[bytes]) -> str | None:
    """The client's ``X-Request-Id`` when it sent exactly one sane one (module rules)."""
    if len(values) != 1:
        return None
    value = values[0].strip()
    if _SAFE_ID.match(value) is None:
        return None
    return value.decode("ascii")
