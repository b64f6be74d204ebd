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

import attrs
import h11
import trio

from guard_adapters.chunked import ChunkedBodyReader, ChunkedFramingError, frame
from guard_adapters.sse import FirstUsefulEventScanner
from guard_trio._downstream import Downstream
from guard_trio._engine import Slot
from guard_trio._metrics_instruments import EventCounter
from guard_trio._upstream import IdleGuard, UpstreamConnection, UpstreamError

__all__ = (
    "KEEPALIVE_AFTER_S",
    "KEEPALIVE_COMMENT",
    "Watch",
    "copy_body",
    "copy_chunked",
    "send_head",
)

#: ``SSE_KEEPALIVE_ENABLED``: the comment sent after this long without upstream data.
KEEPALIVE_AFTER_S = 2.0
KEEPALIVE_COMMENT = b": keep-alive\n\n"


@attrs.define
class Watch:
    """What a pump watches as it copies one body: the idle guard it moves, the first-useful-event
    scanner while it still looks (and the slot it tells), and SSE keep-alive comments (counted
    in ``comments`` as they go out)."""

    guard: IdleGuard
    comments: EventCounter
    scanner: FirstUsefulEventScanner | None = None
    slot: Slot | None = None
    keepalive: bool = False

    def saw(self, payload: bytes) -> None:
        """Payload bytes went by: the scanner reads them, the slot hears of the first useful
        event once, and the scanner stops looking once it is done."""
        scanner = self.scanner
        if scanner is None:
            return
        if scanner.feed(payload) and self.slot is not None:
            self.slot.first_token()
        if scanner.done or scanner.limit_reached:
            self.scanner = None


async def send_head(
    down: Downstream, up: UpstreamConnection, head: h11.Response, watch: Watch
) -> bool:
    """Send the head together with any body bytes already read; False if the body ended."""
    first = up.buffered_event()
    if isinstance(first, h11.Data):
        # A sized body read whole with its head: its end goes out in the same write.
        data = bytes(first.data)
        data, ended = up.drain_buffered(data) if up.sized else (data, False)
        await down.send(head, h11.Data(data=data), *((h11.EndOfMessage(),) if ended else ()))
        watch.saw(data)
        return not ended
    if isinstance(first, h11.EndOfMessage):
        await down.send(head, h11.EndOfMessage())
        return False
    await down.send(head)
    return True


async def copy_chunked(
    down: Downstream, up: UpstreamConnection, head: h11.Response | None, watch: Watch
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
                piece = reader.feed(data, want_payload=watch.scanner is not None)
            except ChunkedFramingError as exc:
                raise UpstreamError(f"{up.target.name}: {exc}") from None
            if piece.passthrough is not None:
                out = out + piece.passthrough if out else piece.passthrough
            elif piece.payload:
                out += frame(piece.payload)
            if watch.scanner is not None and piece.payload:
                watch.saw(piece.payload)
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
        if watch.keepalive:
            received: bytes | bytearray | None = None
            with trio.move_on_after(KEEPALIVE_AFTER_S):
                received = await up.receive_raw()
            if received is None:
                out = frame(KEEPALIVE_COMMENT)
                watch.comments.inc()
                data = b""
                continue
            data = received
        else:
            data = await up.receive_raw()
        if not data:
            raise UpstreamError(f"{up.target.name}: connection closed mid-response")
        watch.guard.progress()


async def copy_body(down: Downstream, up: UpstreamConnection, watch: Watch) -> None:
    """Pass body chunks through as h11 reads them (Content-Length and close-delimited
    bodies, HTTP/1.0 clients); scan only until the first useful SSE event.

    With ``keepalive``, an SSE comment goes out whenever the backend stays silent for
    :data:`KEEPALIVE_AFTER_S` (a cancelled receive loses no bytes).
    """
    guard = watch.guard
    while True:
        if watch.keepalive:
            event = None
            with trio.move_on_after(KEEPALIVE_AFTER_S):
                event = await up.next_event()
            if event is None:
                await down.send(h11.Data(data=KEEPALIVE_COMMENT))
                watch.comments.inc()
                continue
        else:
            event = await up.next_event()
        guard.progress()
        if isinstance(event, h11.Data):
            data, ended = up.drain_buffered(bytes(event.data))
            # One downstream write for everything this upstream read brought.
            await down.send(h11.Data(data=data), *((h11.EndOfMessage(),) if ended else ()))
            if watch.scanner is not None:
                watch.saw(data)
            if ended:
                return
            guard.progress()
        elif isinstance(event, h11.EndOfMessage):
            await down.send(h11.EndOfMessage())
            return
