"""The official OpenAI Python SDK as a client of the guard: streams through it, and a guard 429
surfaces as the SDK's ``RateLimitError`` (with the Retry-After the guard sent)."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import trio
from openai.types.chat import ChatCompletionMessageParam

TOKEN = "s3cret"
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Tell me about the sea, in a few words."}
]


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0, timeout=20)


async def test_the_sdk_streams_through_the_guard(start_sim: Any, start_guard: Any) -> None:
    sim, _ = await start_sim()
    guard, server = await start_guard(
        {"UPSTREAM": sim, "DYNAMIC_METRICS_URL": f"{sim}/metrics", "TOKEN": TOKEN}
    )

    def run() -> list[Any]:
        with client(guard) as sdk:
            stream = sdk.chat.completions.create(
                model="m",
                messages=MESSAGES,
                max_tokens=10,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers={"X-User-Tier": "premium"},
            )
            return list(stream)

    chunks = await trio.to_thread.run_sync(run)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 10
    semantic = server.engine.state.learner.semantic_ttft
    assert semantic is not None
    assert semantic.count == 1


async def test_a_guard_429_is_a_rate_limit_error_for_the_sdk(
    start_sim: Any, start_guard: Any, http: Any
) -> None:
    sim, _ = await start_sim()
    guard, _ = await start_guard(
        {
            "UPSTREAM": sim,
            "TOKEN": TOKEN,
            "DYNAMIC_PIG_ENABLED": "false",
            "GLOBAL_LIMIT": "1",
            "PIG_QUEUE_WAIT_SECONDS": "0",
        }
    )
    holder = await http.connect(guard)
    body = (
        b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":400,"stream":true}'
    )
    await holder.send_request(
        "POST", "/v1/chat/completions", [("Authorization", f"Bearer {TOKEN}")], body
    )
    assert (await holder.response_head()).status_code == 200

    def run() -> None:
        with client(guard) as sdk:
            sdk.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)

    with pytest.raises(openai.RateLimitError) as caught:
        await trio.to_thread.run_sync(run)
    error = caught.value
    assert error.status_code == 429
    assert error.response.headers["retry-after"] == "1"
    assert error.body == {
        "message": "Too many requests",
        "type": "TooManyRequestsError",
        "param": None,
        "code": 429,
    }
    await holder.aclose()
