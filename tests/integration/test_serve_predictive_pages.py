"""``serve`` with ``DYNAMIC_POLICY=predictive`` polling real recorded vLLM and SGLang pages.

The metrics come from a small server on 127.0.0.1 that answers ``/metrics`` with a page recorded
from a real engine (tests/fixtures/metrics/). So that the learner has intervals to learn from,
each scrape multiplies the page's cumulative counters the learner reads (prompt and generation
tokens, the time-per-output-token histogram) by ``1 + scrape / 10``: the same traffic mix goes on
at a steady rate, and every other line is served as recorded. Chat requests go to a simulated
backend. The recorded vLLM page (an idle engine after six requests) lets requests through and
teaches the fit that page's own mean inter-token latency; the recorded SGLang page (an engine
under load with 2,826 requests queued) closes intake, as PIG's learner does on a queueing
backend.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import h11
import trio

FIXTURES = Path(__file__).parents[1] / "fixtures/metrics"
VLLM = (FIXTURES / "vllm-0.10-nvcr25.09-qwen3-4b-fp8-idle-after-6req.prom").read_bytes()
SGLANG = (FIXTURES / "sglang-0.4-docs-llama3.1-8b-under-load.prom").read_bytes()
#: The counter lines the learner reads, in either engine's names.
_ADVANCING = re.compile(
    rb"^((?:vllm|sglang):(?:prompt_tokens_total|generation_tokens_total"
    rb"|time_per_output_token_seconds_(?:sum|count|bucket))(?:\{[^}]*\})?) (\S+)$",
    re.MULTILINE,
)
CHAT = "/v1/chat/completions"
TOKEN = "s3cret"
HEADERS = [("Content-Type", "application/json"), ("Authorization", f"Bearer {TOKEN}")]


def advanced(page: bytes, scrape: int) -> bytes:
    factor = 1 + scrape / 10

    def scale(match: re.Match[bytes]) -> bytes:
        return match.group(1) + b" " + repr(float(match.group(2)) * factor).encode()

    return _ADVANCING.sub(scale, page)


def page_server(page: bytes) -> Callable[[trio.SocketStream], Any]:
    scrapes = 0

    async def serve_one(stream: trio.SocketStream) -> None:
        nonlocal scrapes
        connection = h11.Connection(h11.SERVER)
        async with stream:
            while True:
                event = connection.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    connection.receive_data(data)
                    continue
                if not isinstance(event, h11.Request):
                    return
                scrapes += 1
                body = advanced(page, scrapes)
                headers = [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))]
                await stream.send_all(
                    connection.send(h11.Response(status_code=200, headers=headers))
                    + connection.send(h11.Data(data=body))
                    + connection.send(h11.EndOfMessage())
                )
                return

    return serve_one


async def start_pages(nursery: trio.Nursery, page: bytes) -> str:
    listeners = await nursery.start(partial(trio.serve_tcp, page_server(page), 0, host="127.0.0.1"))
    host, port = listeners[0].socket.getsockname()[:2]
    return f"http://{host}:{port}/metrics"


async def start_stack(
    nursery: trio.Nursery, page: bytes, start_sim: Any, start_guard: Any
) -> tuple[str, Any]:
    """A simulated backend for chat, the recorded page for metrics, and a predictive guard."""
    metrics_url = await start_pages(nursery, page)
    upstream, _ = await start_sim()
    started: tuple[str, Any] = await start_guard(
        {
            "UPSTREAM": upstream,
            "DYNAMIC_METRICS_URL": metrics_url,
            "DYNAMIC_POLL_INTERVAL_MS": "100",
            "DYNAMIC_POLICY": "predictive",
            "TOKEN": TOKEN,
        }
    )
    return started


def chat_body() -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hello " * 50}], "max_tokens": 8}
    ).encode()


async def test_a_recorded_vllm_page_teaches_the_fit_and_requests_get_through(
    nursery: trio.Nursery, start_sim: Any, start_guard: Any, http: Any, until: Any
) -> None:
    base, server = await start_stack(nursery, VLLM, start_sim, start_guard)

    def fitted() -> bool:
        model = server.engine.state.predictive
        return model is not None and model.fit().observations >= 3

    await until(fitted, timeout_s=10)
    model = server.engine.state.predictive
    assert model is not None
    # Both families reached the learner from the real page: the prompt counter and the
    # time-per-output-token histogram (41.11 s over 1,733 gaps: 23.7 ms each).
    ((_, sample),) = [history[-1] for history in model.samples.values()]
    assert sample.inter_token_latency is not None
    assert sample.prompt_tokens is not None
    assert model.inter_token_s is not None
    assert abs(model.inter_token_s - 41.111971570000605 / 1733) < 1e-6
    replies = [await http.request(base, "POST", CHAT, HEADERS, chat_body()) for _ in range(3)]
    assert [reply.status for reply in replies] == [200, 200, 200]
    decision = server.engine.state.gate.decision
    assert decision.cap > 0
    assert str(decision.final_reason) in {"predicted_speed", "hard_global"}
    page = await http.request(base, "GET", "/pig/metrics", HEADERS[1:])
    assert b"inference_guard_predictive_fit_observations" in page.body


async def test_a_recorded_sglang_page_with_a_queue_closes_intake(
    nursery: trio.Nursery, start_sim: Any, start_guard: Any, http: Any, until: Any
) -> None:
    base, server = await start_stack(nursery, SGLANG, start_sim, start_guard)
    await until(lambda: server.poller.rounds >= 4, timeout_s=10)
    model = server.engine.state.predictive
    assert model is not None
    assert model.waiting == 2826
    assert model.waiting_unexplained
    decision = server.engine.state.gate.decision
    assert decision.cap == 0
    assert str(decision.final_reason) == "backend_waiting"
    reply = await http.request(base, "POST", CHAT, HEADERS, chat_body())
    assert reply.status == 429
    # The SGLang page's counters were read: the fit has intervals (162 running, TPOT histogram).
    assert model.fit().observations >= 1
