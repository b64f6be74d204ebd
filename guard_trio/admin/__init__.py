"""The admin plane (``PIG_ADMIN_LISTEN``): the guard's live state for operators, read-only.

Reads: the running guard (:class:`~guard_trio._server.GuardServer`) at the moment each request,
poll round or request event happens; never a copy of its state.
Guarantees: ``GET /admin/state`` (the published state as JSON), ``GET /admin/events`` (a
WebSocket of the stream schema, version 1) and ``GET /admin/`` (a self-contained dashboard),
all behind the guard's token, served by hypercorn's trio worker in the guard's own process and
nursery (:func:`serve_admin`); the proxy's hot path never waits on a viewer. The modules:
``_hub`` (messages and the viewers' bounded buffers), ``_app`` (the ASGI routes, auth and the
stream), ``_serve`` (the listener and its lifecycle), ``dashboard.html`` (the page).
The routes and the schema are described in docs/admin.md.
"""

from guard_trio.admin._hub import DROPPED_CODE, GOING_AWAY_CODE, AdminHub, decision_now
from guard_trio.admin._serve import AdminPlane, serve_admin

__all__ = (
    "DROPPED_CODE",
    "GOING_AWAY_CODE",
    "AdminHub",
    "AdminPlane",
    "decision_now",
    "serve_admin",
)
