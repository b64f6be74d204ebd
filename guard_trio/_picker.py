"""The endpoint picker: Envoy's ext_proc calls decided by the same engine as ``serve``.

Reads: one ext_proc call per HTTP request through Envoy (the request headers; the request body
when the pools need its model; the response headers; the response body while the first useful
event is looked for), and the guard server it shares its engine, pools, router and metrics with.
Guarantees:
- a request to an admitted path is attempted through the engine exactly as ``serve`` attempts
  it (tier, band and tenant, path, body size, request id): admitted, it is sent to the backend
  the same pick chooses (named by ``x-gateway-destination-endpoint`` and ``envoy.lb``
  metadata); refused, Envoy answers PIG's 429 body with ``Retry-After`` and ``X-Request-Id``
  itself; queued, the call waits (its own task) up to the short wait, as in ``serve``;
- another forwarded route goes to a picked backend without a slot; a route ``serve`` refuses
  (unknown, unauthorised, an upgrade on an admitted path) is refused the same way;
- a slot is released exactly once: when Envoy ends the call (the response is over, or the
  client went away: the call's end or its reset), with the status the backend answered, or 499
  when no response head came; the backend's in-flight count, health and the exchange's outcome
  (metrics, admin stream) are told once the same way;
- with response-body processing on, the body is scanned only until the first useful SSE event
  (the slot hears of the first token); later chunks are passed with a cached answer (Envoy
  1.40 does not let a body answer turn body processing off);
- gRPC health: ``liveness`` (and the empty service) always serve, ``readiness`` and the
  ext_proc service serve while the guard has a decision to enforce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from guard_adapters.answers import stamped
from guard_adapters.exchange import (
    NOT_FOUND,
    TOO_MANY_REQUESTS_BODY,
    UNAUTHORIZED_JSON,
    Route,
    content_length,
    first_header,
    header_values,
    route_path,
)
from guard_adapters.ext_proc import ExtProcError, Phase, Received, answer, carry_on, read, route_to
from guard_adapters.grpc_wire import (
    GrpcStatus,
    GrpcWireError,
    HealthStatus,
    health_response,
    health_service,
)
from guard_adapters.model_pools import outside as pool_outside
from guard_adapters.model_pools import request_model
from guard_adapters.outcome import Admission, ExchangeNotes
from guard_adapters.sse import FirstUsefulEventScanner
from guard_core import DecisionSource, Lane, body_lane
from guard_core.traffic import BackendFinished
from guard_trio._engine import AdmissionResult, Attempt, GuardEngine, Slot
from guard_trio._grpc import Call, CallHandler, GrpcServer
from guard_trio._metrics_instruments import LaneMetrics

if TYPE_CHECKING:
    from guard_trio._server import GuardServer

__all__ = ("HEALTH_METHOD", "PROCESS_METHOD", "Picker", "serve_picker")

PROCESS_METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
HEALTH_METHOD = "/grpc.health.v1.Health/Check"
_JSON = (b"content-type", b"application/json")
_TEXT = (b"content-type", b"text/plain; charset=utf-8")


class Picker:
    """The picker's services over one guard server's engine (see the module rules)."""

    def __init__(self, server: GuardServer, *, semantic_ttft: bool = True) -> None:
        self.server = server
        self.app = server.app
        self.relay = server.app.relay
        #: Where Envoy sends each backend's requests: ``host:port`` (an IP for ORIGINAL_DST).
        self.endpoints = tuple(f"{t.host}:{t.port}" for t in self.relay.targets)
        self.semantic_ttft = semantic_ttft
        self.nursery: trio.Nursery | None = None
        #: Response body messages read (semantic TTFT), and first useful events found in them.
        self.body_chunks_seen = 0
        self.body_bytes_scanned = 0
        self.first_tokens = 0

    def services(self) -> dict[str, Callable[[], CallHandler]]:
        """The methods served: ext_proc's ``Process`` and gRPC health's ``Check``."""
        return {PROCESS_METHOD: lambda: Exchange(self), HEALTH_METHOD: lambda: Health(self)}

    def ready(self) -> bool:
        """A decision to enforce: static mode, or the learner's from metrics."""
        if not self.server.settings.dynamic_enabled:
            return True
        return self.server.engine.state.gate.decision.source is DecisionSource.METRICS


class Health:
    """``grpc.health.v1.Health/Check``."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker

    def on_message(self, call: Call, message: bytes) -> None:
        try:
            service = health_service(message)
        except GrpcWireError:
            call.finish(GrpcStatus.INVALID_ARGUMENT, "bad health request")
            return
        if service in ("", "liveness"):
            status = HealthStatus.SERVING
        elif service in ("readiness", PROCESS_METHOD.split("/")[1]):
            status = HealthStatus.SERVING if self.picker.ready() else HealthStatus.NOT_SERVING
        else:
            call.finish(GrpcStatus.NOT_FOUND, "unknown service")
            return
        call.send(health_response(status))
        call.finish()

    def on_end(self, call: Call) -> None:
        return None

    def on_reset(self, call: Call) -> None:
        return None


class Exchange:
    """One HTTP request through Envoy, as one ext_proc call."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.notes = ExchangeNotes()
        self.slot: Slot | None = None
        #: The lanes whose in-flight gauges the admission raised (lowered at the end).
        self.lanes: tuple[LaneMetrics, ...] = ()
        self.waiting: trio.CancelScope | None = None
        self.backend: int | None = None
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.scanner: FirstUsefulEventScanner | None = None
        self.lane = Lane.DEFAULT
        self.started = trio.current_time()
        self.ended = False
        #: The admitted path the engine records; the backends of the body's model (None: any);
        #: the buffered body, when the pools needed it to choose.
        self.target = ""
        self.allowed: tuple[str, ...] | None = None
        self.body: bytes | None = None

    # -- the call's messages -------------------------------------------------------------------

    def on_message(self, call: Call, message: bytes) -> None:
        try:
            received = read(message)
        except ExtProcError as exc:
            self.end(499)
            call.finish(GrpcStatus.INVALID_ARGUMENT, str(exc))
            return
        phase = received.phase
        if phase == Phase.REQUEST_HEADERS:
            self.request_headers(call, received)
        elif phase == Phase.REQUEST_BODY and self.picker.app.model_pools is not None:
            self.admit(call, body=received.body)
        elif phase == Phase.RESPONSE_HEADERS:
            self.response_headers(call, received)
        elif phase == Phase.RESPONSE_BODY:
            self.response_body(call, received)
        else:
            call.send(carry_on(phase))

    def on_end(self, call: Call) -> None:
        """Envoy half-closed the call: the exchange is over."""
        self.end(self.status or 499)
        call.finish()

    def on_reset(self, call: Call) -> None:
        """Envoy reset the call: the exchange is over (or the client went away)."""
        self.end(self.status or 499)

    # -- the request ---------------------------------------------------------------------------

    def request_headers(self, call: Call, received: Received) -> None:
        app = self.picker.app
        headers = self.headers = received.headers
        method = first_header(headers, b":method") or b"GET"
        target = first_header(headers, b":path") or b"/"
        self.notes = ExchangeNotes(trace_id=app.trace_id(header_values(headers, b"x-request-id")))
        route = app.route_of(method, route_path(target), headers)
        if route is Route.ADMITTED:
            self.target = target.decode("latin-1").partition("?")[0]
            if app.model_pools is not None and not received.end_of_stream:
                call.send(carry_on(Phase.REQUEST_HEADERS))  # the body's model picks the pool
                return
            self.admit(call, body=None)
        elif route is Route.FORWARD:
            self.forward(call, slot_engine=None)
        elif route is Route.UNAUTHORIZED:
            self.refuse(call, 401, [_JSON], UNAUTHORIZED_JSON)
        elif route is Route.UPGRADE_REFUSED:
            self.refuse(call, 400, [_TEXT], b"upgrade not allowed on this route\n")
        else:  # unknown, or one of the guard's own routes (served on its HTTP listener)
            self.refuse(call, 404, [_TEXT], NOT_FOUND)

    def admit(self, call: Call, *, body: bytes | None) -> None:
        picker = self.picker
        app, notes, headers = picker.app, self.notes, self.headers
        tier, band, tenant = app.labels.of(lambda name: header_values(headers, name))
        length = content_length(headers) if body is None else len(body)
        self.lane = body_lane(length, app.body_thresholds)
        notes.admitted_path, notes.tier, notes.lane, notes.body_bytes = (
            True,
            tier,
            self.lane,
            length,
        )
        notes.band, notes.tenant = band, tenant
        engine = app.engine
        if body is not None and app.model_pools is not None:
            model = request_model(body)
            if model is not None:
                self.allowed = app.model_pools.backends_for(model)
                engine = app.pools.of_model(model)
        self.body = body
        attempt = engine.begin(
            tier,
            path=self.target,
            body_bytes=length,
            trace_id=notes.trace_id,
            band=band,
            tenant=tenant,
        )
        notes.request_id = attempt.request_id
        if attempt.result is not None:
            self.decided(call, attempt.result, engine)
            return
        assert picker.nursery is not None
        picker.nursery.start_soon(self.wait, call, attempt, engine)

    async def wait(self, call: Call, attempt: Attempt, engine: GuardEngine) -> None:
        scope = self.waiting = trio.CancelScope()
        with scope:
            result = await engine.settle(attempt)  # cancelled (the call ended): abandoned
        self.waiting = None
        if scope.cancelled_caught:
            return
        if call.closed:  # pragma: no cover - an ended call cancels the wait first
            engine.abandon(attempt)
            return
        self.decided(call, result, engine)
        call.flush_soon()

    def decided(self, call: Call, result: AdmissionResult, engine: GuardEngine) -> None:
        notes = self.notes
        notes.waited_s = result.waited_s
        notes.decision_s = max(0.0, trio.current_time() - self.started - result.waited_s)
        if result.slot is None:
            notes.admission, notes.code, notes.binding = (
                Admission.REFUSED,
                result.code,
                result.binding,
            )
            headers = self.picker.app.refusals.headers(result.retry_after_s)
            self.refuse(call, 429, list(headers), TOO_MANY_REQUESTS_BODY)
            return
        notes.admission = Admission.ADMITTED
        self.slot = result.slot
        self.lanes = self.picker.app.count_admitted(result.slot.tier, self.lane)
        self.forward(call, slot_engine=engine)

    def forward(self, call: Call, *, slot_engine: GuardEngine | None) -> None:
        picker = self.picker
        relay = picker.relay
        outside = pool_outside(relay.target_names, self.allowed)  # counted as tried
        key = None if relay.keying is None else relay.keying.key(self.headers, None)
        picked = relay.pick_backend(
            outside, key=key, body_bytes=self.notes.body_bytes, engine=slot_engine
        )
        if picked is None:  # no backend may take it: the guard's own 429
            if self.slot is not None:
                self.slot.release(429)
                self.slot = None
            headers = picker.app.refusals.headers(None)
            self.refuse(call, 429, list(headers), TOO_MANY_REQUESTS_BODY)
            return
        index, _probe = picked
        self.backend = index
        relay.send_to(index, self.notes, key, self.notes.body_bytes)
        extra = [(b"x-request-id", self.notes.trace_id.encode())]
        phase = Phase.REQUEST_BODY if self.body is not None else None
        call.send(route_to(picker.endpoints[index], extra, phase=phase))

    def refuse(
        self, call: Call, status: int, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> None:
        self.status = status
        call.send(answer(status, stamped(headers, self.notes.trace_id), body))
        self.end(status)
        call.finish()

    # -- the response --------------------------------------------------------------------------

    def response_headers(self, call: Call, received: Received) -> None:
        try:
            self.status = int(first_header(received.headers, b":status") or b"0")
        except ValueError:
            self.status = 502
        relay = self.picker.relay
        if self.backend is not None:
            relay.health.head(relay.target_names[self.backend], self.status)
        content_type = first_header(received.headers, b"content-type") or b""
        if (
            self.picker.semantic_ttft
            and self.slot is not None
            and b"text/event-stream" in content_type.lower()
        ):
            self.scanner = FirstUsefulEventScanner()
        trace = [(b"x-request-id", self.notes.trace_id.encode())]
        call.send(carry_on(Phase.RESPONSE_HEADERS, headers=trace))
        if received.end_of_stream:
            self.end(self.status)

    def response_body(self, call: Call, received: Received) -> None:
        self.picker.body_chunks_seen += 1
        scanner = self.scanner
        if scanner is not None:
            self.picker.body_bytes_scanned += len(received.body)
            if scanner.feed(received.body) and self.slot is not None:
                self.slot.first_token()
                self.picker.first_tokens += 1
            if scanner.done or scanner.limit_reached:
                self.scanner = None
        call.send(carry_on(Phase.RESPONSE_BODY))
        if received.end_of_stream:
            self.end(self.status)

    # -- the end -------------------------------------------------------------------------------

    def end(self, status: int) -> None:
        """The exchange is over: the slot back, the backend told, the outcome handed, once."""
        if self.ended:
            return
        self.ended = True
        picker = self.picker
        if self.waiting is not None:
            self.waiting.cancel()  # the wait abandons its attempt
        notes = self.notes
        notes.status = status
        notes.served_s = trio.current_time() - self.started
        if self.slot is not None:
            self.slot.release(status)
            for counted in self.lanes:
                counted.inflight.dec()
        if self.backend is not None:
            name = picker.relay.target_names[self.backend]
            picker.relay.pools.of_backend(name).tell(BackendFinished, name)
        if notes.admitted_path or self.backend is not None:
            picker.app.hand_outcome(notes.outcome())


async def serve_picker(
    server: GuardServer,
    host: str,
    port: int,
    *,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the endpoint picker over ``server``'s engine on ``host:port`` until cancelled."""
    picker = Picker(server)
    async with trio.open_nursery() as nursery:
        picker.nursery = nursery
        grpc = GrpcServer(picker.services())
        bound = await nursery.start(grpc.serve, host, port)
        server.picker = picker
        task_status.started(bound)
