"""``record`` against a real HTTP server on 127.0.0.1: scrapes, failures, timeouts."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import h11
import pytest
import trio

from guard_adapters.metrics import parse_metrics
from guard_adapters.recording import Header, Scrape, ScrapeFailed, read_records
from guard_trio._http import FetchError, ResponseTooLarge, fetch
from guard_trio._record import record

PAGE = (
    Path(__file__).parents[1]
    / "fixtures/metrics/vllm-0.10-nvcr25.09-qwen3-4b-fp8-idle-after-6req.prom"
).read_bytes()


async def serve_one(stream: trio.SocketStream) -> None:
    """A minimal metrics server: /metrics (the real page), /broken (500), /slow, /huge."""
    connection = h11.Connection(h11.SERVER)
    async with stream:
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                if not data:
                    return
                connection.receive_data(data)
                continue
            if not isinstance(event, h11.Request):
                return
            target = event.target
            if target == b"/slow":
                await trio.sleep(5)
            status, body = 200, PAGE
            if target == b"/broken":
                status, body = 500, b"oops\n"
            elif target == b"/huge":
                body = b"x" * (64 * 1024 + 1)
            headers = [
                ("Content-Type", "text/plain; version=0.0.4"),
                ("Content-Length", str(len(body))),
            ]
            await stream.send_all(
                connection.send(h11.Response(status_code=status, headers=headers))
                + connection.send(h11.Data(data=body))
                + connection.send(h11.EndOfMessage())
            )
            return


@pytest.fixture
async def base_url(nursery: trio.Nursery) -> AsyncIterator[str]:
    listeners = await nursery.start(partial(trio.serve_tcp, serve_one, 0, host="127.0.0.1"))
    host, port = listeners[0].socket.getsockname()[:2]
    yield f"http://{host}:{port}"
    nursery.cancel_scope.cancel()


async def test_fetch_reads_the_whole_page(base_url: str) -> None:
    response = await fetch(f"{base_url}/metrics")
    assert response.status == 200
    assert response.body == PAGE


async def test_fetch_refuses_oversized_bodies_and_times_out(base_url: str) -> None:
    with pytest.raises(ResponseTooLarge):
        await fetch(f"{base_url}/huge", max_bytes=64 * 1024)
    with pytest.raises(trio.TooSlowError):
        await fetch(f"{base_url}/slow", timeout_s=0.2)
    with pytest.raises(FetchError):
        await fetch("ftp://127.0.0.1/metrics")


async def test_fetch_reports_a_refused_connection() -> None:
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # nothing listens there now
    with pytest.raises(FetchError):
        await fetch(f"http://127.0.0.1:{port}/metrics")


async def test_record_writes_scrapes_and_failures(base_url: str) -> None:
    out, log = io.BytesIO(), io.StringIO()
    polls = await record(
        [f"{base_url}/metrics", f"{base_url}/broken"],
        interval_s=0.2,
        duration_s=0.4,
        out=out,
        log=log,
    )
    assert polls == 3
    items = list(read_records(out.getvalue().splitlines(), strict=True))
    assert isinstance(items[0], Header)
    assert items[0].config["DYNAMIC_METRICS_URLS"].endswith("/broken")
    scrapes = [i for i in items if isinstance(i, Scrape)]
    failures = [i for i in items if isinstance(i, ScrapeFailed)]
    assert [s.poll for s in scrapes] == [0, 1, 2]
    assert [f.poll for f in failures] == [0, 1, 2]
    assert all(f.error == "status 500" for f in failures)
    # The recorded text is only what the learner reads, and parses to the same sample.
    assert len(scrapes[0].text) < len(PAGE) / 5
    assert parse_metrics(scrapes[0].text) == parse_metrics(PAGE)
    assert scrapes[0].flavour == "vllm"
    # Both scrapes of one poll carry the same time, and polls are about 0.2 s apart.
    times = [s.at for s in scrapes]
    assert [f.at for f in failures] == times
    assert times[2] - times[0] == pytest.approx(0.4, abs=0.15)
