"""Forwarding: one admitted or plain request to a backend, and its response back to the client.

Reads: the request head and body the proxy hands over, the backends' responses, the guard
engine's published state (backend choice, low load); time from trio.
Guarantees:
- a request goes to the backend the core's backend choice scores best, with the headers
  :func:`guard_adapters.exchange.upstream_headers` builds; a kept-alive backend connection
  that fails before the request was fully written is tried once more on a fresh one when the
  request can be sent again (its body is held, or it is idempotent);
- with several backends, each one's health is told to the core (:mod:`guard_trio._health`);
  a request none of whose bytes reached its backend, or refused unstarted by its engine (never
  passed to the client) with its body held, goes on to another backend, each at most once;
- exactly one response per request, or none when the client already left: a backend that fails
  before the response head gets the client PIG's 429, one silent past
  ``PIG_UPSTREAM_HEAD_TIMEOUT_SECONDS`` a 504, one that stalls mid-body past
  ``PIG_UPSTREAM_IDLE_TIMEOUT_SECONDS`` has both connections closed;
- the body is pumped by :mod:`guard_trio._copy` (chunked to an HTTP/1.1 client without h11,
  every other framing through it), under the idle guard;
- an upstream 500 the client caused is rewritten to 400/422 (spec 7) when enabled; the early
  bridge (spec 8.4) and SSE keep-alive run only under low load; in-flight counts per backend
  are core state, told on every path.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import h11
import trio

from guard_adapters._errors import BodyRewriteError
from guard_adapters.backends import RelayConfig, UpstreamTarget
from guard_adapters.exchange import (
    GATEWAY_TIMEOUT_BODY,
    chunked_passthrough,
    client_head,
    content_length,
    first_header,
    low_load,
    opens_bridge,
    upstream_headers,
    without_length,
)
from guard_adapters.model_pools import outside as pool_outside
from guard_adapters.openai_body import StreamingRewriter
from guard_adapters.outcome import Bridge, Disconnect, ExchangeNotes
from guard_adapters.sse import FirstUsefulEventScanner
from guard_core import Lane, Tier
from guard_core.backend_pick import pick_backend
from guard_core.health import ProbeSent
from guard_core.traffic import BackendFinished, BackendForwarded
from guard_core.upstream_errors import BODY_LIMIT, is_candidate, reclassify
from guard_trio._copy import KEEPALIVE_COMMENT, Watch, copy_body, copy_chunked, send_head
from guard_trio._downstream import ClientGone, Downstream, ResponseAborted, read_up_to
from guard_trio._engine import GuardEngine, Slot
from guard_trio._health import BackendHealthReports, EngineRefused
from guard_trio._upstream import (
    IdleGuard,
    UpstreamConnection,
    UpstreamError,
)

if TYPE_CHECKING:
    from guard_trio._proxy import ProxyApp

__all__ = ("BRIDGE_GRACE_S", "Relay")

_JSON = (b"content-type", b"application/json")
#: ``SSE_EARLY_BRIDGE_ENABLED``: how long a streamed request waits for the backend's head before
#: the client gets its 200 stream anyway.
BRIDGE_GRACE_S = 0.5
_BRIDGE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS"})


class Relay:
    """The forwarding half of the proxy, shared by all connections (see the module rules)."""

    def __init__(self, app: ProxyApp) -> None:
        self.app = app
        self.settings = settings = app.settings
        self.metrics = app.metrics
        self.engine = app.engine
        #: The engine of each backend's pool (one for all without ``PIG_POOLS``).
        self.pools = app.pools
        self.pool = app.pool
        #: What forwarding reads of the settings (:class:`guard_adapters.backends.RelayConfig`).
        self.config = config = RelayConfig.of(settings)
        self.targets = config.targets
        self.backend_metrics = tuple(self.metrics.backends[t.name] for t in self.targets)
        self.target_names = tuple(t.name for t in self.targets)
        self.health = BackendHealthReports(self.pools.of_backend, backends=len(self.targets))
        self.keying = config.keying

    def low_load(self, slot: Slot | None = None) -> bool:
        """PIG's gate for SSE keep-alive and the early bridge: quiet backend, empty queue (of
        the pool the slot was taken in)."""
        engine = self.engine if slot is None else slot.engine
        return low_load(engine.state.gate, dynamic=self.settings.dynamic_enabled)

    def pick_backend(
        self,
        tried: frozenset[int] = frozenset(),
        *,
        key: int | None = None,
        body_bytes: int | None = None,
        engine: GuardEngine | None = None,
    ) -> tuple[int, bool] | None:
        """The backend to send to (:func:`guard_core.backend_pick.pick_backend`, over the state
        of ``engine``, the pool's), and whether the request is its half-open probe (told to the
        core); ``tried``: backends it already went to (``None``: no other one takes work)."""
        if len(self.targets) == 1:
            return None if tried else (0, False)
        engine = engine or self.engine
        now = engine.seconds_since_start()
        picked = pick_backend(
            engine.state,
            self.target_names,
            self.config.routing,
            now=now,
            key=key,
            body_bytes=body_bytes,
            tried=tried,
        )
        if picked is None:
            return None
        if picked.probe:
            engine.tell(ProbeSent, self.target_names[picked.index])
        self.backend_metrics[picked.index].routed[picked.reason].inc()
        return picked.index, picked.probe

    async def forward(  # noqa: PLR0915 - one request's attempts, read top to bottom
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
        allowed: tuple[str, ...] | None = None,
        lead: list[bytes] | None = None,
    ) -> int:
        """Forward one request and relay the response; returns the status the client got.
        ``allowed``: the backends of the request's model (``PIG_POOLS``); None: any."""
        proxy_started = trio.current_time()
        body_length = sum(len(c) for c in body) if body is not None else content_length(headers)
        key = None if self.keying is None else self.keying.key(headers, body)
        outside = pool_outside(self.target_names, allowed)  # counted as tried: never picked
        engine = self.engine if slot is None else slot.engine
        picked = self.pick_backend(outside, key=key, body_bytes=body_length, engine=engine)
        assert picked is not None
        index, probe = picked
        upstream = partial(
            upstream_headers,
            headers,
            peer=down.peer.encode(),
            tier=tier,
            lane=lane,
            body_length=None if rewriter is not None else body_length,  # a rewrite goes chunked
            output_tokens=output_tokens,
            trace_id=down.notes.trace_id.encode(),
        )
        notes = down.notes
        target = self.send_to(index, notes, key, body_length)
        status = 0
        bridge = (
            self.config.sse_early_bridge
            and slot is not None
            and rewriter is None
            and opens_bridge(headers, body, quiet=self.low_load(slot))
        )
        # A request whose body we hold (or that has none) can be sent again when a kept-alive
        # connection fails before the request was fully written. Once it was written, only an
        # idempotent one is: a POST the backend may have started must not generate twice.
        replayable = body is not None or (body_length == 0 and rewriter is None)
        idempotent = request.method in _IDEMPOTENT
        tried = {index, *outside}
        up: UpstreamConnection | None = None
        try:
            with trio.move_on_after(self.config.proxy_timeout_s) as deadline:
                fresh = False
                while True:
                    reused = written = False
                    up = None
                    try:
                        async with self.pool.connection(target, fresh=fresh) as up:
                            reused = up.reused
                            upstream_request = h11.Request(
                                method=request.method,
                                target=target.base_path.encode() + request.target,
                                headers=upstream(
                                    authority=target.authority.encode(),
                                    backend=target.name.encode(),
                                ),
                            )
                            if body is not None and rewriter is None:
                                # A held body goes out with the head, in one write.
                                data = (h11.Data(data=chunk) for chunk in body if chunk)
                                await up.send(upstream_request, *data, h11.EndOfMessage())
                            else:
                                await up.send(upstream_request)
                                await self.send_body(down, up, body, rewriter, lead)
                            written = True
                            status = await self.relay_response(
                                down, up, slot, proxy_started, method=request.method, bridge=bridge
                            )
                        break
                    except (UpstreamError, EngineRefused) as exc:
                        refused = isinstance(exc, EngineRefused)
                        if (
                            not refused
                            and not fresh
                            and reused
                            and replayable
                            and (idempotent or not written)
                            and down.can_respond
                        ):
                            fresh = True  # a stale kept-alive connection: once more, fresh
                            continue
                        again = None
                        if self.health.go_on(exc, target.name, up, down.can_respond, replayable):
                            again = self.pick_backend(
                                frozenset(tried), key=key, body_bytes=body_length, engine=engine
                            )
                        if again is None:
                            probe = False  # its verdict is told
                            return await self.upstream_failed(down, refused=refused)
                        self.pools.of_backend(target.name).tell(BackendFinished, target.name)
                        (index, probe), fresh = again, False
                        tried.add(index)
                        target = self.send_to(index, notes, key, body_length)
            if deadline.cancelled_caught:
                if down.can_respond:
                    await down.skip_body()
                    await self.app.too_many_requests(down)
                    return 429
                raise ResponseAborted("PROXY_TIMEOUT_SECONDS reached mid-response")
        except ClientGone:
            notes.disconnect = Disconnect.RESPONSE if status else Disconnect.UPSTREAM
            raise
        finally:
            if probe:
                self.health.probe_ended(target.name, up)
            self.pools.of_backend(target.name).tell(BackendFinished, target.name)
            notes.proxy_s = trio.current_time() - proxy_started
        return status

    def send_to(
        self,
        index: int,
        notes: ExchangeNotes,
        key: int | None = None,
        body_bytes: int | None = None,
    ) -> UpstreamTarget:
        """The request goes to backend ``index`` now: noted, counted, told to the core (with
        its id, and with affinity on its prefix key and body size, for the router's memory)."""
        target = self.targets[index]
        notes.backend = target.name
        placement = () if self.keying is None else (key, body_bytes)
        self.pools.of_backend(target.name).tell(
            BackendForwarded, target.name, notes.request_id, *placement
        )
        self.backend_metrics[index].accepted.inc()  # a moment, not an outcome: counted now
        return target

    async def send_body(
        self,
        down: Downstream,
        up: UpstreamConnection,
        body: list[bytes] | None,
        rewriter: StreamingRewriter | None = None,
        lead: list[bytes] | None = None,
    ) -> None:
        """The request body upstream: the buffered chunks, or streamed as the client sends it,
        after its ``lead`` (the part already read) when there is one (through the streaming
        priority rewriter when there is one)."""
        if body is not None:
            for chunk in body:
                await up.send(h11.Data(data=chunk))
            await up.send(h11.EndOfMessage())
            return
        try:
            for chunk in lead or ():
                data = chunk if rewriter is None else rewriter.feed(chunk)
                if data:
                    await up.send(h11.Data(data=data))
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
            down.notes.note_priority("failed")
            raise UpstreamError(f"request body rewrite failed: {exc}") from None
        if rewriter is not None:
            down.notes.note_priority("rewritten")
        await up.send(h11.EndOfMessage())

    async def upstream_failed(self, down: Downstream, *, refused: bool = False) -> int:
        """The backend failed: a 429 if the client has seen nothing yet, else cut the response.
        ``refused``: it did not fail, its engine refused the request (the guard's own 429)."""
        notes = down.notes
        if not refused:
            notes.upstream_errors += 1
            notes.backend_failed = True
        if down.can_respond:
            await down.skip_body()
            await self.app.too_many_requests(down)
            return 429
        notes.mid_response_failure = True
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
        head_deadline = started + self.config.head_timeout_s
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
                self.health.stalled(up.target.name)
                return await self.head_timed_out(down)
        received = list(event.headers)
        status = event.status_code
        plan = client_head(
            status,
            received,
            classify_errors=self.config.classify_errors,
            keepalive_allowed=self.config.sse_keepalive and self.low_load(slot),
            reclassifiable=is_candidate(
                status,
                first_header(received, b"content-type") or b"",
                content_length(received),
            ),
        )
        headers = plan.headers
        if self.health.refuses(up.target.name, status, can_respond=down.can_respond):
            raise EngineRefused(up.target.name)  # unstarted: another backend, or our own 429
        if not plan.reclassify:
            self.health.head(up.target.name, status)
        if plan.reclassify:
            return await self.relay_error(
                down, up, event, headers=headers, content_type=plan.content_type, started=started
            )
        scanner = FirstUsefulEventScanner() if slot is not None and plan.event_stream else None
        keepalive = plan.keepalive
        down.notes.keepalive_stream = keepalive
        head = down.head(status, headers, event.reason)
        down.notes.ttfb_s = trio.current_time() - started
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
        fast = chunked_passthrough(
            upstream.headers,
            status=upstream.status_code,
            method=method,
            client_version=down.h11.their_http_version or b"",
        )
        with IdleGuard(self.config.idle_timeout_s) as guard:
            watch = Watch(
                guard, self.metrics.sse_keepalive_comments, scanner, slot, keepalive=keepalive
            )
            if fast:
                await copy_chunked(down, up, head, watch)
            elif head is None or await send_head(down, up, head, watch):
                await copy_body(down, up, watch)

    async def head_timed_out(self, down: Downstream) -> int:
        """The backend sent no response head within its budget: 504, the connection closed."""
        down.notes.upstream_errors += 1
        if not down.can_respond:
            raise ResponseAborted("no response head from the backend in time")
        await down.skip_body()
        await down.respond(504, [_JSON, (b"connection", b"close")], GATEWAY_TIMEOUT_BODY)
        down.gone = True  # the exchange is abandoned mid-way: close the connection
        return 504

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
        notes = down.notes
        notes.bridge = Bridge.OPENED
        notes.keepalive_stream = True
        self.metrics.sse_keepalive_comments.inc()  # comments are counted as they go out
        notes.ttfb_s = trio.current_time() - started
        head = down.head(200, _BRIDGE_HEADERS, b"OK")
        await down.send(head, h11.Data(data=KEEPALIVE_COMMENT))
        event: h11.Response | None = None
        try:
            with trio.move_on_at(head_deadline):
                event = await up.read_head()
            if event is None:
                notes.upstream_errors += 1
                self.health.stalled(up.target.name)
                raise ResponseAborted("no response head from the backend in time")
            self.health.head(up.target.name, event.status_code)
            content_type = next((v for k, v in event.headers if k == b"content-type"), b"")
            if event.status_code != 200 or b"text/event-stream" not in content_type.lower():
                notes.bridge = Bridge.INVALID_UPSTREAM
                while not isinstance(await up.next_event(), h11.EndOfMessage):
                    pass  # the body is discarded; the client gets an empty stream
                await down.send(h11.EndOfMessage())
                return 200
        except UpstreamError:
            notes.bridge = Bridge.UPSTREAM_ERROR
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
        chunks, end = await read_up_to(up.next_event, BODY_LIMIT)
        complete = end is not None
        down.notes.ttfb_s = trio.current_time() - started
        if complete:
            body = b"".join(chunks)
            rewritten = reclassify(status, content_type, body)
            self.health.head(up.target.name, rewritten.status if rewritten is not None else status)
            if rewritten is not None:
                await down.respond(rewritten.status, without_length(headers), rewritten.body)
                return rewritten.status
            await down.respond(status, without_length(headers), body)
            return status
        # Longer than 64 KiB: pass it through untouched, the part already read first.
        self.health.head(up.target.name, status)
        await down.send(
            down.head(status, headers, event.reason),
            h11.Data(data=b"".join(chunks)),
        )
        with IdleGuard(self.config.idle_timeout_s) as guard:
            await copy_body(down, up, Watch(guard, self.metrics.sse_keepalive_comments))
        return status
