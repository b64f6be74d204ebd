"""The metrics poller: every backend's /metrics, concurrently, once per interval (spec 5.1).

Reads: the metrics URLs from the settings; each page with a 2 s timeout and a 4 MiB limit.
Guarantees:
- one poll round starts every ``DYNAMIC_POLL_INTERVAL_MS`` (the first at once); the round ends
  when every fetch answered, failed or timed out, and only then is it evaluated, so a slow
  backend delays a round by at most the timeout;
- a fetch or parse failure becomes a failed backend in the round, never an exception;
- each round is published to the engine and reported to the observer with the verbatim
  learner families, for recording, and, under the predictive learner, the explanation of the
  cap it set; only then does the engine retry its waiters, so a recording holds the round
  before the retries it allowed.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio

from guard_adapters.backends import MetricsSource
from guard_adapters.explain import poll_prediction
from guard_adapters.metrics import MAX_PAGE_BYTES, parse_metrics
from guard_core import BackendPoll, GuardError, Prediction, PublishedDecision
from guard_trio._engine import GuardEngine
from guard_trio._http import fetch

__all__ = ("PollReport", "Poller")

POLL_TIMEOUT_S = 2.0


@attrs.frozen
class PollReport:
    """One finished round: what each source answered (page text or error) and the decision."""

    at: float
    pages: tuple[tuple[str, str | None, str], ...]  # (name, page text or None, error)
    polls: tuple[BackendPoll, ...]
    decision: PublishedDecision | None
    #: The predictive learner's explanation of this round's cap (None under PIG's learner).
    prediction: Prediction | None = None


class Poller:
    def __init__(
        self,
        engine: GuardEngine,
        sources: tuple[MetricsSource, ...],
        *,
        interval_s: float,
        on_round: Callable[[PollReport], None] | None = None,
    ) -> None:
        self.engine = engine
        self.sources = sources
        self.interval_s = interval_s
        self.on_round: list[Callable[[PollReport], None]] = [on_round] if on_round else []
        self.rounds = 0

    async def _fetch(
        self, source: MetricsSource, results: dict[str, tuple[str | None, str]]
    ) -> None:
        try:
            if source.health_url is not None:
                health = await fetch(source.health_url, timeout_s=POLL_TIMEOUT_S, max_bytes=65536)
                if health.status != 200:
                    raise GuardError(f"health check status {health.status}")
            response = await fetch(source.url, timeout_s=POLL_TIMEOUT_S, max_bytes=MAX_PAGE_BYTES)
            if response.status != 200:
                raise GuardError(f"status {response.status}")
            results[source.name] = (response.body.decode("utf-8", errors="replace"), "")
        except trio.TooSlowError:
            results[source.name] = (None, "timed out")
        except GuardError as exc:
            results[source.name] = (None, str(exc)[:200])

    async def poll_once(self) -> PollReport:
        results: dict[str, tuple[str | None, str]] = {}
        async with trio.open_nursery() as nursery:
            for source in self.sources:
                nursery.start_soon(self._fetch, source, results)
        polls, pages = [], []
        for source in self.sources:
            text, error = results[source.name]
            sample = None
            if text is not None:
                try:
                    sample = parse_metrics(text)
                except GuardError as exc:
                    text, error = None, str(exc)[:200]
            polls.append(BackendPoll(name=source.name, sample=sample, error=error))
            pages.append((source.name, text, error))
        at = self.engine.seconds_since_start()
        before = self.engine.state
        decision = self.engine.publish_poll(tuple(polls), at=at)
        prediction = poll_prediction(before, self.engine.state)
        self.rounds += 1
        report = PollReport(at, tuple(pages), tuple(polls), decision, prediction)
        for listener in self.on_round:
            listener(report)
        # After the round is recorded: the retries it allows follow it in a recording, as they
        # follow it in the core.
        self.engine.retry_waiters()
        return report

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Poll forever: at once, then every interval (a slow round delays the next one)."""
        task_status.started()
        next_at = trio.current_time()
        while True:
            await self.poll_once()
            next_at = max(next_at + self.interval_s, trio.current_time())
            await trio.sleep_until(next_at)
