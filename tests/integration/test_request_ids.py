"""Every answer names its request (``X-Request-Id``), and every exchange ends in one outcome."""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import h11
import trio

from guard_adapters.outcome import Admission, ExchangeOutcome
from guard_core import RejectCode

CHAT = "/v1/chat/completions"
_GENERATED = re.compile(rb"ig-[0-9a-f]{8}-[0-9a-f]+\Z")


async def _recording_backend(nursery: trio.Nursery, seen: list[dict[bytes, bytes]]) -> str:
    """A backend that records each request's headers and answers with an id of its own."""

    async def serve(stream: trio.SocketStream) -> None:
        connection = h11.Connection(h11.SERVER)
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                if not data:
                    return
                connection.receive_data(data)
                continue
            if isinstance(event, h11.Request):
                seen.append(dict(event.headers))
            if isinstance(event, h11.EndOfMessage):
                head = h11.Response(
                    status_code=200,
                    headers=[
                        ("Content-Length", "2"),
                        ("Content-Type", "application/json"),
                        ("X-Request-Id", "the-backends-own"),
                    ],
                )
                out = connection.send(head) + connection.send(h11.Data(data=b"{}"))
                await stream.send_all(out + connection.send(h11.EndOfMessage()))
                connection.start_next_cycle()

    listeners = await nursery.start(partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"


def _ids(reply: Any) -> list[bytes]:
    """The reply's id (its headers are a dict: test_fast_paths.py checks there is one line)."""
    value = reply.header("x-request-id")
    return [] if value is None else [value]


async def test_the_clients_id_or_the_guards_goes_to_the_backend_and_comes_back(
    nursery: trio.Nursery, start_guard: Any, http: Any
) -> None:
    seen: list[dict[bytes, bytes]] = []
    backend = await _recording_backend(nursery, seen)
    guard, server = await start_guard({"UPSTREAM": backend, "DYNAMIC_PIG_ENABLED": "false"})
    outcomes: list[ExchangeOutcome] = []
    server.app.outcome_listeners.append(outcomes.append)

    sent = await http.request(guard, "POST", CHAT, [("X-Request-Id", "req-42:a/b")], b"{}")
    assert sent.status == 200
    assert _ids(sent) == [b"req-42:a/b"]  # the backend's own id is replaced by the request's
    assert seen[-1][b"x-request-id"] == b"req-42:a/b"

    for header in ([], [("X-Request-Id", "has space")], [("X-Request-Id", "x" * 129)]):
        reply = await http.request(guard, "POST", CHAT, header, b"{}")
        assert reply.status == 200
        (given,) = _ids(reply)
        assert _GENERATED.match(given), given
        assert seen[-1][b"x-request-id"] == given

    health = await http.request(guard, "GET", "/health", [("X-Request-Id", "probe-1")])
    assert _ids(health) == [b"probe-1"]

    assert [o.trace_id for o in outcomes][:1] == ["req-42:a/b"]
    assert len(outcomes) == 5  # one per exchange, no more
    served = outcomes[0]
    assert served.admission is Admission.ADMITTED
    assert served.status == 200
    assert served.backend == "backend1"
    assert served.request_id is not None
    assert served.ttfb_s is not None
    assert served.proxy_s is not None
    assert outcomes[-1].admission is None  # /health asks for no slot
    assert outcomes[-1].status == 200
    generated = {o.trace_id for o in outcomes[1:4]}
    assert len(generated) == 3


async def test_refusals_name_their_request_on_both_paths(start_guard: Any, http: Any) -> None:
    guard, server = await start_guard(
        {
            "UPSTREAM": "http://127.0.0.1:9",
            "DYNAMIC_PIG_ENABLED": "false",
            "GLOBAL_LIMIT": "0",
            "PIG_QUEUE_WAIT_SECONDS": "0",
        },
        poll=False,
    )
    outcomes: list[ExchangeOutcome] = []
    server.app.outcome_listeners.append(outcomes.append)
    recorded: list[Any] = []
    server.engine.on_event = recorded.append

    fast = await http.request(guard, "POST", CHAT, [("X-Request-Id", "fast-1")], b"{}")
    # A Connection header takes the full path (h11's judgement).
    full = await http.request(
        guard, "POST", CHAT, [("X-Request-Id", "full-1"), ("Connection", "close")], b"{}"
    )
    for reply, trace in ((fast, b"fast-1"), (full, b"full-1")):
        assert reply.status == 429
        assert _ids(reply) == [trace]
        assert trace not in reply.body  # the id is in the head only
    assert [o.trace_id for o in outcomes] == ["fast-1", "full-1"]
    for outcome in outcomes:
        assert outcome.admission is Admission.REFUSED
        assert outcome.code is RejectCode.TIER_BASIC_LIMIT  # a basic request, no room
        assert outcome.status == 429
    # The recording's arrivals carry the id, so a refusal can be found by it.
    arrivals = [e for e in recorded if type(e).__name__ == "Arrived"]
    assert [a.trace_id for a in arrivals] == ["fast-1", "full-1"]
    assert server.metrics.rejected.value == 2
