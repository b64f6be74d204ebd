"""The simulated vLLM or SGLang server: routes, info pages and generation over the driver.

Reads: a :class:`SimBackendConfig`; whole requests from :mod:`._http`; the engine through the
:class:`~._driver.EngineDriver`, which owns its clock.

Guarantees:

- Endpoints are the real servers': ``/v1/chat/completions``, ``/v1/completions``,
  ``/v1/responses`` (POST), ``/health``, ``/metrics``, ``/v1/models`` (GET), with FastAPI's
  404 and 405 bodies; ``/sim/control`` (GET the fault state, POST a command) answers loopback
  peers only.
- A generation request is checked as the flavour checks it (lengths, ``sim_error`` cases, a
  dead engine, a full queue under ``max_queued``: vLLM's 503 ``admission_queue_full``, SGLang's
  queue-full 503), then submitted to the engine; its response, whole or streamed, is written from
  the tokens the driver hands over. A client that closes while its request waits or streams
  gets its sequence aborted in the engine at once (its KV is freed).
- ``--replay-sse`` answers every streaming request with a recorded transcript, byte for byte,
  one event per interval, without the engine.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Mapping
from typing import Any

import attrs
import h11
import trio
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from guard_adapters.engine_model import EngineDead, EngineMetrics
from guard_trio.tools.sim_backend._asks import Ask, BadRequest, Kind, parse_ask
from guard_trio.tools.sim_backend._config import SimBackendConfig, SimBackendError
from guard_trio.tools.sim_backend._driver import EngineDriver, Seq
from guard_trio.tools.sim_backend._errors import (
    ERROR_CASES,
    SGLANG_INPUT_TOO_LONG,
    SGLANG_QUEUE_FULL,
    SGLANG_TOTAL_TOO_LONG,
    ErrorCase,
    error_body,
    json_bytes,
    stream_error_event,
)
from guard_trio.tools.sim_backend._formats import Format, WordRing, hex_id, new_format
from guard_trio.tools.sim_backend._http import (
    NOT_ALLOWED,
    NOT_FOUND,
    SSE_HEADERS,
    Exchange,
    chunk,
    handle_connection,
    is_loopback,
    send,
    split_sse_events,
    watched,
    write,
)
from guard_trio.tools.sim_backend._metrics import metrics_registry


class SimBackend:
    """The simulated server. ``await nursery.start(backend.serve)`` returns ``(host, port)``."""

    def __init__(self, config: SimBackendConfig) -> None:
        self.config = config
        self._driver = driver = EngineDriver(config)
        self._rng = random.Random(config.seed)
        self._ring = WordRing(self._rng)
        self._replay: list[bytes] | None = None
        if config.replay_sse is not None:
            try:
                self._replay = split_sse_events(config.replay_sse.read_bytes())
            except OSError as error:
                raise SimBackendError(
                    f"cannot read {config.replay_sse}: {error.strerror or error}"
                ) from None
        self._registry = metrics_registry(driver, config)
        self._max_model_len = config.max_model_len  # the engine profile carries the same
        self._sglang = config.flavour == "sglang"

    # -- what tests and the demo read --------------------------------------------------------------

    def engine_metrics(self) -> EngineMetrics:
        """The engine's figures at this instant."""
        return self._driver.engine_metrics()

    @property
    def dead(self) -> bool:
        return self._driver.dead

    @property
    def finished_by_reason(self) -> dict[str, int]:
        """Requests ended, by vLLM's ``finished_reason`` label (``stop``, ``length``, ``abort``)."""
        return self._driver.finished_by_reason

    def control(self, command: Mapping[str, Any]) -> dict[str, Any]:
        """Apply a ``/sim/control`` command now (see :meth:`EngineDriver.control`)."""
        return self._driver.control(command)

    def fault_state(self) -> dict[str, Any]:
        return self._driver.fault_state()

    # -- serving -----------------------------------------------------------------------------------

    async def serve(
        self, *, task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen, report ``(host, port)`` through ``task_status`` and serve until cancelled."""
        config = self.config
        try:
            listeners = await trio.open_tcp_listeners(config.port, host=config.host)
        except OSError as error:
            raise SimBackendError(
                f"cannot listen on {config.host}:{config.port}: {error.strerror or error}"
            ) from None
        port = listeners[0].socket.getsockname()[1]
        self._driver.start()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._driver.drive)
            await nursery.start(trio.serve_listeners, self._handle_connection, listeners)
            task_status.started((config.host, port))

    async def _handle_connection(self, stream: trio.SocketStream) -> None:
        await handle_connection(stream, self._route, keep_alive_s=self.config.keep_alive_s)

    async def _route(
        self, exchange: Exchange, request: h11.Request, body: bytes, peer: str
    ) -> None:
        path = request.target.partition(b"?")[0]
        method = request.method
        generation = {
            b"/v1/chat/completions": "chat",
            b"/v1/completions": "completions",
            b"/v1/responses": "responses",
        }.get(path)
        if generation is not None:
            if method != b"POST":
                await send(exchange, 405, NOT_ALLOWED)
                return
            if self._driver.dropping:
                return  # read and left unanswered: the connection closes (a fault on purpose)
            await self._generation(exchange, generation, body)  # type: ignore[arg-type]
            return
        simple = {
            b"/health": (b"GET", self._health),
            b"/metrics": (b"GET", self._metrics),
            b"/v1/models": (b"GET", self._models),
        }.get(path)
        if path == b"/sim/control":
            await self._control(exchange, method, body, peer)
        elif simple is None:
            await send(exchange, 404, NOT_FOUND)
        elif method != simple[0]:
            await send(exchange, 405, NOT_ALLOWED)
        else:
            await simple[1](exchange)

    async def _health(self, exchange: Exchange) -> None:
        await send(exchange, 503 if self._driver.dead else 200, b"", "")

    async def _metrics(self, exchange: Exchange) -> None:
        if self._driver.metrics_delay_s > 0:
            await trio.sleep(self._driver.metrics_delay_s)
        if self._driver.metrics_failing():
            await send(exchange, 500, b"Internal Server Error", "text/plain; charset=utf-8")
            return
        await send(exchange, 200, generate_latest(self._registry), CONTENT_TYPE_PLAIN_0_0_4)

    async def _models(self, exchange: Exchange) -> None:
        config = self.config
        created = int(time.time())
        model: dict[str, Any] = {
            "id": config.model,
            "object": "model",
            "created": created,
            "owned_by": config.flavour,
            "root": config.model,
            "parent": None,
            "max_model_len": self._max_model_len,
        }
        if config.flavour == "vllm":
            model["permission"] = [
                {
                    "id": f"modelperm-{hex_id(self._rng, 32)}",
                    "object": "model_permission",
                    "created": created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ]
        await send(exchange, 200, json_bytes({"object": "list", "data": [model]}))

    async def _control(self, exchange: Exchange, method: bytes, body: bytes, peer: str) -> None:
        if not is_loopback(peer):
            await send(exchange, 403, json_bytes({"detail": "sim control is loopback-only"}))
            return
        if method == b"GET":
            await send(exchange, 200, json_bytes(self.fault_state()))
            return
        if method != b"POST":
            await send(exchange, 405, NOT_ALLOWED)
            return
        try:
            command = json.loads(body or b"{}")
            if not isinstance(command, dict):
                raise ValueError("the body must be a JSON object")
            state = self._driver.control(command)
        except (ValueError, UnicodeDecodeError) as invalid:
            await send(exchange, 400, json_bytes({"detail": str(invalid)}))
            return
        await send(exchange, 200, json_bytes(state))

    # -- generation --------------------------------------------------------------------------------

    async def _error(
        self, exchange: Exchange, case: ErrorCase, fields: Mapping[str, object]
    ) -> None:
        message = case.message.format_map(fields)
        param = case.param.format_map(fields) if case.param is not None else None
        body = error_body(self.config.flavour, case.status, case.type, param, message)
        await send(exchange, case.status, body)

    def _limits(self, ask: Ask) -> tuple[int, ErrorCase | None, str]:
        """Output tokens to generate, or the error a real server gives for these lengths."""
        limit = self._max_model_len
        prompt = ask.prompt_tokens
        requested = ask.max_tokens
        if self.config.flavour == "sglang":
            if prompt >= limit:
                return 0, ERROR_CASES["context_length_exceeded"], SGLANG_INPUT_TOO_LONG
            if requested is not None and prompt + requested > limit:
                return 0, ERROR_CASES["context_length_exceeded"], SGLANG_TOTAL_TOO_LONG
        else:
            if prompt >= limit:
                case = ERROR_CASES["context_length_exceeded"]
                return 0, case, case.message
            if requested is not None and requested > limit:
                case = ERROR_CASES["max_tokens_greater_than_context"]
                return 0, case, case.message
        wanted = requested if requested is not None else self.config.default_max_tokens
        return max(1, min(wanted, self.config.max_output, limit - prompt)), None, ""

    async def _generation(self, exchange: Exchange, kind: Kind, raw: bytes) -> None:
        try:
            ask = parse_ask(kind, raw, self.config.model)
        except BadRequest as bad:
            body = error_body(self.config.flavour, 400, "BadRequestError", bad.param, str(bad))
            await send(exchange, 400, body)
            return
        if ask.stream and self._replay is not None:
            await watched(exchange, self._replay_stream(exchange))
            return
        out_tokens, too_long, message = self._limits(ask)
        fields = {
            "max_model_len": self._max_model_len,
            "prompt_tokens": ask.prompt_tokens,
            "max_tokens": ask.max_tokens
            if ask.max_tokens is not None
            else self.config.default_max_tokens,
            "max_tokens_param": ask.max_tokens_param,
            "total_tokens": ask.prompt_tokens + (ask.max_tokens or 0),
            "model": ask.model,
        }
        if too_long is not None:
            await self._error(exchange, attrs.evolve(too_long, message=message), fields)
            return
        case = ERROR_CASES.get(ask.sim_error or "")
        if case is not None and not (ask.sim_error == "streaming_error_mid_stream" and ask.stream):
            if case.kills_engine:
                self._driver.kill()
            await self._error(exchange, case, fields)
            return
        if self._driver.queue_full():
            full = ERROR_CASES["admission_queue_full"]
            await self._error(exchange, SGLANG_QUEUE_FULL if self._sglang else full, fields)
            return
        try:
            seq = self._driver.submit(ask.prompt_tokens, out_tokens)
        except EngineDead:
            await self._error(exchange, ERROR_CASES["engine_dead"], fields)
            return
        fmt = new_format(
            ask,
            out_tokens,
            self._ring,
            self._rng,
            created=int(time.time()),
            flavour=self.config.flavour,
            reasoning_field=self.config.reasoning_field,
        )
        try:
            if ask.stream:
                mid_stream_error = ask.sim_error == "streaming_error_mid_stream"
                await watched(
                    exchange, self._stream(exchange, seq, fmt, out_tokens, mid_stream_error)
                )
            else:
                await watched(exchange, self._reply(exchange, seq, fmt, out_tokens))
        finally:
            self._driver.release(seq)

    async def _reply(self, exchange: Exchange, seq: Seq, fmt: Format, out_tokens: int) -> None:
        await seq.wait_for_end()
        if seq.end == "failed":
            case = ERROR_CASES["engine_dead"]
            await send(
                exchange,
                case.status,
                error_body(self.config.flavour, case.status, case.type, None, case.message),
            )
            return
        generated = seq.pending
        reason = self._driver.finish_reason(generated, out_tokens)
        await send(exchange, 200, fmt.body(generated, reason))

    async def _stream(
        self, exchange: Exchange, seq: Seq, fmt: Format, out_tokens: int, mid_stream_error: bool
    ) -> None:
        conn, stream = exchange.conn, exchange.stream
        head = conn.send(h11.Response(status_code=200, headers=SSE_HEADERS, reason=b"OK"))
        opening = fmt.opening()
        await stream.send_all(head + conn.send(h11.Data(data=opening)) if opening else head)
        # Body chunks are framed here rather than by h11 (one call less per write); h11 still
        # writes the end, and frames everything itself for an HTTP/1.0 client.
        chunked = b"transfer-encoding: chunked" in head.lower() and os.name == "posix"
        fd = stream.socket.fileno()
        sent = 0
        while True:
            if seq.pending == 0 and seq.end is None:
                await seq.wait_for_news()
                continue
            count, seq.pending = seq.pending, 0
            payload = fmt.tokens(sent, count) if count else b""
            sent += count
            end = seq.end
            if mid_stream_error and sent:
                payload += stream_error_event(500, "InternalServerError", "Internal server error")
                end = "aborted"
            elif end == "failed":
                payload += fmt.failure()
            elif end is not None:
                payload += fmt.finish(sent, self._driver.finish_reason(sent, out_tokens))
            if not payload:
                continue
            if end is not None:
                data = conn.send(h11.Data(data=payload)) + conn.send(h11.EndOfMessage())
                await stream.send_all(data)
                return
            if chunked:
                await write(stream, fd, chunk(payload))
            else:
                await stream.send_all(conn.send(h11.Data(data=payload)))

    async def _replay_stream(self, exchange: Exchange) -> None:
        assert self._replay is not None
        conn, send = exchange.conn, exchange.stream.send_all
        data = conn.send(h11.Response(status_code=200, headers=SSE_HEADERS, reason=b"OK"))
        interval = self.config.replay_interval_s
        for index, event in enumerate(self._replay):
            if index:
                await trio.sleep(interval)
            await send(data + conn.send(h11.Data(data=event)))
            data = b""
        await send(data + conn.send(h11.EndOfMessage()))


async def serve_sim_backend(
    config: SimBackendConfig,
    *,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve a simulated backend until cancelled; reports ``(host, port)`` once bound."""
    await SimBackend(config).serve(task_status=task_status)
