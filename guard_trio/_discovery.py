"""``PIG_POOLS=discover``: the pools, from what each backend lists on ``/v1/models`` at start.

Reads: the settings' backends, and their ``/v1/models`` answers (fetched on loopback or the
network the backends are on); time from trio.
Guarantees:
- every backend is asked once a second until each has answered with a model list or
  ``wait_s`` passed; the pools are then :func:`guard_adapters.model_pools.discovered_pools` of
  the lists that came (a backend that never answered serves no model, and is logged);
- the settings come back with those pools, or :class:`DiscoveryError` says why there are none
  (no backend listed a model, or two backends' lists overlap without being equal), before the
  guard listens: it never starts with pools it could not build.
"""

from __future__ import annotations

import logging

import attrs
import trio

from guard_adapters.config import Settings
from guard_adapters.model_pools import discovered_pools, listed_models
from guard_core import GuardError
from guard_trio._http import FetchError, fetch

__all__ = ("DiscoveryError", "discover_pools")

log = logging.getLogger("inference_guard")

#: How long start-up waits for every backend to list its models.
DISCOVERY_WAIT_S = 30.0


class DiscoveryError(GuardError):
    """The pools could not be built from what the backends listed."""


async def discover_pools(settings: Settings, *, wait_s: float = DISCOVERY_WAIT_S) -> Settings:
    """``settings`` with the pools the backends' ``/v1/models`` give (see the module rules)."""
    listings: dict[str, list[str]] = {}
    deadline = trio.current_time() + wait_s
    while True:
        for backend in settings.backends:
            if backend.name in listings:
                continue
            try:
                answer = await fetch(f"{backend.upstream}/v1/models", timeout_s=2.0)
            except (FetchError, OSError, trio.TooSlowError):
                continue
            models = listed_models(answer.body) if answer.status == 200 else []
            if models:
                listings[backend.name] = models
        if len(listings) == len(settings.backends) or trio.current_time() >= deadline:
            break
        await trio.sleep(1.0)
    names = [b.name for b in settings.backends]
    for missing in (n for n in names if n not in listings):
        log.warning("pool discovery: backend %s listed no model; it serves none", missing)
    pools, problems = discovered_pools(listings, names)
    if pools is None:
        raise DiscoveryError("; ".join(problems))
    for model, backends in pools.by_model.items():
        log.info("pool discovery: model %s on %s", model, ",".join(backends))
    return attrs.evolve(settings, model_pools=pools)
