"""The guard's own answers, framed: refusals of a bad head or body, the 429, and the header
edits every answer gets (its request id, ``Connection: close``).

Reads: statuses, header lists and bodies the shell hands in; the refusal settings.
Guarantees:
- an answer's bytes are exactly what an h11 server connection writes for it on a kept-alive
  HTTP/1.1 exchange (:func:`whole_response_bytes`), so a cached answer and one sent through
  h11 cannot differ;
- an answer carries one ``X-Request-Id``, the request's (a backend's own is dropped), and one
  ``Connection: close`` when it must close;
- the bodies name the problem in client terms only (OpenAI-style JSON for a body, plain text
  for a head): no internal reason reaches a client;
- nothing here does I/O or keeps state beyond the bounded cache of :class:`RefusalAnswers`.
"""

from __future__ import annotations

from collections.abc import Sequence
from http import HTTPStatus

import attrs
import h11

from guard_adapters.exchange import TOO_MANY_REQUESTS_BODY, openai_error, refusal_headers

__all__ = (
    "BodyLimits",
    "BodyRefused",
    "RefusalAnswers",
    "RefusedRequest",
    "body_refusal",
    "declared_length",
    "head_refusal",
    "stamped",
    "whole_response",
    "whole_response_bytes",
    "with_close",
)

Headers = Sequence[tuple[bytes, bytes]]


@attrs.frozen
class RefusedRequest(Exception):
    """A request refused before routing: answer ``status`` and close."""

    status: int
    reason: str


@attrs.frozen
class BodyRefused(Exception):
    """The request body broke a limit (413 too large, 408 too slow, 400 bad framing): answer
    ``status`` if a response can still be sent, then close."""

    status: int
    reason: str


@attrs.frozen
class BodyLimits:
    """``PIG_MAX_BODY_BYTES``, ``PIG_BODY_IDLE_TIMEOUT_SECONDS``, ``PIG_BODY_TIMEOUT_SECONDS``."""

    max_bytes: int = 8 * 1024 * 1024
    #: The longest wait for the next body bytes.
    idle_timeout_s: float = 10.0
    #: The whole body must arrive within this, counted from the first read of it.
    total_timeout_s: float = 60.0


_CLOSE = (b"connection", b"close")
_HEAD_REFUSALS = {
    400: b"bad request\n",
    408: b"request timeout\n",
    431: b"request header fields too large\n",
}
_BODY_REFUSALS = {
    400: openai_error(b"Malformed request body", b"BadRequestError", 400),
    408: openai_error(b"Request body not received in time", b"RequestTimeoutError", 408),
    413: openai_error(b"Request body too large", b"RequestTooLargeError", 413),
}


def head_refusal(status: int) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The headers and plain-text body answering a refused head (the connection closes)."""
    body = _HEAD_REFUSALS.get(status, b"bad request\n")
    return [(b"content-type", b"text/plain"), _CLOSE], body


def body_refusal(status: int) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The headers and OpenAI-style body answering a refused body (the connection closes)."""
    body = _BODY_REFUSALS.get(status) or openai_error(
        b"Malformed request body", b"BadRequestError", status
    )
    return [(b"content-type", b"application/json"), _CLOSE], body


def declared_length(headers: Headers) -> int | None:
    """The body length a head announces: None for a chunked body, 0 when there is none."""
    length = 0
    for name, value in headers:
        if name == b"transfer-encoding":
            return None
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                return None
    return length


def stamped(headers: list[tuple[bytes, bytes]], trace_id: str) -> list[tuple[bytes, bytes]]:
    """``headers`` with ``trace_id`` as its one ``X-Request-Id`` (unchanged without an id)."""
    if not trace_id:
        return headers
    kept = [(n, v) for n, v in headers if n.lower() != b"x-request-id"]
    kept.append((b"x-request-id", trace_id.encode()))
    return kept


def with_close(event: h11.Event) -> h11.Event:
    """A response head that says ``Connection: close`` (other events unchanged)."""
    if not isinstance(event, h11.Response):
        return event
    if any(n == b"connection" and v.lower() == b"close" for n, v in event.headers):
        return event
    kept = [(n, v) for n, v in event.headers if n != b"connection"]
    return h11.Response(
        status_code=event.status_code,
        headers=[*kept, _CLOSE],
        reason=event.reason,
        http_version=event.http_version,
    )


def whole_response(status: int, headers: Headers, body: bytes) -> list[h11.Event]:
    """The h11 events of a whole answer: its head with the length, the body, the end."""
    framed = [*headers, (b"content-length", str(len(body)).encode())]
    events: list[h11.Event] = [
        h11.Response(status_code=status, headers=framed, reason=_reason(status))
    ]
    if body:
        events.append(h11.Data(data=body))
    events.append(h11.EndOfMessage())
    return events


#: A request h11 has read, so that :func:`whole_response_bytes` can frame an answer to it.
_SOME_REQUEST = b"POST / HTTP/1.1\r\nhost: guard\r\ncontent-length: 0\r\n\r\n"


def whole_response_bytes(status: int, headers: Headers, body: bytes) -> bytes:
    """The exact bytes an h11 server writes for this answer on a kept-alive HTTP/1.1
    connection, framed by a throwaway h11 connection (callers keep what they reuse)."""
    framer = h11.Connection(h11.SERVER)
    framer.receive_data(_SOME_REQUEST)
    while framer.next_event() is not h11.NEED_DATA and framer.their_state is not h11.DONE:
        pass
    return b"".join(framer.send(event) or b"" for event in whole_response(status, headers, body))


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


class RefusalAnswers:
    """PIG's 429, its headers and its cached bytes.

    ``retry_after``: ``PIG_RETRY_AFTER_SECONDS`` as bytes (None: no ``Retry-After`` at all);
    ``predicted``: ``PIG_RETRY_AFTER_MODE=predicted``, an admission refusal then says the
    learner's seconds instead."""

    #: Distinct predicted seconds whose bytes are kept (they are few; the bound is a guard).
    CACHE_SIZE = 64

    def __init__(self, retry_after: bytes | None, *, predicted: bool) -> None:
        self.retry_after = retry_after
        self.predicted = predicted and retry_after is not None
        self._cached: dict[int | None, tuple[bytes, bytes]] = {}

    def headers(self, predicted_s: int | None) -> tuple[tuple[bytes, bytes], ...]:
        return refusal_headers(self.retry_after, predicted_s if self.predicted else None)

    def whole(self, predicted_s: int | None, trace_id: str) -> bytes:
        """The whole 429 for a kept-alive connection with ``trace_id`` as its request id:
        the bytes the shell would send through h11, from a bounded cache."""
        answer = self._cached.get(predicted_s)
        if answer is None:
            whole = whole_response_bytes(429, self.headers(predicted_s), TOO_MANY_REQUESTS_BODY)
            split = whole.index(b"\r\n") + 2
            answer = whole[:split], whole[split:]
            if len(self._cached) < self.CACHE_SIZE:
                self._cached[predicted_s] = answer
        status_line, rest = answer
        return b"%sx-request-id: %s\r\n%s" % (status_line, trace_id.encode(), rest)
