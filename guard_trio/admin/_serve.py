"""The admin plane's listener: hypercorn's trio worker in the guard's own trio process.

Reads: the guard server (:class:`~guard_trio._server.GuardServer`: its settings, engine,
poller and metrics) and the address to bind.
Guarantees:
- :func:`serve_admin` binds its own socket (its send buffer held to :data:`SEND_BUFFER_BYTES`,
  so a viewer that stops reading holds little memory in the kernel either, and a connection
  whose peer takes none of the data waiting for it for ``stall_timeout_s`` is aborted by the
  kernel: hypercorn's writes cannot be cancelled, so this is what ends a write to a viewer
  that stopped reading, while running and at shutdown), hooks the hub onto
  the poller's rounds and the engine's request events, serves the app with
  ``hypercorn.trio.serve`` in the caller's nursery, and reports the running
  :class:`AdminPlane` (with the bound address) once it accepts connections;
- it serves until cancelled or until :meth:`AdminPlane.stop`: the viewers are told the plane
  is going away, hypercorn stops gracefully, the hooks are removed and the socket is closed,
  on every way out;
- the proxy never waits on it: the hooks only offer messages to bounded buffers.
"""

from __future__ import annotations

import logging
import socket
from typing import Final

import attrs
import trio
from hypercorn.config import Config, Sockets
from hypercorn.trio import serve as hypercorn_serve

from guard_trio._listeners import add_event_listener, remove_event_listener
from guard_trio._server import GuardServer
from guard_trio.admin._app import AdminApp
from guard_trio.admin._hub import DEFAULT_BUFFER, AdminHub

__all__ = ("SEND_BUFFER_BYTES", "STALL_TIMEOUT_S", "AdminPlane", "serve_admin")

log = logging.getLogger("inference_guard.admin")

#: The admin sockets' kernel send buffer (Linux doubles it for its own bookkeeping).
SEND_BUFFER_BYTES: Final = 64 * 1024
#: How long a connection may have data waiting that its peer takes none of (a zero window)
#: before the kernel aborts it (``TCP_USER_TIMEOUT``).
STALL_TIMEOUT_S: Final = 10.0
#: How long open connections get to finish when the plane stops.
_GRACE_S: Final = 1.0


@attrs.define(eq=False)
class AdminPlane:
    """A running admin plane: where it listens, its hub and its app."""

    host: str
    port: int
    hub: AdminHub
    app: AdminApp
    stopping: trio.Event = attrs.field(factory=trio.Event)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self) -> None:
        """Close every stream (1001) and stop serving."""
        self.hub.close()
        self.stopping.set()


class _BoundConfig(Config):
    """Hypercorn's settings, serving a socket bound beforehand instead of binding its own."""

    def __init__(self, listening: socket.socket) -> None:
        super().__init__()
        self._listening = listening

    def create_sockets(self) -> Sockets:
        return Sockets(secure_sockets=[], insecure_sockets=[self._listening], quic_sockets=[])


def _bind(host: str, port: int, stall_timeout_s: float) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    listening = socket.socket(family, kind, proto)
    try:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit it: a stalled viewer pins at most this much.
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux; inherited by accepted connections
            milliseconds = max(1, round(stall_timeout_s * 1000))
            listening.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, milliseconds)
        listening.bind(address)
        listening.setblocking(False)
    except OSError:
        listening.close()
        raise
    return listening


def _config(listening: socket.socket) -> Config:
    config = _BoundConfig(listening)
    config.errorlog = log
    config.accesslog = None
    config.graceful_timeout = _GRACE_S
    config.include_server_header = False
    config.websocket_ping_interval = (
        20.0  # keeps idle-killing middleboxes away; answered by wsproto
    )
    return config


async def serve_admin(
    server: GuardServer,
    host: str,
    port: int,
    *,
    buffer: int = DEFAULT_BUFFER,
    stall_timeout_s: float = STALL_TIMEOUT_S,
    task_status: trio.TaskStatus[AdminPlane] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the admin plane of ``server`` on ``host:port`` until cancelled or stopped."""
    settings = server.settings
    hub = AdminHub(server, buffer=buffer)
    app = AdminApp(
        hub,
        policy="predictive" if settings.predictive_enabled else "pig",
        backends=_backend_names(server),
    )
    listening = _bind(host, port, stall_timeout_s)
    bound = listening.getsockname()
    plane = AdminPlane(str(bound[0]), int(bound[1]), hub, app)
    server.poller.on_round.append(hub.on_round)
    add_event_listener(server.engine, hub.on_event)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: hypercorn_serve(
                    app,
                    _config(listening),
                    shutdown_trigger=plane.stopping.wait,
                    task_status=task_status,
                )
            )
            task_status.started(plane)
    finally:
        hub.close()
        remove_event_listener(server.engine, hub.on_event)
        if hub.on_round in server.poller.on_round:
            server.poller.on_round.remove(hub.on_round)
        listening.close()


def _backend_names(server: GuardServer) -> tuple[str, ...]:
    """The names the decisions list their backends under (the poller's sources)."""
    return tuple(source.name for source in server.poller.sources) or tuple(
        backend.name for backend in server.settings.backends
    )
