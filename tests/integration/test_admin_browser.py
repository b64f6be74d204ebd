"""The admin dashboard in a real browser: headless Chromium loads ``/admin/`` from a running
guard, logs in through the page's Basic challenge as an operator would, and the page's script
receives the stream and draws.

Chromium is driven over its DevTools protocol (on 127.0.0.1, through trio-websocket): the login
is answered when the browser asks for it (``Fetch.authRequired``), so the page, its WebSocket
handshake and its charts run exactly as in an operator's browser. ``--dump-dom`` alone cannot
be used: it prints the document as soon as it has loaded, before any stream message arrives.
The test reads the document as ``--dump-dom`` prints it once messages have arrived, checks
that the canvases hold drawn pixels, and writes a screenshot (to ``ADMIN_SCREENSHOT`` when
set: that is how docs/images/admin-dashboard.png is made).

Skipped when Chromium is missing, except under CI (``CI=true``), where it fails instead.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from trio_websocket import WebSocketConnection, open_websocket_url

from guard_trio.admin import AdminPlane, serve_admin

TOKEN = "br0wser-token"
BEARER = [("Authorization", f"Bearer {TOKEN}")]
CHAT = "/v1/chat/completions"


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("chromium is required in CI (.ci/run installs it)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return found


class DevTools:
    """Commands and events of one DevTools connection, with sessions (flat mode)."""

    def __init__(self, ws: WebSocketConnection) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.replies: dict[int, trio.MemorySendChannel[dict[str, Any]]] = {}
        self.handlers: dict[str, Callable[[dict[str, Any]], Awaitable[None]]] = {}

    async def read(self) -> None:
        while True:
            message = json.loads(await self.ws.get_message())
            if "id" in message:
                channel = self.replies.pop(message["id"])
                channel.send_nowait(message)
            elif (handler := self.handlers.get(message.get("method", ""))) is not None:
                await handler(message)

    async def call(self, method: str, session: str | None = None, **params: Any) -> Any:
        number = next(self.ids)
        send, receive = trio.open_memory_channel[dict[str, Any]](1)
        self.replies[number] = send
        command: dict[str, Any] = {"id": number, "method": method, "params": params}
        if session is not None:
            command["sessionId"] = session
        await self.ws.send_message(json.dumps(command))
        with trio.fail_after(15):
            reply = await receive.receive()
        if "error" in reply:
            raise AssertionError(f"{method}: {reply['error']}")
        return reply["result"]


@asynccontextmanager
async def chromium(profile: Path) -> AsyncIterator[DevTools]:
    """A headless Chromium with its DevTools endpoint on 127.0.0.1, closed on the way out."""
    command = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--hide-scrollbars",
        "--remote-debugging-address=127.0.0.1",
        "--remote-debugging-port=0",
        f"--user-data-dir={profile}",
        "--window-size=1280,1180",
        "about:blank",
    ]
    process = await trio.lowlevel.open_process(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        active = trio.Path(profile / "DevToolsActivePort")
        with trio.fail_after(30):
            # Chromium writes its port there once it listens; nothing to wait on but the file.
            while not await active.exists() or len((await active.read_text()).split()) < 2:  # noqa: ASYNC110
                await trio.sleep(0.05)
        port, path = (await active.read_text()).split()[:2]
        url = f"ws://127.0.0.1:{port}{path}"
        async with (
            open_websocket_url(url, max_message_size=64 * 2**20) as ws,
            trio.open_nursery() as nursery,
        ):
            tools = DevTools(ws)
            nursery.start_soon(tools.read)
            yield tools
            nursery.cancel_scope.cancel()
    finally:
        process.terminate()
        with trio.move_on_after(10) as waited:
            await process.wait()
        if waited.cancelled_caught:
            process.kill()
            await process.wait()


async def open_logged_in(tools: DevTools, nursery: trio.Nursery, url: str) -> str:
    """A new tab on ``url`` that answers the Basic challenge with the token; its session."""
    target = (await tools.call("Target.createTarget", url="about:blank"))["targetId"]
    attached = await tools.call("Target.attachToTarget", targetId=target, flatten=True)
    session: str = attached["sessionId"]
    challenges: list[str] = []

    async def paused(message: dict[str, Any]) -> None:
        request_id = message["params"]["requestId"]
        nursery.start_soon(
            lambda: tools.call("Fetch.continueRequest", session, requestId=request_id)
        )

    async def asked(message: dict[str, Any]) -> None:
        params = message["params"]
        challenges.append(params["authChallenge"]["scheme"])
        answer = {"response": "ProvideCredentials", "username": "operator", "password": TOKEN}
        nursery.start_soon(
            lambda: tools.call(
                "Fetch.continueWithAuth",
                session,
                requestId=params["requestId"],
                authChallengeResponse=answer,
            )
        )

    tools.handlers["Fetch.requestPaused"] = paused
    tools.handlers["Fetch.authRequired"] = asked
    await tools.call(
        "Fetch.enable", session, handleAuthRequests=True, patterns=[{"urlPattern": "*"}]
    )
    await tools.call("Page.enable", session)
    await tools.call("Page.navigate", session, url=url)
    with trio.fail_after(15):
        while not challenges:  # noqa: ASYNC110 - filled by the DevTools reader
            await trio.sleep(0.05)
    assert challenges[0].lower() == "basic"
    return session


async def evaluate(tools: DevTools, session: str, expression: str) -> Any:
    result = await tools.call(
        "Runtime.evaluate", session, expression=expression, returnByValue=True
    )
    return result["result"].get("value")


async def traffic(guard: str, http: Any) -> None:
    """Premium and basic streams, more than the small GLOBAL_LIMIT takes (some are refused),
    until cancelled."""

    async def one(index: int) -> None:
        tier = [("X-User-Tier", "premium")] if index % 3 == 0 else []
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi " * (20 + index % 7 * 30)}],
            "max_tokens": 40 + index % 5 * 30,
            "stream": True,
        }
        await http.request(guard, "POST", CHAT, [*BEARER, *tier], json.dumps(body).encode())

    async with trio.open_nursery() as clients:
        for index in itertools.count():
            clients.start_soon(one, index)
            await trio.sleep(0.03)


@pytest.mark.slow
async def test_the_dashboard_receives_the_stream_and_draws(
    nursery: trio.Nursery, start_sim: Any, start_guard: Any, http: Any, tmp_path: Path
) -> None:
    _chromium()
    sim, _ = await start_sim(max_num_seqs=16)
    guard, server = await start_guard(
        {
            "UPSTREAM": sim,
            "DYNAMIC_METRICS_URL": f"{sim}/metrics",
            "TOKEN": TOKEN,
            "DYNAMIC_POLICY": "predictive",
            "DYNAMIC_POLL_INTERVAL_MS": "250",
            "GLOBAL_LIMIT": "12",
            "PIG_QUEUE_WAIT_SECONDS": "0.2",
        }
    )
    plane: AdminPlane = await nursery.start(serve_admin, server, "127.0.0.1", 0)
    async with chromium(tmp_path / "profile") as tools, trio.open_nursery() as page_tasks:
        session = await open_logged_in(tools, page_tasks, f"{plane.url}/admin/")
        page_tasks.start_soon(traffic, guard, http)
        await trio.sleep(6.0)  # a few seconds of charts
        with trio.fail_after(20):
            while True:
                counts = await evaluate(tools, session, "JSON.stringify(document.body.dataset)")
                seen = json.loads(counts) if counts else {}
                if int(seen.get("decisions", 0)) >= 8 and int(seen.get("admissions", 0)) >= 5:
                    break
                await trio.sleep(0.2)
        await trio.sleep(0.5)  # one more frame drawn
        # Two moments apart: every chart is redrawn with new points and the counts move on.
        pictures = "Array.from(document.querySelectorAll('canvas')).map(c => c.toDataURL())"
        before = await evaluate(tools, session, pictures)
        counted = json.loads(
            await evaluate(tools, session, "JSON.stringify(document.body.dataset)")
        )
        await trio.sleep(1.5)
        after = await evaluate(tools, session, pictures)
        later = json.loads(await evaluate(tools, session, "JSON.stringify(document.body.dataset)"))
        dom = await evaluate(tools, session, "document.documentElement.outerHTML")
        drawn = await evaluate(
            tools,
            session,
            """Array.from(document.querySelectorAll('canvas')).map(c => {
                 const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                 let lit = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) lit++;
                 return lit; })""",
        )
        shot = await tools.call("Page.captureScreenshot", session, format="png")
        assert len(plane.hub.viewers) == 1  # the page's one stream
        page_tasks.cancel_scope.cancel()
    png = base64.b64decode(shot["data"])
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    await trio.Path(tmp_path / "admin-dashboard.png").write_bytes(png)
    if target := os.environ.get("ADMIN_SCREENSHOT"):
        await trio.Path(target).write_bytes(png)

    assert 'data-decisions="' in dom
    assert "policy predictive" in dom  # the hello, shown
    assert 'id="link" class="up"' in dom  # the stream is live
    assert dom.count("<tr>") >= 10  # rows of decisions and admissions
    assert "refused" in dom
    assert "admitted" in dom
    assert len(drawn) == 4
    assert all(lit > 500 for lit in drawn), drawn  # axes, labels and lines on every chart
    assert len(before) == len(after) == 4
    assert all(b != a for b, a in zip(before, after, strict=True))  # each chart moved on
    assert int(later["decisions"]) > int(counted["decisions"])
    assert int(later["admissions"]) > int(counted["admissions"])
