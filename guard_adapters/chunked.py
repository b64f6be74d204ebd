"""Chunked transfer coding (RFC 9112 section 7.1), read incrementally for a relay.

Reads: the raw bytes of one chunked message body, in whatever pieces the socket delivers them.
Guarantees:
- the payload comes out in order and whole, whatever the split of the input;
- the end of the body (the zero-size chunk and the trailer section) is found exactly; bytes that
  follow it are returned as ``leftover`` and never as payload; the trailer section is returned
  as it came, for h11 to validate;
- when a piece of input is a run of whole chunks whose size lines carry no extension, it is
  returned unchanged as ``passthrough``: it is already canonical chunked framing, so a relay
  can forward it without re-framing (the zero-size chunk is never part of it: the relay writes
  its own end of message);
- malformed framing raises :class:`ChunkedFramingError`, accepting what h11 accepts and no
  more (sizes of 1 to 20 hex digits, optional extensions and trailing blanks, every line ending
  in CRLF, chunk data followed by CRLF); size lines and trailer sections are bounded. The
  differential test against h11 is ``tests/property/adapters/test_chunked.py``.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from guard_adapters._errors import AdapterError

__all__ = ("ChunkedBodyReader", "ChunkedFramingError", "ChunkedRead", "frame")

_HEX_SIZE = re.compile(rb"[0-9A-Fa-f]{1,20}")
_MAX_SIZE_LINE = 4096
_MAX_TRAILER = 16 * 1024
_BLANK_LINE = re.compile(rb"\n\r?\n")

_SIZE, _DATA, _CRLF, _TRAILER, _DONE = range(5)


class ChunkedFramingError(AdapterError):
    """The chunked framing is malformed: the connection cannot be trusted any further."""


class ChunkedRead(NamedTuple):
    """What one :meth:`ChunkedBodyReader.feed` found."""

    #: The payload bytes of the piece (empty when it held none), in order.
    payload: bytes
    #: The piece itself when it is forwardable unchanged, else None.
    passthrough: bytes | None
    #: The body ended inside this piece.
    done: bool
    #: Bytes after the end of the body (only when ``done``).
    leftover: bytes
    #: The trailer section with its closing blank line (only when ``done``), for h11 to check.
    trailer: bytes


def frame(payload: bytes) -> bytes:
    """One chunk carrying ``payload`` (which must not be empty)."""
    return b"%x\r\n%b\r\n" % (len(payload), payload)


class ChunkedBodyReader:
    """Feed raw body bytes; get payload, forwardable framing and the end of the body."""

    __slots__ = ("_crlf_seen", "_in_chunk", "_pending", "_state")

    def __init__(self) -> None:
        self._state = _SIZE
        self._pending = b""
        self._in_chunk = 0
        self._crlf_seen = 0

    @property
    def done(self) -> bool:
        return self._state == _DONE

    def feed(  # noqa: PLR0915 - one frame for the hot loop: a call per chunk costs more
        self, data: bytes | bytearray, *, want_payload: bool = True
    ) -> ChunkedRead:
        """Consume ``data``. With ``want_payload=False`` the payload is only computed when the
        piece cannot be passed through as it is."""
        if self._state == _DONE:
            return ChunkedRead(b"", None, True, bytes(data), b"")
        aligned = self._state == _SIZE and not self._pending
        if aligned:
            # Fast path: the piece is exactly one whole canonical chunk (a backend writing one
            # chunk per event, read as it arrives): the common case on a streaming relay.
            end = data.find(b"\r\n")
            if 0 < end <= 20 and _HEX_SIZE.fullmatch(data, 0, end) is not None:
                chunk_size = int(data[:end], 16)
                if chunk_size and end + chunk_size + 4 == len(data) and data[-2:] == b"\r\n":
                    whole = bytes(data)
                    payload = whole[end + 2 : -2] if want_payload else b""
                    return ChunkedRead(payload, whole, False, b"", b"")
        buf = self._pending + data if self._pending else data
        self._pending = b""
        forwardable = aligned
        spans: list[tuple[int, int]] = []
        terminal_at = -1
        trailer = b""
        pos = 0
        size = len(buf)
        state = self._state
        while pos < size:
            if state == _DATA:
                take = min(self._in_chunk, size - pos)
                spans.append((pos, pos + take))
                pos += take
                self._in_chunk -= take
                if self._in_chunk == 0:
                    state = _CRLF
                    self._crlf_seen = 0
            elif state == _SIZE:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if size - pos > _MAX_SIZE_LINE:
                        raise ChunkedFramingError("chunk size line too long")
                    self._pending = bytes(buf[pos:])
                    forwardable = False
                    pos = size
                    break
                if end - pos > _MAX_SIZE_LINE:
                    raise ChunkedFramingError("chunk size line too long")
                line = buf[pos:end]
                digits, semicolon, extension = line.partition(b";")
                if semicolon:
                    forwardable = False
                    if b"\n" in extension:
                        raise ChunkedFramingError("bad chunk extension")
                elif digits[-1:] in (b" ", b"\t"):
                    forwardable = False
                    digits = digits.rstrip(b" \t")
                if _HEX_SIZE.fullmatch(digits) is None:
                    raise ChunkedFramingError("bad chunk size line")
                chunk_size = int(digits, 16)
                if chunk_size == 0:
                    terminal_at = pos
                    state = _TRAILER
                else:
                    self._in_chunk = chunk_size
                    state = _DATA
                pos = end + 2
            elif state == _CRLF:
                expected = b"\r\n"[self._crlf_seen :]
                got = buf[pos : pos + len(expected)]
                if not expected.startswith(got):
                    raise ChunkedFramingError("chunk data not followed by CRLF")
                pos += len(got)
                self._crlf_seen += len(got)
                if self._crlf_seen == 2:
                    state = _SIZE
            elif state == _TRAILER:
                # The end of the trailer section, found as h11 finds it; h11 itself validates
                # the section when the relay hands it over (ChunkedRead.trailer).
                section = buf[pos:]
                if section[:1] == b"\n":
                    end = 1
                elif section[:2] == b"\r\n":
                    end = 2
                else:
                    match = _BLANK_LINE.search(section)
                    if match is None:
                        if len(section) > _MAX_TRAILER:
                            raise ChunkedFramingError("trailer section too large")
                        self._pending = bytes(section)
                        pos = size
                        break
                    end = match.end()
                if end > _MAX_TRAILER:
                    raise ChunkedFramingError("trailer section too large")
                trailer = bytes(section[:end])
                pos += end
                state = _DONE
                break
            else:  # pragma: no cover - _DONE breaks out above
                break
        self._state = state
        done = state == _DONE
        passthrough: bytes | None = None
        if forwardable:
            if done:
                if terminal_at >= 0:
                    passthrough = bytes(buf[:terminal_at])
            elif state == _SIZE and not self._pending:
                passthrough = bytes(buf)
        if passthrough is not None and not want_payload:
            payload = b""
        elif len(spans) == 1:
            start, stop = spans[0]
            payload = bytes(buf[start:stop])
        else:
            payload = b"".join(buf[start:stop] for start, stop in spans)
        leftover = bytes(buf[pos:]) if done else b""
        return ChunkedRead(payload, passthrough, done, leftover, trailer)
