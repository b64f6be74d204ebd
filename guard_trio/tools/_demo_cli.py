"""``inference-guard demo``: the guard at work in one command, no GPU, no network, no config.

Reads: its own flags only (``--duration``, ``--seed``, ``--quick``, ``--json``); nothing from the
environment, no file, no network beyond 127.0.0.1.

Guarantees:

- Everything runs in one trio process on 127.0.0.1 with ports chosen by the kernel (port 0): a
  simulated vLLM (:class:`~guard_trio.tools.sim_backend.SimBackend`, a calibrated two-GPU 32B
  profile with ``max_num_seqs`` 48, whose per-user speed falls below 25 tok/s past about 20
  streams),
  the guard in front of it (dynamic mode, polling ``/metrics`` every 500 ms) and a load
  generator of simulated users.
- The load is a plan fixed by the seed: user ``i`` starts at a set time (ramping from light to
  about three times what the backend carries at 25 tok/s per user), is premium when
  ``(i + seed) % 5 == 0`` (20 %), and draws its output lengths and think times from its own
  seeded generator; a quarter of its requests carry a long prompt (a document of 1,000-3,000
  tokens). Three phases run the plan, each against a fresh backend: straight to it (no
  guard), through the guard with PIG's learner (``DYNAMIC_POLICY=pig``), and through the guard
  with the predictive learner (``DYNAMIC_POLICY=predictive``), so every phase sees the same
  users asking the same things.
- Each user keeps one keep-alive connection, sends a streaming chat request, reads the event
  stream (a token is a chunk whose ``delta.content`` is not empty), thinks, and starts again; a
  429 makes it wait about a second and try again with a new request.
- At the end of a phase no new request starts; requests in flight get a short drain, then are
  cancelled. Figures: *served* = 200 and stream complete; *good* = served within the service
  objective: first content token within 1 s of sending plus the time its prompt alone needs on
  an idle engine (prompt-aware, as ``nox -s policy`` counts it), and at least 20 tok/s where the
  stream was long enough to measure; *rejected* = 429; per-user tok/s is a
  stream's decode speed, ``(tokens - 1) / (last token - first token)``, over every stream that
  got at least 16 tokens (a stream cut at the end still says how fast it ran); TTFT runs from
  sending the request to its first content token, and a request still without one when the
  phase ends counts with the time it had waited (a lower bound).
- Progress: one status line a second on stdout (rewritten in place with ``\\r`` on a terminal,
  plain lines otherwise); then a table per phase and tier, and one line of interpretation.
  ``--json OUT`` writes the same figures. Exit status 0; every task is ended before returning.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import attrs
import h11
import trio

from guard_adapters.config import load_config
from guard_adapters.engine_model import PROFILES, idle_prefill_s
from guard_adapters.live_view import LiveView, compact_line, fold
from guard_trio._cli_support import figure, number, write_json, write_table
from guard_trio._server import GuardServer
from guard_trio.admin import decision_now
from guard_trio.tools.sim_backend import SimBackend, SimBackendConfig

PROFILE = "2xa100-tp2-qwen2.5-32b"
MAX_NUM_SEQS = 48
PROMPT_CHARS = 400  # about 100 prompt tokens for the simulated engine (chars / 4)
#: A quarter of the requests carry a document: 1,000-3,000 prompt tokens (chars / 4), as real
#: chat traffic has a long tail of long prompts (the Azure trace's p90 is above 2,000 tokens).
LONG_SHARE = 0.25
LONG_PROMPT_CHARS = (4_000, 12_000)
MIN_SPEED_TOKENS = 16
RECENT_S = 3.0
TIERS = ("premium", "basic")
QUICK_S = 45.0
#: The service objective a *good* request met.
GOOD_TTFT_S = 1.0
GOOD_TPS = 20.0
#: The phases: name, the guard's DYNAMIC_POLICY (``None``: no guard) and what it is, in words.
PHASES = (
    ("unguarded", None, "straight to a fresh backend, no guard"),
    ("pig", "pig", "through the guard, PIG's learner"),
    ("predictive", "predictive", "through the guard, the predictive learner"),
)


# -- the plan --------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class DemoPlan:
    """The load and timing of one demo run; both phases follow it."""

    seed: int
    phase_s: float
    ramp_s: float
    drain_s: float
    start_users: int
    peak_users: int
    tokens_low: int
    tokens_high: int
    think_s: tuple[float, float]
    retry_s: tuple[float, float]
    poll_ms: int

    @classmethod
    def for_duration(cls, duration_s: float, seed: int, *, quick: bool = False) -> DemoPlan:
        """The plan for a total of about ``duration_s``; ``quick`` reaches the peak sooner."""
        phase_s = 0.3 * duration_s
        high = min(300, max(40, int(phase_s * 11)))
        return cls(
            seed=seed,
            phase_s=phase_s,
            ramp_s=(0.4 if quick else 0.8) * phase_s,
            drain_s=max(0.5, 0.03 * duration_s),
            start_users=6,
            peak_users=70,
            tokens_low=high // 2,
            tokens_high=high,
            think_s=(0.5, 2.0),
            retry_s=(0.7, 1.3),
            poll_ms=500 if duration_s >= 30 else 250,
        )

    def user_start_s(self, user: int) -> float:
        """When user ``user`` (0-based) starts: a few at once, then a linear ramp."""
        if user < self.start_users:
            return 0.0
        span = max(1, self.peak_users - self.start_users)
        return self.ramp_s * (user - self.start_users + 1) / span

    def users_at(self, elapsed_s: float) -> int:
        return sum(1 for u in range(self.peak_users) if self.user_start_s(u) <= elapsed_s)

    def is_premium(self, user: int) -> bool:
        return (user + self.seed) % 5 == 0


@attrs.define
class Outcome:
    """One request as its user saw it; filled in while it runs."""

    user: int
    tier: str
    started: float
    #: The prompt's size in the simulated engine's tokens.
    prompt_tokens: int = 0
    status: int | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    tokens: int = 0
    complete: bool = False

    @property
    def speed(self) -> float | None:
        first, last = self.first_token_at, self.last_token_at
        if self.tokens < MIN_SPEED_TOKENS or first is None or last is None or last <= first:
            return None
        return (self.tokens - 1) / (last - first)

    @property
    def good(self) -> bool:
        """Served within the objective: complete, a fast first token, and fast enough after."""
        if self.status != 200 or not self.complete or self.first_token_at is None:
            return False
        allowed = GOOD_TTFT_S + idle_prefill_s(PROFILES[PROFILE], max(1, self.prompt_tokens))
        if self.first_token_at - self.started > allowed:
            return False
        speed = self.speed
        return speed is None or speed >= GOOD_TPS

    def ttft(self, ended: float) -> float | None:
        if self.first_token_at is not None:
            return self.first_token_at - self.started
        if self.status in (None, 200):
            return ended - self.started  # still waiting at the end: a lower bound
        return None


# -- a small keep-alive streaming client -----------------------------------------------------------


class _Connection:
    def __init__(self, stream: trio.SocketStream, host: str) -> None:
        self.stream = stream
        self.host = host
        self.h11 = h11.Connection(h11.CLIENT)

    async def next_event(self) -> Any:
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(await self.stream.receive_some(65536))
                continue
            return event

    async def send(self, path: str, headers: list[tuple[str, str]], body: bytes) -> None:
        all_headers = [("Host", self.host), ("Content-Length", str(len(body))), *headers]
        data = self.h11.send(h11.Request(method="POST", target=path, headers=all_headers)) or b""
        data += self.h11.send(h11.Data(data=body)) or b""
        data += self.h11.send(h11.EndOfMessage()) or b""
        await self.stream.send_all(data)

    def reusable(self) -> bool:
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
            return True
        return False


async def _connect(address: tuple[str, int]) -> _Connection:
    host, port = address
    stream = await trio.open_tcp_stream(host, port)
    return _Connection(stream, f"{host}:{port}")


def _content_tokens(event: bytes) -> int:
    """1 when an SSE event carries a chat chunk with non-empty ``delta.content``, else 0."""
    if not event.startswith(b"data: {"):
        return 0
    try:
        chunk = json.loads(event[6:])
        return 1 if chunk["choices"][0]["delta"].get("content") else 0
    except (ValueError, KeyError, IndexError, TypeError):
        return 0


async def _stream_request(
    connection: _Connection, body: bytes, tier: str, outcome: Outcome
) -> None:
    """Send one streaming chat request and record its timing into ``outcome`` as it arrives."""
    headers = [("Content-Type", "application/json"), ("Accept", "text/event-stream")]
    if tier == "premium":
        headers.append(("X-User-Tier", "premium"))
    await connection.send("/v1/chat/completions", headers, body)
    event = await connection.next_event()
    while isinstance(event, h11.InformationalResponse):
        event = await connection.next_event()
    if not isinstance(event, h11.Response):
        raise ConnectionError(f"unexpected {event!r}")
    outcome.status = event.status_code
    pending = b""
    while True:
        event = await connection.next_event()
        if isinstance(event, h11.EndOfMessage):
            break
        if not isinstance(event, h11.Data):
            raise ConnectionError(f"unexpected {event!r}")
        if outcome.status != 200:
            continue
        now = trio.current_time()
        pending += bytes(event.data)
        *events, pending = pending.split(b"\n\n")
        for sse in events:
            if sse == b"data: [DONE]":
                outcome.complete = True
            elif _content_tokens(sse):
                outcome.tokens += 1
                if outcome.first_token_at is None:
                    outcome.first_token_at = now
                outcome.last_token_at = now


def _request_body(rng: random.Random, plan: DemoPlan) -> tuple[bytes, int]:
    """A streaming chat body and its prompt's size in the simulated engine's tokens."""
    chars = PROMPT_CHARS
    if rng.random() < LONG_SHARE:
        chars = rng.randint(*LONG_PROMPT_CHARS)
    words = " ".join(f"w{rng.randrange(1000)}" for _ in range(chars // 5 + 1))
    body = json.dumps(
        {
            "model": "demo",
            "messages": [{"role": "user", "content": words[:chars]}],
            "max_tokens": rng.randint(plan.tokens_low, plan.tokens_high),
            "stream": True,
        }
    ).encode()
    return body, max(1, chars // 4)


# -- the load --------------------------------------------------------------------------------------


@attrs.define
class _Phase:
    """What one phase shares between its users, the monitor and the figures."""

    name: str
    plan: DemoPlan
    start: float
    outcomes: list[Outcome] = attrs.Factory(list)
    stop: trio.Event = attrs.Factory(trio.Event)
    ended: float = 0.0

    def elapsed(self) -> float:
        return trio.current_time() - self.start


async def _user(phase: _Phase, user: int, address: tuple[str, int]) -> None:
    """One simulated user: request, read the stream, think; until the phase stops."""
    plan = phase.plan
    rng = random.Random(plan.seed * 100_003 + user)
    tier = "premium" if plan.is_premium(user) else "basic"
    with trio.move_on_at(phase.start + plan.user_start_s(user)):
        await phase.stop.wait()
    connection: _Connection | None = None
    try:
        while not phase.stop.is_set():
            body, prompt_tokens = _request_body(rng, plan)
            think = rng.uniform(*plan.think_s)
            retry = rng.uniform(*plan.retry_s)
            outcome = Outcome(
                user=user, tier=tier, started=trio.current_time(), prompt_tokens=prompt_tokens
            )
            phase.outcomes.append(outcome)
            try:
                if connection is None:
                    connection = await _connect(address)
                await _stream_request(connection, body, tier, outcome)
                if not connection.reusable():
                    await connection.stream.aclose()
                    connection = None
            except (OSError, trio.BrokenResourceError, h11.ProtocolError, ConnectionError):
                if connection is not None:
                    await connection.stream.aclose()
                connection = None
            with trio.move_on_after(retry if outcome.status == 429 else think):
                await phase.stop.wait()
    finally:
        if connection is not None:
            with trio.CancelScope(shield=True):
                await connection.stream.aclose()


# -- progress --------------------------------------------------------------------------------------


def _quantile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks; ``None`` for no data."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _progress_line(
    phase: _Phase, backend: SimBackend, guard: GuardServer | None, view: LiveView
) -> str:
    """The clients' own figures, then the guard's as ``inference-guard watch`` prints its line
    (the same message, folded into the same view, drawn by the same renderer)."""
    now = trio.current_time()
    recent_speeds: list[float] = []
    recent_ttfts: list[float] = []
    for o in phase.outcomes:
        if o.last_token_at is not None and now - o.last_token_at <= RECENT_S:
            speed = o.speed
            if speed is not None:
                recent_speeds.append(speed)
        if o.first_token_at is not None and now - o.first_token_at <= RECENT_S:
            recent_ttfts.append(o.first_token_at - o.started)
    metrics = backend.engine_metrics()
    guard_part = "no guard" if guard is None else compact_line(view)
    return (
        f"{phase.name:<9} {phase.elapsed():4.0f}s users {phase.plan.users_at(phase.elapsed()):>3}"
        f" | backend run {metrics.running:>3} wait {metrics.waiting:>3}"
        f" | user tok/s p50 {figure(_quantile(recent_speeds, 0.5)):>5}"
        f" TTFT p95 {figure(_quantile(recent_ttfts, 0.95), 2):>5} s | {guard_part}"
    )


async def _monitor(
    phase: _Phase, backend: SimBackend, guard: GuardServer | None, out: IO[str]
) -> None:
    tty = out.isatty()
    view = LiveView()
    try:
        while True:
            await trio.sleep(1.0)
            if guard is not None:
                view = fold(view, decision_now(guard))
            line = _progress_line(phase, backend, guard, view)
            out.write(f"\r{line}\x1b[K" if tty else f"{line}\n")
            out.flush()
    finally:
        if tty:
            out.write("\n")
            out.flush()


# -- a phase ---------------------------------------------------------------------------------------


async def _run_phase(name: str, plan: DemoPlan, policy: str | None, out: IO[str]) -> _Phase:
    """Start a fresh backend (and the guard with ``policy``, unless ``None``), run the plan,
    stop everything."""
    backend = SimBackend(
        SimBackendConfig(
            host="127.0.0.1", port=0, profile=PROFILE, max_num_seqs=MAX_NUM_SEQS, seed=plan.seed
        )
    )
    async with trio.open_nursery() as services:
        host, port = await services.start(backend.serve)
        address = (host, port)
        guard: GuardServer | None = None
        if policy is not None:
            base = f"http://{host}:{port}"
            settings = load_config(
                {
                    "LISTEN": "127.0.0.1:0",
                    "UPSTREAM": base,
                    "DYNAMIC_METRICS_URL": f"{base}/metrics",
                    "DYNAMIC_POLL_INTERVAL_MS": str(plan.poll_ms),
                    "PIG_STATUS_LOG_INTERVAL_SECONDS": "0",
                    "DYNAMIC_POLICY": policy,
                }
            )
            guard = GuardServer(settings)
            address = await services.start(guard.serve)
        phase = _Phase(name=name, plan=plan, start=trio.current_time())
        async with trio.open_nursery() as load:
            load.start_soon(_monitor, phase, backend, guard, out)
            # Users stop starting requests at phase_s; those in flight get drain_s to finish.
            with trio.move_on_at(phase.start + plan.phase_s + plan.drain_s):
                async with trio.open_nursery() as users:
                    for user in range(plan.peak_users):
                        users.start_soon(_user, phase, user, address)
                    await trio.sleep_until(phase.start + plan.phase_s)
                    phase.stop.set()
            phase.ended = trio.current_time()
            load.cancel_scope.cancel()
        services.cancel_scope.cancel()
    return phase


# -- figures ---------------------------------------------------------------------------------------


def tier_figures(outcomes: Sequence[Outcome], ended: float) -> dict[str, Any]:
    speeds = [s for s in (o.speed for o in outcomes) if s is not None]
    ttfts = [t for t in (o.ttft(ended) for o in outcomes) if t is not None]
    return {
        "requests": len(outcomes),
        "served": sum(1 for o in outcomes if o.status == 200 and o.complete),
        "good": sum(1 for o in outcomes if o.good),
        "rejected": sum(1 for o in outcomes if o.status == 429),
        "user_tps_p5": _quantile(speeds, 0.05),
        "user_tps_p50": _quantile(speeds, 0.50),
        "ttft_p95_s": _quantile(ttfts, 0.95),
    }


def phase_figures(phase: _Phase) -> dict[str, dict[str, Any]]:
    figures = {
        tier: tier_figures([o for o in phase.outcomes if o.tier == tier], phase.ended)
        for tier in TIERS
    }
    figures["all"] = tier_figures(phase.outcomes, phase.ended)
    return figures


def render_table(results: dict[str, dict[str, dict[str, Any]]], out: IO[str]) -> None:
    header = (
        "phase",
        "tier",
        "requests",
        "served",
        "good",
        "rejected",
        "tok/s p5",
        "tok/s p50",
        "TTFT p95",
    )
    rows: list[tuple[str, ...]] = [header]
    for phase, tiers in results.items():
        for tier, f in tiers.items():
            rows.append(
                (
                    phase,
                    tier,
                    str(f["requests"]),
                    str(f["served"]),
                    str(f["good"]),
                    str(f["rejected"]),
                    figure(f["user_tps_p5"]),
                    figure(f["user_tps_p50"]),
                    "-" if f["ttft_p95_s"] is None else f"{f['ttft_p95_s']:.2f} s",
                )
            )
    write_table(rows, out, left=2)


def interpretation(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    unguarded, pig, predictive = (
        results[name]["all"] for name in ("unguarded", "pig", "predictive")
    )
    return (
        f"Good requests (first token within {GOOD_TTFT_S:g} s beyond the prompt's own prefill,"
        f" at least {GOOD_TPS:g} tok/s):"
        f" {predictive['good']} with the predictive learner, {pig['good']} with PIG's learner,"
        f" {unguarded['good']} unguarded. The slowest 5 % of streams ran at"
        f" {figure(predictive['user_tps_p5'])} tok/s with the predictive learner,"
        f" {figure(pig['user_tps_p5'])} with PIG's"
        f" and {figure(unguarded['user_tps_p5'])} unguarded;"
        f" TTFT p95 {figure(predictive['ttft_p95_s'], 2)} s, {figure(pig['ttft_p95_s'], 2)} s and"
        f" {figure(unguarded['ttft_p95_s'], 2)} s. The guard answered the rest with a 429"
        f" (Retry-After) rather than slow everyone down."
    )


# -- the command -----------------------------------------------------------------------------------


async def _demo(plan: DemoPlan, out: IO[str]) -> dict[str, dict[str, dict[str, Any]]]:
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for name, policy, what in PHASES:
        out.write(
            f"phase {name}: {plan.phase_s:.0f} s, users ramp {plan.start_users} -> "
            f"{plan.peak_users} over {plan.ramp_s:.0f} s, {what}\n"
        )
        out.flush()
        phase = await _run_phase(name, plan, policy, out)
        results[name] = phase_figures(phase)
    return results


_seconds = number(lambda value: math.isfinite(value) and value >= 4, "a number of seconds >= 4")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``demo``."""
    parser.add_argument(
        "--duration", type=_seconds, default=90.0, metavar="S", help="total seconds (90)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the load plan (default 0)")
    parser.add_argument("--quick", action="store_true", help="about 45 s in all (for tests)")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the final figures as JSON")


def run(args: argparse.Namespace, out: IO[str] | None = None) -> int:
    stream = out or sys.stdout
    duration = QUICK_S if args.quick else float(args.duration)
    plan = DemoPlan.for_duration(duration, args.seed, quick=args.quick)
    out_write: Callable[[str], Any] = stream.write
    out_write(
        f"inference-guard demo: simulated vLLM ({PROFILE}, max_num_seqs {MAX_NUM_SEQS}) on"
        f" 127.0.0.1, {plan.peak_users} users (20 % premium), {plan.tokens_low}-"
        f"{plan.tokens_high} output tokens per request\n"
    )
    began = time.monotonic()
    results = trio.run(_demo, plan, stream)
    runtime = time.monotonic() - began
    out_write("\n")
    render_table(results, stream)
    out_write("\n" + interpretation(results) + "\n")
    out_write(f"(demo ran {runtime:.0f} s)\n")
    stream.flush()
    if args.json is not None:
        document = {
            "plan": attrs.asdict(plan),
            "profile": PROFILE,
            "max_num_seqs": MAX_NUM_SEQS,
            "runtime_s": round(runtime, 2),
            "phases": results,
        }
        write_json(args.json, document)
    return 0
