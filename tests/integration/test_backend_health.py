"""Backend health over real sockets: several simulated backends behind one guard on loopback.

Checks: a backend stopped mid-run is ejected and every request still gets exactly one answer
(none is sent to two engines, none is lost); restarted on the same port it comes back after its
backoff through one probe; a backend that drops requests after reading them is ejected, and
those requests get the guard's 429, never a second backend; an engine's queue-full 503 (vLLM's
and SGLang's) never reaches the client: the request goes to another backend, or gets the guard's
own 429 when every engine is full; PIG_FAILURE_MODE=open forwards within GLOBAL_LIMIT while the
metrics endpoint is down, where close refuses, and says so on the metrics page and the status
line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import trio

from guard_adapters.exchange import TOO_MANY_REQUESTS_BODY
from guard_core.health import Availability, availability
from guard_trio._server import GuardServer
from guard_trio.tools.sim_backend import SimBackend, SimBackendConfig
from tests.integration.conftest import Reply, request, wait_for

CHAT = "/v1/chat/completions"
JSON = [("Content-Type", "application/json")]


def chat(max_tokens: int = 4) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    ).encode()


class Sim:
    """One simulated backend that can be stopped and started again on the same port."""

    def __init__(self, nursery: trio.Nursery, **config: Any) -> None:
        self.nursery = nursery
        self.config = config
        self.port = 0
        self.instances: list[SimBackend] = []
        self._scope = trio.CancelScope()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def backend(self) -> SimBackend:
        return self.instances[-1]

    async def start(self) -> None:
        backend = SimBackend(SimBackendConfig(host="127.0.0.1", port=self.port, **self.config))
        scope = self._scope = trio.CancelScope()

        async def run(task_status: trio.TaskStatus[tuple[str, int]]) -> None:
            with scope:
                await backend.serve(task_status=task_status)

        _host, self.port = await self.nursery.start(run)
        self.instances.append(backend)

    def stop(self) -> None:
        self._scope.cancel()

    def submitted(self) -> int:
        """Requests every instance's engine took in (finished, aborted or still running)."""
        return sum(b._driver._next_rid for b in self.instances)

    def finished(self) -> int:
        """Requests every instance's engine finished generating (its client got a 200)."""
        return sum(
            b.finished_by_reason["stop"] + b.finished_by_reason["length"] for b in self.instances
        )


async def sims(nursery: trio.Nursery, count: int, **config: Any) -> list[Sim]:
    started = []
    for _ in range(count):
        sim = Sim(nursery, **{"speed": 20.0, **config})
        await sim.start()
        started.append(sim)
    return started


def backends_env(named: dict[str, Sim], **extra: str) -> dict[str, str]:
    entries = ",".join(f"{name}={sim.url}" for name, sim in named.items())
    return {"BACKENDS": entries, "DYNAMIC_PIG_ENABLED": "false", **extra}


def health(server: GuardServer, name: str) -> Availability:
    state = server.engine.state.health.of(name)
    return availability(state, now=server.engine.seconds_since_start())


async def load(guard: str, count: int, *, concurrency: int = 4, max_tokens: int = 4) -> list[Reply]:
    """``count`` chat requests, ``concurrency`` at a time; every reply, in no order."""
    replies: list[Reply] = []
    send, receive = trio.open_memory_channel[int](count)
    for number in range(count):
        send.send_nowait(number)
    send.close()

    async def worker() -> None:
        async for _ in receive:
            replies.append(await request(guard, "POST", CHAT, JSON, chat(max_tokens)))

    with trio.fail_after(30):
        async with trio.open_nursery() as workers:
            for _ in range(concurrency):
                workers.start_soon(worker)
    return replies


async def test_a_killed_backend_is_ejected_and_comes_back_through_a_probe(
    nursery: trio.Nursery, start_guard: Any
) -> None:
    a, b, c = await sims(nursery, 3)
    guard, server = await start_guard(
        backends_env(
            {"a": a, "b": b, "c": c},
            PIG_BACKEND_EJECT_FAILURES="2",
            PIG_BACKEND_EJECT_SECONDS="0.6",
            PIG_BACKEND_EJECT_MAX_SECONDS="5",
        )
    )
    before = await load(guard, 30)
    assert b.finished() > 0  # b took its share while up

    b.stop()
    during = await load(guard, 60)
    assert health(server, "b") in (Availability.EJECTED, Availability.PROBE)
    b_health = server.engine.state.health.of("b")
    assert b_health is not None
    assert b_health.ejections >= 1
    # Refused connects left no byte at b: every one of those requests went to a or c.
    assert all(reply.status == 200 for reply in during), [r.status for r in during]

    await b.start()  # the same port
    await trio.sleep(0.7)  # past the backoff: half-open
    after = await load(guard, 40)
    assert health(server, "b") is Availability.AVAILABLE
    restored = server.engine.state.health.of("b")
    assert restored is not None
    assert restored.probes >= 1
    assert b.backend.finished_by_reason["length"] > 0  # it serves again

    replies = before + during + after
    assert len(replies) == 130  # each request got exactly one answer
    assert {reply.status for reply in replies} <= {200, 429}
    ok = sum(reply.status == 200 for reply in replies)
    # No request reached two engines, and every 200 is one finished generation.
    engines = (a, b, c)
    assert sum(sim.submitted() for sim in engines) <= len(replies)
    assert sum(sim.finished() for sim in engines) == ok
    page = server.metrics.exposition().decode()
    assert 'inference_guard_backend_ejections_total{name="b"}' in page
    assert 'inference_guard_backend_health_info{name="b",state="available"} 1' in page


async def test_requests_that_reached_a_failing_backend_are_never_sent_again(
    nursery: trio.Nursery, start_guard: Any
) -> None:
    a, b = await sims(nursery, 2)
    guard, server = await start_guard(
        backends_env({"a": a, "b": b}, PIG_BACKEND_EJECT_FAILURES="3")
    )
    a.backend.control({"drop_requests": True})  # reads each request, then closes unanswered
    replies = await load(guard, 40, concurrency=1)
    refused = [reply for reply in replies if reply.status == 429]
    assert refused, "a POST that reached a backend is never replayed: its client gets a 429"
    assert all(reply.body == TOO_MANY_REQUESTS_BODY for reply in refused)
    assert len(refused) == 3  # three failures in a row, then a is ejected
    assert health(server, "a") is Availability.EJECTED
    # b saw exactly the requests that were answered 200: none of a's was sent again.
    assert b.submitted() == b.finished() == sum(reply.status == 200 for reply in replies)


async def test_an_engine_503_never_reaches_the_client(
    nursery: trio.Nursery, start_guard: Any
) -> None:
    (vllm,) = await sims(nursery, 1)
    (sglang,) = await sims(nursery, 1, flavour="sglang")
    (spare,) = await sims(nursery, 1)
    guard, server = await start_guard(
        backends_env({"vllm": vllm, "sglang": sglang, "spare": spare})
    )
    vllm.backend.control({"queue_full": True})
    sglang.backend.control({"queue_full": True})
    replies = await load(guard, 30)
    assert [reply.status for reply in replies] == [200] * 30  # each went on to the spare
    assert spare.finished() == 30
    state = server.engine.state.health
    marks = {name: h.full_marks for name in ("vllm", "sglang") if (h := state.of(name))}
    assert sum(marks.values()) > 0
    assert all(h.failures == 0 and h.ejections == 0 for h in state.backends)  # not failures

    spare.backend.control({"queue_full": True})  # every engine full: the guard's own 429
    await trio.sleep(1.1)  # the full hold of the first two ends
    replies = await load(guard, 10)
    assert {reply.status for reply in replies} == {429}
    assert all(reply.body == TOO_MANY_REQUESTS_BODY for reply in replies)
    assert all(reply.header("retry-after") == b"1" for reply in replies)


async def test_a_real_queue_limit_is_spread_not_passed_on(
    nursery: trio.Nursery, start_guard: Any
) -> None:
    """``--max-num-queued-reqs 1`` on a one-sequence engine: its 503s go elsewhere."""
    small, big = await sims(nursery, 2, max_num_seqs=1, max_queued=1, speed=1.0)
    guard, server = await start_guard(backends_env({"small": small, "big": big}))
    replies = await load(guard, 24, concurrency=6, max_tokens=32)
    statuses = {reply.status for reply in replies}
    assert 503 not in statuses
    assert statuses <= {200, 429}
    full = sum(h.full_marks for h in server.engine.state.health.backends)
    assert full > 0  # the engines did refuse, and the guard took it
    assert small.finished() + big.finished() == sum(r.status == 200 for r in replies)


async def _inflight_peak(server: GuardServer, done: Callable[[], bool]) -> int:
    peak = 0
    while not done():
        peak = max(peak, server.engine.state.gate.inflight)
        await trio.sleep(0.005)
    return peak


async def test_fail_open_forwards_within_global_limit_where_close_refuses(
    nursery: trio.Nursery, start_guard: Any
) -> None:
    (sim,) = await sims(nursery, 1)
    sim.backend.control({"metrics_fail": True})
    env = {
        "UPSTREAM": sim.url,
        "DYNAMIC_METRICS_URL": f"{sim.url}/metrics",
        "DYNAMIC_POLL_INTERVAL_MS": "100",
        "GLOBAL_LIMIT": "2",
        "PIG_QUEUE_WAIT_SECONDS": "0",
    }
    closed_guard, closed = await start_guard(env, poll=False)
    open_guard, opened = await start_guard({**env, "PIG_FAILURE_MODE": "open"}, poll=False)
    await wait_for(lambda: closed.poller.rounds >= 2 and opened.poller.rounds >= 2)

    refused = await load(closed_guard, 6)
    assert {reply.status for reply in refused} == {429}
    assert "failure_mode" not in closed.status()

    finished = False
    replies: list[Reply] = []

    async def burst() -> None:
        nonlocal finished
        replies.extend(await load(open_guard, 12, concurrency=6))
        finished = True

    nursery.start_soon(burst)
    peak = await _inflight_peak(opened, lambda: finished)
    assert 1 <= peak <= 2  # forwards, never past GLOBAL_LIMIT
    assert 200 in {reply.status for reply in replies}
    assert {reply.status for reply in replies} <= {200, 429}
    assert opened.status().endswith("failure_mode=open:failing")
    page = opened.metrics.exposition().decode()
    assert "inference_guard_failure_mode_open 1.0" in page

    sim.backend.control({"metrics_fail": False})  # metrics back: the learner decides again
    await wait_for(lambda: not opened.status().endswith(":failing"))
    page = opened.metrics.exposition().decode()
    assert "inference_guard_failure_mode_open 0.0" in page
