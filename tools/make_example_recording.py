"""Build the example recording in tests/fixtures/recordings/ from the real vLLM metrics page.

The scrapes are the real vLLM 0.10 page's learner families (tests/fixtures/metrics/), with their
values rewritten each poll by a small closed-loop stand-in for a loaded engine; the requests are a
seeded load that ramps past capacity, slows down, builds an engine queue, preempts, brings slow
first tokens, then recovers. The guard's decisions come from guard_core itself, exactly as the
proxy would publish them, so replaying the file with its own settings must give them back.

Run from the repository root: ``python tools/make_example_recording.py``. Deterministic.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import attrs

from guard_adapters.metrics import parse_metrics
from guard_adapters.recording import (
    Decision,
    Header,
    Record,
    Scrape,
    encode,
    open_for_writing,
)
from guard_core import (
    Admitted,
    Arrived,
    BackendPoll,
    Finished,
    FirstToken,
    Forwarded,
    GuardConfig,
    GuardState,
    MetricsPolled,
    Queued,
    Refused,
    Rejected,
    RequestEvent,
    Retried,
    Tier,
    apply_guard_event,
)

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "tests/fixtures/metrics/vllm-0.10-nvcr25.09-qwen3-4b-fp8-idle-after-6req.prom"
OUT = ROOT / "tests/fixtures/recordings/example-vllm-overload.jsonl.gz"
FAMILIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds",
)
TICK_S = 0.1
POLL_EVERY = 10  # ticks
DURATION_S = 150.0
MAX_NUM_SEQS = 64
SETTINGS = {"GLOBAL_LIMIT": "512", "DYNAMIC_METRICS_URL": "http://backend:8000/metrics"}


def template() -> list[str]:
    """The learner's families from the real page: HELP/TYPE comments and samples, in order."""
    lines = []
    for line in PAGE.read_text().splitlines():
        name = line.split(" ")[2] if line.startswith("# ") else re.split(r"[{ ]", line)[0]
        base = name.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
        if base in FAMILIES:
            lines.append(line)
    return lines


TTFT_BOUNDS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip


@attrs.define
class Engine:
    """A stand-in for a loaded vLLM engine: batch, queue, counters."""

    running: list[list[float]] = attrs.field(factory=list)  # [tokens left, request id]
    waiting: list[list[float]] = attrs.field(factory=list)
    generated: float = 1739.0
    preemptions: float = 0.0
    ttft_counts: list[float] = attrs.field(factory=lambda: [0.0] * (len(TTFT_BOUNDS) + 1))
    ttft_sum: float = 0.0

    def user_speed(self) -> float:
        return 90.0 * 32 / (32 + len(self.running))

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_sum += seconds
        for i, bound in enumerate((*TTFT_BOUNDS, float("inf"))):
            if seconds <= bound:
                self.ttft_counts[i] += 1

    def render(self, lines: list[str]) -> str:
        values = {
            "vllm:num_requests_running": float(len(self.running)),
            "vllm:num_requests_waiting": float(len(self.waiting)),
            "vllm:kv_cache_usage_perc": min(0.99, 0.012 * len(self.running)),
            "vllm:num_preemptions_total": self.preemptions,
            "vllm:generation_tokens_total": float(int(self.generated)),
            "vllm:time_to_first_token_seconds_count": self.ttft_counts[-1],
            "vllm:time_to_first_token_seconds_sum": round(self.ttft_sum, 6),
        }
        out = []
        for line in lines:
            if line.startswith("#"):
                out.append(line)
                continue
            name = re.split(r"[{ ]", line)[0]
            head = line.rsplit(" ", 1)[0]
            if name == "vllm:time_to_first_token_seconds_bucket":
                le = re.search(r'le="([^"]+)"', line)
                assert le is not None
                index = (
                    len(TTFT_BOUNDS)
                    if le.group(1) == "+Inf"
                    else TTFT_BOUNDS.index(float(le.group(1)))
                )
                out.append(f"{head} {self.ttft_counts[index]}")
            else:
                out.append(f"{head} {values[name]}")
        return "\n".join(out) + "\n"


def arrival_rate(t: float) -> float:
    if t < 40:
        return 2 + 12 * t / 40
    if t < 80:
        return 25.0
    if t < 120:
        return 8.0
    return 6.0


def prefill_s(t: float) -> float:
    """Time to first token inside the engine; long prompts between 80 s and 120 s."""
    return 0.65 if 80 <= t < 120 else 0.15


def main() -> None:  # noqa: PLR0915 - one linear script
    rng = random.Random(20261129)
    lines = template()
    config = GuardConfig()
    state = GuardState.initial(config, at=0.0)
    engine = Engine()
    records: list[Record] = []
    waiters: dict[int, Queued] = {}
    admitted: dict[int, tuple[Tier, float]] = {}  # id -> (tier, arrival time)
    pending_first: list[tuple[float, int, float]] = []  # (when, id, arrival)
    next_id = 0
    poll = 0

    def step(event: RequestEvent | MetricsPolled) -> object:
        """Apply one event; a request event is also recorded, as the live engine records it."""
        nonlocal state
        if not isinstance(event, MetricsPolled):
            records.append(event)
        result = apply_guard_event(state, event)
        state = result.state
        return result.decision if result.decision is not None else result.outcome

    def start(request_id: int, tier: Tier, arrived: float, at: float) -> None:
        admitted[request_id] = (tier, arrived)
        step(Forwarded(at=at, request_id=request_id))
        job = [float(rng.randint(100, 500)), float(request_id)]
        if len(engine.running) < MAX_NUM_SEQS:
            engine.running.append(job)
        else:
            engine.waiting.append(job)
        pending_first.append(
            (at + prefill_s(at) + 0.004 * len(engine.running), request_id, arrived)
        )

    def retry(at: float, *, expired_only: bool = False) -> None:
        """Retry every waiter (after a release or a poll), or only those at their deadline."""
        for request_id, queued in list(waiters.items()):
            if expired_only and queued.deadline > at:
                continue
            outcome = step(Retried(at=at, request_id=request_id))
            if isinstance(outcome, Queued):
                waiters[request_id] = outcome
                continue
            del waiters[request_id]
            if isinstance(outcome, Admitted):
                start(request_id, queued.tier, arrivals[request_id], at)
                continue
            assert isinstance(outcome, Rejected)
            step(Refused(at=at, request_id=request_id, code=outcome.code))

    arrivals: dict[int, float] = {}
    ticks = int(DURATION_S / TICK_S)
    for tick in range(1, ticks + 1):
        at = round(tick * TICK_S, 6)
        # Decode one tick for the batch; finished requests leave and free their slot.
        speed = engine.user_speed()
        released = False
        for job in list(engine.running):
            made = min(job[0], speed * TICK_S)
            job[0] -= made
            engine.generated += made
            if job[0] <= 0:
                engine.running.remove(job)
                request_id = int(job[1])
                admitted.pop(request_id)
                step(Finished(at=at, request_id=request_id, status=200))
                released = True
        while engine.waiting and len(engine.running) < MAX_NUM_SEQS:
            engine.running.append(engine.waiting.pop(0))
        if at == 60.0:
            engine.preemptions += 2
        for when, request_id, arrived in [p for p in pending_first if p[0] <= at]:
            pending_first.remove((when, request_id, arrived))
            if request_id in admitted:
                engine.observe_ttft(when - arrived)
                seconds = round(at - arrived, 6)
                step(FirstToken(at=at, request_id=request_id, seconds=seconds))
        if released:
            retry(at)
        retry(at, expired_only=True)
        # Arrivals.
        for _ in range(sum(rng.random() < arrival_rate(at) * TICK_S / 4 for _ in range(4))):
            request_id, next_id = next_id, next_id + 1
            tier = Tier.PREMIUM if rng.random() < 0.2 else Tier.BASIC
            body = rng.randint(400, 40_000)
            arrivals[request_id] = at
            arrival = Arrived(
                at=at,
                request_id=request_id,
                tier=tier,
                body_bytes=body,
                path="/v1/chat/completions",
            )
            outcome = step(arrival)
            if isinstance(outcome, Admitted):
                start(request_id, tier, at, at)
            elif isinstance(outcome, Queued):
                waiters[request_id] = outcome
            else:
                assert isinstance(outcome, Rejected)
                step(Refused(at=at, request_id=request_id, code=outcome.code))
        # Poll.
        if tick % POLL_EVERY == 0:
            text = engine.render(lines)
            records.append(Scrape(at=at, poll=poll, backend="backend1", flavour="vllm", text=text))
            decision = step(
                MetricsPolled(at, (BackendPoll(name="backend1", sample=parse_metrics(text)),))
            )
            assert decision is not None
            records.append(
                Decision(
                    at=at,
                    poll=poll,
                    cap=decision.cap,  # type: ignore[attr-defined]
                    state=str(decision.state),  # type: ignore[attr-defined]
                    reason=str(decision.final_reason),  # type: ignore[attr-defined]
                    yellow=[str(r) for r in decision.yellow_reasons],  # type: ignore[attr-defined]
                    red=[str(r) for r in decision.red_reasons],  # type: ignore[attr-defined]
                )
            )
            poll += 1
            retry(at)

    OUT.parent.mkdir(parents=True, exist_ok=True)
    header = Header(
        started_at="2026-11-29T00:00:00Z",
        producer="tools/make_example_recording.py (simulated load over the real vLLM 0.10 page)",
        config=SETTINGS,
    )
    with open_for_writing(OUT) as out:
        out.write(encode(header))
        for record in records:
            out.write(encode(record))
    print(f"wrote {len(records)} records, {poll} polls to {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
