"""A fake SSE backend in a process of its own, so a test can SIGKILL it mid-stream (T22c).

Usage: ``python sse_backend_process.py [PORT]`` (0 or nothing: any free port). It listens on
127.0.0.1, prints the bound port on one line, then answers every request with a chunked
``text/event-stream``: 3 events then ``[DONE]`` when the first message's content starts with
``ok-``, otherwise 3,000 events 20 ms apart. Standard library only; keep-alive like vLLM.
"""

from __future__ import annotations

import asyncio
import json
import sys

ITL_S = 0.02
LONG_EVENTS = 3000


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            body = json.loads(await reader.readexactly(length)) if length else {}
            ident = str(body.get("messages", [{}])[0].get("content", ""))
            events = 3 if ident.startswith("ok-") else LONG_EVENTS
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            for index in range(events):
                writer.write(_chunk(b'data: {"i": %d}\n\n' % index))
                await writer.drain()
                await asyncio.sleep(ITL_S)
            writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        pass
    finally:
        writer.close()


async def _main() -> None:
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    server = await asyncio.start_server(_handle, "127.0.0.1", port, reuse_address=True)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_main())
