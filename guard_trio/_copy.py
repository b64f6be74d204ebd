"""The response body's pumps: from a backend's connection to the client's, as fast as each framing
allows.

Reads: the backend connection (:class:`~guard_trio._upstream.UpstreamConnection`) after its
response head, the client connection, and the first-useful-event scanner while it still looks.
Guarantees:
- a chunked body to an HTTP/1.1 client is copied without h11 parsing either side
  (:class:`~guard_adapters.chunked.ChunkedBodyReader` checks the framing and the copy is
  unchanged when it is whole chunks); every other body goes through h11, one downstream write
  per upstream read;
- the scanner sees the payload only until the first useful SSE event (then the slot hears of the
  first token once); with ``keepalive`` an SSE comment goes out whenever the backend stays
  silent for :data:`KEEPALIVE_AFTER_S`, counted in ``comments`` as it goes out, and a cancelled
  receive loses no bytes;
- every byte of progress moves the idle guard; a body cut short raises
  :class:`~guard_trio._upstream.UpstreamError`.
"""

from __future__ import annotations

import h11
import trio

from guard_adapters.chunked import ChunkedBodyReader, ChunkedFramingError, frame
from guard_adapters.sse import FirstUsefulEventScanner
from guard_trio._downstream import Downstream
from guard_trio._engine import Slot
from guard_trio._metrics_instruments import EventCounter
from guard_trio._upstream import IdleGuard, UpstreamConnection, UpstreamError

__all__ = ("KEEPALIVE_AFTER_S", "KEEPALIVE_COMMENT", "copy_body", "copy_chunked", "send_head")

#: ``SSE_KEEPALIVE_ENABLED``: the comment sent after this long without upstream data.
KEEPALIVE_AFTER_S = 2.0
KEEPALIVE_COMMENT = b": keep-alive\n\n"


async def send_head(
    down: Downstream,
    up: UpstreamConnection,
    head: h11.Response,
    *,
    scanner: FirstUsefulEventScanner | None,
    slot: Slot | None,
) -> bool:
    """Send the head together with any body bytes already read; False if the body ended."""
    first = up.buffered_event()
    if isinstance(first, h11.Data):
        await down.send(head, h11.Data(data=first.data))
        if scanner is not None and scanner.feed(bytes(first.data)) and slot is not None:
            slot.first_token()
        return True
    if isinstance(first, h11.EndOfMessage):
        await down.send(head, h11.EndOfMessage())
        return False
    await down.send(head)
    return True


async def copy_chunked(
    down: Downstream,
    up: UpstreamConnection,
    head: h11.Response | None,
    *,
    scanner: FirstUsefulEventScanner | None,
    slot: Slot | None,
    guard: IdleGuard,
    keepalive: bool = False,
    comments: EventCounter,
) -> None:
    """The fast path for a chunked upstream body to an HTTP/1.1 client (whose response h11
    frames as chunked too): h11 parses neither side's body. Each upstream read is checked
    by :class:`ChunkedBodyReader` and forwarded in one write, unchanged when it is whole
    chunks (re-framed as one chunk otherwise); the SSE scanner sees the payload only until
    the first useful event. ``head`` (None when already sent) goes out with the first bytes.
    """
    reader = ChunkedBodyReader()
    pending_head = head
    out = b""
    data = await up.receive_raw() if up.unparsed else b""
    while True:
        if data:
            try:
                piece = reader.feed(data, want_payload=scanner is not None)
            except ChunkedFramingError as exc:
                raise UpstreamError(f"{up.target.name}: {exc}") from None
            if piece.passthrough is not None:
                out = out + piece.passthrough if out else piece.passthrough
            elif piece.payload:
                out += frame(piece.payload)
            if scanner is not None and piece.payload:
                if scanner.feed(piece.payload) and slot is not None:
                    slot.first_token()
                if scanner.done or scanner.limit_reached:
                    scanner = None
            if piece.done:
                up.finish_raw_body(piece.trailer, clean=not piece.leftover)
                prefix = down.frame(pending_head) if pending_head is not None else b""
                await down.send_raw(prefix + out + down.frame(h11.EndOfMessage()))
                return
        if pending_head is not None:
            out = down.frame(pending_head) + out
            pending_head = None
        if out:
            await down.send_raw(out)
            out = b""
        if keepalive:
            received: bytes | bytearray | None = None
            with trio.move_on_after(KEEPALIVE_AFTER_S):
                received = await up.receive_raw()
            if received is None:
                out = frame(KEEPALIVE_COMMENT)
                comments.inc()
                data = b""
                continue
            data = received
        else:
            data = await up.receive_raw()
        if not data:
            raise UpstreamError(f"{up.target.name}: connection closed mid-response")
        guard.progress()


async def copy_body(
    down: Downstream,
    up: UpstreamConnection,
    *,
    scanner: FirstUsefulEventScanner | None,
    slot: Slot | None,
    guard: IdleGuard,
    keepalive: bool = False,
    comments: EventCounter,
) -> None:
    """Pass body chunks through as h11 reads them (Content-Length and close-delimited
    bodies, HTTP/1.0 clients); scan only until the first useful SSE event.

    With ``keepalive``, an SSE comment goes out whenever the backend stays silent for
    :data:`KEEPALIVE_AFTER_S` (a cancelled receive loses no bytes).
    """
    while True:
        if keepalive:
            event = None
            with trio.move_on_after(KEEPALIVE_AFTER_S):
                event = await up.next_event()
            if event is None:
                await down.send(h11.Data(data=KEEPALIVE_COMMENT))
                comments.inc()
                continue
        else:
            event = await up.next_event()
        guard.progress()
        if isinstance(event, h11.Data):
            data, ended = up.drain_buffered(bytes(event.data))
            if ended:
                await down.send(h11.Data(data=data), h11.EndOfMessage())
                if scanner is not None and scanner.feed(data) and slot is not None:
                    slot.first_token()
                return
            # One downstream write for everything this upstream read brought.
            await down.send(h11.Data(data=data))
            guard.progress()
            if scanner is not None:
                if scanner.feed(data) and slot is not None:
                    slot.first_token()
                if scanner.done or scanner.limit_reached:
                    scanner = None
        elif isinstance(event, h11.EndOfMessage):
            await down.send(h11.EndOfMessage())
            return
