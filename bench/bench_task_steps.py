"""How many times trio runs one of the guard's tasks per request: a count, not a time.

Run: ``python bench/bench_task_steps.py [--requests N] [--connections C]`` (also part of
``nox -s bench``). The guard runs in this process (static, no poller) in front of
``bench_proxy.py``'s minimal backend; a client in another process sends small POSTs over ``C``
kept-alive connections, one at a time on each, ``N`` in all, then the same with the guard
refusing every request (``GLOBAL_LIMIT=0``, no wait). A trio instrument counts the steps of the
guard's own tasks (each time the scheduler resumes one), by task, while the client runs.

Each step is a trip through trio's scheduler (a few microseconds of Python here), so steps per
request are a figure of the shell's design that the host's noise does not move, unlike the
CPU-second figures of ``bench_proxy.py``. They still depend a little on timing: a task woken
twice before it runs takes one step for both. Prints one table; asserts only that every request
was answered with the status its mode expects.
"""

from __future__ import annotations

import argparse
import ast
import collections
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path

import trio
import trio.lowlevel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from guard_adapters.config import load_config  # noqa: E402
from guard_trio._server import GuardServer  # noqa: E402

#: The client: ``connections`` asyncio connections, each sending its share of the small POSTs
#: one after another; prints the count of each status line's code.
_CLIENT = textwrap.dedent(
    """
    import asyncio, collections, sys
    port, total, connections = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":8}'
    request = (
        b"POST /v1/chat/completions HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\n"
        b"Content-Type: application/json\\r\\nContent-Length: %d\\r\\n\\r\\n" % len(body)
    ) + body
    codes = collections.Counter()

    async def one(count):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(count):
            writer.write(request)
            head = await reader.readuntil(b"\\r\\n\\r\\n")
            codes[head.split(b" ", 2)[1].decode()] += 1
            length = 0
            for line in head.split(b"\\r\\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
        writer.close()

    async def main():
        share, extra = divmod(total, connections)
        await asyncio.gather(*(one(share + (i < extra)) for i in range(connections)))
        print(dict(codes))

    asyncio.run(main())
    """
)


class TaskSteps(trio.abc.Instrument):
    """Steps of every task, by its name, while :attr:`counting`."""

    def __init__(self) -> None:
        self.steps: collections.Counter[str] = collections.Counter()
        self.counting = False

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.counting:
            self.steps[task.name] += 1


async def steps_per_request(
    backend_port: int, *, refusing: bool, requests: int, connections: int
) -> tuple[dict[str, float], dict[str, int]]:
    environ = {
        "DYNAMIC_PIG_ENABLED": "false",
        "GLOBAL_LIMIT": "0" if refusing else "100000",
        "PIG_QUEUE_WAIT_SECONDS": "0",
        "LISTEN": "127.0.0.1:0",
        "PIG_STATUS_LOG_INTERVAL_SECONDS": "0",
        "UPSTREAM": f"http://127.0.0.1:{backend_port}",
    }
    server = GuardServer(load_config(environ))
    instrument = TaskSteps()
    trio.lowlevel.add_instrument(instrument)
    try:
        async with trio.open_nursery() as nursery:
            _host, port = await nursery.start(server.serve)
            client = [sys.executable, "-c", _CLIENT, str(port)]
            warm_up = [*client, str(connections), str(connections)]
            await trio.run_process(warm_up, capture_stdout=True)
            instrument.counting = True
            done = await trio.run_process(
                [*client, str(requests), str(connections)], capture_stdout=True
            )
            instrument.counting = False
            nursery.cancel_scope.cancel()
    finally:
        trio.lowlevel.remove_instrument(instrument)
        await server.aclose()
    codes = ast.literal_eval(done.stdout.decode())  # the client's dict of status counts
    # The guard's tasks (trio names a task by its function): each connection's handler, and
    # every task running guard_trio's code (a connection's watcher; the sweeps, a few a second).
    handler = other = 0
    for name, count in instrument.steps.items():
        if name.endswith("._run_handler"):
            handler += count
        elif name.startswith("guard_trio."):
            other += count
    return {"handler": handler / requests, "other": other / requests}, codes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--connections", type=int, default=32)
    args = parser.parse_args()
    backend = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "bench_proxy.py"), "--serve-backend"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert backend.stdout is not None
        line = backend.stdout.readline()  # "backend listening on 127.0.0.1:PORT"
        backend_port = int(line.rsplit(":", 1)[1])
        print(f"bench_task_steps: {args.requests} small POSTs on {args.connections} connections")
        print("task steps per request: the connection's handler, the guard's other tasks")
        print(f"{'mode':<12}{'handler':>10}{'other':>10}{'all':>10}  answers")
        for mode, refusing, expected in (("admitted", False, "200"), ("refused", True, "429")):
            run = partial(
                steps_per_request,
                backend_port,
                refusing=refusing,
                requests=args.requests,
                connections=args.connections,
            )
            steps, codes = trio.run(run)
            assert codes == {expected: args.requests}, codes
            handler, other = steps["handler"], steps["other"]
            print(f"{mode:<12}{handler:>10.2f}{other:>10.2f}{handler + other:>10.2f}  {codes}")
    finally:
        backend.terminate()
        backend.wait(timeout=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
