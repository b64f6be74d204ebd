"""The admin plane's ASGI application: the state document, the event stream and the page.

Reads: each request's path, method, headers and query string; the guard's state through the
hub (:class:`~guard_trio.admin._hub.AdminHub`) at the moment a request is answered.
Guarantees:
- read-only: only ``GET`` (and ``HEAD``) is answered; every other method gets 405 with
  ``Allow``; a path other than ``/admin``, ``/admin/``, ``/admin/state`` and ``/admin/events``
  gets 404; paths are compared as sent (no decoding);
- every route needs the guard's token (:func:`~guard_adapters.admin_auth.admin_credentials_match`:
  ``Authorization: Bearer <TOKEN>`` or HTTP Basic with the token as password); a request
  without it gets 401 with a Basic challenge, so that a browser asks once and then sends it
  on the page's fetches and its WebSocket handshake;
- a WebSocket handshake that carries an ``Origin`` must come from the admin plane's own
  origin (403 otherwise): another site open in the operator's browser cannot read the stream
  with the credentials the browser remembers; a bad ``kinds`` or ``sample`` gets 400;
- a stream sends ``hello`` first, then the messages the hub buffers for it in order; it ends
  with close code 1013 when the hub dropped it for falling behind and 1001 when the plane
  shuts down; what the viewer sends is read and ignored;
- responses are never cached (``Cache-Control: no-store``) and the page may not be framed.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Iterable
from typing import Final
from urllib.parse import urlsplit

import trio
from hypercorn.typing import (
    ASGIReceiveCallable,
    ASGISendCallable,
    HTTPScope,
    LifespanScope,
    Scope,
    WebsocketScope,
)

from guard_adapters.admin_auth import CHALLENGE, admin_credentials_match
from guard_adapters.admin_stream import (
    SubscriptionError,
    encode,
    hello_message,
    parse_subscription,
    state_document,
)
from guard_adapters.exchange import first_header, token_digest
from guard_trio import __version__
from guard_trio.admin._hub import DROPPED_CODE, GOING_AWAY_CODE, AdminHub, Viewer

__all__ = ("AdminApp",)

Header = tuple[bytes, bytes]

_PAGE_PATH: Final = b"/admin/"
_STATE_PATH: Final = b"/admin/state"
_EVENTS_PATH: Final = b"/admin/events"
_BARE_PATH: Final = b"/admin"
_ROUTES: Final = frozenset({_PAGE_PATH, _STATE_PATH, _EVENTS_PATH, _BARE_PATH})
_READ_METHODS: Final = frozenset({"GET", "HEAD"})

_COMMON: Final[tuple[Header, ...]] = (
    (b"cache-control", b"no-store"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
)
#: The page's own script and style only, talking to its own origin; no frame may hold it.
_PAGE_POLICY: Final = (
    b"default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    b"connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'"
)


def _page() -> bytes:
    return importlib.resources.files(__package__).joinpath("dashboard.html").read_bytes()


def _same_origin(origin: bytes, host: bytes | None) -> bool:
    """Whether a handshake's ``Origin`` names the host it was sent to (scheme http or https)."""
    if host is None:
        return False
    try:
        parts = urlsplit(origin.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return False
    return (
        parts.scheme in ("http", "https")
        and parts.netloc.lower() == host.decode("ascii", "replace").lower()
    )


class AdminApp:
    """The ASGI callable hypercorn serves; one per admin plane."""

    def __init__(self, hub: AdminHub, *, policy: str, backends: Iterable[str]) -> None:
        self.hub = hub
        self.policy = policy
        self.backends = tuple(backends)
        self.expected = token_digest(hub.server.settings.env.token)
        self.page = _page()

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] == "http":
            await self._http(scope, send)
        elif scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
        else:
            await _lifespan(scope, receive, send)

    def _authorised(self, scope: HTTPScope | WebsocketScope) -> bool:
        return admin_credentials_match(list(scope["headers"]), self.expected)

    # -- plain HTTP -----------------------------------------------------------------------------

    async def _http(self, scope: HTTPScope, send: ASGISendCallable) -> None:
        path = scope["raw_path"] or scope["path"].encode()
        if path not in _ROUTES:
            await _respond(send, 404, b"not found\n")
        elif scope["method"] not in _READ_METHODS:
            await _respond(send, 405, b"method not allowed\n", ((b"allow", b"GET, HEAD"),))
        elif not self._authorised(scope):
            await _respond(send, 401, b"unauthorized\n", ((b"www-authenticate", CHALLENGE),))
        elif path == _BARE_PATH:
            await _respond(send, 308, b"", ((b"location", _PAGE_PATH),))
        elif path == _EVENTS_PATH:
            upgrade = ((b"upgrade", b"websocket"), (b"connection", b"upgrade"))
            await _respond(send, 426, b"this route is a WebSocket\n", upgrade)
        elif path == _STATE_PATH:
            await _respond(send, 200, self.state_json(), ((b"content-type", b"application/json"),))
        else:
            headers: tuple[Header, ...] = (
                (b"content-type", b"text/html; charset=utf-8"),
                (b"content-security-policy", _PAGE_POLICY),
                (b"x-frame-options", b"DENY"),
            )
            await _respond(send, 200, self.page, headers)

    def state_json(self) -> bytes:
        """``GET /admin/state``: the state read now."""
        hub = self.hub
        admitted, refused = hub.counts()
        document = state_document(
            hub.state(),
            at=hub.server.engine.seconds_since_start(),
            version=__version__,
            policy=self.policy,
            admitted=admitted,
            refused=refused,
            viewers=len(hub.viewers),
        )
        return encode(document).encode() + b"\n"

    # -- the event stream -----------------------------------------------------------------------

    async def _websocket(
        self, scope: WebsocketScope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        connect = await receive()
        if connect["type"] != "websocket.connect":
            return
        headers = list(scope["headers"])
        origin = first_header(headers, b"origin")
        path = scope["raw_path"] or scope["path"].encode()
        if path != _EVENTS_PATH:
            await _deny(scope, send, 404, b"not found\n")
            return
        if origin is not None and not _same_origin(origin, first_header(headers, b"host")):
            await _deny(scope, send, 403, b"cross-origin WebSocket refused\n")
            return
        if not self._authorised(scope):
            await _deny(scope, send, 401, b"unauthorized\n", ((b"www-authenticate", CHALLENGE),))
            return
        try:
            subscription = parse_subscription(scope["query_string"].decode("latin-1"))
        except SubscriptionError as error:
            await _deny(scope, send, 400, f"{error}\n".encode())
            return
        await send({"type": "websocket.accept", "subprotocol": None, "headers": []})
        viewer = self.hub.subscribe(subscription)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_until_disconnect, receive, nursery.cancel_scope)
                hello = hello_message(
                    version=__version__,
                    policy=self.policy,
                    backends=self.backends,
                    kinds=subscription.kinds,
                )
                await _send_text(send, encode(hello))
                await self._relay(viewer, send)
                nursery.cancel_scope.cancel()
        finally:
            self.hub.unsubscribe(viewer)

    async def _relay(self, viewer: Viewer, send: ASGISendCallable) -> None:
        """The viewer's buffered messages in order, until the hub drops it or shuts down."""
        async for text in viewer.receive:
            if viewer.dropped:
                break  # what is still buffered is not worth sending to a viewer that fell behind
            await _send_text(send, text)
        code, reason = (
            (DROPPED_CODE, "viewer too slow") if viewer.dropped else (GOING_AWAY_CODE, "shutdown")
        )
        await send({"type": "websocket.close", "code": code, "reason": reason})


async def _until_disconnect(receive: ASGIReceiveCallable, scope: trio.CancelScope) -> None:
    """Read (and ignore) what the viewer sends; cancel the stream when it goes away."""
    while True:
        message = await receive()
        if message["type"] == "websocket.disconnect":
            scope.cancel()
            return


async def _send_text(send: ASGISendCallable, text: str) -> None:
    await send({"type": "websocket.send", "text": text, "bytes": None})


async def _respond(
    send: ASGISendCallable, status: int, body: bytes, headers: Iterable[Header] = ()
) -> None:
    all_headers = [
        *_COMMON,
        *headers,
        (b"content-length", str(len(body)).encode()),
    ]
    if not any(name == b"content-type" for name, _ in all_headers):
        all_headers.append((b"content-type", b"text/plain; charset=utf-8"))
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _deny(
    scope: WebsocketScope,
    send: ASGISendCallable,
    status: int,
    body: bytes,
    headers: Iterable[Header] = (),
) -> None:
    """Refuse a WebSocket handshake with an HTTP answer (the ASGI denial extension), or with a
    bare close (which the server turns into a 403) where the server lacks it."""
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 1008, "reason": None})
        return
    all_headers = [
        *_COMMON,
        *headers,
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "websocket.http.response.start", "status": status, "headers": all_headers})
    await send({"type": "websocket.http.response.body", "body": body, "more_body": False})


async def _lifespan(
    scope: LifespanScope, receive: ASGIReceiveCallable, send: ASGISendCallable
) -> None:
    """Nothing to set up or tear down: acknowledge both."""
    del scope
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
