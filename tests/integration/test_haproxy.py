"""Debian's HAProxy in front of the guard, with deploy/haproxy.cfg's recipe: the tier comes from
HAProxy (never from the client), SSE is not buffered, and the health check uses /healthz."""

from __future__ import annotations

import itertools
import json
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio

from guard_core import Tier

RECIPE = Path(__file__).parents[2] / "deploy/haproxy.cfg"
CHAT = "/v1/chat/completions"
PREMIUM_KEY = "change-me-premium-key"

pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def config_for(guard: str, port: int) -> str:
    """The recipe with loopback addresses: same rules, only the addresses differ."""
    text = RECIPE.read_text()
    text = text.replace("bind :8080", f"bind 127.0.0.1:{port}")
    return text.replace("server guard guard:8000", f"server guard {guard.removeprefix('http://')}")


async def start_haproxy(nursery: trio.Nursery, guard: str, tmp_path: Path, http: Any) -> str:
    port = free_port()
    path = tmp_path / "haproxy.cfg"
    path.write_text(config_for(guard, port))
    process = await trio.lowlevel.open_process(
        ["haproxy", "-f", str(path), "-db"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )

    async def stop_on_cancel() -> None:
        try:
            await trio.sleep_forever()
        finally:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()

    nursery.start_soon(stop_on_cancel)
    base = f"http://127.0.0.1:{port}"
    with trio.fail_after(10):
        while True:
            try:
                reply = await http.request(base, "GET", "/healthz")
                if reply.status == 200:
                    return base
            except OSError:
                pass
            await trio.sleep(0.05)


async def test_tiers_come_from_haproxy_not_from_the_client(
    start_sim: Any, start_guard: Any, http: Any, nursery: trio.Nursery, tmp_path: Path
) -> None:
    sim, _ = await start_sim()
    guard, server = await start_guard({"UPSTREAM": sim, "DYNAMIC_PIG_ENABLED": "false"})
    front = await start_haproxy(nursery, guard, tmp_path, http)
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    ).encode()
    forged = await http.request(front, "POST", CHAT, [("X-User-Tier", "premium")], body)
    assert forged.status == 200
    keyed = await http.request(front, "POST", CHAT, [("X-Api-Key", PREMIUM_KEY)], body)
    assert keyed.status == 200
    accepted = server.metrics.tier_accepted
    assert (accepted[Tier.BASIC].value, accepted[Tier.PREMIUM].value) == (1, 1)


async def test_sse_is_not_buffered_by_haproxy(
    start_sim: Any, start_guard: Any, http: Any, nursery: trio.Nursery, tmp_path: Path
) -> None:
    sim, _ = await start_sim()
    guard, _ = await start_guard({"UPSTREAM": sim, "DYNAMIC_PIG_ENABLED": "false"})
    front = await start_haproxy(nursery, guard, tmp_path, http)
    body = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 60,
            "stream": True,
        }
    ).encode()
    connection = await http.connect(front)
    await connection.send_request("POST", CHAT, [("X-Api-Key", PREMIUM_KEY)], body)
    assert (await connection.response_head()).status_code == 200
    arrivals: list[float] = []
    async for chunk in connection.chunks():
        arrivals.extend(trio.current_time() for _ in range(chunk.count(b"\n\n")))
    await connection.aclose()
    # Events keep arriving one decode step apart, not in one burst at the end.
    assert len(arrivals) >= 60
    assert arrivals[-1] - arrivals[0] > 0.3
    gaps = sorted(b - a for a, b in itertools.pairwise(arrivals))
    assert gaps[len(gaps) // 2] > 0.002
