"""What the admin plane's stream costs the guard: messages per second and CPU at a given decision
rate, with viewers that read and with one that stops reading.

The guard side runs in this process (a ``GuardServer`` and its admin plane on hypercorn, as
``serve`` runs them); a driver task feeds the hub one poll round every ``1 / rate`` seconds, so
the decision rate is exact and no backend's metrics fetch is counted. The viewers are a child
process (``--viewers N`` WebSocket clients that read and count; with ``--stalled``, one more that
subscribes and never reads). Each phase reports the guard process's CPU seconds over the window
(``time.process_time``), the decision messages the viewers received per second, and whether the
stalled viewer was dropped. The first phase has no viewers: its CPU is the driver's own cost,
subtracted from the others.

    python bench/bench_admin.py                      # 1,000 decisions/s, 4 viewers, 5 s
    python bench/bench_admin.py --rate 200 --viewers 1 --seconds 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio
from trio_websocket import ConnectionClosed, open_websocket_url

from guard_adapters.config import load_config
from guard_trio._poller import PollReport
from guard_trio._server import GuardServer
from guard_trio.admin import serve_admin

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-admin-token"


# -- the viewers (child process) -------------------------------------------------------------------


async def _viewers(url: str, count: int, stalled: bool, seconds: float) -> None:
    received = [0] * count
    headers = [(b"Authorization", f"Bearer {TOKEN}".encode())]

    async def reader(index: int) -> None:
        async with open_websocket_url(f"{url}?kinds=decision", extra_headers=headers) as ws:
            with trio.move_on_after(seconds):
                while True:
                    try:
                        await ws.get_message()
                    except ConnectionClosed:
                        return
                    received[index] += 1

    async def sleeper() -> None:
        async with open_websocket_url(f"{url}?kinds=decision", extra_headers=headers):
            await trio.sleep(seconds)  # subscribed, never reads

    async with trio.open_nursery() as nursery:
        for index in range(count):
            nursery.start_soon(reader, index)
        if stalled:
            nursery.start_soon(sleeper)
    sys.stdout.write(json.dumps({"received": received}) + "\n")


# -- the guard side ------------------------------------------------------------------------------


async def _phase(
    plane: Any, server: Any, *, rate: float, seconds: float, viewers: int, stalled: bool
) -> dict[str, Any]:
    url = plane.url.replace("http://", "ws://") + "/admin/events"
    child = None
    if viewers or stalled:
        child = await trio.lowlevel.open_process(
            [
                sys.executable,
                __file__,
                "--as-viewers",
                url,
                str(viewers),
                str(int(stalled)),
                str(seconds + 1.0),
            ],
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        with trio.fail_after(10):
            while len(plane.hub.viewers) < viewers + int(stalled):  # noqa: ASYNC110 - polled state
                await trio.sleep(0.01)
    dropped_before = plane.hub.dropped_total
    report = PollReport(at=0.0, pages=(), polls=(), decision=None)
    period = 1.0 / rate
    cpu0, wall0 = time.process_time(), trio.current_time()
    rounds = 0
    next_at = wall0
    while trio.current_time() - wall0 < seconds:
        plane.hub.on_round(report)
        rounds += 1
        next_at += period
        await trio.sleep_until(next_at)
    cpu = time.process_time() - cpu0
    wall = trio.current_time() - wall0
    received: list[int] = []
    if child is not None:
        assert child.stdout is not None
        out = b""
        with trio.fail_after(seconds + 15):
            while True:
                chunk = await child.stdout.receive_some(65536)
                if not chunk:
                    break
                out += chunk
            await child.wait()
        received = json.loads(out.decode().strip().splitlines()[-1])["received"]
    return {
        "viewers": viewers,
        "stalled": stalled,
        "decisions_per_s": rounds / wall,
        "messages_per_s_per_viewer": (sum(received) / len(received) / wall) if received else 0.0,
        "cpu_s": cpu,
        "cpu_share": cpu / wall,
        "stalled_dropped": plane.hub.dropped_total - dropped_before,
        "seconds": wall,
    }


async def _bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    settings = load_config(
        {
            "UPSTREAM": "http://127.0.0.1:9",
            "LISTEN": "127.0.0.1:0",
            "TOKEN": TOKEN,
            "DYNAMIC_PIG_ENABLED": "false",
        }
    )
    server = GuardServer(settings)
    results = []
    async with trio.open_nursery() as nursery:
        plane = await nursery.start(serve_admin, server, "127.0.0.1", 0)
        for viewers, stalled in ((0, False), (args.viewers, False), (args.viewers, True)):
            results.append(
                await _phase(
                    plane,
                    server,
                    rate=args.rate,
                    seconds=args.seconds,
                    viewers=viewers,
                    stalled=stalled,
                )
            )
            await trio.sleep(0.5)
        plane.stop()
    return results


def _print(results: list[dict[str, Any]], rate: float) -> None:
    base = results[0]["cpu_s"] / results[0]["seconds"]
    print(
        f"admin stream at {rate:,.0f} decisions/s (guard process CPU; the driver's own cost,"
        f" {100 * base:.1f} % of a core, is subtracted)"
    )
    print(
        f"{'viewers':>8} {'stalled':>8} {'decisions/s':>12} {'msgs/s/viewer':>14}"
        f" {'stream CPU':>11} {'CPU per 1,000 msgs':>19} {'stalled dropped':>16}"
    )
    for r in results:
        extra = r["cpu_s"] / r["seconds"] - base
        sent = r["messages_per_s_per_viewer"] * max(r["viewers"], 1)
        per_k = f"{1000 * extra / sent * 1000:.2f} ms" if sent > 0 else "-"
        print(
            f"{r['viewers']:>8} {'yes' if r['stalled'] else 'no':>8}"
            f" {r['decisions_per_s']:>12,.0f} {r['messages_per_s_per_viewer']:>14,.0f}"
            f" {100 * extra:>10.1f}% {per_k:>19} {r['stalled_dropped']:>16}"
        )


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--as-viewers":
        url, count, stalled, seconds = sys.argv[2:6]
        trio.run(_viewers, url, int(count), stalled == "1", float(seconds))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=1000.0, help="decisions per second")
    parser.add_argument("--viewers", type=int, default=4, help="viewers that read")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each phase")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    results = trio.run(_bench, args)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        _print(results, args.rate)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
