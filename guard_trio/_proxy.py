"""Routing and forwarding: what the guard does with each request (spec 1, 6, 7, 8, 9).

Reads: the request head and body from :class:`~guard_trio._downstream.Downstream`, the settings,
the guard engine's decisions, and the backends' responses.
Guarantees:
- routing order: ``/healthz``, ``/pig/metrics``, ``/v1/metrics``, ``/v1/upstream-status``,
  ``/v1/attestation/report`` (auth, GET only, then the attestation handler, which fails
  closed), generation-route auth, then QoS for POST to an admitted path and
  plain forwarding for everything else (only to ``PIG_FORWARD_PATHS`` when that is set);
- every check sees the path the backend gets: routing uses the percent-decoded path, and a
  target a backend could read as another path (dot or empty segments, ``;``, ``#``, ``\\``,
  ``%`` left after decoding, bytes outside printable ASCII, a case or trailing-slash variant of
  a known route) is answered 404 before any check or backend sees it; the target is forwarded
  as received;
- the token check compares SHA-256 digests in constant time (no length leak, no error on
  non-ASCII bytes);
- a request the gate would refuse at once (no wait possible) is refused before its body is
  parsed, and before it is read unless it is short (at most 64 KiB declared), with
  ``Connection: close`` when body bytes remain unread;
- exactly one response per request, or none when the client already left; a slot taken for a
  request is released exactly once on every path (success, error, timeout, cancellation);
- refusals, upstream failures before the response head and internal errors all answer PIG's
  429 body (with ``Retry-After`` unless ``PIG_RETRY_AFTER_SECONDS=0``); internal reasons never
  reach the client;
- client-sent ``X-PIG-*`` headers never reach a backend; hop-by-hop headers are removed both
  ways; the upstream Host is the backend's own;
- a client that disconnects while its request waits or is being served cancels the wait or the
  upstream exchange at once (the upstream connection is closed, not reused);
- an upstream 500 caused by the client is rewritten to 400/422 (spec 7) when enabled; other
  responses pass through unchanged.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
from collections.abc import Callable, Sequence
from functools import partial
from urllib.parse import unquote

import h11
import trio

from guard_adapters._errors import BodyRewriteError
from guard_adapters.chunked import ChunkedBodyReader, ChunkedFramingError, frame
from guard_adapters.config import Settings
from guard_adapters.http_head import SimpleRequest
from guard_adapters.openai_body import (
    Plan,
    StreamingRewriter,
    as_utf8_json,
    output_token_intent,
    rewrite,
)
from guard_adapters.openai_body import plan as body_plan
from guard_adapters.sse import FirstUsefulEventScanner, is_streaming_request
from guard_core import (
    Arrived,
    Binding,
    DecisionSource,
    GuardError,
    Lane,
    LoadState,
    RejectCode,
    Rejected,
    Tier,
    apply_guard_event,
    body_lane,
    tier_from_header_values,
    upstream_status_digit,
)
from guard_core.backend_choice import backend_views, choose_backend
from guard_core.lanes import (
    DEFAULT_OUTPUT_THRESHOLDS,
    Thresholds,
    combine_lanes,
    output_lane,
)
from guard_core.upstream_errors import BODY_LIMIT, is_candidate, reclassify
from guard_trio._attestation import AttestationHandler
from guard_trio._downstream import (
    EARLY_DRAIN_BYTES,
    ClientGone,
    Downstream,
    ResponseAborted,
    whole_response_bytes,
)
from guard_trio._engine import AdmissionResult, Attempt, GuardEngine, Slot
from guard_trio._http import fetch
from guard_trio._observability import BackendMetrics, GuardMetrics
from guard_trio._upstream import UpstreamConnection, UpstreamError, UpstreamPool, UpstreamTarget

__all__ = ("TOO_MANY_REQUESTS_BODY", "ProxyApp")


def openai_error(message: bytes, kind: bytes, code: int) -> bytes:
    """An OpenAI-style error body (PIG's shape): what every refusal of the guard answers."""
    return b'{"error":{"message":"%b","type":"%b","param":null,"code":%d}}\n' % (
        message,
        kind,
        code,
    )


TOO_MANY_REQUESTS_BODY = openai_error(b"Too many requests", b"TooManyRequestsError", 429)
GATEWAY_TIMEOUT_BODY = openai_error(
    b"The backend did not answer in time", b"GatewayTimeoutError", 504
)
UNAUTHORIZED_JSON = openai_error(
    b"Invalid or missing Authorization header", b"AuthenticationError", 401
)
BAD_ENCODING_BODY = openai_error(
    b"The request body must be JSON encoded as UTF-8", b"BadRequestError", 400
)
_JSON = (b"content-type", b"application/json")
_TEXT = (b"content-type", b"text/plain; charset=utf-8")
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"proxy-connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
_BUFFER_LIMIT = 2 * 1024 * 1024
#: ``rewrite_body``'s answer when the request must be refused (fail-closed injection).
_REFUSE = object()
#: ``rewrite_body``'s answer for a JSON body in UTF-16 or UTF-32: the backend would read it,
#: the rewrite cannot, so forwarding it would let a client choose its own priority.
_BAD_ENCODING = object()
#: Buffered rewrites of bodies larger than this run in a worker thread.
_REWRITE_IN_THREAD_BYTES = 256 * 1024
#: ``SSE_KEEPALIVE_ENABLED``: the comment sent after this long without upstream data.
KEEPALIVE_AFTER_S = 2.0
KEEPALIVE_COMMENT = b": keep-alive\n\n"
#: ``SSE_EARLY_BRIDGE_ENABLED``: how long a streamed request waits for the backend's head before
#: the client gets its 200 stream anyway.
BRIDGE_GRACE_S = 0.5
_BRIDGE_SAFE_BODY = 524_288
_BRIDGE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_BACKEND_PAGE_LIMIT = 16 * 1024 * 1024
_IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS"})
_SSE_DEFAULTS = ((b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"))


def _hop_by_hop(headers: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    named = {
        token.strip().lower()
        for name, value in headers
        if name == b"connection"
        for token in value.split(b",")
    }
    return _HOP_BY_HOP | named


def _header_values(headers: list[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    return [value for key, value in headers if key == name]


NOT_FOUND = b"404 page not found\n"
#: The routes the guard answers itself (their case and trailing-slash variants are refused).
#: How many request targets the fast reader remembers the route of.
_ROUTE_CACHE_SIZE = 1024
_OWN_ROUTES = ("/healthz", "/pig/metrics", "/v1/metrics", "/v1/upstream-status")
_ATTESTATION_ROUTE = "/v1/attestation/report"
#: In the raw path: anything but printable ASCII, a fragment, a backslash or an encoded slash.
_UNSAFE_RAW = re.compile(rb"[^\x21-\x7e]|[#\\]|%2[fF]")
#: In the decoded path: the same, plus what some backend would split, strip or decode again.
_UNSAFE_DECODED = re.compile(r"[^\x21-\x7e]|[#\\;?%]|//|/\.\.?(?:/|$)")


def _route_path(target: bytes) -> str | None:
    """The decoded path the guard routes on, or None when a backend could read ``target`` as
    another path than the guard would (see the module header). Only origin-form targets are
    served (:mod:`guard_trio._downstream` refuses the other forms first)."""
    if not target.startswith(b"/"):
        return None
    raw_path = target.partition(b"?")[0]
    if _UNSAFE_RAW.search(raw_path):
        return None
    path = raw_path.decode("ascii")
    if "%" in path:
        try:
            path = unquote(path, errors="strict")
        except UnicodeDecodeError:
            return None
    if _UNSAFE_DECODED.search(path):
        return None
    return path


def _route_key(path: str) -> str:
    """What a lenient backend might treat as the same route: case and trailing slashes."""
    return path.rstrip("/").lower() or "/"


class ProxyApp:
    """Everything one request needs, shared by all connections."""

    def __init__(
        self,
        settings: Settings,
        engine: GuardEngine,
        pool: UpstreamPool,
        *,
        metrics: GuardMetrics,
        local_metrics: Callable[[], bytes] = lambda: b"",
        metrics_content_type: bytes = b"text/plain; version=0.0.4; charset=utf-8",
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.body_thresholds = settings.lane_thresholds.body
        self.engine = engine
        self.pool = pool
        self.local_metrics = local_metrics
        self.metrics_content_type = metrics_content_type
        env = settings.env
        self.targets = tuple(UpstreamTarget.from_url(b.name, b.upstream) for b in settings.backends)
        self.backend_metrics = tuple(metrics.backends[t.name] for t in self.targets)
        self.target_names = tuple(t.name for t in self.targets)
        self.expected_authorization = b"Bearer " + env.token.encode() if env.token else None
        self.expected_digest = (
            hashlib.sha256(self.expected_authorization).digest()
            if self.expected_authorization is not None
            else None
        )
        #: ``PIG_FORWARD_PATHS``: None forwards every path (PIG).
        self.forward_paths = frozenset(env.pig_forward_paths) or None
        known = (
            *_OWN_ROUTES,
            _ATTESTATION_ROUTE,
            *settings.paths.paths,
            *settings.auth_paths.paths,
            *env.pig_forward_paths,
        )
        self.known_routes = frozenset(known)
        self.own_routes = frozenset((*_OWN_ROUTES, _ATTESTATION_ROUTE))
        self.known_keys = frozenset(_route_key(route) for route in known)
        self.suffix_keys = (
            tuple({_route_key(r) for r in (*settings.paths.paths, *settings.auth_paths.paths)})
            if settings.paths.suffix_match
            else ()
        )
        self.proxy_timeout_s = float(env.proxy_timeout_seconds)
        self.retry_after = (
            str(env.pig_retry_after_seconds).encode() if env.pig_retry_after_seconds > 0 else None
        )
        #: ``PIG_RETRY_AFTER_MODE=predicted``: an admission 429 says the learner's seconds.
        self.retry_after_predicted = settings.retry_after_predicted and self.retry_after is not None
        #: The 429's bytes by predicted Retry-After (None: the configured one).
        self._refusals: dict[int | None, bytes] = {}
        #: :meth:`_admitted_route` by request target (routes are few; the cache is bounded).
        self._admitted_routes: dict[bytes, tuple[str, bool] | None] = {}
        self.api_auth_paths = settings.auth_paths
        self.api_auth_enabled: bool = env.api_auth_enabled
        self.classify_errors: bool = env.upstream_error_classification_enabled
        self.attestation_enabled: bool = env.attestation_enabled
        self.attestation = AttestationHandler(settings)
        self.sse_keepalive: bool = env.sse_keepalive_enabled
        self.injection = settings.injection_policy()
        self.rewrites_in_flight = 0
        self.classify = env.classify_output_tokens
        self.classify_body_bytes = env.json_classify_body_bytes
        self.classify_fields = env.output_token_field_names
        self.adaptive_config = settings.adaptive_output
        self.output_thresholds = settings.lane_thresholds.output
        self.sse_early_bridge: bool = env.sse_early_bridge_enabled
        self.upstream_head_timeout_s = _budget(env.pig_upstream_head_timeout_seconds)
        self.upstream_idle_timeout_s = _budget(env.pig_upstream_idle_timeout_seconds)

    # -- small responses -----------------------------------------------------------------------

    async def too_many_requests(self, down: Downstream, predicted_s: int | None = None) -> None:
        """The standard 429. ``predicted_s`` is an admission refusal's predicted Retry-After,
        sent in place of ``PIG_RETRY_AFTER_SECONDS`` when ``PIG_RETRY_AFTER_MODE`` is
        ``predicted``; ``PIG_RETRY_AFTER_SECONDS=0`` sends no Retry-After at all."""
        await down.respond(429, list(self.refusal_headers(predicted_s)), TOO_MANY_REQUESTS_BODY)

    def refusal_headers(self, predicted_s: int | None) -> tuple[tuple[bytes, bytes], ...]:
        if predicted_s is not None and self.retry_after_predicted:
            return (_JSON, (b"retry-after", str(predicted_s).encode()))
        if self.retry_after is not None:
            return (_JSON, (b"retry-after", self.retry_after))
        return (_JSON,)

    def admit_simple(self, request: SimpleRequest) -> tuple[Attempt | None, bytes | None]:
        """The fast reader's request: answered here when it is an admission that is refused at
        once (the 429's bytes, already counted), else handed on (the attempt, when one was made).

        Only a POST to an admitted path gets this far; every other route, and a request the API
        token check would refuse, returns ``(None, None)`` and takes the full path unchanged.
        """
        if request.method != b"POST":
            return None, None
        routes = self._admitted_routes
        if request.target in routes:
            route = routes[request.target]
        else:
            route = self._admitted_route(request.target)
            if len(routes) < _ROUTE_CACHE_SIZE:
                routes[request.target] = route
        if route is None:
            return None, None
        raw_path, token_checked = route
        if token_checked and not self.authorized(list(request.headers)):
            return None, None
        tier = tier_from_header_values(request.values(b"x-user-tier"))
        length = request.body_length
        started = trio.current_time()
        attempt = self.engine.begin(tier, path=raw_path, body_bytes=length)
        result = attempt.result
        if result is None or result.code is None:
            return attempt, None  # admitted or queued: the full path serves it
        lane = body_lane(length, self.body_thresholds)
        self.metrics.lanes[lane].observe_body(length)
        self.count_decision(result, started)
        self.count_refusal(tier, lane, result.code, waited=False, binding=result.binding)
        return None, self.refusal_bytes(result.retry_after_s)

    def _admitted_route(self, target: bytes) -> tuple[str, bool] | None:
        """For a POST to ``target``: (the path the engine records, whether the API token is
        checked) when it is an admitted path :meth:`handle` would send to :meth:`admitted`;
        None for every other route."""
        path = _route_path(target)
        if (
            path is None
            or path in self.own_routes
            or self.lookalike(path)
            or not self.settings.paths.matches(path)
        ):
            return None
        token_checked = self.api_auth_enabled and self.api_auth_paths.matches(path)
        return target.decode("latin-1").partition("?")[0], token_checked

    def refusal_bytes(self, predicted_s: int | None) -> bytes:
        """The whole 429 for a kept-alive connection, as :meth:`too_many_requests` sends it."""
        answer = self._refusals.get(predicted_s)
        if answer is None:
            headers = self.refusal_headers(predicted_s)
            answer = whole_response_bytes(429, headers, TOO_MANY_REQUESTS_BODY)
            if len(self._refusals) < 64:  # predicted seconds are few; bound it all the same
                self._refusals[predicted_s] = answer
        return answer

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Exactly one Authorization header, equal in constant time to ``Bearer <TOKEN>``.

        Digests are compared, so neither the token's length nor its bytes (any byte at all)
        change how the comparison runs.
        """
        expected = self.expected_digest
        values = _header_values(headers, b"authorization")
        if expected is None or len(values) != 1:
            return False
        return hmac.compare_digest(hashlib.sha256(values[0]).digest(), expected)

    def lookalike(self, path: str) -> bool:
        """A case or trailing-slash variant of a route the guard knows, which a lenient backend
        could serve as that route while the guard's checks would not apply."""
        if path in self.known_routes:
            return False
        key = _route_key(path)
        if key in self.known_keys:
            return True
        if self.suffix_keys and any(key.endswith(k) for k in self.suffix_keys):
            return not (self.settings.paths.matches(path) or self.api_auth_paths.matches(path))
        return False

    def low_load(self) -> bool:
        """PIG's gate for SSE keep-alive and the early bridge: quiet backend, empty queue."""
        if not self.settings.dynamic_enabled:
            return True
        gate = self.engine.state.gate
        decision = gate.decision
        return (
            decision.source is DecisionSource.METRICS
            and decision.state is LoadState.GREEN
            and decision.waiting == 0
            and decision.backend_failed == 0
            and decision.kv_usage < 0.70
            and gate.waiting == 0
        )

    # -- routing -------------------------------------------------------------------------------

    async def handle(
        self, down: Downstream, request: h11.Request, begun: Attempt | None = None
    ) -> None:
        """Serve one request; ``begun``: its admission, already attempted by the fast reader
        (:meth:`admit_simple`), which only a POST to an admitted path has."""
        path = _route_path(request.target)
        if path is None or self.lookalike(path):
            # Refused before any check: no backend may read this target as another path.
            await self.discard_body(down)
            await down.respond(404, [_TEXT], NOT_FOUND)
            return
        query = request.target.partition(b"?")[2].decode("latin-1")
        headers = list(request.headers)
        if not _header_values(headers, b"content-length") and not _header_values(
            headers, b"transfer-encoding"
        ):
            # No framing header means no body (RFC 9112 6.3): the backend is told so with a
            # zero Content-Length rather than an empty body re-framed as chunked.
            headers.append((b"content-length", b"0"))
        method = request.method
        if path == "/healthz":
            await self.discard_body(down)
            await down.respond(200, [_TEXT], b"ok\n")
            return
        if path in ("/pig/metrics", "/v1/metrics", "/v1/upstream-status"):
            await self.discard_body(down)
            if not self.authorized(headers):
                await down.respond(401, [_TEXT], b"unauthorized\n")
                return
            if path == "/v1/upstream-status":
                digit = upstream_status_digit(self.engine.state.gate)
                await down.respond(200, [_TEXT], f"{int(digit)}\n".encode())
            elif path == "/pig/metrics":
                await down.respond(
                    200, [(b"content-type", self.metrics_content_type)], self.local_metrics()
                )
            else:
                await down.respond(
                    200, [(b"content-type", self.metrics_content_type)], await self.all_metrics()
                )
            return
        if path == "/v1/attestation/report":
            await self.discard_body(down)
            if not self.authorized(headers):
                await down.respond(401, [_JSON], UNAUTHORIZED_JSON)
            elif method != b"GET":
                await down.respond(405, [_TEXT], b"method not allowed\n")
            elif not self.attestation_enabled:
                await down.respond(404, [_TEXT], NOT_FOUND)
            else:
                status, report_headers, body = await self.attestation.report(
                    method=method, query=query
                )
                await down.respond(status, report_headers, body)
            return
        admitted_path = method == b"POST" and self.settings.paths.matches(path)
        if (
            method == b"POST"
            and self.api_auth_enabled
            and self.api_auth_paths.matches(path)
            and not self.authorized(headers)
        ):
            await self.discard_body(down)
            await down.respond(401, [_JSON], UNAUTHORIZED_JSON)
            return
        if _header_values(headers, b"upgrade") and admitted_path:
            await self.discard_body(down)
            await down.respond(400, [_TEXT], b"upgrade not allowed on this route\n")
            return
        if admitted_path:
            await self.admitted(down, request, headers, begun)
        elif self.forward_paths is not None and path not in self.forward_paths:
            await self.discard_body(down)
            await down.respond(404, [_TEXT], NOT_FOUND)
        else:
            await self.forward(down, request, headers, slot=None, tier=None)

    async def discard_body(self, down: Downstream) -> None:
        """The body is not needed (an early response follows): a short one is read and dropped,
        a longer one is left unread and the connection closes after the response."""
        await down.skip_body()

    async def read_body(self, down: Downstream, limit: int) -> tuple[list[bytes], bool]:
        """Read up to ``limit`` bytes of body; returns (chunks, complete)."""
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            event = await down.body_event()  # under PIG_MAX_BODY_BYTES and the body timeouts
            if isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
                size += len(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return chunks, True
            elif isinstance(event, h11.ConnectionClosed):
                raise ClientGone("client closed while sending its body")
        return chunks, False

    # -- QoS -----------------------------------------------------------------------------------

    async def admitted(
        self,
        down: Downstream,
        request: h11.Request,
        headers: list[tuple[bytes, bytes]],
        begun: Attempt | None = None,
    ) -> None:
        """QoS: wait for a slot (or a refusal), then forward; the slot is released once."""
        tier = tier_from_header_values(_header_values(headers, b"x-user-tier"))
        length = _content_length(headers)
        lane = body_lane(length, self.body_thresholds)
        self.metrics.lanes[lane].observe_body(length)
        path = request.target.decode("latin-1").partition("?")[0]
        # A short body costs nothing to read (a refusal drops it anyway and keeps the
        # connection); a long one, or one the classifier would parse, is worth a peek first.
        worth_a_peek = length is None or length > EARLY_DRAIN_BYTES or self.classify
        if begun is None and worth_a_peek and self.refused_at_once(tier, length):
            # Decided from the head alone: the body is neither read nor parsed for a 429.
            await self.refuse_early(down, tier, lane, path=path, length=length)
            return
        body: list[bytes] | None = None
        # A client waiting for 100 Continue gets it only once admitted (the body is read then).
        if (
            length is not None
            and length <= _BUFFER_LIMIT
            and not down.h11.they_are_waiting_for_100_continue
        ):
            body, _complete = await self.read_body(down, _BUFFER_LIMIT)
        output_tokens = self.output_intent(lane, length, body)
        if output_tokens is not None:
            lane = combine_lanes(lane, output_lane(output_tokens, self.current_output_thresholds()))
        started = trio.current_time()
        result: AdmissionResult | None = None
        with trio.CancelScope() as client_scope:
            async with trio.open_nursery() as nursery:
                # Once the request is read to its end (now, or after it is streamed upstream),
                # a closed client cancels everything: the wait, the upstream exchange.
                nursery.start_soon(down.watch_for_disconnect, client_scope)
                if begun is None:
                    result = await self.engine.admit(tier, path=path, body_bytes=length)
                else:
                    result = await self.engine.settle(begun)
                self.count_decision(result, started)
                if result.slot is not None:
                    await self.serve_slot(
                        down,
                        request,
                        headers,
                        result,
                        lane=lane,
                        body=body,
                        started=started,
                        output_tokens=output_tokens,
                    )
                nursery.cancel_scope.cancel()
        if result is None:  # the client left while waiting
            self.metrics.disconnect_queue.inc()
            self.metrics.queue_timeout.inc()
            return
        if result.code is not None and not down.gone:
            self.count_refusal(
                tier, lane, result.code, waited=result.waited_s > 0, binding=result.binding
            )
            await self.discard_remaining(down)
            await self.too_many_requests(down, result.retry_after_s)

    def refused_at_once(self, tier: Tier, length: int | None) -> bool:
        """The gate would refuse a slot request now, with no wait: a pure peek at the engine's
        state (nothing is applied)."""
        engine = self.engine
        # Id 0 is never one of the engine's, and the step is dropped: nothing is applied.
        attempt = Arrived(
            at=engine.seconds_since_start(), request_id=0, tier=tier, body_bytes=length
        )
        step = apply_guard_event(engine.state, attempt)
        return isinstance(step.outcome, Rejected)

    async def refuse_early(
        self, down: Downstream, tier: Tier, lane: Lane, *, path: str, length: int | None
    ) -> None:
        """The 429 of :meth:`refused_at_once`, through the engine (recorded and counted as any
        refusal); a short body is dropped, a longer one left unread and the connection closed."""
        started = trio.current_time()
        # Nothing awaited since the peek: the same state gives the same immediate refusal.
        result = await self.engine.admit(tier, path=path, body_bytes=length)
        if result.slot is not None:  # pragma: no cover - the reducer is deterministic
            result.slot.release(0)
        self.count_decision(result, started)
        code = result.code or RejectCode.GLOBAL_DYNAMIC_LIMIT
        self.count_refusal(tier, lane, code, waited=False, binding=result.binding)
        await self.discard_remaining(down)
        await self.too_many_requests(down, result.retry_after_s)

    def count_decision(self, result: AdmissionResult, started: float) -> None:
        metrics = self.metrics
        decided = trio.current_time()
        metrics.decision_duration.observe(max(0.0, decided - started - result.waited_s))
        if result.waited_s > 0:
            metrics.queue_total.inc()
            metrics.queue_wait.observe(result.waited_s)

    async def serve_slot(
        self,
        down: Downstream,
        request: h11.Request,
        headers: list[tuple[bytes, bytes]],
        result: AdmissionResult,
        *,
        lane: Lane,
        body: list[bytes] | None,
        started: float,
        output_tokens: int | None,
    ) -> None:
        """Forward an admitted request; account for it and release its slot on every path."""
        slot = result.slot
        assert slot is not None
        metrics = self.metrics
        metrics.tier_accepted[slot.tier].inc()
        lanes = (metrics.lanes[lane], metrics.lanes[Lane.GLOBAL])
        for counted in lanes:
            counted.accepted.inc()
            counted.inflight.inc()
        decided = trio.current_time()
        status = 499
        plan = body_plan(
            self.injection,
            tier=slot.tier,
            content_type=_first_header(headers, b"content-type"),
            content_length=_content_length(headers),
            slot_free=self.rewrites_in_flight < self.injection.rewrite_limit,
        )
        for name in plan.counts:
            self.count_priority(name)
        try:
            if plan.uses_slot:
                self.rewrites_in_flight += 1
                metrics.priority_rewrite_inflight.inc()
            try:
                rewritten = await self.rewrite_body(down, plan, body, _content_length(headers))
            finally:
                if plan.uses_slot:
                    self.rewrites_in_flight -= 1
                    metrics.priority_rewrite_inflight.dec()
            if rewritten is _BAD_ENCODING:
                await self.discard_remaining(down)
                await down.respond(400, [_JSON], BAD_ENCODING_BODY)
                status = 400
                return
            if rewritten is _REFUSE:
                self.count_refusal(
                    slot.tier, lane, RejectCode.BACKEND_PRIORITY_INJECTION, waited=False
                )
                await self.discard_remaining(down)
                await self.too_many_requests(down)
                status = 429
                return
            status = await self.forward(
                down,
                request,
                headers,
                slot=slot,
                tier=slot.tier,
                lane=lane,
                body=rewritten if isinstance(rewritten, list) else body,
                rewriter=rewritten if isinstance(rewritten, StreamingRewriter) else None,
                output_tokens=output_tokens,
            )
        finally:
            slot.release(status)
            ended = trio.current_time()
            elapsed = ended - started
            metrics.internal_overhead.observe(
                max(0.0, elapsed - result.waited_s - (ended - decided))
            )
            for counted in lanes:
                counted.inflight.dec()
                counted.complete(499 if down.gone else status, elapsed)

    def output_intent(self, lane: Lane, length: int | None, body: list[bytes] | None) -> int | None:
        """Spec 6.4: the requested output tokens, when classification is on and the body is read."""
        if not self.classify or lane is Lane.UNKNOWN_BODY or body is None:
            return None
        if length is None or length > self.classify_body_bytes:
            return None
        # The walk is synchronous here, so the JSON_CLASSIFY_LIMIT slots are never all busy.
        tokens = output_token_intent(b"".join(body), self.classify_fields)
        if tokens is not None and self.adaptive_config is not None:
            self.engine.output_intent(tokens)
        return tokens

    def current_output_thresholds(self) -> Thresholds:
        if self.adaptive_config is None:
            return self.output_thresholds or DEFAULT_OUTPUT_THRESHOLDS
        state = self.engine.state
        return state.traffic.adaptive.effective(
            self.adaptive_config, state.published.decision.state
        )

    def count_priority(self, name: str) -> None:
        counter = {
            "rewritten": self.metrics.priority_rewrites,
            "skipped": self.metrics.priority_skipped,
            "failed": self.metrics.priority_failed,
        }[name]
        counter.inc()

    async def rewrite_body(
        self, down: Downstream, plan: Plan, body: list[bytes] | None, length: int | None
    ) -> list[bytes] | StreamingRewriter | object | None:
        """Spec 6.3: the body to send (rewritten chunks), a streaming rewriter, ``None`` to send
        the body unchanged, or :data:`_REFUSE` for a 429."""
        if plan.action == "reject":
            return _REFUSE
        if plan.action == "unchanged":
            return None
        if plan.action == "streaming":
            return StreamingRewriter(plan)
        if body is None:  # a strict-mode plan buffers bodies larger than the usual 2 MiB
            assert length is not None
            body, _complete = await self.read_body(down, length)
        started = trio.current_time()
        joined = as_utf8_json(b"".join(body))
        if joined is None:
            return _BAD_ENCODING
        try:
            if len(joined) > _REWRITE_IN_THREAD_BYTES:
                # Tens of milliseconds of CPU: a worker thread keeps other streams moving meanwhile.
                new = await trio.to_thread.run_sync(partial(rewrite, joined, plan=plan))
            else:
                new = rewrite(joined, plan=plan)
        except BodyRewriteError:
            counter = plan.outcome_counter(ok=False)
            if counter is not None:
                self.count_priority(counter)
            return body if plan.fail_open else _REFUSE
        counter = plan.outcome_counter(ok=True)
        if counter is not None:
            self.count_priority(counter)
            self.metrics.priority_rewrite_duration.observe(trio.current_time() - started)
        return [new]

    def count_refusal(
        self,
        tier: Tier,
        lane: Lane,
        code: RejectCode,
        *,
        waited: bool,
        binding: Binding | None = None,
    ) -> None:
        """PIG's reject accounting (spec 4.4), and the predictive learner's by constraint."""
        metrics = self.metrics
        if waited:
            metrics.queue_timeout.inc()
        if binding is not None:
            metrics.predictive_refusals[binding].inc()
        if code is RejectCode.BACKEND_UNAVAILABLE:
            metrics.backend_unavailable.inc()
            return
        if code is RejectCode.BACKEND_PRIORITY_INJECTION:
            self.engine.refused_after_admission(tier)
        metrics.tier_rejected[tier].inc()
        metrics.rejected.inc()
        counted = Lane.GLOBAL if code is RejectCode.GLOBAL_LIMIT else lane
        metrics.lanes[counted].rejected.inc()

    async def discard_remaining(self, down: Downstream) -> None:
        if down.h11.their_state is h11.SEND_BODY:
            await self.discard_body(down)

    # -- forwarding ----------------------------------------------------------------------------

    def pick_backend(self) -> int:
        if len(self.targets) == 1:
            return 0
        state = self.engine.state
        policy = state.config.policy
        chosen = choose_backend(
            backend_views(self.target_names, state.published, state.traffic),
            now=self.engine.seconds_since_start(),
            poll_interval_s=self.settings.env.dynamic_poll_interval_ms / 1000,
            dynamic=self.settings.dynamic_enabled,
            capacity_ratio=policy.capacity_ratio,
            target_user_tps=policy.user_tps_yellow,
        )
        return chosen or 0

    def upstream_headers(
        self,
        down: Downstream,
        headers: list[tuple[bytes, bytes]],
        target: UpstreamTarget,
        *,
        tier: Tier | None,
        lane: Lane,
        body_length: int | None,
        output_tokens: int | None = None,
    ) -> list[tuple[bytes, bytes]]:
        hop_by_hop = _hop_by_hop(headers)
        drop = hop_by_hop | {b"host", b"content-length", b"x-forwarded-for", b"expect"}
        out = [
            (name, value)
            for name, value in headers
            if name not in drop and not name.startswith(b"x-pig-")
        ]
        out.insert(0, (b"host", target.authority.encode()))
        # A client that names X-Forwarded-For in Connection asks for its value to be dropped at
        # this hop: only the socket peer remains (as Go's reverse proxy does).
        client_chain = (
            [] if b"x-forwarded-for" in hop_by_hop else _header_values(headers, b"x-forwarded-for")
        )
        forwarded = b", ".join([*client_chain, down.peer.encode()])
        out.append((b"x-forwarded-for", forwarded))
        out.append((b"x-pig-backend", target.name.encode()))
        if tier is not None:
            out.append((b"x-pig-tier", str(tier).encode()))
            out.append((b"x-pig-lane", str(lane).encode()))
            if output_tokens is not None:
                out.append((b"x-pig-output-tokens", str(output_tokens).encode()))
        if body_length is not None:
            out.append((b"content-length", str(body_length).encode()))
        else:
            out.append((b"transfer-encoding", b"chunked"))
        return out

    async def forward(
        self,
        down: Downstream,
        request: h11.Request,
        headers: list[tuple[bytes, bytes]],
        *,
        slot: Slot | None,
        tier: Tier | None,
        lane: Lane = Lane.DEFAULT,
        body: list[bytes] | None = None,
        rewriter: StreamingRewriter | None = None,
        output_tokens: int | None = None,
    ) -> int:
        """Forward one request and relay the response; returns the status the client got."""
        proxy_started = trio.current_time()
        index = self.pick_backend()
        target = self.targets[index]
        body_length = sum(len(c) for c in body) if body is not None else _content_length(headers)
        if rewriter is not None:
            body_length = None  # the rewritten body goes upstream chunked
        upstream_request = h11.Request(
            method=request.method,
            target=target.base_path.encode() + request.target,
            headers=self.upstream_headers(
                down,
                headers,
                target,
                tier=tier,
                lane=lane,
                body_length=body_length,
                output_tokens=output_tokens,
            ),
        )
        backend = self.backend_metrics[index]
        self.engine.forwarded(target.name)
        backend.accepted.inc()
        status = 0
        bridge = (
            self.sse_early_bridge
            and slot is not None
            and body is not None
            and body_length is not None
            and body_length < _BRIDGE_SAFE_BODY
            and is_streaming_request(_first_header(headers, b"accept"), b"".join(body))
            and self.low_load()
        )
        # A request whose body we hold (or that has none) can be sent again when a kept-alive
        # connection fails before the request was fully written. Once it was written, only an
        # idempotent one is: a POST the backend may have started must not generate twice.
        replayable = body is not None or body_length == 0
        idempotent = request.method in _IDEMPOTENT
        try:
            with trio.move_on_after(self.proxy_timeout_s) as deadline:
                for attempt in range(2):
                    reused = written = False
                    try:
                        async with self.pool.connection(target, fresh=attempt > 0) as up:
                            reused = up.reused
                            await up.send(upstream_request)
                            await self.send_body(down, up, body, rewriter)
                            written = True
                            status = await self.relay_response(
                                down, up, slot, proxy_started, method=request.method, bridge=bridge
                            )
                        break
                    except UpstreamError:
                        if (
                            attempt == 0
                            and reused
                            and replayable
                            and (idempotent or not written)
                            and down.can_respond
                        ):
                            continue
                        return await self.upstream_failed(down, backend)
            if deadline.cancelled_caught:
                if down.can_respond:
                    await self.discard_remaining(down)
                    await self.too_many_requests(down)
                    return 429
                raise ResponseAborted("PROXY_TIMEOUT_SECONDS reached mid-response")
        except ClientGone:
            phase = self.metrics.disconnect_response if status else self.metrics.disconnect_upstream
            phase.inc()
            self.metrics.client_disconnect_upstream_cancellations.inc()
            raise
        finally:
            self.engine.finished(target.name)
            backend.completed.inc()
            self.metrics.proxy_total_duration.observe(trio.current_time() - proxy_started)
        return status

    async def send_body(
        self,
        down: Downstream,
        up: UpstreamConnection,
        body: list[bytes] | None,
        rewriter: StreamingRewriter | None = None,
    ) -> None:
        """The request body upstream: the buffered chunks, or streamed as the client sends it
        (through the streaming priority rewriter when there is one)."""
        if body is not None:
            for chunk in body:
                await up.send(h11.Data(data=chunk))
            await up.send(h11.EndOfMessage())
            return
        try:
            while True:
                event = await down.body_event()
                if isinstance(event, h11.Data):
                    data = bytes(event.data) if rewriter is None else rewriter.feed(event.data)
                    if data:
                        await up.send(h11.Data(data=data))
                elif isinstance(event, h11.EndOfMessage):
                    break
                else:
                    raise ClientGone("client closed while sending its body")
            if rewriter is not None:
                tail = rewriter.finish()
                if tail:
                    await up.send(h11.Data(data=tail))
        except BodyRewriteError as exc:
            # PIG surfaces a failed streaming rewrite as a broken request body: an upstream error.
            self.count_priority("failed")
            raise UpstreamError(f"request body rewrite failed: {exc}") from None
        if rewriter is not None:
            self.count_priority("rewritten")
        await up.send(h11.EndOfMessage())

    async def upstream_failed(self, down: Downstream, backend: BackendMetrics) -> int:
        """The backend failed: a 429 if the client has seen nothing yet, else cut the response."""
        self.metrics.proxy_upstream_errors.inc()
        backend.proxy_errors.inc()
        if down.can_respond:
            await self.discard_remaining(down)
            await self.too_many_requests(down)
            return 429
        self.metrics.proxy_body_copy_errors.inc()
        backend.body_copy_errors.inc()
        raise ResponseAborted("upstream broke mid-response")

    async def relay_response(
        self,
        down: Downstream,
        up: UpstreamConnection,
        slot: Slot | None,
        started: float,
        *,
        method: bytes = b"POST",
        bridge: bool = False,
    ) -> int:
        """Copy the upstream response to the client; returns the status sent.

        With ``bridge`` (spec 8.4), a backend that has not answered its head within
        :data:`BRIDGE_GRACE_S` gets the client a 200 event stream at once. A backend silent for
        ``PIG_UPSTREAM_HEAD_TIMEOUT_SECONDS`` before its head gets the client a 504; one that
        makes no progress for ``PIG_UPSTREAM_IDLE_TIMEOUT_SECONDS`` mid-body has both
        connections closed.
        """
        head_deadline = started + self.upstream_head_timeout_s
        event: h11.Response | None = None
        if bridge:
            with trio.move_on_after(BRIDGE_GRACE_S):
                event = await up.read_head()
            if event is None:
                return await self.relay_bridged(
                    down, up, slot, started, head_deadline, method=method
                )
        if event is None:
            with trio.move_on_at(head_deadline):
                event = await up.read_head()
            if event is None:
                return await self.head_timed_out(down)
        status = event.status_code
        upstream_headers = list(event.headers)
        drop = _hop_by_hop(upstream_headers)
        if _header_values(upstream_headers, b"transfer-encoding"):
            drop = drop | {b"content-length"}  # the chunked framing wins (RFC 9112 6.3)
        headers = [(name, value) for name, value in upstream_headers if name not in drop]
        content_type = next((v for k, v in upstream_headers if k == b"content-type"), b"")
        length = _content_length(upstream_headers)
        if self.classify_errors and is_candidate(status, content_type, length):
            return await self.relay_error(
                down, up, event, headers=headers, content_type=content_type, started=started
            )
        is_sse = status == 200 and b"text/event-stream" in content_type.lower()
        if is_sse:
            headers = _with_sse_defaults(headers)
        scanner = FirstUsefulEventScanner() if slot is not None and is_sse else None
        keepalive = is_sse and self.sse_keepalive and self.low_load()
        if keepalive:
            self.metrics.sse_keepalive_streams.inc()
            headers = _without_length(headers)
        head = h11.Response(status_code=status, headers=headers, reason=event.reason)
        self.metrics.proxy_ttfb.observe(trio.current_time() - started)
        await self.relay_body(
            down, up, event, head, method=method, scanner=scanner, slot=slot, keepalive=keepalive
        )
        return status

    async def relay_body(
        self,
        down: Downstream,
        up: UpstreamConnection,
        upstream: h11.Response,
        head: h11.Response | None,
        *,
        method: bytes,
        scanner: FirstUsefulEventScanner | None,
        slot: Slot | None,
        keepalive: bool = False,
    ) -> None:
        """The response body after ``upstream``'s head, with ``head`` first (None when the client
        already has its head), under the idle timeout: through the chunked fast path when both
        sides frame the body as chunks, through h11 otherwise."""
        fast = (
            _is_chunked(upstream.headers)
            and method != b"HEAD"
            and upstream.status_code not in (204, 304)
            and down.h11.their_http_version == b"1.1"
        )
        with _IdleGuard(self.upstream_idle_timeout_s) as guard:
            if fast:
                await self.copy_chunked(
                    down, up, head, scanner=scanner, slot=slot, keepalive=keepalive, guard=guard
                )
            elif head is None or await self.send_head(down, up, head, scanner=scanner, slot=slot):
                await self.copy_body(
                    down, up, scanner=scanner, slot=slot, keepalive=keepalive, guard=guard
                )

    async def head_timed_out(self, down: Downstream) -> int:
        """The backend sent no response head within its budget: 504, the connection closed."""
        self.metrics.proxy_upstream_errors.inc()
        if not down.can_respond:
            raise ResponseAborted("no response head from the backend in time")
        await self.discard_remaining(down)
        await down.respond(504, [_JSON, (b"connection", b"close")], GATEWAY_TIMEOUT_BODY)
        down.gone = True  # the exchange is abandoned mid-way: close the connection
        return 504

    async def send_head(
        self,
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

    async def relay_bridged(
        self,
        down: Downstream,
        up: UpstreamConnection,
        slot: Slot | None,
        started: float,
        head_deadline: float,
        *,
        method: bytes,
    ) -> int:
        """The early bridge: a 200 stream with a comment now, the backend events once it answers."""
        metrics = self.metrics
        metrics.sse_bridge_streams.inc()
        metrics.sse_keepalive_streams.inc()
        metrics.sse_keepalive_comments.inc()
        metrics.proxy_ttfb.observe(trio.current_time() - started)
        head = h11.Response(status_code=200, headers=_BRIDGE_HEADERS, reason=b"OK")
        await down.send(head, h11.Data(data=KEEPALIVE_COMMENT))
        event: h11.Response | None = None
        try:
            with trio.move_on_at(head_deadline):
                event = await up.read_head()
            if event is None:
                self.metrics.proxy_upstream_errors.inc()
                raise ResponseAborted("no response head from the backend in time")
            content_type = next((v for k, v in event.headers if k == b"content-type"), b"")
            if event.status_code != 200 or b"text/event-stream" not in content_type.lower():
                metrics.sse_bridge_invalid_upstream.inc()
                while not isinstance(await up.next_event(), h11.EndOfMessage):
                    pass  # the body is discarded; the client gets an empty stream
                await down.send(h11.EndOfMessage())
                return 200
        except UpstreamError:
            metrics.sse_bridge_upstream_errors.inc()
            await down.send(h11.EndOfMessage())
            return 200
        await self.relay_body(
            down, up, event, None, method=method, scanner=FirstUsefulEventScanner(), slot=slot
        )
        return 200

    async def relay_error(
        self,
        down: Downstream,
        up: UpstreamConnection,
        event: h11.Response,
        *,
        headers: list[tuple[bytes, bytes]],
        content_type: bytes,
        started: float,
    ) -> int:
        """A 500 that may be the client's fault: read up to 64 KiB and rewrite it if so."""
        status = event.status_code
        chunks: list[bytes] = []
        size = 0
        complete = False
        while size <= BODY_LIMIT:
            part = await up.next_event()
            if isinstance(part, h11.Data):
                chunks.append(bytes(part.data))
                size += len(part.data)
            elif isinstance(part, h11.EndOfMessage):
                complete = True
                break
        self.metrics.proxy_ttfb.observe(trio.current_time() - started)
        if complete:
            body = b"".join(chunks)
            rewritten = reclassify(status, content_type, body)
            if rewritten is not None:
                await down.respond(rewritten.status, _without_length(headers), rewritten.body)
                return rewritten.status
            await down.respond(status, _without_length(headers), body)
            return status
        # Longer than 64 KiB: pass it through untouched, the part already read first.
        await down.send(
            h11.Response(status_code=status, headers=headers, reason=event.reason),
            h11.Data(data=b"".join(chunks)),
        )
        with _IdleGuard(self.upstream_idle_timeout_s) as guard:
            await self.copy_body(down, up, scanner=None, slot=None, guard=guard)
        return status

    async def copy_chunked(
        self,
        down: Downstream,
        up: UpstreamConnection,
        head: h11.Response | None,
        *,
        scanner: FirstUsefulEventScanner | None,
        slot: Slot | None,
        guard: _IdleGuard,
        keepalive: bool = False,
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
                    self.metrics.sse_keepalive_comments.inc()
                    data = b""
                    continue
                data = received
            else:
                data = await up.receive_raw()
            if not data:
                raise UpstreamError(f"{up.target.name}: connection closed mid-response")
            guard.progress()

    async def copy_body(
        self,
        down: Downstream,
        up: UpstreamConnection,
        *,
        scanner: FirstUsefulEventScanner | None,
        slot: Slot | None,
        guard: _IdleGuard,
        keepalive: bool = False,
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
                    self.metrics.sse_keepalive_comments.inc()
                    continue
            else:
                event = await up.next_event()
            guard.progress()
            if isinstance(event, h11.Data):
                data, ended = _drain_buffered(up, bytes(event.data))
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

    # -- /v1/metrics -----------------------------------------------------------------------------

    async def all_metrics(self) -> bytes:
        parts = [self.local_metrics(), b"\n# --- Backend Metrics ---\n"]
        fetched = 0
        for backend in self.settings.backends:
            if not backend.metrics_url:
                parts.append(f"# backend {backend.name} metrics URL is empty\n".encode())
                continue
            parts.append(f"\n# --- backend {backend.name} {backend.metrics_url} ---\n".encode())
            try:
                response = await fetch(
                    backend.metrics_url, timeout_s=2.0, max_bytes=_BACKEND_PAGE_LIMIT
                )
            except (trio.TooSlowError, GuardError) as exc:
                reason = "timed out" if isinstance(exc, trio.TooSlowError) else str(exc)
                parts.append(f"# failed to fetch backend metrics: {reason}\n".encode())
                continue
            if response.status != 200:
                parts.append(f"# backend metrics status {response.status}\n".encode())
                continue
            fetched += 1
            body = response.body
            parts.append(body if body.endswith(b"\n") else body + b"\n")
        if fetched == 0:
            parts.append(b"# no backend metrics were fetched\n")
        return b"".join(parts)


def _drain_buffered(up: UpstreamConnection, data: bytes) -> tuple[bytes, bool]:
    """Join the body bytes h11 already holds to ``data``; True if the body ended too."""
    parts = [data]
    while True:
        event = up.h11.next_event()
        if isinstance(event, h11.Data):
            parts.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            return b"".join(parts), True
        else:  # NEED_DATA: nothing more buffered
            return b"".join(parts), False


def _with_sse_defaults(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """An event stream tells caches and buffering proxies (nginx) to pass it on at once."""
    names = {name for name, _ in headers}
    extra = [pair for pair in _SSE_DEFAULTS if pair[0] not in names]
    return [*headers, *extra] if extra else headers


def _budget(seconds: float) -> float:
    """A timeout setting in seconds, 0 meaning none."""
    return float(seconds) if seconds > 0 else math.inf


def _is_chunked(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    """The response body is chunked (h11 already refused any other transfer coding)."""
    return any(
        name == b"transfer-encoding" and value.strip().lower() == b"chunked"
        for name, value in headers
    )


class _IdleGuard:
    """Cancels a body copy when neither side made progress for ``idle_s`` seconds.

    One cancel scope per copy whose deadline moves forward at most twice a second, so the cost
    per relayed event is one clock read. When it fires the copy ends with
    :class:`ResponseAborted`: both connections are closed.
    """

    __slots__ = ("_armed_at", "_idle_s", "_scope", "_step_s")

    def __init__(self, idle_s: float) -> None:
        self._idle_s = idle_s
        #: The deadline moves at most once per step; it may fire up to one step late, never
        #: early (5 % of the budget, at most half a second).
        self._step_s = min(0.5, idle_s / 20)
        self._armed_at = 0.0
        self._scope = trio.CancelScope()

    def __enter__(self) -> _IdleGuard:
        now = trio.current_time()
        self._armed_at = now
        self._scope.deadline = now + self._idle_s + self._step_s
        self._scope.__enter__()
        return self

    def progress(self) -> None:
        now = trio.current_time()
        if now - self._armed_at > self._step_s:
            self._armed_at = now
            self._scope.deadline = now + self._idle_s + self._step_s

    def __exit__(self, *exc_info: object) -> bool:
        suppressed = self._scope.__exit__(*exc_info)  # type: ignore[arg-type]
        if self._scope.cancelled_caught:
            raise ResponseAborted("no progress on the response within the idle timeout")
        return bool(suppressed)


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    values = _header_values(headers, b"content-length")
    if len(values) != 1 or _header_values(headers, b"transfer-encoding"):
        return None
    try:
        value = int(values[0])
    except ValueError:
        return None
    return value if value >= 0 else None


def _first_header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    return next((value for key, value in headers if key == name), None)


def _without_length(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in headers if k != b"content-length"]
