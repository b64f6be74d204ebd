"""A strict, fast reader of the simplest HTTP/1.1 request heads: the refusal path's parser.

Reads: the bytes a client sent on an idle keep-alive connection; request heads h11 has read.
Guarantees:
- :func:`head_problem` says what a proxy must refuse in a head h11 accepts (limits, framing,
  versions, non-origin targets, upgrades, underscore aliases of guarded headers);
- :func:`read_simple_request` returns a :class:`SimpleRequest` only for a request that h11 (as
  the guard's :class:`~guard_trio._downstream.Downstream` configures and checks it) would accept
  as the very same request: the same method, target, lower-cased header names and stripped
  values, in order, with the same body length; ``tests/property/adapters/test_http_head.py``
  holds it to that against h11 on generated and mutated heads;
- it accepts only what needs no judgement: ``HTTP/1.1``, an origin-form target, CRLF line ends,
  exactly one ``Host``, at most one ``Content-Length`` (digits only), no ``Transfer-Encoding``,
  ``Upgrade``, ``Expect`` or ``Connection`` header, no ``CONNECT``, no obsolete line folding,
  no underscore alias of a header the guard controls, at most :data:`MAX_HEADERS` lines and
  :data:`MAX_HEAD_BYTES` bytes; anything else returns ``None`` and goes to h11 unchanged, so the
  fast reader never answers a request differently from the full one, it only answers sooner;
- it never parses the body: it only checks that all of it has arrived, and says where it starts
  and how long it is.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import attrs

__all__ = (
    "MAX_HEADERS",
    "MAX_HEAD_BYTES",
    "MAX_REQUEST_HEADERS",
    "MAX_REQUEST_HEAD_BYTES",
    "SimpleRequest",
    "head_problem",
    "read_simple_request",
)

#: The fast reader's limits; a longer head goes to h11 (whose own limits are larger).
MAX_HEAD_BYTES = 8 * 1024
MAX_HEADERS = 64
#: The limits of any request head the guard reads (431 past them).
MAX_REQUEST_HEAD_BYTES = 16 * 1024
MAX_REQUEST_HEADERS = 100

_TOKEN = rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+"
#: What follows a header name as h11 reads it: colon, whitespace, the value, whitespace, CRLF.
_REST_OF_FIELD = rb":[ \t]*((?:[^\x00\s]+(?:[ \t]+[^\x00\s]+)*)?)[ \t]*\r\n"
#: The whole head: request line, header lines, blank line (CRLF only, no folding).
_HEAD = re.compile(
    rb"(" + _TOKEN + rb") (/[\x21-\x7e]*) HTTP/1\.1\r\n((?:" + _TOKEN + _REST_OF_FIELD + rb")*)\r\n"
)
#: Headers whose presence needs the full reader's judgement (framing, upgrades, continues).
_DEFERRED = frozenset({b"transfer-encoding", b"upgrade", b"expect", b"connection"})
#: Header names the guard controls: an underscore alias of one goes to the full reader (400).
_SENSITIVE = frozenset(
    {
        b"content-length",
        b"transfer-encoding",
        b"host",
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"upgrade",
        b"x-forwarded-for",
        b"x-user-tier",
    }
)


@attrs.frozen(slots=True)
class SimpleRequest:
    """One request head as h11 would give it."""

    method: bytes
    target: bytes
    #: (lower-cased name, value) in the order sent, as ``h11.Request.headers`` iterates.
    headers: tuple[tuple[bytes, bytes], ...]
    #: The declared body length (0 when no Content-Length was sent).
    body_length: int
    #: Where the body starts in the buffer read.
    head_end: int

    def values(self, name: bytes) -> list[bytes]:
        """Every value of header ``name`` (lower-case), in order."""
        return [value for key, value in self.headers if key == name]


def head_problem(
    method: bytes, target: bytes, http_version: bytes, headers: Sequence[tuple[bytes, bytes]]
) -> tuple[int, str] | None:
    """What is wrong with a request head h11 has read, for a proxy: (status, reason), or None.

    Refused, besides h11's own rules: more than :data:`MAX_REQUEST_HEADERS` lines or
    :data:`MAX_REQUEST_HEAD_BYTES` bytes (431); both Content-Length and Transfer-Encoding, an
    HTTP version other than 1.0 and 1.1, Transfer-Encoding on HTTP/1.0, ``CONNECT`` or a target
    that is not origin-form (the guard is no forward proxy: a target's own host never chooses
    where a request goes), an ``Upgrade``, and an underscore alias of a header the guard
    controls (``Content_Length``, ``X_PIG_Tier``), all 400."""
    if len(headers) > MAX_REQUEST_HEADERS:
        return 431, "too many header lines"
    # One pass over the headers, with no call per line: this runs on every request h11 reads.
    size = len(method) + len(target) + 12
    length = chunked = upgrade = alias = False
    for name, value in headers:
        size += len(name) + len(value) + 4
        if name == b"content-length":
            length = True
        elif name == b"transfer-encoding":
            chunked = True
        elif name == b"upgrade":
            upgrade = True
        elif b"_" in name and not alias:
            alias = _sensitive_alias(name)
    if size > MAX_REQUEST_HEAD_BYTES:
        return 431, "request head too large"
    if length and chunked:
        return 400, "both Content-Length and Transfer-Encoding"
    if http_version not in (b"1.0", b"1.1"):
        return 400, "unsupported HTTP version"
    if http_version == b"1.0" and chunked:
        return 400, "Transfer-Encoding on HTTP/1.0"
    if method == b"CONNECT" or not target.startswith(b"/"):
        return 400, "request target is not origin-form"
    if upgrade:
        return 400, "protocol upgrades are not proxied"
    if alias:
        return 400, "underscore alias of a header the guard controls"
    return None


def _sensitive_alias(name: bytes) -> bool:
    alias = name.replace(b"_", b"-")
    return alias in _SENSITIVE or alias.startswith(b"x-pig-")


def read_simple_request(data: bytes) -> SimpleRequest | None:
    """The request at the start of ``data`` when its head is simple and both head and body are
    whole in ``data``; else None."""
    end = data.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES)
    if end < 0:
        return None
    head = _HEAD.match(data, 0, end + 4)
    if head is None or head.end() != end + 4 or head[1] == b"CONNECT":
        return None  # a bad line, a bare CR or LF, obs-fold: the full reader decides
    # _HEAD matched every line as ``name: value`` (a token, a colon, the value between optional
    # blanks), so a line splits at its first colon and the value is what lies between the blanks.
    lines = head[3].split(b"\r\n")
    lines.pop()  # the empty piece after the last CRLF
    if len(lines) > MAX_HEADERS:
        return None
    headers: list[tuple[bytes, bytes]] = []
    hosts = 0
    length: bytes | None = None
    for line in lines:
        raw_name, _, value = line.partition(b":")
        value = value.strip(b" \t")
        name = raw_name.lower()
        if name in _DEFERRED or (b"_" in name and _sensitive_alias(name)):
            return None
        if name == b"host":
            hosts += 1
        elif name == b"content-length":
            if length is not None or not value.isdigit() or len(value) > 18:
                return None  # repeated, not a number, or absurd: the full reader says why
            length = value
        headers.append((name, value))
    if hosts != 1:
        return None
    body_length = int(length) if length is not None else 0
    head_end = end + 4
    if len(data) < head_end + body_length:
        return None  # the body is not all here yet
    return SimpleRequest(
        method=head[1],
        target=head[2],
        headers=tuple(headers),
        body_length=body_length,
        head_end=head_end,
    )
