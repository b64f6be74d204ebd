"""Routing and admission: what the guard does with each request (spec 1, 4, 6).

Reads: the request head and body from :class:`~guard_trio._downstream.Downstream`, the settings
and the guard engine's decisions.
Guarantees:
- the route is :class:`guard_adapters.exchange.Routes`' (PIG's order; a target a backend could
  read as another path, or a look-alike of a known route, gets 404 before any check); the
  token check is :func:`~guard_adapters.exchange.token_matches` (constant time); the target is
  forwarded as received, by :class:`~guard_trio._relay.Relay`;
- a request the gate would refuse at once is refused before its body is parsed, and before it
  is read unless it is short (at most 64 KiB declared), with ``Connection: close`` when body
  bytes remain unread; on a kept-alive connection the fast reader's request is answered from
  its head (:meth:`ProxyApp.admit_simple`), judged once;
- exactly one response per request, or none when the client already left; a slot taken for a
  request is released exactly once on every path (success, error, timeout, cancellation);
- refusals and internal errors answer PIG's 429 body (with ``Retry-After`` unless
  ``PIG_RETRY_AFTER_SECONDS=0``); internal reasons never reach the client;
- a client that disconnects while its request waits or is being served cancels the wait or the
  upstream exchange at once.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial

import h11
import trio

from guard_adapters._errors import BodyRewriteError
from guard_adapters.answers import RefusalAnswers
from guard_adapters.config import Settings
from guard_adapters.exchange import (
    BAD_ENCODING_BODY,
    TOO_MANY_REQUESTS_BODY,
    Route,
    Routes,
    admitted_post,
    content_length,
    first_header,
    framed,
    header_values,
    peek_first,
    route_path,
    token_digest,
    token_matches,
)
from guard_adapters.flow_headers import RequestLabels, band_priority
from guard_adapters.http_head import SimpleRequest
from guard_adapters.model_pools import request_model
from guard_adapters.openai_body import (
    Plan,
    StreamingRewriter,
    as_utf8_json,
    output_token_intent,
    rewrite,
)
from guard_adapters.openai_body import plan as body_plan
from guard_adapters.outcome import (
    Admission,
    Disconnect,
    ExchangeNotes,
    ExchangeOutcome,
    TraceIds,
)
from guard_core import (
    Lane,
    RejectCode,
    Tier,
    body_lane,
)
from guard_core.lanes import (
    DEFAULT_OUTPUT_THRESHOLDS,
    Thresholds,
    combine_lanes,
    output_lane,
)
from guard_core.traffic import OutputIntentObserved, RefusedAfterAdmission
from guard_trio._attestation import AttestationHandler
from guard_trio._downstream import Downstream
from guard_trio._engine import AdmissionResult, Attempt, GuardEngine, PoolEngines
from guard_trio._metrics_instruments import LaneMetrics
from guard_trio._observability import GuardMetrics
from guard_trio._own_routes import answer_own
from guard_trio._pools import choose_pool
from guard_trio._relay import Relay
from guard_trio._upstream import UpstreamPool

__all__ = ("TOO_MANY_REQUESTS_BODY", "ProxyApp")


_JSON = (b"content-type", b"application/json")
_TEXT = (b"content-type", b"text/plain; charset=utf-8")
_BUFFER_LIMIT = 2 * 1024 * 1024
#: ``rewrite_body``'s answer when the request must be refused (fail-closed injection).
_REFUSE = object()
#: ``rewrite_body``'s answer for a JSON body in UTF-16 or UTF-32: the backend would read it,
#: the rewrite cannot, so forwarding it would let a client choose its own priority.
_BAD_ENCODING = object()
#: Buffered rewrites of bodies larger than this run in a worker thread.
_REWRITE_IN_THREAD_BYTES = 256 * 1024


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
        pools: PoolEngines | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.body_thresholds = settings.lane_thresholds.body
        #: The first pool's engine (PIG's only one); ``pools`` has each pool's.
        self.engine = engine
        self.pools = pools or PoolEngines(engine)
        self.pool = pool
        self.local_metrics = local_metrics
        self.metrics_content_type = metrics_content_type
        env = settings.env
        self.expected_digest = token_digest(env.token)
        self.routes = Routes.build(
            admitted=settings.paths,
            auth=settings.auth_paths,
            api_auth=env.api_auth_enabled,
            forward=env.pig_forward_paths,
            models_union=settings.model_pools is not None,
        )
        self.refusals = RefusalAnswers(
            str(env.pig_retry_after_seconds).encode() if env.pig_retry_after_seconds > 0 else None,
            predicted=settings.retry_after_predicted,
        )
        #: The request's ``X-Request-Id``: the client's when sane, else the guard's own.
        self.trace_id = TraceIds(os.urandom(4).hex())
        #: Told every exchange's outcome, once, in order: the metrics first.
        self.outcome_listeners: list[Callable[[ExchangeOutcome], None]] = [metrics.record_exchange]
        self.attestation_enabled: bool = env.attestation_enabled
        self.attestation = AttestationHandler(settings)
        self.injection = settings.injection_policy()
        self.rewrites_in_flight = 0
        self.classify = env.classify_output_tokens
        self.classify_body_bytes = env.json_classify_body_bytes
        self.classify_fields = env.output_token_field_names
        self.adaptive_config = settings.adaptive_output
        self.output_thresholds = settings.lane_thresholds.output
        self.relay = Relay(self)
        #: ``PIG_POOLS``: the backends of each routed model (None: PIG's single pool).
        self.model_pools = settings.model_pools
        flow = settings.flow_config
        #: Flow control's bands (None: PIG's tiers, no band label) and tenant header.
        self.bands = None if flow is None else flow.bands
        self.labels = RequestLabels(self.bands, settings.tenant_header)

    # -- small responses -----------------------------------------------------------------------

    async def too_many_requests(self, down: Downstream, predicted_s: int | None = None) -> None:
        """The standard 429. ``predicted_s`` is an admission refusal's predicted Retry-After,
        sent in place of ``PIG_RETRY_AFTER_SECONDS`` when ``PIG_RETRY_AFTER_MODE`` is
        ``predicted``; ``PIG_RETRY_AFTER_SECONDS=0`` sends no Retry-After at all."""
        await down.respond(429, list(self.refusals.headers(predicted_s)), TOO_MANY_REQUESTS_BODY)

    def admit_simple(
        self, request: SimpleRequest, body: bytes = b""
    ) -> tuple[Attempt | None, bytes | None]:
        """The fast reader's request: answered here when it is an admission that is refused at
        once (the 429's bytes, already counted), else handed on (the attempt, when one was made).

        Only a POST to an admitted path gets this far; every other route, and a request the API
        token check would refuse, returns ``(None, None)`` and takes the full path unchanged.
        """
        if request.method != b"POST":
            return None, None
        engine = self.engine
        if self.model_pools is not None:  # ``body``: the whole body, to read its model from
            model = request_model(body)
            if model is None or self.model_pools.backends_for(model) is None:
                return None, None  # the full path serves it unrouted, or answers its 404
            engine = self.pools.of_model(model)
        route = admitted_post(self.routes, request.target)
        if route is None:
            return None, None
        raw_path, token_checked = route
        if token_checked and not self.authorized(list(request.headers)):
            return None, None
        tier, band, tenant = self.labels.of(request.values)
        length = request.body_length
        trace_id = self.trace_id(request.values(b"x-request-id"))
        attempt = engine.begin(
            tier, path=raw_path, body_bytes=length, trace_id=trace_id, band=band, tenant=tenant
        )
        result = attempt.result
        if result is None or result.code is None:
            return attempt, None  # admitted or queued: the full path serves it
        # The decision took from the attempt's arrival (engine time) to now.
        started = engine.started_at(attempt)
        self.hand_outcome(
            ExchangeNotes(
                trace_id=trace_id,
                request_id=attempt.request_id,
                admitted_path=True,
                tier=tier,
                band=band,
                tenant=tenant,
                lane=body_lane(length, self.body_thresholds),
                body_bytes=length,
                admission=Admission.REFUSED,
                code=result.code,
                binding=result.binding,
                decision_s=max(0.0, trio.current_time() - started),
                status=429,
            ).outcome()
        )
        return None, self.refusals.whole(result.retry_after_s, trace_id)

    # -- the exchange's id and outcome ---------------------------------------------------------

    def begin_exchange(
        self, down: Downstream, request: h11.Request, begun: Attempt | None = None
    ) -> None:
        """Fresh notes for ``request``, with its id (a fast-read request's came with it)."""
        trace_id = (
            begun.trace_id
            if begun is not None
            else self.trace_id([v for n, v in request.headers if n == b"x-request-id"])
        )
        down.notes = ExchangeNotes(trace_id=trace_id)
        down.exchange_open = True

    def end_exchange(self, down: Downstream) -> None:
        """Hand the outcome of ``down``'s exchange to every listener, once: as soon as its
        response is done (before any other task runs), or when the server is done with it."""
        if down.exchange_open:
            down.exchange_open = False
            self.hand_outcome(down.notes.outcome())

    def hand_outcome(self, outcome: ExchangeOutcome) -> None:
        for listener in self.outcome_listeners:
            listener(outcome)

    def route_of(
        self, method: bytes, path: str | None, headers: list[tuple[bytes, bytes]]
    ) -> Route:
        """The request's route (``Routes.route``), with the token checked where it is needed."""
        token_checked = path is not None and self.routes.needs_token(method, path)
        return self.routes.route(
            method,
            path,
            upgrade=bool(header_values(headers, b"upgrade")),
            authorized=token_checked and self.authorized(headers),
        )

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Exactly one Authorization header, equal in constant time to ``Bearer <TOKEN>``."""
        return token_matches(headers, self.expected_digest)

    # -- routing -------------------------------------------------------------------------------

    async def handle(
        self, down: Downstream, request: h11.Request, begun: Attempt | None = None
    ) -> None:
        """Serve one request; ``begun``: its admission, already attempted by the fast reader
        (:meth:`admit_simple`), which only a POST to an admitted path has."""
        path = route_path(request.target)
        headers = framed(request.headers)
        method = request.method
        route = self.route_of(method, path, headers)
        if route is Route.ADMITTED:
            await self.admitted(down, request, headers, begun)
        elif route is Route.FORWARD:
            await self.relay.forward(down, request, headers, slot=None, tier=None)
        else:
            await down.skip_body()
            await answer_own(self, down, route, request, headers)

    async def read_body(self, down: Downstream, limit: int) -> tuple[list[bytes], bool]:
        """Read up to ``limit`` bytes of body; returns (chunks, complete)."""
        return await down.read_body(limit)

    # -- QoS -----------------------------------------------------------------------------------

    async def admitted(
        self,
        down: Downstream,
        request: h11.Request,
        headers: list[tuple[bytes, bytes]],
        begun: Attempt | None = None,
    ) -> None:
        """QoS: wait for a slot (or a refusal), then forward; the slot is released once."""
        tier, band, tenant = self.labels.of(lambda name: header_values(headers, name))
        length = content_length(headers)
        lane = body_lane(length, self.body_thresholds)
        notes = down.notes
        notes.admitted_path, notes.tier, notes.lane, notes.body_bytes = True, tier, lane, length
        notes.band, notes.tenant = band, tenant
        path = request.target.decode("latin-1").partition("?")[0]
        pooled = self.model_pools is not None
        # Refused from the head alone: the body is neither read nor parsed for the 429, and
        # nothing is awaited before the attempt below, which the same state refuses at once.
        early = (
            begun is None
            and peek_first(length, classify=self.classify, pooled=pooled)
            and self.engine.refuses_at_once(tier, length, band, tenant)
        )
        body: list[bytes] | None = None
        # A client waiting for 100 Continue gets it only once admitted (the body is read then).
        if (
            not early
            and length is not None
            and length <= _BUFFER_LIMIT
            and not down.h11.they_are_waiting_for_100_continue
        ):
            body, _complete = await self.read_body(down, _BUFFER_LIMIT)
        allowed: tuple[str, ...] | None = None
        engine, lead = self.engine, None
        if self.model_pools is not None:
            chosen = await choose_pool(self, down, body)
            if chosen is None:
                return  # an unknown model: answered 404 before any slot was asked for
            body, lead, allowed, engine = chosen
            if begun is not None and begun.engine is not None:
                engine = begun.engine  # the fast reader began it in its model's pool
        output_tokens = self.output_intent(lane, length, body)
        if output_tokens is not None:
            lane = combine_lanes(lane, output_lane(output_tokens, self.current_output_thresholds()))
            notes.lane = lane
        started = trio.current_time()
        result: AdmissionResult | None = None
        trace_id = notes.trace_id
        with trio.CancelScope() as client:  # cancelled when the client leaves
            # Once the request is read to its end (now, or after it is streamed upstream),
            # a closed client cancels everything: the wait, the upstream exchange.
            if not early:  # answered at once: nothing to watch
                down.watch(client)
            try:
                begun = begun or engine.begin(
                    tier, path=path, body_bytes=length, trace_id=trace_id, band=band, tenant=tenant
                )
                notes.request_id = begun.request_id
                result = await engine.settle(begun)
                self.note_decision(notes, result, started)
                if result.slot is not None:
                    notes.admission = Admission.ADMITTED
                    await self.serve_slot(
                        down,
                        request,
                        headers,
                        result,
                        lane=lane,
                        body=body,
                        started=started,
                        output_tokens=output_tokens,
                        allowed=allowed,
                        lead=lead,
                    )
                    self.end_exchange(down)
            finally:
                down.unwatch()
        if result is None:  # the client left while waiting
            notes.admission, notes.disconnect = Admission.ABANDONED, Disconnect.QUEUE
            return
        if result.code is not None and not down.gone:
            notes.admission, notes.code = Admission.REFUSED, result.code
            notes.binding = result.binding
            await down.skip_body()
            await self.too_many_requests(down, result.retry_after_s)

    @staticmethod
    def note_decision(notes: ExchangeNotes, result: AdmissionResult, started: float) -> None:
        notes.waited_s = result.waited_s
        notes.decision_s = max(0.0, trio.current_time() - started - result.waited_s)

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
        allowed: tuple[str, ...] | None = None,
        lead: list[bytes] | None = None,
    ) -> None:
        """Forward an admitted request (to one of the ``allowed`` backends, when its model
        names them); account for it and release its slot on every path."""
        slot = result.slot
        assert slot is not None
        notes = down.notes
        metrics = self.metrics
        lanes = self.count_admitted(slot.tier, lane)
        decided = trio.current_time()
        status = 499
        plan = body_plan(
            self.injection,
            tier=slot.tier,
            content_type=first_header(headers, b"content-type"),
            content_length=notes.body_bytes,  # admitted's content_length(headers)
            slot_free=self.rewrites_in_flight < self.injection.rewrite_limit,
        )
        plan = band_priority(self.bands, notes.band, plan)  # a band's own priority, if any
        for name in plan.counts:
            notes.note_priority(name)
        try:
            if plan.uses_slot:
                self.rewrites_in_flight += 1
                metrics.priority_rewrite_inflight.inc()
            try:
                rewritten = await self.rewrite_body(down, plan, body, notes.body_bytes, lead)
            finally:
                if plan.uses_slot:
                    self.rewrites_in_flight -= 1
                    metrics.priority_rewrite_inflight.dec()
            if rewritten is _BAD_ENCODING:
                await down.skip_body()
                await down.respond(400, [_JSON], BAD_ENCODING_BODY)
                status = 400
                return
            if rewritten is _REFUSE:
                notes.code = RejectCode.BACKEND_PRIORITY_INJECTION
                slot.engine.tell(RefusedAfterAdmission, slot.tier)
                await down.skip_body()
                await self.too_many_requests(down)
                status = 429
                return
            status = await self.relay.forward(
                down,
                request,
                headers,
                slot=slot,
                tier=slot.tier,
                lane=lane,
                body=rewritten if isinstance(rewritten, list) else body,
                rewriter=rewritten if isinstance(rewritten, StreamingRewriter) else None,
                output_tokens=output_tokens,
                allowed=allowed,
                lead=None if isinstance(rewritten, list) else lead,  # a rewrite holds it all
            )
        finally:
            slot.release(status)
            ended = trio.current_time()
            notes.served_s = elapsed = ended - started
            notes.overhead_s = max(0.0, elapsed - result.waited_s - (ended - decided))
            notes.status = 499 if down.gone else status
            for counted in lanes:
                counted.inflight.dec()

    def count_admitted(self, tier: Tier, lane: Lane) -> tuple[LaneMetrics, LaneMetrics]:
        """An admission's moments and levels, counted as they happen (not outcomes): the tier's
        and the lanes' accepted counts and in-flight gauges; the caller lowers the gauges of
        the lanes returned when the request ends."""
        metrics = self.metrics
        metrics.tier_accepted[tier].inc()
        lanes = (metrics.lanes[lane], metrics.lanes[Lane.GLOBAL])
        for counted in lanes:
            counted.accepted.inc()
            counted.inflight.inc()
        return lanes

    def output_intent(self, lane: Lane, length: int | None, body: list[bytes] | None) -> int | None:
        """Spec 6.4: the requested output tokens, when classification is on and the body is read."""
        if not self.classify or lane is Lane.UNKNOWN_BODY or body is None:
            return None
        if length is None or length > self.classify_body_bytes:
            return None
        # The walk is synchronous here, so the JSON_CLASSIFY_LIMIT slots are never all busy.
        tokens = output_token_intent(b"".join(body), self.classify_fields)
        if tokens is not None and self.adaptive_config is not None:
            self.engine.tell(OutputIntentObserved, tokens)
        return tokens

    def current_output_thresholds(self) -> Thresholds:
        if self.adaptive_config is None:
            return self.output_thresholds or DEFAULT_OUTPUT_THRESHOLDS
        state = self.engine.state
        return state.traffic.adaptive.effective(
            self.adaptive_config, state.published.decision.state
        )

    async def rewrite_body(
        self,
        down: Downstream,
        plan: Plan,
        body: list[bytes] | None,
        length: int | None,
        lead: list[bytes] | None = None,
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
            rest, _complete = await self.read_body(down, length)
            body = [*(lead or ()), *rest]
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
                down.notes.note_priority(counter)
            return body if plan.fail_open else _REFUSE
        counter = plan.outcome_counter(ok=True)
        if counter is not None:
            down.notes.note_priority(counter)
            down.notes.priority_rewrite_s = trio.current_time() - started
        return [new]
