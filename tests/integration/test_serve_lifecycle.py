"""``serve`` as an operator sees it: intake closing and reopening with the backend, failing
metrics, configuration errors, drain on SIGTERM, and the live recording replayed exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio

from guard_adapters.config import load_config
from guard_adapters.recording import open_for_reading, read_records
from guard_adapters.replay import replay

TOKEN = "s3cret"
AUTH = [("Authorization", f"Bearer {TOKEN}")]
CHAT = "/v1/chat/completions"


def chat_body(max_tokens: int = 4, *, stream: bool = False) -> bytes:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
    }
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


def guard_env(sim: str, **extra: str) -> dict[str, str]:
    return {
        "UPSTREAM": sim,
        "DYNAMIC_METRICS_URL": f"{sim}/metrics",
        "TOKEN": TOKEN,
        "DYNAMIC_POLL_INTERVAL_MS": "100",
        **extra,
    }


async def test_backend_waiting_closes_intake_within_one_poll_and_reopens(
    start_sim: Any, start_guard: Any, http: Any, until: Any
) -> None:
    sim, backend = await start_sim(max_num_seqs=1)
    guard, server = await start_guard(guard_env(sim))
    first = await http.connect(guard)
    second = await http.connect(guard)
    await first.send_request("POST", CHAT, AUTH, chat_body(300, stream=True))
    await second.send_request("POST", CHAT, AUTH, chat_body(300, stream=True))
    # One sequence runs, the other waits inside the engine: the next poll closes intake.
    await until(lambda: backend.engine_metrics().waiting == 1)
    polls = server.poller.rounds
    await until(lambda: server.poller.rounds >= polls + 1)
    assert server.engine.state.gate.decision.cap == 0
    assert server.engine.state.gate.decision.final_reason == "backend_waiting"
    refused = await http.request(guard, "POST", CHAT, AUTH, chat_body())
    assert refused.status == 429
    status = await http.request(guard, "GET", "/v1/upstream-status", AUTH)
    assert status.body == b"2\n"
    # Both streams end; the queue empties and the next poll reopens intake.
    await first.aclose()
    await second.aclose()
    await until(
        lambda: backend.engine_metrics().waiting == 0 and backend.engine_metrics().running == 0
    )
    await until(lambda: server.engine.state.gate.decision.cap > 0, 3.0)
    assert (await http.request(guard, "POST", CHAT, AUTH, chat_body())).status == 200


async def test_failing_metrics_give_immediate_429s(
    start_sim: Any, start_guard: Any, http: Any, until: Any
) -> None:
    sim, backend = await start_sim()
    guard, server = await start_guard(guard_env(sim))
    assert (await http.request(guard, "POST", CHAT, AUTH, chat_body())).status == 200
    backend.control({"metrics_fail": True})
    polls = server.poller.rounds
    await until(lambda: server.poller.rounds >= polls + 2)
    start = trio.current_time()
    refused = await http.request(guard, "POST", CHAT, AUTH, chat_body())
    assert refused.status == 429
    assert trio.current_time() - start < 0.3  # no short wait when the backend is unavailable
    backend.control({"reset_faults": True})
    await until(lambda: server.engine.state.gate.decision.cap > 0, 3.0)
    assert (await http.request(guard, "POST", CHAT, AUTH, chat_body())).status == 200


async def test_live_recording_replays_to_the_same_decisions(
    start_sim: Any, start_guard: Any, http: Any, until: Any, tmp_path: Path, nursery: trio.Nursery
) -> None:
    from guard_trio._recorder import Recorder
    from guard_trio._server import GuardServer

    sim, _ = await start_sim(max_num_seqs=4)
    env = {"LISTEN": "127.0.0.1:0", **guard_env(sim, PIG_QUEUE_WAIT_SECONDS="0.3")}
    settings = load_config(env)
    path = tmp_path / "live.jsonl"
    recorder = Recorder(path, config=settings.redacted(), producer="test")
    server = GuardServer(settings, on_event=recorder.event, on_poll=recorder.poll)
    host, port = await nursery.start(server.serve)
    guard = f"http://{host}:{port}"
    await until(lambda: server.poller.rounds >= 2)

    async def client(index: int) -> None:
        tier = [("X-User-Tier", "premium")] if index % 3 == 0 else []
        await http.request(guard, "POST", CHAT, [*AUTH, *tier], chat_body(30 + index, stream=True))

    async with trio.open_nursery() as clients:
        for index in range(24):
            clients.start_soon(client, index)
            await trio.sleep(0.05)
    await until(lambda: server.engine.state.gate.inflight == 0)
    rounds = server.poller.rounds
    await until(lambda: server.poller.rounds >= rounds + 2)
    await recorder.aclose()
    with open_for_reading(path) as stream:
        items = list(read_records(stream, strict=True))
    records = items[1:]
    result = replay(records, load_config(items[0].config).guard_config())  # type: ignore[union-attr, arg-type]
    assert len(result.polls) >= 4
    assert all(poll.recorded is not None for poll in result.polls)
    differing = [poll for poll in result.polls if poll.differs]
    assert differing == []
    assert (result.admitted, result.rejected) == (
        result.recorded_forwarded,
        result.recorded_rejected,
    )
    assert result.admitted > 0


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "guard_trio", *args],
        env={**{k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "PYTHONPATH")}, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_every_bad_variable_is_reported_and_the_exit_code_is_2() -> None:
    result = run_cli(
        "serve",
        env={
            "GLOBAL_LIMIT": "many",
            "DYNAMIC_KV_YELLOW": "0.9",
            "DYNAMIC_KV_RED": "0.5",
            "LISTEN": "127.0.0.1:0",
        },
    )
    assert result.returncode == 2
    assert "GLOBAL_LIMIT" in result.stderr
    assert "DYNAMIC_KV_YELLOW" in result.stderr or "DYNAMIC_KV_RED" in result.stderr


def test_print_config_redacts_the_token() -> None:
    result = run_cli(
        "serve", "--print-config", env={"TOKEN": "s3cret", "UPSTREAM": "http://backend:8000"}
    )
    assert result.returncode == 0, result.stderr
    assert "s3cret" not in result.stdout
    assert "GLOBAL_LIMIT=512" in result.stdout


async def test_sigterm_drains_a_running_stream_and_exits_0(start_sim: Any, http: Any) -> None:
    sim, _ = await start_sim()
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()
    env = {
        **{k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "PYTHONPATH")},
        "UPSTREAM": sim,
        "DYNAMIC_PIG_ENABLED": "false",
        "LISTEN": f"127.0.0.1:{port}",
        "PIG_DRAIN_SECONDS": "10",
    }
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "guard_trio", "serve"], env=env, stderr=subprocess.PIPE
    )
    guard = f"http://127.0.0.1:{port}"
    try:
        with trio.fail_after(20):
            while True:
                try:
                    connection = await http.connect(guard)
                    break
                except OSError:
                    await trio.sleep(0.1)
            await connection.send_request("POST", CHAT, [], chat_body(60, stream=True))
            assert (await connection.response_head()).status_code == 200
            process.send_signal(signal.SIGTERM)
            body = b"".join([chunk async for chunk in connection.chunks()])
            assert body.endswith(b"data: [DONE]\n\n")
            await connection.aclose()
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        if process.stderr is not None:
            await process.stderr.aclose()


async def test_serve_with_three_variables_guards_a_running_sim_backend(http: Any) -> None:
    """The acceptance setup: both as real processes, the guard given only UPSTREAM,
    DYNAMIC_METRICS_URL and TOKEN (plus LISTEN to stay on loopback)."""
    base_env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "PYTHONPATH")}

    def free_port() -> int:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return int(probe.getsockname()[1])

    sim_port, guard_port = free_port(), free_port()
    sim = await trio.lowlevel.open_process(
        [sys.executable, "-m", "guard_trio", "sim-backend", "--port", str(sim_port)],
        env=base_env,
        stdout=subprocess.DEVNULL,
    )
    guard_env_vars = {
        **base_env,
        "UPSTREAM": f"http://127.0.0.1:{sim_port}",
        "DYNAMIC_METRICS_URL": f"http://127.0.0.1:{sim_port}/metrics",
        "TOKEN": TOKEN,
        "LISTEN": f"127.0.0.1:{guard_port}",
    }
    guard = await trio.lowlevel.open_process(
        [sys.executable, "-m", "guard_trio", "serve"], env=guard_env_vars, stderr=subprocess.DEVNULL
    )
    base = f"http://127.0.0.1:{guard_port}"
    try:
        with trio.fail_after(30):
            while True:
                try:
                    status = await http.request(base, "GET", "/v1/upstream-status", AUTH)
                except OSError:
                    await trio.sleep(0.1)
                    continue
                if status.body == b"0\n":  # polled, and the backend is green
                    break
                await trio.sleep(0.1)
            reply = await http.request(base, "POST", CHAT, AUTH, chat_body(5))
            assert reply.status == 200
            assert json.loads(reply.body)["usage"]["completion_tokens"] == 5
            denied = await http.request(base, "POST", CHAT, [], chat_body(5))
            assert denied.status == 401
    finally:
        for process in (guard, sim):
            process.send_signal(signal.SIGTERM)
        with trio.move_on_after(15):
            await guard.wait()
            await sim.wait()
        for process in (guard, sim):
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert guard.returncode == 0
