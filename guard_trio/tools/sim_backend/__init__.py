"""A simulated vLLM or SGLang server: the engine model of ``guard_adapters.engine_model`` on HTTP.

Reads: a :class:`SimBackendConfig`; HTTP/1.1 requests on the bound socket.

Guarantees: what a real server does, closely enough for the guard to be tested against it
without a GPU. The package is split by concern, each module with its own guarantees:

- :mod:`._config`: the configuration, checked whole, and each flavour's histogram bounds;
- :mod:`._driver`: the one task that owns the engine's clock, the faults, and the hand-over of
  tokens to the requests' own tasks;
- :mod:`._http`: connections, whole requests and plain responses (h11), and the watch that
  sees a client leave;
- :mod:`._server`: :class:`SimBackend`, its routes, info pages and generation;
- :mod:`._asks`, :mod:`._formats`, :mod:`._errors`: what a request asks for, the bytes of the
  answer per API and server, and the errors the real servers write;
- :mod:`._metrics`: the ``/metrics`` page, from prometheus-client.

Faults (from the command line or, at run time, from ``POST /sim/control`` on loopback only):
a slow-down factor from a given time, engine death (``/health`` turns 503, requests get vLLM's
engine-dead 500, streams in flight end with an error event), a delay before or failures of
``/metrics``, and ``--replay-sse`` which answers every streaming request with a recorded
transcript, byte for byte, one event per interval.

A request body may carry ``"sim_error": "<case>"`` to get the error a real server writes for that
case (see :data:`ERROR_CASES`); the case names are the file names of ``../shared/data/errors``.
"""

from guard_trio.tools.sim_backend._config import (
    SGLANG_ITL_BUCKETS,
    SGLANG_TTFT_BUCKETS,
    VLLM_ITL_BUCKETS,
    VLLM_LEGACY_TPOT_BUCKETS,
    VLLM_LEGACY_TTFT_BUCKETS,
    VLLM_TTFT_BUCKETS,
    SimBackendConfig,
    SimBackendError,
)
from guard_trio.tools.sim_backend._errors import ERROR_CASES
from guard_trio.tools.sim_backend._http import is_loopback, split_sse_events
from guard_trio.tools.sim_backend._server import SimBackend, serve_sim_backend

__all__ = (
    "ERROR_CASES",
    "SGLANG_ITL_BUCKETS",
    "SGLANG_TTFT_BUCKETS",
    "VLLM_ITL_BUCKETS",
    "VLLM_LEGACY_TPOT_BUCKETS",
    "VLLM_LEGACY_TTFT_BUCKETS",
    "VLLM_TTFT_BUCKETS",
    "SimBackend",
    "SimBackendConfig",
    "SimBackendError",
    "is_loopback",
    "serve_sim_backend",
    "split_sse_events",
)
