"""The routes the guard answers itself: health, its own refusals of a route, attestation,
the upstream status and the metrics pages.

Reads: the route :class:`guard_adapters.exchange.Routes` chose, the request and its headers,
and the proxy's settings, engine state and metrics page.
Guarantees: one whole response per request; the token check is the proxy's constant-time one
and comes before anything a route would read or say (attestation checks it before the
method); a target no route may serve gets 404 before any check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import h11

from guard_adapters.exchange import NOT_FOUND, UNAUTHORIZED_JSON, Route
from guard_adapters.model_pools import models_document
from guard_core import upstream_status_digit
from guard_trio._downstream import Downstream
from guard_trio._observability import backend_pages

if TYPE_CHECKING:
    from guard_trio._proxy import ProxyApp

__all__ = ("answer_own",)

_JSON = (b"content-type", b"application/json")
_TEXT = (b"content-type", b"text/plain; charset=utf-8")


async def answer_own(
    app: ProxyApp,
    down: Downstream,
    route: Route,
    request: h11.Request,
    headers: list[tuple[bytes, bytes]],
) -> None:
    """The routes the guard answers itself, and the early refusals of :class:`Routes`."""
    if route is Route.HEALTH:
        await down.respond(200, [_TEXT], b"ok\n")
    elif route is Route.UNAUTHORIZED:
        await down.respond(401, [_JSON], UNAUTHORIZED_JSON)
    elif route is Route.UPGRADE_REFUSED:
        await down.respond(400, [_TEXT], b"upgrade not allowed on this route\n")
    elif route is Route.NOT_FOUND:
        # Refused before any check: no backend may read this target as another path.
        await down.respond(404, [_TEXT], NOT_FOUND)
    elif route is Route.MODELS:
        assert app.model_pools is not None
        await down.respond(200, [_JSON], models_document(app.model_pools))
    elif route is Route.ATTESTATION:
        if not app.authorized(headers):
            await down.respond(401, [_JSON], UNAUTHORIZED_JSON)
        elif request.method != b"GET":
            await down.respond(405, [_TEXT], b"method not allowed\n")
        elif not app.attestation_enabled:
            await down.respond(404, [_TEXT], NOT_FOUND)
        else:
            query = request.target.partition(b"?")[2].decode("latin-1")
            status, report_headers, body = await app.attestation.report(
                method=request.method, query=query
            )
            await down.respond(status, report_headers, body)
    elif not app.authorized(headers):
        await down.respond(401, [_TEXT], b"unauthorized\n")
    elif route is Route.UPSTREAM_STATUS:
        digit = upstream_status_digit(app.engine.state.gate)
        await down.respond(200, [_TEXT], f"{int(digit)}\n".encode())
    else:
        page = (
            app.local_metrics()
            if route is Route.METRICS
            else await backend_pages(app.local_metrics(), app.settings.backends)
        )
        await down.respond(200, [(b"content-type", app.metrics_content_type)], page)
