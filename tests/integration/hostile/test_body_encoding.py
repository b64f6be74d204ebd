"""T9 (JSON rewrite hazards), the encoding part: a client must not choose its own backend
priority by sending JSON the rewrite cannot read but the backend can.

- a UTF-8 byte order mark is skipped by the backend's parser; the guard skips it too, so the
  trusted priority is injected and the client's own ``priority`` member is dropped;
- UTF-16 and UTF-32 bodies are refused with 400 (with ``BACKEND_PRIORITY_FAIL_OPEN`` on, the
  unreadable body used to be forwarded unchanged) and never reach the backend.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

SPOOF = {"model": "m", "priority": -100, "messages": [{"role": "user", "content": "hi"}]}


async def test_a_bom_body_gets_the_trusted_priority(
    start_upstream: Any, start_guard: Any, http: Any, figure: Any, recording_backend: Any
) -> None:
    bodies: list[bytes] = []
    upstream = await start_upstream(recording_backend(bodies))
    base, _ = await start_guard({"UPSTREAM": upstream.base}, poll=False)
    body = b"\xef\xbb\xbf" + json.dumps(SPOOF).encode()
    reply = await http.request(
        base, "POST", "/v1/chat/completions", [("Content-Type", "application/json")], body
    )
    assert reply.status == 200
    assert len(bodies) == 1
    forwarded = json.loads(bodies[0])
    assert forwarded["priority"] == 0  # the basic tier's value, not the client's -100
    assert forwarded["messages"] == SPOOF["messages"]
    figure("T9", "UTF-8 BOM body claiming priority -100", "forwarded with priority 0", "trusted")


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32", "utf-32-be"])
async def test_utf16_and_utf32_bodies_are_refused(
    start_upstream: Any,
    start_guard: Any,
    http: Any,
    figure: Any,
    recording_backend: Any,
    encoding: str,
) -> None:
    bodies: list[bytes] = []
    upstream = await start_upstream(recording_backend(bodies))
    base, _ = await start_guard({"UPSTREAM": upstream.base}, poll=False)
    body = json.dumps(SPOOF).encode(encoding)
    assert json.loads(body)["priority"] == -100  # what a Python backend would read
    reply = await http.request(
        base, "POST", "/v1/chat/completions", [("Content-Type", "application/json")], body
    )
    assert reply.status == 400
    assert json.loads(reply.body)["error"]["code"] == 400
    await trio.sleep(0.05)
    assert bodies == []
    assert upstream.requests == 0
    figure("T9", f"{encoding} body claiming priority -100", "400, 0 upstream", "refused")
