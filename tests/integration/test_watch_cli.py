"""``inference-guard watch``, run as a real process against a WebSocket server in the test.

The server stands in for the admin plane (schema version 1): it checks the bearer token with
the guard's own comparison, records the path it was asked for and sends a hello, then a
decision and an admission per round. Checks:

* not on a terminal: one compact line a second, and one at the end, with the cap and the rates;
* ``--json``: every message as one JSON line, in order (one sent over several lines too), and
  ``--kinds``/``--sample`` in the query string; ``--token-file`` is read before ``TOKEN``;
* on a terminal (a pty): the alternate screen with the cursor hidden, frames drawn in place
  from the cursor's home, sized to the terminal and redrawn smaller after a resize; Ctrl-C
  restores the cursor and the screen and exits 0;
* faults in one line, no traceback: a wrong or missing token (2), nothing listening (1), a
  server that closes the stream (1), a bad URL (2), a missing token file (2).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import termios
from pathlib import Path
from typing import Any

import attrs
import trio
from trio_websocket import ConnectionClosed, WebSocketRequest, serve_websocket

from guard_adapters.exchange import token_digest, token_matches

TOKEN = "watch-test-token"
#: Every run of the command is bounded by this, whatever it is asked to do.
RUN_LIMIT_S = 30.0
ESC = "\x1b"


def hello() -> dict[str, Any]:
    return {
        "v": 1,
        "type": "hello",
        "version": "0.1.0-test",
        "policy": "predictive",
        "backends": ["sim-a"],
        "kinds": ["decision", "admission"],
    }


def decision(round_: int, interval: float) -> dict[str, Any]:
    return {
        "v": 1,
        "type": "decision",
        "at": 100.0 + round_ * interval,
        "cap": 8,
        "state": "yellow",
        "reasons": ["kv_cache"],
        "in_flight": 7,
        "waiting": {"basic": 2, "premium": 0},
        "admitted": {"basic": 10 * round_, "premium": 2 * round_},
        "refused": {"basic": 5 * round_, "premium": 0},
        "backends": [
            {
                "name": "sim-a",
                "failed": False,
                "running": 7,
                "waiting": 1,
                "kv_usage": 0.91,
                "generation_tps": 250.0,
                "ttft_avg_s": 0.3,
            }
        ],
        "tps": {"observed": 21.5, "predicted": 20.0},
        "ttft_s": {"observed": 0.4, "predicted": 0.35},
        "a_field_from_the_future": [1, 2, 3],
    }


def admission(round_: int, interval: float) -> dict[str, Any]:
    return {
        "v": 1,
        "type": "admission",
        "at": 100.0 + round_ * interval,
        "id": f"req-{round_}",
        "tier": "basic",
        "outcome": "refused" if round_ % 2 else "admitted",
        "reason": "tier_basic_limit" if round_ % 2 else None,
        "waited_s": 0.05,
        "predicted_tps": 20.0,
        "predicted_ttft_s": 0.35,
    }


@attrs.define
class FakeAdmin:
    """A stand-in for the admin plane's event stream."""

    rounds: int = 400
    interval: float = 0.05
    #: Close the stream (1001) after this many rounds instead of staying open.
    close_after: int | None = None
    #: Send the hello indented over several lines.
    indented_hello: bool = False
    port: int = 0
    paths: list[str] = attrs.field(factory=list)
    sent: list[str] = attrs.field(factory=list)
    #: Set once a second's worth of rounds has been sent.
    streaming: trio.Event = attrs.field(factory=trio.Event)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, request: WebSocketRequest) -> None:
        self.paths.append(request.path)
        if not token_matches(request.headers, token_digest(TOKEN)):
            await request.reject(401, body=b"unauthorized")
            return
        connection = await request.accept()
        first = json.dumps(hello(), indent=2 if self.indented_hello else None)
        self.sent.append(first)
        try:
            await connection.send_message(first)
            for round_ in range(self.rounds):
                if self.close_after is not None and round_ == self.close_after:
                    await connection.aclose(code=1001, reason="guard shutting down")
                    return
                for message in (decision(round_, self.interval), admission(round_, self.interval)):
                    self.sent.append(json.dumps(message))
                    await connection.send_message(self.sent[-1])
                if round_ * self.interval >= 1.0:
                    self.streaming.set()
                await trio.sleep(self.interval)
        except ConnectionClosed:
            return  # the watcher went away: its count or its time was up


async def start_admin(nursery: trio.Nursery, admin: FakeAdmin) -> FakeAdmin:
    server = await nursery.start(serve_websocket, admin.handle, "127.0.0.1", 0, None)
    admin.port = server.port
    return admin


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TOKEN")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path.cwd()), env.get("PYTHONPATH")]))
    return {**env, **extra}


async def watch(*args: str, **env: str) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(RUN_LIMIT_S):
        return await trio.run_process(
            [sys.executable, "-m", "guard_trio", "watch", *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=environment(**env),
        )


def one_line_fault(result: subprocess.CompletedProcess[bytes]) -> str:
    err = result.stderr.decode()
    assert "Traceback" not in err
    assert err.count("\n") == 1, err
    assert err.startswith("inference-guard watch: ")
    return err


# -- the modes ----------------------------------------------------------------------------------


async def test_one_line_a_second_when_not_a_terminal() -> None:
    async with trio.open_nursery() as nursery:
        admin = await start_admin(nursery, FakeAdmin())
        result = await watch(admin.url, "--duration", "2.5", TOKEN=TOKEN)
        nursery.cancel_scope.cancel()
    assert result.returncode == 0, result.stderr
    assert result.stderr == b""
    lines = result.stdout.decode().splitlines()
    # Two lines a second apart in 2.5 s, and the last one at the end.
    assert 2 <= len(lines) <= 4, lines
    for line in lines:
        assert ESC not in line
        assert line.startswith("t ")
        assert "cap 8  yellow  in-flight 7  queue 2" in line
        assert "reasons kv_cache" in line
    # Ten basic admissions and five refusals per round of 0.05 s.
    assert "admitted/s basic 200.0 premium 40.0  refused/s basic 100.0 premium 0.0" in lines[-1]
    assert admin.paths == ["/admin/events"]


async def test_json_lines_in_order_with_the_query_string(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    async with trio.open_nursery() as nursery:
        admin = await start_admin(nursery, FakeAdmin(indented_hello=True))
        result = await watch(
            f"ws://127.0.0.1:{admin.port}/admin/events",
            "--json",
            "--count",
            "7",
            "--kinds",
            "decision,admission",
            "--sample",
            "0.5",
            "--token-file",
            str(token_file),
            # The file wins over the environment.
            TOKEN="not-the-token",
        )
        nursery.cancel_scope.cancel()
    assert result.returncode == 0, result.stderr
    lines = result.stdout.decode().splitlines()
    assert len(lines) == 7
    assert json.loads(lines[0]) == hello()
    # The rest come as sent, byte for byte.
    assert lines[1:] == admin.sent[1:7]
    assert admin.paths == ["/admin/events?kinds=decision,admission&sample=0.5"]


def set_size(fd: int, rows: int, columns: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))


def read_all(fd: int) -> bytes:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the last holder of the pty's other end has gone
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def frames(screen_output: str) -> list[list[str]]:
    """Each frame drawn from the cursor's home, as its lines (the erase sequences removed)."""
    drawn = []
    for part in screen_output.split(f"{ESC}[H")[1:]:
        if f"{ESC}[K" not in part:
            continue  # the clear screen on entry
        lines = part.split(f"{ESC}[J")[0].split(f"{ESC}[K")
        if lines[-1] == "":
            lines.pop()
        drawn.append([line.removeprefix("\r\n") for line in lines])
    return drawn


async def test_on_a_terminal_it_redraws_in_place_and_restores_it_on_ctrl_c() -> None:
    controller, terminal = os.openpty()
    set_size(terminal, 30, 90)
    output = bytearray()
    try:
        async with trio.open_nursery() as nursery:
            admin = await start_admin(nursery, FakeAdmin())
            started = trio.current_time()
            process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "guard_trio", "watch", admin.url],
                stdin=terminal,
                stdout=terminal,
                stderr=subprocess.PIPE,
                env=environment(TOKEN=TOKEN, TERM="xterm"),
            )
            os.close(terminal)
            terminal = -1

            async def collect() -> None:
                output.extend(await trio.to_thread.run_sync(read_all, controller))

            nursery.start_soon(collect)
            with trio.fail_after(RUN_LIMIT_S):
                await admin.streaming.wait()
                set_size(controller, 20, 60)
                await trio.sleep(1.0)
                process.send_signal(signal.SIGINT)
                status = await process.wait()
            elapsed = trio.current_time() - started
            assert process.stderr is not None
            err = await process.stderr.receive_some(65536)
            await process.stderr.aclose()
            nursery.cancel_scope.cancel()
    finally:
        if terminal >= 0:
            os.close(terminal)
        os.close(controller)
    text = bytes(output).decode()
    assert status == 0, err
    assert b"Traceback" not in err
    assert text.startswith(f"{ESC}[?1049h{ESC}[?25l")
    drawn = frames(text)
    # At most four frames a second, each within the terminal of its time.
    assert 2 <= len(drawn) <= 4 * elapsed + 2
    assert all(len(frame) <= 30 and max(map(len, frame)) <= 90 for frame in drawn)
    full = [f for f in drawn if f[0].startswith("cap 8") and any("recent refusals" in x for x in f)]
    assert any(max(map(len, frame)) > 60 for frame in full)
    # After the resize: 60 columns, 20 rows.
    assert len(drawn[-1]) <= 20
    assert max(map(len, drawn[-1])) <= 60
    assert drawn[-1][0].startswith("cap 8  state yellow")
    # The cursor and the screen come back, then the last state is left as one line.
    tail = text.rsplit(f"{ESC}[?25h{ESC}[?1049l", 1)
    assert len(tail) == 2
    assert tail[1].strip().startswith("t ")
    assert "cap 8" in tail[1]


# -- the faults -----------------------------------------------------------------------------------


async def test_a_wrong_token_is_one_line_and_exit_2() -> None:
    async with trio.open_nursery() as nursery:
        admin = await start_admin(nursery, FakeAdmin())
        wrong = await watch(admin.url, TOKEN="wrong")
        missing = await watch(admin.url)
        nursery.cancel_scope.cancel()
    assert wrong.returncode == 2
    assert "refused the token (HTTP 401)" in one_line_fault(wrong)
    assert wrong.stdout == b""
    assert missing.returncode == 2
    assert "needs the guard's TOKEN (HTTP 401)" in one_line_fault(missing)
    assert len(admin.paths) == 2


async def test_nothing_listening_is_one_line_and_exit_1() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = await watch(f"http://127.0.0.1:{port}", TOKEN=TOKEN)
    assert result.returncode == 1
    assert "nothing is listening there" in one_line_fault(result)


async def test_a_stream_the_guard_closes_ends_with_its_reason() -> None:
    async with trio.open_nursery() as nursery:
        admin = await start_admin(nursery, FakeAdmin(close_after=3))
        result = await watch(admin.url, TOKEN=TOKEN)
        nursery.cancel_scope.cancel()
    assert result.returncode == 1
    fault = one_line_fault(result)
    assert "the guard closed the stream (code 1001 GOING_AWAY: guard shutting down)" in fault
    # The state it had reached is left on stdout.
    assert result.stdout.decode().splitlines()[-1].startswith("t 100.1 s  cap 8")


async def test_a_bad_url_or_token_file_is_exit_2(tmp_path: Path) -> None:
    result = await watch("ftp://127.0.0.1:9000")
    assert result.returncode == 2
    assert "not an http, https, ws or wss URL" in one_line_fault(result)
    result = await watch("http://127.0.0.1:9", "--token-file", str(tmp_path / "missing"))
    assert result.returncode == 2
    assert "cannot read the token file" in one_line_fault(result)
