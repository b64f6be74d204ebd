"""The guard's HTTP server: listeners, connections, the poller, and graceful drain.

Reads: the validated :class:`~guard_adapters.config.Settings`.
Guarantees:
- every connection is served by h11 with keep-alive; a malformed or hostile request head gets
  its status (400, 408, 431) and the connection is closed; an unexpected internal error answers
  the standard 429 when a response is still possible, and never takes the server down;
- the head must arrive within ``PIG_HEADER_TIMEOUT_SECONDS``; a body over ``PIG_MAX_BODY_BYTES``
  (declared or counted) gets a JSON 413, one slower than ``PIG_BODY_IDLE_TIMEOUT_SECONDS`` between
  reads or ``PIG_BODY_TIMEOUT_SECONDS`` in all a JSON 408, when a response can still be sent;
  the connection is closed after either;
- the poller runs when dynamic mode is enabled; the status line is logged every
  ``PIG_STATUS_LOG_INTERVAL_SECONDS`` when it is positive;
- drain (:meth:`GuardServer.drain`): stop accepting, close every idle keep-alive connection at
  once, mark the busy ones so that their current response says ``Connection: close`` (where its
  head is still to be sent) and they close after it, let in-flight requests finish for up to
  ``PIG_DRAIN_SECONDS``, then cancel what is left.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import attrs
import h11
import trio

from guard_adapters.answers import (
    BodyLimits,
    BodyRefused,
    RefusedRequest,
    body_refusal,
    head_refusal,
)
from guard_adapters.backends import poll_sources
from guard_adapters.config import Settings
from guard_adapters.outcome import ExchangeNotes
from guard_adapters.status_line import runtime_counts, startup_line, status_line
from guard_core import GuardConfig
from guard_trio import __version__
from guard_trio._downstream import ClientGone, Downstream, ResponseAborted
from guard_trio._engine import Attempt, GuardEngine, PoolEngines, RequestListener
from guard_trio._observability import CONTENT_TYPE, GuardMetrics
from guard_trio._poller import Poller, PollReport
from guard_trio._proxy import ProxyApp
from guard_trio._upstream import UpstreamPool

if TYPE_CHECKING:
    from guard_trio._picker import Picker

__all__ = ("GuardServer",)

log = logging.getLogger("inference_guard")


class GuardServer:
    """One guard: engine, proxy, poller, and the connections it serves."""

    def __init__(
        self,
        settings: Settings,
        *,
        on_event: RequestListener | None = None,
        on_poll: Callable[[PollReport], None] | None = None,
        local_metrics: Callable[[], bytes] | None = None,
        header_timeout_s: float | None = None,
    ) -> None:
        self.settings = settings
        # The adaptive output lanes' samples are core state; their settings join the core's.
        config = attrs.evolve(settings.guard_config(), adaptive_output=settings.adaptive_output)
        ids = itertools.count(1)  # request ids, unique across the pools' engines
        self.engine = GuardEngine(config, on_event=on_event, ids=ids)
        self.pools = _pool_engines(settings, self.engine, config, ids)
        self.pool = UpstreamPool()
        self.metrics = GuardMetrics(
            settings,
            lambda: self.engine.state,
            version=__version__,
            clock=self.engine.seconds_since_start,
        )
        if settings.model_pools is not None:
            pools = self.pools
            self.metrics.pooled = True
            self.metrics.pool_states = lambda: tuple((e.name, e.state) for e in pools.engines)
            self.metrics.state_of_backend = lambda name: pools.of_backend(name).state
        self.app = ProxyApp(
            settings,
            self.engine,
            self.pool,
            metrics=self.metrics,
            local_metrics=local_metrics or self.metrics.exposition,
            metrics_content_type=CONTENT_TYPE.encode(),
            pools=self.pools,
        )
        env = settings.env
        self.header_timeout_s = (
            float(env.pig_header_timeout_seconds) if header_timeout_s is None else header_timeout_s
        )
        self.body_limits = BodyLimits(
            max_bytes=int(env.pig_max_body_bytes),
            idle_timeout_s=float(env.pig_body_idle_timeout_seconds),
            total_timeout_s=float(env.pig_body_timeout_seconds),
        )
        sources = poll_sources(settings)
        interval_s = settings.env.dynamic_poll_interval_ms / 1000
        # Each pool's engine learns from its own backends' pages; the first pool's poller is
        # the one the recorder, the metrics page and the admin plane follow.
        self.pollers = [
            Poller(
                engine,
                tuple(s for s in sources if self.pools.of_backend(s.name) is engine)
                if len(self.pools.engines) > 1
                else sources,
                interval_s=interval_s,
                on_round=on_poll if engine is self.engine else None,
            )
            for engine in self.pools.engines
        ]
        self.poller = self.pollers[0]
        self.poller.on_round.append(self._account_poll)
        #: ``inference-guard epp``: the endpoint picker over this server's engine, once it serves.
        self.picker: Picker | None = None
        self._accepting = trio.CancelScope()
        self._listeners: list[trio.SocketListener] = []
        self.draining = False
        self.active_requests = 0
        self._idle = trio.Event()
        self._idle.set()
        #: Every open connection, with the cancel scope of its wait for a request head while it
        #: waits for one (None while a request is being served).
        self._connections: dict[Downstream, trio.CancelScope | None] = {}

    def _account_poll(self, report: PollReport) -> None:
        self.metrics.record_poll(report.polls)

    def status(self) -> str:
        """The ``pig_status`` line for the current state."""
        state = self.engine.state
        names = tuple(self.metrics.backends)
        return status_line(
            state,
            version=__version__,
            backend_names=names,
            backend_unavailable_total=int(self.metrics.backend_unavailable.value),
            counts=runtime_counts(state, names),
            now=self.engine.seconds_since_start(),
        )

    async def log_status(self, interval_s: float) -> None:
        log.info("%s", startup_line(self.settings, version=__version__))
        log.info("%s", self.status())
        if interval_s <= 0:
            return
        while True:
            await trio.sleep(interval_s)
            log.info("%s", self.status())

    # -- connections ---------------------------------------------------------------------------

    async def handle_connection(self, stream: trio.SocketStream) -> None:
        try:
            peer = stream.socket.getpeername()[0]
        except OSError:
            peer = ""
        down = Downstream(stream, str(peer), self.body_limits)
        self._connections[down] = None
        try:
            # The connection's own tasks (its disconnect watcher, once a request is watched)
            # end with it.
            async with trio.open_nursery() as down.tasks:
                with trio.CancelScope() as down.idle_scope:  # cancelled only while idle
                    await self._serve_connection(down)
                down.tasks.cancel_scope.cancel()
        except Exception:  # a fault in this connection's own code ends it, not the server
            log.exception("connection from %s failed", peer)
        finally:
            self._connections.pop(down, None)
            await down.close()

    async def _serve_connection(self, down: Downstream) -> None:
        while not self.draining:
            simple = await down.next_simple()
            begun: Attempt | None = None
            if simple is not None and self.draining:
                down.defer_simple()  # answered below, with Connection: close
            elif simple is not None:
                # The refusal path: a request refused at once is answered from its head;
                # any other goes on through h11 below, its attempt (if any) with it.
                # With pools the body goes along: its model picks the pool.
                body = down.simple_body(simple) if self.app.model_pools is not None else b""
                begun, answer = self.app.admit_simple(simple, body)
                if answer is not None:
                    try:
                        await down.answer_simple(simple, answer)
                    except ClientGone:
                        return
                    continue
                down.defer_simple()
            # The head's time runs from when the connection began to wait for it.
            deadline = (down.wait_started or trio.current_time()) + self.header_timeout_s
            if not await self._serve_next(down, deadline, begun):
                return

    async def sweep_idle(self) -> None:
        """End the keep-alive waits that outlast the header timeout (the fast reader's wait has
        no timer of its own); a few times per timeout, so a wait ends within a quarter of it."""
        period = min(0.25, self.header_timeout_s / 4)
        while True:
            await trio.sleep(period)
            limit = trio.current_time() - self.header_timeout_s
            for down in list(self._connections):
                since = down.idle_since
                if since is not None and since <= limit:
                    down.stop_idle_wait()

    async def _serve_next(self, down: Downstream, deadline: float, begun: Attempt | None) -> bool:
        """One request through h11 (with its admission when the fast reader began it); whether
        the connection may carry another."""
        try:
            request = await self._read_head(down, deadline)
            if request is None:
                return False
            down.closing = down.closing or self.draining
            self.app.begin_exchange(down, request, begun)
            try:
                down.begin_body(request)
            except BodyRefused as refused:
                await _refuse_body(down, refused)
                return False
            else:
                await self.serve_request(down, request, begun)
            finally:
                self.app.end_exchange(down)
        finally:
            if begun is not None:
                # A no-op once served (a slot is released once), by the pool's engine.
                (begun.engine or self.app.engine).abandon(begun)
        if (
            down.gone
            or down.closing
            or down.h11.our_state is not h11.DONE
            or down.h11.their_state is not h11.DONE
        ):
            return False
        down.h11.start_next_cycle()
        return True

    async def _read_head(self, down: Downstream, deadline: float) -> h11.Request | None:
        """The next request head through h11 by ``deadline``; a bad one is answered here (and
        the connection is to close: None), as is a client that closed or stayed idle."""
        # Drain cancels the wait of an idle one: the connection's own scope, which ends it (no
        # scope of its own per request, whose head is most often in the buffer already).
        self._connections[down] = down.idle_scope
        try:
            return await down.next_request(max(0.0, deadline - trio.current_time()))
        except RefusedRequest as refused:
            down.notes = ExchangeNotes(trace_id=self.app.trace_id([]))
            if down.can_respond:
                with contextlib.suppress(ClientGone):
                    await down.respond(refused.status, *head_refusal(refused.status))
            return None
        finally:
            self._connections[down] = None

    async def serve_request(
        self, down: Downstream, request: h11.Request, begun: Attempt | None = None
    ) -> None:
        self.active_requests += 1
        self._idle = trio.Event() if self.active_requests == 1 else self._idle
        try:
            await self.app.handle(down, request, begun)
        except ClientGone:
            pass
        except BodyRefused as refused:
            await _refuse_body(down, refused)
        except ResponseAborted:
            down.gone = True  # the client sees the connection close before the response ends
        except Exception:
            log.exception("internal error while serving %s", request.target[:200])
            if down.can_respond:
                with contextlib.suppress(ClientGone):
                    await self.app.too_many_requests(down)
            down.gone = True  # close the connection: its state is unknown
        finally:
            self.active_requests -= 1
            if self.active_requests == 0:
                self._idle.set()

    # -- lifecycle -----------------------------------------------------------------------------

    async def serve(
        self, *, task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen and serve until cancelled; reports the bound (host, port)."""
        try:
            await self._serve(task_status)
        finally:
            with trio.CancelScope(shield=True):
                await self.pool.aclose()

    async def _serve(self, task_status: trio.TaskStatus[tuple[str, int]]) -> None:
        async with trio.open_nursery() as nursery:
            for poller in self.pollers:
                if self.settings.dynamic_enabled and poller.sources:
                    await nursery.start(poller.run)
            host = self.settings.listen_host or None
            self._listeners = await trio.open_tcp_listeners(self.settings.listen_port, host=host)
            bound = self._listeners[0].socket.getsockname()

            async def accept() -> None:
                with self._accepting:
                    # Connection handlers live in the outer nursery, so that stopping the accept
                    # loop (drain) leaves requests in flight running.
                    await trio.serve_listeners(
                        self.handle_connection, self._listeners, handler_nursery=nursery
                    )

            nursery.start_soon(accept)
            nursery.start_soon(self.pool.sweep_every, _POOL_SWEEP_S)
            nursery.start_soon(self.sweep_idle)
            nursery.start_soon(
                self.log_status, float(self.settings.env.pig_status_log_interval_seconds)
            )
            task_status.started((str(bound[0]), int(bound[1])))

    async def drain(self, grace_s: float) -> None:
        """Stop accepting new connections, close the idle ones, and wait for in-flight requests,
        at most ``grace_s``."""
        self.draining = True
        self._accepting.cancel()
        for listener in self._listeners:
            with contextlib.suppress(trio.ClosedResourceError):
                await listener.aclose()
        for down, waiting in self._connections.items():
            down.closing = True  # the response in progress is its last
            down.stop_idle_wait()
            if waiting is not None:
                waiting.cancel()
        with trio.move_on_after(grace_s):
            await self._idle.wait()

    async def aclose(self) -> None:
        await self.pool.aclose()


async def _refuse_body(down: Downstream, refused: BodyRefused) -> None:
    down.closing = True
    if not down.can_respond:
        return
    with contextlib.suppress(ClientGone):
        await down.respond(refused.status, *body_refusal(refused.status))


#: How often idle backend connections are checked for a close from the backend.
_POOL_SWEEP_S = 2.0


def _pool_engines(
    settings: Settings,
    first: GuardEngine,
    config: GuardConfig,
    ids: Iterator[int],
) -> PoolEngines:
    """One engine per pool of ``PIG_POOLS`` (its own learned cap and tier accounting), the
    first pool's being ``first`` (the only one with a listener); without pools, ``first``
    alone, for every backend."""
    pools = settings.model_pools
    if pools is None:
        return PoolEngines(first)
    names, of_backend, of_model = pools.layout()
    # Only the first pool's engine tells the listener (the recorder): a recording holds one
    # pool's polls and events, so that a replay folds them into that pool's state.
    engines = [first, *(GuardEngine(config, ids=ids) for _ in names[1:])]
    for engine, name in zip(engines, names, strict=True):
        engine.name = name
    by_backend = {backend: engines[index] for backend, index in of_backend.items()}
    by_model = {model: engines[index] for model, index in of_model.items()}
    return PoolEngines(first, by_backend=by_backend, by_model=by_model)
