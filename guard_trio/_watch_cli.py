"""``inference-guard watch URL``: a live view of a guard's admin plane, in the terminal.

Reads: the command line, the token (``--token-file``, else the ``TOKEN`` environment variable,
sent as ``Authorization: Bearer`` in the WebSocket handshake), the admin plane's event stream
(``/admin/events`` under URL, :mod:`guard_adapters.live_view_messages`) and the terminal's size.

Guarantees:

- on a terminal, once connected: the full screen of :func:`guard_adapters.live_view.screen`,
  redrawn in place (cursor home, each line erased to its end, the rest of the screen erased)
  at most four times a second and only when something changed or the terminal was resized, on
  the alternate screen with the cursor hidden; both are restored on every way out (the end of
  the stream, Ctrl-C, SIGTERM, a fault), and the last compact line is then printed on the
  normal screen;
- not on a terminal: one :func:`guard_adapters.live_view.compact_line` a second, and one more
  at the end; with ``--json``: each message that is JSON as one line as it comes, flushed (its
  text as received, re-encoded compactly only when it spanned lines);
- ``--count N`` stops after N messages, ``--duration S`` S seconds after connecting; both
  exit 0;
- every fault is one line on stderr, never a traceback: 2 for what the command line must fix
  (a bad URL, an unreadable or empty token file, a token missing or refused: 401 or 403), 1 for
  a guard that cannot be reached, answers without an event stream or closes the stream;
  Ctrl-C and SIGTERM stop the view and exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import IO, Final

import attrs
import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    ConnectionTimeout,
    DisconnectionTimeout,
    HandshakeError,
    WebSocketConnection,
    open_websocket_url,
)

from guard_adapters.live_view import LiveView, compact_line, fold, screen
from guard_adapters.live_view_messages import KINDS, events_url, parse_message
from guard_trio._cli_support import number

_COMMAND: Final = "watch"
#: How long the WebSocket handshake may take, and the closing one.
_CONNECT_TIMEOUT_S: Final = 10.0
_CLOSE_TIMEOUT_S: Final = 2.0
#: The shortest time between two frames on a terminal (at most four a second).
_FRAME_S: Final = 0.25
#: The time between two lines when not on a terminal.
_LINE_S: Final = 1.0
#: Exit statuses: what the command line must fix, and what went wrong on the way.
_USAGE: Final = 2
_FAILED: Final = 1

_ENTER: Final = "\x1b[?1049h\x1b[?25l\x1b[H\x1b[2J"
_LEAVE: Final = "\x1b[?25h\x1b[?1049l"


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = sorted(set(kinds) - set(KINDS))
    if not kinds or unknown:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(KINDS)}, got {text!r}"
        )
    return kinds


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``watch``."""
    parser.add_argument(
        "url", help="the admin plane, e.g. http://127.0.0.1:9000 (PIG_ADMIN_LISTEN) or ws://..."
    )
    parser.add_argument(
        "--json", action="store_true", help="print each message as one JSON line (for jq)"
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        metavar="PATH",
        help="read the guard's TOKEN from this file (default: the TOKEN environment variable)",
    )
    parser.add_argument(
        "--kinds",
        type=_kinds,
        default=(),
        metavar="LIST",
        help="the messages to ask for: decision, admission or both, comma-separated"
        " (default: both)",
    )
    parser.add_argument(
        "--sample",
        type=number(lambda x: 0 < x <= 1, "in (0, 1]"),
        metavar="SHARE",
        help="ask for about this share of the admission messages, e.g. 0.1",
    )
    parser.add_argument(
        "--count", type=_count, metavar="N", help="stop after N messages (the hello included)"
    )
    parser.add_argument(
        "--duration",
        type=number(lambda x: x > 0, "above 0"),
        metavar="S",
        help="stop S seconds after connecting",
    )


@attrs.define
class _Shown:
    """The view as folded so far, and whether it changed since it was last drawn."""

    view: LiveView = attrs.field(factory=LiveView)
    changed: bool = True


class _Fault(Exception):
    """A fault to report in one line, with the exit status it gives."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _token(args: argparse.Namespace, environ: Mapping[str, str]) -> str:
    path: Path | None = args.token_file
    if path is None:
        return environ.get("TOKEN", "")
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
        raise _Fault(f"cannot read the token file {path}: {reason or error}", _USAGE) from None
    if not token:
        raise _Fault(f"the token file {path} is empty", _USAGE)
    return token


def _headers(token: str) -> list[tuple[bytes, bytes]]:
    if not token:
        return []
    if not token.isascii() or not token.isprintable():
        raise _Fault("the token has characters an HTTP header cannot carry", _USAGE)
    return [(b"authorization", b"Bearer " + token.encode("ascii"))]


# -- drawing -----------------------------------------------------------------------------------


def _frame(view: LiveView, size: os.terminal_size) -> str:
    lines = screen(view, size.columns, size.lines)
    return "\x1b[H" + "\x1b[K\n".join(lines) + "\x1b[K\x1b[J"


async def _draw_screens(shown: _Shown, out: IO[str]) -> None:
    drawn_size = None
    while True:
        size = shutil.get_terminal_size()
        if shown.changed or size != drawn_size:
            shown.changed, drawn_size = False, size
            out.write(_frame(shown.view, size))
            out.flush()
        await trio.sleep(_FRAME_S)


async def _draw_lines(shown: _Shown, out: IO[str]) -> None:
    while True:
        await trio.sleep(_LINE_S)
        out.write(compact_line(shown.view) + "\n")
        out.flush()


@contextmanager
def _alternate_screen(out: IO[str]) -> Iterator[None]:
    out.write(_ENTER)
    out.flush()
    try:
        yield
    finally:
        out.write(_LEAVE)
        out.flush()


def _json_line(message: str | bytes) -> str | None:
    text = message.decode("utf-8", "replace") if isinstance(message, bytes) else message
    decoded = parse_message(text)
    if decoded is None:
        return None
    if "\n" in text or "\r" in text:
        return json.dumps(decoded, separators=(",", ":"), ensure_ascii=False)
    return text


# -- the stream --------------------------------------------------------------------------------


def _closed(error: ConnectionClosed) -> _Fault:
    reason = error.reason
    if reason is None:
        return _Fault("the guard closed the stream", _FAILED)
    why = f": {reason.reason}" if reason.reason else ""
    return _Fault(f"the guard closed the stream (code {reason.code} {reason.name}{why})", _FAILED)


async def _read(
    socket: WebSocketConnection, shown: _Shown, out: IO[str], *, raw: bool, count: int | None
) -> None:
    received = 0
    while count is None or received < count:
        try:
            message = await socket.get_message()
        except ConnectionClosed as closed:
            raise _closed(closed) from None
        received += 1
        if raw:
            line = _json_line(message)
            if line is not None:
                out.write(line + "\n")
                out.flush()
        else:
            shown.view = fold(shown.view, parse_message(message))
            shown.changed = True


async def _stop_on_signal(cancel_scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            cancel_scope.cancel()
            return


async def _watch(
    url: str,
    headers: list[tuple[bytes, bytes]],
    args: argparse.Namespace,
    shown: _Shown,
    out: IO[str],
    *,
    terminal: bool,
) -> None:
    """Connect, then read and draw until the stream ends, a bound is reached or a signal."""
    with trio.CancelScope() as stopped:
        async with trio.open_nursery() as signals:
            signals.start_soon(_stop_on_signal, stopped)
            async with open_websocket_url(
                url,
                extra_headers=headers,
                connect_timeout=_CONNECT_TIMEOUT_S,
                disconnect_timeout=_CLOSE_TIMEOUT_S,
            ) as socket:
                # The alternate screen only once connected: a fault is then a plain line.
                with (
                    _alternate_screen(out) if terminal else nullcontext(),
                    trio.move_on_after(args.duration if args.duration else float("inf")),
                ):
                    async with trio.open_nursery() as drawing:
                        if not args.json:
                            draw = _draw_screens if terminal else _draw_lines
                            drawing.start_soon(draw, shown, out)
                        await _read(socket, shown, out, raw=args.json, count=args.count)
                        drawing.cancel_scope.cancel()
            signals.cancel_scope.cancel()


def _rejected(url: str, error: ConnectionRejected, *, with_token: bool) -> _Fault:
    status = error.status_code
    if status in (401, 403) and not with_token:
        return _Fault(
            f"{url} needs the guard's TOKEN (HTTP {status}): set TOKEN or --token-file", _USAGE
        )
    if status in (401, 403):
        return _Fault(
            f"{url} refused the token (HTTP {status}): set TOKEN or --token-file to the"
            " guard's TOKEN",
            _USAGE,
        )
    if status == 404:
        return _Fault(
            f"no event stream at {url} (HTTP 404): is this the admin plane (PIG_ADMIN_LISTEN)?",
            _FAILED,
        )
    return _Fault(f"{url} refused the WebSocket handshake (HTTP {status})", _FAILED)


def _causes(error: BaseException) -> list[OSError]:
    """The operating system's errors behind ``error``: its causes, inside groups too."""
    found: list[OSError] = []
    seen: set[int] = set()
    pending: list[BaseException] = [error]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        elif isinstance(current, OSError):
            found.append(current)
        if current.__cause__ is not None:
            pending.append(current.__cause__)
    return found


def _unreachable(url: str, error: HandshakeError) -> _Fault:
    causes = _causes(error)
    refused = [c for c in causes if isinstance(c, ConnectionRefusedError)]
    reasons = [c.strerror for c in causes if c.strerror and c not in refused]
    if refused and not reasons:
        return _Fault(f"cannot connect to {url}: nothing is listening there", _FAILED)
    reason = reasons[0] if reasons else (str(causes[0]) if causes else repr(error))
    return _Fault(f"cannot connect to {url}: {reason}", _FAILED)


def _fault_of(url: str, error: BaseException, *, with_token: bool) -> _Fault | None:
    """The one-line fault ``error`` is, or ``None`` when it is none of the expected ones."""
    if isinstance(error, _Fault):
        return error
    if isinstance(error, ConnectionRejected):
        return _rejected(url, error, with_token=with_token)
    if isinstance(error, ConnectionTimeout):
        return _Fault(f"no answer from {url} within {_CONNECT_TIMEOUT_S:g} s", _FAILED)
    if isinstance(error, HandshakeError):
        return _unreachable(url, error)
    if isinstance(error, OSError) and not isinstance(error, BrokenPipeError):
        return _Fault(f"lost the connection to {url}: {error.strerror or error}", _FAILED)
    return None


async def _main(
    url: str, headers: list[tuple[bytes, bytes]], args: argparse.Namespace, out: IO[str]
) -> None:
    shown, terminal = _Shown(), not args.json and out.isatty()
    try:
        await _watch(url, headers, args, shown, out, terminal=terminal)
    except BaseException as raised:
        error = _single(raised) if isinstance(raised, BaseExceptionGroup) else raised
        if isinstance(error, DisconnectionTimeout):
            return  # the view ended; the guard was only slow to acknowledge the close
        fault = _fault_of(url, error, with_token=bool(headers))
        if fault is None:
            raise
        raise fault from None
    finally:
        if not args.json and shown.view.messages:
            out.write(compact_line(shown.view) + "\n")
            out.flush()


def _single(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one exception a group of nested groups holds, or the group when it holds more."""
    leaves = []

    def walk(error: BaseException) -> None:
        if isinstance(error, BaseExceptionGroup):
            for inner in error.exceptions:
                walk(inner)
        else:
            leaves.append(error)

    walk(group)
    return leaves[0] if len(leaves) == 1 else group


def run(args: argparse.Namespace, out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """Run ``watch``; the exit status."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    try:
        url = events_url(args.url, kinds=args.kinds, sample=args.sample)
    except ValueError as error:
        err.write(f"inference-guard {_COMMAND}: {error}\n")
        return _USAGE
    try:
        headers = _headers(_token(args, os.environ))
        try:
            trio.run(_main, url, headers, args, out)
        except BaseExceptionGroup as group:
            single = _single(group)
            if single is group:
                raise
            raise single from None
    except _Fault as fault:
        err.write(f"inference-guard {_COMMAND}: {fault}\n")
        return fault.status
    except KeyboardInterrupt:
        return 0
    return 0
