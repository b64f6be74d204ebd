"""``inference-guard watch`` on a terminal (a pty) against a real guard's admin plane, under
overload: the screen shows the cap, the state and the last refusal's reason."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import trio

from guard_trio.admin import AdminPlane, serve_admin
from tests.integration.test_watch_cli import ESC, frames, read_all, set_size

TOKEN = "watch-live-token"
CHAT = "/v1/chat/completions"
_BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":60,"stream":true}'


async def test_the_screen_shows_cap_state_and_the_last_refusal_reason(
    start_sim: Any, start_guard: Any, http: Any, until: Any
) -> None:
    controller, terminal = os.openpty()
    set_size(terminal, 40, 100)
    output = bytearray()
    try:
        async with trio.open_nursery() as nursery:
            sim, _ = await start_sim()
            guard, server = await start_guard(
                {
                    "UPSTREAM": sim,
                    "DYNAMIC_METRICS_URL": f"{sim}/metrics",
                    "TOKEN": TOKEN,
                    "DYNAMIC_POLL_INTERVAL_MS": "100",
                    "GLOBAL_LIMIT": "1",
                    "PIG_QUEUE_WAIT_SECONDS": "0",
                }
            )
            plane: AdminPlane = await nursery.start(serve_admin, server, "127.0.0.1", 0)
            outcomes: list[Any] = []
            server.app.outcome_listeners.append(outcomes.append)
            keep = ("PATH", "HOME", "PYTHONPATH")
            process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "guard_trio", "watch", plane.url],
                stdin=terminal,
                stdout=terminal,
                stderr=subprocess.PIPE,
                env={
                    **{k: v for k, v in os.environ.items() if k in keep},
                    "TOKEN": TOKEN,
                    "TERM": "xterm",
                },
            )
            os.close(terminal)
            terminal = -1

            async def collect() -> None:
                output.extend(await trio.to_thread.run_sync(read_all, controller))

            nursery.start_soon(collect)
            auth = [("Authorization", f"Bearer {TOKEN}")]
            with trio.fail_after(20):
                await until(lambda: len(plane.hub.viewers) >= 1)
                async with trio.open_nursery() as clients:
                    # One stream holds the only slot; the next request is refused at once.
                    clients.start_soon(http.request, guard, "POST", CHAT, auth, _BODY)
                    await until(lambda: server.engine.state.gate.inflight == 1)
                    refused = await http.request(guard, "POST", CHAT, auth, _BODY)
                    assert refused.status == 429
                await trio.sleep(1.2)  # a few polls and frames after the refusal
                process.send_signal(2)  # SIGINT: watch restores the terminal and exits 0
                status = await process.wait()
            assert process.stderr is not None
            err = await process.stderr.receive_some(65536)
            await process.stderr.aclose()
            nursery.cancel_scope.cancel()
    finally:
        if terminal >= 0:
            os.close(terminal)
        os.close(controller)
    assert status == 0, err
    text = bytes(output).decode()
    drawn = frames(text)
    assert drawn, text[:400]
    last = drawn[-1]
    assert last[0].startswith("cap 1  state "), last[0]
    state = last[0].split()[3]
    assert state in ("green", "yellow", "red")
    screen = "\n".join(last)
    (refusal,) = [o for o in outcomes if o.code is not None]
    refused_line = [line for line in last if " refused " in line][-1]
    # The last refusal's reason and id, as the guard decided and answered it.
    assert str(refusal.code) in refused_line.split(), screen
    assert refusal.trace_id in refused_line, screen
    assert f"{ESC}[?25h{ESC}[?1049l" in text  # the terminal was restored
