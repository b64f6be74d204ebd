"""``sim-backend`` on real sockets: wire formats, metrics, disconnects and faults.

Every server runs on 127.0.0.1 with a free port inside the test's nursery and is cancelled at the
end. The OpenAI SDK runs its synchronous client in a worker thread (its async client leaves
half-consumed async generators to the garbage collector, which trio reports as warnings).
Timing assertions are loose: a clear change, never an exact figure.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import h11
import openai
import pytest
import trio

from guard_adapters.engine_model import TTFT_BUCKETS
from guard_adapters.metrics import parse_metrics
from guard_core.observations import Flavour
from guard_trio.tools.sim_backend import (
    SGLANG_ITL_BUCKETS,
    SGLANG_TTFT_BUCKETS,
    VLLM_ITL_BUCKETS,
    VLLM_LEGACY_TPOT_BUCKETS,
    VLLM_LEGACY_TTFT_BUCKETS,
    SimBackend,
    SimBackendConfig,
    is_loopback,
    split_sse_events,
)

FIXTURES = Path(__file__).parents[1] / "fixtures"
TRANSCRIPT = FIXTURES / "sse/vllm-0.24-crusoe-llama3.3-70b-chat-content-usage-done.txt"
ERRORS = FIXTURES / "errors"
MESSAGES: Any = [{"role": "user", "content": "Tell me about rivers and stones, briefly."}]


@attrs.frozen
class Sim:
    backend: SimBackend
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


Start = Callable[..., Awaitable[Sim]]


@pytest.fixture
async def start(nursery: trio.Nursery) -> AsyncIterator[Start]:
    async def _start(**changes: Any) -> Sim:
        # The earlier tests' garbage (the OpenAI SDK's) is collected now: a full collection takes
        # over 100 ms here and would otherwise land, by chance, inside a timed exchange.
        gc.collect()
        backend = SimBackend(SimBackendConfig(port=0, **changes))
        host, port = await nursery.start(backend.serve)
        return Sim(backend, host, port)

    yield _start
    nursery.cancel_scope.cancel()


# -- a small raw HTTP/1.1 client ------------------------------------------------------------------


class Connection:
    """One keep-alive connection; reads a response's body piece by piece."""

    def __init__(self, stream: trio.SocketStream, host: str) -> None:
        self.stream = stream
        self.host = host
        self.conn = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, sim: Sim) -> Connection:
        return cls(await trio.open_tcp_stream(sim.host, sim.port), sim.host)

    async def _event(self) -> Any:
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.conn.receive_data(await self.stream.receive_some(65536))

    async def send(self, method: str, path: str, payload: object = None) -> h11.Response:
        await self.request(method, path, payload)
        response = await self._event()
        assert isinstance(response, h11.Response)
        return response

    async def request(self, method: str, path: str, payload: object = None) -> None:
        """Send a request without waiting for the response."""
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        body = b"" if payload is None else json.dumps(payload).encode()
        headers = [("host", self.host), ("content-length", str(len(body)))]
        if payload is not None:
            headers.append(("content-type", "application/json"))
        data = self.conn.send(h11.Request(method=method, target=path, headers=headers))
        await self.stream.send_all(
            data + self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
        )

    async def piece(self) -> bytes | None:
        """The next body bytes as received, or ``None`` at the end of the response."""
        event = await self._event()
        if isinstance(event, h11.Data):
            return bytes(event.data)
        assert isinstance(event, h11.EndOfMessage)
        return None

    async def body(self) -> bytes:
        parts = []
        while (part := await self.piece()) is not None:
            parts.append(part)
        return b"".join(parts)

    async def aclose(self) -> None:
        await self.stream.aclose()


async def call(sim: Sim, method: str, path: str, payload: object = None) -> tuple[int, bytes]:
    connection = await Connection.open(sim)
    try:
        response = await connection.send(method, path, payload)
        return response.status_code, await connection.body()
    finally:
        await connection.aclose()


def chat(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MESSAGES, "max_tokens": max_tokens, "stream": True} | extra


async def scrape(sim: Sim) -> Any:
    status, page = await call(sim, "GET", "/metrics")
    assert status == 200
    return parse_metrics(page)


async def wait_until(condition: Callable[[], bool], limit_s: float) -> float:
    """Poll every 10 ms until ``condition()``; returns the seconds it took."""
    began = trio.current_time()
    with trio.fail_after(limit_s):
        while not condition():  # noqa: ASYNC110 - polls the engine: there is nothing to wait on
            await trio.sleep(0.01)
    return trio.current_time() - began


def data_events(raw: bytes) -> list[str]:
    return [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]


# -- the OpenAI SDK as a client -----------------------------------------------------------------


def sdk(sim: Sim) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{sim.url}/v1", api_key="x", max_retries=0, timeout=20)


async def in_thread(function: Callable[[], Any]) -> Any:
    return await trio.to_thread.run_sync(function)


async def test_sdk_streams_chat_content_then_a_usage_chunk(start: Start) -> None:
    sim = await start()

    def run() -> list[Any]:
        with sdk(sim) as client:
            stream = client.chat.completions.create(
                model="m",
                messages=MESSAGES,
                max_tokens=12,
                stream=True,
                stream_options={"include_usage": True},
            )
            return list(stream)

    chunks = await in_thread(run)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) >= 6
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(MESSAGES[0]["content"]) // 4
    assert all(c.id == chunks[0].id and c.id.startswith("chatcmpl-") for c in chunks)


async def test_sdk_non_streaming_chat_and_completions(start: Start) -> None:
    sim = await start()

    def run() -> tuple[Any, Any, list[Any]]:
        with sdk(sim) as client:
            reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=7)
            completion = client.completions.create(model="m", prompt="Once upon", max_tokens=5)
            streamed = list(
                client.completions.create(
                    model="m",
                    prompt="Once upon",
                    max_tokens=4,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            return reply, completion, streamed

    reply, completion, streamed = await in_thread(run)
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.content.strip()
    assert (reply.usage.completion_tokens, reply.choices[0].finish_reason) == (7, "length")
    assert completion.object == "text_completion"
    assert len(completion.choices[0].text.split()) >= 3
    assert completion.usage.completion_tokens == 5
    assert [c.choices[0].text != "" for c in streamed[:4]] == [True] * 4
    assert streamed[4].choices[0].finish_reason == "length"
    assert streamed[-1].usage.completion_tokens == 4


async def test_sdk_streams_responses_api_events(start: Start) -> None:
    sim = await start()

    def run() -> list[Any]:
        with sdk(sim) as client:
            return list(
                client.responses.create(
                    model="m", input="Say something.", max_output_tokens=5, stream=True
                )
            )

    events = await in_thread(run)
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 5,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-4].text == deltas
    assert events[-1].response.usage.output_tokens == 5


async def test_sdk_sees_reasoning_then_a_forced_tool_call(start: Start) -> None:
    sim = await start()
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]

    def run(**options: Any) -> list[Any]:
        with sdk(sim) as client:
            return list(
                client.chat.completions.create(
                    model="m", messages=MESSAGES, max_tokens=10, stream=True, **options
                )
            )

    thinking = await in_thread(lambda: run(reasoning_effort="low"))
    deltas = [c.choices[0].delta for c in thinking[1:-1]]
    reasoning = [d.model_extra.get("reasoning_content") for d in deltas]
    assert all(reasoning[:5])
    assert not any(reasoning[5:])
    assert all(d.content for d in deltas[5:])

    called = await in_thread(lambda: run(tools=tools, tool_choice="required"))
    calls = [
        c.choices[0].delta.tool_calls[0]
        for c in called
        if c.choices and c.choices[0].delta.tool_calls
    ]
    assert calls[0].id.startswith("chatcmpl-tool-")
    assert calls[0].function.name == "get_weather"
    arguments = json.loads("".join(call.function.arguments for call in calls))
    assert list(arguments) == ["city"]
    assert len(arguments["city"].split()) >= 5
    assert called[-1].choices[0].finish_reason == "tool_calls"


# -- metrics ---------------------------------------------------------------------------------------


async def test_metrics_parse_to_the_engine_figures_while_streams_run(start: Start) -> None:
    sim = await start(max_num_seqs=2)
    connections = [await Connection.open(sim) for _ in range(3)]
    for connection in connections:
        assert (
            await connection.send("POST", "/v1/chat/completions", chat(3000))
        ).status_code == 200
    for connection in connections[:2]:
        assert await connection.piece()  # the role chunk: both running streams have started
    first = await scrape(sim)
    engine = sim.backend.engine_metrics()
    assert first.flavour is Flavour.VLLM
    assert (first.running, first.waiting) == (2, 1) == (engine.running, engine.waiting)
    assert first.kv_usage == pytest.approx(engine.kv_usage, abs=1e-3)
    assert first.preemptions == engine.preemptions_total == 0
    await trio.sleep(0.2)
    before = sim.backend.engine_metrics()
    second = await scrape(sim)
    engine = sim.backend.engine_metrics()
    assert second.generation_tokens > first.generation_tokens > 0
    assert (
        before.generation_tokens_total <= second.generation_tokens <= engine.generation_tokens_total
    )
    assert second.ttft is not None
    assert second.ttft.count == engine.ttft_count == 2
    assert second.ttft.sum == pytest.approx(engine.ttft_sum)
    assert second.ttft.buckets == tuple(
        zip((*TTFT_BUCKETS, float("inf")), map(float, engine.ttft_bucket_counts), strict=True)
    )
    for connection in connections:
        await connection.aclose()
    await wait_until(lambda: sim.backend.engine_metrics().running == 0, 2.0)
    _, page = await call(sim, "GET", "/metrics")
    assert b'vllm:request_success_total{engine="0",finished_reason="abort"' in page
    assert b"vllm:kv_cache_usage_perc{" in page


async def test_sglang_and_legacy_vllm_pages(start: Start) -> None:
    sglang = await start(flavour="sglang")
    status, body = await call(sglang, "POST", "/v1/chat/completions", chat(4) | {"stream": False})
    assert status == 200
    assert json.loads(body)["usage"]["completion_tokens"] == 4
    status, body = await call(sglang, "POST", "/v1/chat/completions", chat(2))
    chunks = [json.loads(event) for event in data_events(body)[:-1]]
    assert all(chunk["choices"][0]["delta"]["content"] for chunk in chunks[1:3])
    assert chunks[1]["choices"][0]["delta"]["reasoning_content"] is None  # explicit nulls
    assert chunks[-1]["choices"][0]["matched_stop"] is None
    sample = await scrape(sglang)
    assert sample.flavour is Flavour.SGLANG
    assert (sample.running, sample.waiting, sample.generation_tokens) == (0, 0, 6)
    assert sample.ttft is not None
    assert [bound for bound, _ in sample.ttft.finite_buckets] == list(SGLANG_TTFT_BUCKETS)
    assert sample.ttft.count == 2
    _, page = await call(sglang, "GET", "/metrics")
    assert b'sglang:num_running_reqs{engine_type="unified",model_name=' in page
    assert b"sglang:gen_throughput{" in page

    legacy = await start(metrics_names="legacy")
    await call(legacy, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    _, page = await call(legacy, "GET", "/metrics")
    assert b"vllm:gpu_cache_usage_perc{" in page
    assert b"kv_cache_usage_perc" not in page
    assert b'engine="0"' not in page
    sample = parse_metrics(page)
    assert sample.kv_usage == 0
    assert sample.ttft is not None
    assert [bound for bound, _ in sample.ttft.finite_buckets] == list(VLLM_LEGACY_TTFT_BUCKETS)


@pytest.mark.parametrize(
    ("changes", "family", "bounds"),
    [
        ({}, "vllm:inter_token_latency_seconds", VLLM_ITL_BUCKETS),
        (
            {"metrics_names": "legacy"},
            "vllm:time_per_output_token_seconds",
            VLLM_LEGACY_TPOT_BUCKETS,
        ),
        ({"flavour": "sglang"}, "sglang:inter_token_latency_seconds", SGLANG_ITL_BUCKETS),
    ],
)
async def test_inter_token_latency_and_prompt_tokens_parse_back(
    start: Start, changes: dict[str, str], family: str, bounds: tuple[float, ...]
) -> None:
    sim = await start(**changes)
    empty = await scrape(sim)
    assert empty.prompt_tokens == 0
    assert empty.inter_token_latency is not None
    assert empty.inter_token_latency.count == 0
    prompts = 0
    for max_tokens in (6, 9):
        status, body = await call(
            sim, "POST", "/v1/chat/completions", chat(max_tokens) | {"stream": False}
        )
        assert status == 200
        usage = json.loads(body)["usage"]
        assert usage["completion_tokens"] == max_tokens
        prompts += usage["prompt_tokens"]
    _, page = await call(sim, "GET", "/metrics")
    assert f"{family}_bucket{{".encode() in page
    prompt_counter = family.split(":", maxsplit=1)[0] + ":prompt_tokens_total{"
    assert prompt_counter.encode() in page
    sample = parse_metrics(page)
    engine = sim.backend.engine_metrics()
    assert sample.prompt_tokens == prompts == engine.prompt_tokens_total
    itl = sample.inter_token_latency
    assert itl is not None
    assert itl.count == (6 - 1) + (9 - 1) == engine.itl_count
    assert itl.sum == pytest.approx(engine.itl_sum)
    assert [bound for bound, _ in itl.finite_buckets] == list(bounds)
    assert itl.buckets == tuple(
        zip((*bounds, float("inf")), map(float, engine.itl_bucket_counts), strict=True)
    )
    # one user alone decodes at the profile's single-stream step, about 11.6 ms
    assert 0.010 < itl.sum / itl.count < 0.013


# -- disconnects -----------------------------------------------------------------------------------


async def test_a_disconnect_mid_stream_frees_the_sequence_at_once(start: Start) -> None:
    sim = await start()
    connection = await Connection.open(sim)
    await connection.send("POST", "/v1/chat/completions", chat(3000))
    assert await connection.piece()
    assert await connection.piece()  # tokens are flowing
    assert sim.backend.engine_metrics().running == 1
    await connection.aclose()
    took = await wait_until(lambda: sim.backend.engine_metrics().running == 0, 2.0)
    assert took < 0.5
    assert sim.backend.engine_metrics().kv_usage == 0
    assert sim.backend.finished_by_reason["abort"] == 1


async def test_a_disconnect_while_queued_leaves_the_queue(start: Start) -> None:
    sim = await start(max_num_seqs=1)
    running = await Connection.open(sim)
    await running.send("POST", "/v1/chat/completions", chat(3000))
    waiting = await Connection.open(sim)
    await waiting.request("POST", "/v1/chat/completions", chat(10) | {"stream": False})
    await wait_until(lambda: sim.backend.engine_metrics().waiting == 1, 2.0)
    await waiting.aclose()
    took = await wait_until(lambda: sim.backend.engine_metrics().waiting == 0, 2.0)
    assert took < 0.5
    assert sim.backend.engine_metrics().running == 1
    await running.aclose()


async def test_keep_alive_serves_several_requests_on_one_connection(start: Start) -> None:
    sim = await start()
    connection = await Connection.open(sim)
    for path in ("/health", "/v1/models", "/v1/models"):
        response = await connection.send("GET", path)
        assert response.status_code == 200
        await connection.body()
    response = await connection.send("POST", "/v1/chat/completions", chat(3))
    events = data_events(await connection.body())
    assert events[-1] == "[DONE]"
    response = await connection.send("GET", "/nope")
    assert (response.status_code, await connection.body()) == (404, b'{"detail":"Not Found"}')
    await connection.aclose()


# -- client-caused errors --------------------------------------------------------------------------


def template(case: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((ERRORS / f"{case}.json").read_text())
    return loaded


def filled(shape: dict[str, Any], message: str) -> bytes:
    """A template's body shape with its message put in, written as vLLM's server writes JSON."""
    text = json.dumps(shape)
    for placeholder in ('"<message_template>"', '"<message>"'):
        text = text.replace(placeholder, json.dumps(message))
    return json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False).encode()


async def test_sim_error_bodies_are_the_templates_bodies(start: Start) -> None:
    sim = await start()
    request = chat(100) | {"stream": False}
    values = {"max_model_len": 8192, "prompt_tokens": 10, "qualifier": "", "max_tokens": 100}

    context = template("context_length_exceeded")["by_version"][0]
    status, body = await call(
        sim, "POST", "/v1/chat/completions", request | {"sim_error": "context_length_exceeded"}
    )
    assert status == 400
    assert body == filled(context["body_shape"], context["message_template"].format(**values))

    too_many = template("max_tokens_greater_than_context")["by_version"][0]
    message = too_many["message_template"].format(
        max_output_tokens_param="max_tokens",
        max_tokens=100,
        max_total_tokens_param="max_total_tokens",
        max_model_len=8192,
    )
    status, body = await call(
        sim,
        "POST",
        "/v1/chat/completions",
        request | {"sim_error": "max_tokens_greater_than_context"},
    )
    assert (status, body) == (400, filled(too_many["body_shape"], message))

    media = template("multimodal_image_url_http_4xx")["by_version"][0]
    status, body = await call(
        sim,
        "POST",
        "/v1/chat/completions",
        request | {"sim_error": "multimodal_image_url_http_4xx"},
    )
    assert (status, body) == (media["http_status"], filled(media["body_shape"], ""))

    dead = template("engine_dead")["by_version"][0]
    status, body = await call(
        sim, "POST", "/v1/completions", {"prompt": "x", "sim_error": "engine_dead"}
    )
    assert (status, body) == (dead["http_status"], filled(dead["body_shape"], ""))
    assert not sim.backend.dead  # the body only; the engine lives

    for case, variant in (("admission_queue_full", 0), ("generation_error_finish_reason_error", 0)):
        expected = template(case)["by_version"][0]["variants"][variant]
        status, body = await call(
            sim, "POST", "/v1/chat/completions", request | {"sim_error": case}
        )
        assert status == expected["http_status"]
        assert json.loads(body)["error"] | {"code": status} == {
            "message": expected["message"],
            "type": expected["error_type"],
            "param": None,
            "code": expected["http_status"],
        }


async def test_an_oversized_prompt_gets_the_real_context_length_400(start: Start) -> None:
    sim = await start(max_model_len=1000)
    prompt = "word " * 1000  # 5000 characters: 1250 tokens by the 4-characters rule
    request = {"model": "m", "messages": [{"role": "user", "content": prompt}], "stream": True}
    status, body = await call(sim, "POST", "/v1/chat/completions", request)
    context = template("context_length_exceeded")["by_version"][0]
    message = context["message_template"].format(
        max_model_len=1000, qualifier="", prompt_tokens=1250
    )
    assert (status, body) == (400, filled(context["body_shape"], message))

    status, body = await call(sim, "POST", "/v1/chat/completions", chat(5000))
    assert status == 400
    assert json.loads(body)["error"]["param"] == "max_tokens"

    sglang = await start(flavour="sglang", max_model_len=1000)
    status, body = await call(sglang, "POST", "/v1/chat/completions", request)
    shape = template("sglang_context_length_and_error_shape")
    message = shape["message_templates"][0].format(input_tokens=1250, context_len=1000)
    assert (status, body) == (400, filled(shape["body_shape_non_streaming"], message))


async def test_a_stream_can_fail_mid_way_as_vllm_writes_it(start: Start) -> None:
    sim = await start()
    status, body = await call(
        sim, "POST", "/v1/chat/completions", chat(50, sim_error="streaming_error_mid_stream")
    )
    assert status == 200
    events = data_events(body)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert error == {
        "error": {
            "message": "Internal server error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    assert '": "' in events[-2]  # json.dumps spacing, unlike the chunks
    assert len(events) < 50


# -- faults ---------------------------------------------------------------------------------------


async def tokens_per_second(connection: Connection, seconds: float) -> float:
    """Content chunks received per second over the next ``seconds``."""
    count = 0
    with trio.move_on_after(seconds):
        while (piece := await connection.piece()) is not None:
            count += piece.count(b'"content":')
    return count / seconds


async def test_slow_down_cuts_the_token_rate(start: Start) -> None:
    sim = await start()
    connection = await Connection.open(sim)
    await connection.send("POST", "/v1/chat/completions", chat(3000))
    await connection.piece()
    before = await tokens_per_second(connection, 0.6)
    status, body = await call(sim, "POST", "/sim/control", {"slow_down": 2.0})
    assert status == 200
    assert json.loads(body)["slow_down"] == 2.0
    after = await tokens_per_second(connection, 0.6)
    assert before > 30
    assert after < 0.75 * before
    await call(sim, "POST", "/sim/control", {"reset_faults": True})
    restored = await tokens_per_second(connection, 0.6)
    assert restored > 0.8 * before
    await connection.aclose()


async def test_a_scheduled_slow_down_starts_on_time(start: Start) -> None:
    sim = await start(slow_down=((4.0, 0.8),))
    connection = await Connection.open(sim)
    await connection.send("POST", "/v1/chat/completions", chat(3000))
    await connection.piece()
    before = await tokens_per_second(connection, 0.5)
    await tokens_per_second(connection, 0.4)  # across the change
    after = await tokens_per_second(connection, 0.5)
    assert after < 0.5 * before
    assert sim.backend.fault_state()["slow_down"] == 4.0
    await connection.aclose()


async def test_kill_fails_streams_health_and_new_requests(start: Start) -> None:
    sim = await start()
    connection = await Connection.open(sim)
    await connection.send("POST", "/v1/chat/completions", chat(3000))
    await connection.piece()
    assert await call(sim, "GET", "/health") == (200, b"")
    status, body = await call(sim, "POST", "/sim/control", {"kill": True})
    assert (status, json.loads(body)["dead"]) == (200, True)
    events = data_events(await connection.body())
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "InternalServerError"
    assert await call(sim, "GET", "/health") == (503, b"")
    dead = template("engine_dead")["by_version"][0]
    assert await call(sim, "POST", "/v1/chat/completions", chat(5)) == (
        500,
        filled(dead["body_shape"], ""),
    )
    assert (await scrape(sim)).running == 0  # metrics are still served
    await connection.aclose()

    dies = await start(die_at_s=0.2)
    assert await call(dies, "GET", "/health") == (200, b"")
    await trio.sleep(0.3)
    assert await call(dies, "GET", "/health") == (503, b"")


async def test_metrics_delay_and_failure(start: Start) -> None:
    sim = await start(metrics_delay_s=0.3)
    began = trio.current_time()
    await scrape(sim)
    assert trio.current_time() - began >= 0.3
    await call(sim, "POST", "/sim/control", {"metrics_delay_s": 0, "metrics_fail": True})
    status, body = await call(sim, "GET", "/metrics")
    assert (status, body) == (500, b"Internal Server Error")
    await call(sim, "POST", "/sim/control", {"reset_faults": True})
    assert (await call(sim, "GET", "/metrics"))[0] == 200

    failing = await start(metrics_fail_after_s=0.2)
    assert (await call(failing, "GET", "/metrics"))[0] == 200
    await trio.sleep(0.25)
    assert (await call(failing, "GET", "/metrics"))[0] == 500


async def test_control_is_loopback_only_and_checks_its_input(start: Start) -> None:
    for address in ("127.0.0.1", "127.3.2.1", "::1", "::ffff:127.0.0.1", "fe80::1%lo"):
        assert is_loopback(address) is (address != "fe80::1%lo"), address
    for address in ("10.0.0.1", "192.168.1.20", "::ffff:10.1.2.3", "2001:db8::1", "", "localhost"):
        assert not is_loopback(address), address
    sim = await start()
    status, body = await call(sim, "POST", "/sim/control", {"slow_down": -1})
    assert status == 400
    status, body = await call(sim, "POST", "/sim/control", {"explode": True})
    assert (status, json.loads(body)["detail"]) == (400, "unknown control keys: explode")
    status, body = await call(sim, "GET", "/sim/control")
    assert (status, json.loads(body)["dead"]) == (200, False)


async def test_replay_sends_the_transcript_byte_for_byte_and_paced(start: Start) -> None:
    original = TRANSCRIPT.read_bytes()
    assert b"".join(split_sse_events(original)) == original
    events = len(split_sse_events(original))
    sim = await start(replay_sse=TRANSCRIPT, replay_interval_s=0.02)
    connection = await Connection.open(sim)
    began = trio.current_time()
    response = await connection.send("POST", "/v1/chat/completions", chat(5))
    assert response.status_code == 200
    assert dict(response.headers)[b"content-type"].startswith(b"text/event-stream")
    assert await connection.body() == original
    assert trio.current_time() - began >= 0.8 * 0.02 * (events - 1)
    # non-streaming requests still go to the engine
    response = await connection.send("POST", "/v1/chat/completions", chat(2) | {"stream": False})
    assert json.loads(await connection.body())["usage"]["completion_tokens"] == 2
    await connection.aclose()


# -- the command ----------------------------------------------------------------------------------


def test_the_command_prints_where_it_listens_and_stops_on_signals() -> None:
    command = [
        sys.executable,
        "-m",
        "guard_trio",
        "sim-backend",
        "--port",
        "0",
        "--flavour",
        "sglang",
    ]
    for stop in (signal.SIGINT, signal.SIGTERM):
        with subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=os.environ | {"PYTHONUNBUFFERED": "1"},
        ) as process:
            try:
                assert process.stdout is not None
                line = process.stdout.readline()
                assert line.startswith("sim-backend listening on http://127.0.0.1:")
                assert line.rstrip().endswith("(sglang, a100-qwen2-7b)")
                port = int(line.split(":")[2].split(" ")[0])

                async def get_metrics(port: int = port) -> bytes:
                    sim = Sim(None, "127.0.0.1", port)  # type: ignore[arg-type]
                    return (await call(sim, "GET", "/metrics"))[1]

                assert parse_metrics(trio.run(get_metrics)).flavour is Flavour.SGLANG
                process.send_signal(stop)
                assert process.wait(timeout=10) == 0
            finally:
                if process.poll() is None:
                    process.kill()
