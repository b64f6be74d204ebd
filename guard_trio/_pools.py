"""Model routing on the request path (``PIG_POOLS``): which pool a request's body names.

Reads: the request body the proxy holds (or, for one too long to hold, its first bytes, read
here), the pools of the settings and each pool's engine.
Guarantees: a body's top-level ``model`` picks its pool's backends and engine; a model no pool
serves is answered OpenAI's 404 ``model_not_found`` here, before any slot is asked for; the
first bytes read of a long body are handed back, to go upstream first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from guard_adapters.model_pools import model_not_found_body, request_model
from guard_trio._downstream import Downstream
from guard_trio._engine import GuardEngine

if TYPE_CHECKING:
    from guard_trio._proxy import ProxyApp

__all__ = ("LEAD_BYTES", "choose_pool")

_JSON = (b"content-type", b"application/json")
#: How much of a body too long to hold is read for its model.
LEAD_BYTES = 64 * 1024


async def choose_pool(
    app: ProxyApp, down: Downstream, body: list[bytes] | None
) -> tuple[list[bytes] | None, list[bytes] | None, tuple[str, ...] | None, GuardEngine] | None:
    """``PIG_POOLS``: the body (or, for one too long to hold, its first bytes, which go
    upstream first), the backends of its model and its pool's engine; None when no pool
    serves its model (the 404 is sent)."""
    assert app.model_pools is not None
    lead = None
    if body is None:
        lead, complete = await app.read_body(down, LEAD_BYTES)
        body, lead = (lead, None) if complete else (None, lead)
    model = request_model(b"".join(body if body is not None else lead or ()))
    if model is None:
        return body, lead, None, app.engine
    allowed = app.model_pools.backends_for(model)
    if allowed is None:
        await down.respond(404, [_JSON], model_not_found_body(model))
        return None
    return body, lead, allowed, app.pools.of_model(model)
