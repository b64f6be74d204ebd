"""``PIG_RECORD_PATH``: the live recording, written without ever blocking a request.

Reads: the request events the engine applied (its listener is :meth:`Recorder.event`) and the
poller's rounds (:meth:`Recorder.poll`).
Guarantees:
- the request path only appends an encoded line to an in-memory list; a background task hands
  the pending lines to a worker thread about twice a second, so a slow disk never stalls trio;
- if the pending lines exceed ``max_pending`` (the disk cannot keep up), new lines are dropped
  and counted rather than growing memory without bound, and the count is logged at the end;
- the header carries the effective settings with every secret redacted.
"""

from __future__ import annotations

import datetime
import logging
from pathlib import Path
from typing import IO

import trio

from guard_adapters.explain import explanation
from guard_adapters.metrics import LEARNER_FAMILIES
from guard_adapters.recording import (
    Decision,
    Header,
    Record,
    Scrape,
    ScrapeFailed,
    encode,
    learner_text,
    open_for_writing,
)
from guard_core import RequestEvent
from guard_trio._poller import PollReport

__all__ = ("Recorder",)

log = logging.getLogger("inference_guard")

_FLUSH_EVERY_S = 0.5


class Recorder:
    def __init__(
        self, path: Path, *, config: dict[str, str], producer: str, max_pending: int = 200_000
    ) -> None:
        self.path = path
        self.max_pending = max_pending
        self.dropped = 0
        self._pending: list[bytes] = []
        self._poll = 0
        self._stream: IO[bytes] = open_for_writing(path)
        header = Header(
            started_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            producer=producer,
            config=config,
        )
        self._stream.write(encode(header))

    def _add(self, record: Record) -> None:
        if len(self._pending) >= self.max_pending:
            self.dropped += 1
            return
        self._pending.append(encode(record))

    # -- the engine's listener ----------------------------------------------------------------

    def event(self, event: RequestEvent) -> None:
        """One request event the engine applied: written as it is (docs/recording.md)."""
        self._add(event)

    # -- poller --------------------------------------------------------------------------------

    def poll(self, report: PollReport) -> None:
        poll = self._poll
        self._poll += 1
        for (name, text, error), parsed in zip(report.pages, report.polls, strict=True):
            if text is None or parsed.sample is None:
                self._add(ScrapeFailed(at=report.at, poll=poll, backend=name, error=error))
            else:
                self._add(
                    Scrape(
                        at=report.at,
                        poll=poll,
                        backend=name,
                        flavour=str(parsed.sample.flavour),  # as the parser saw the page
                        text=learner_text(text, LEARNER_FAMILIES),
                    )
                )
        decision = report.decision
        if decision is not None:
            self._add(
                Decision(
                    at=report.at,
                    poll=poll,
                    cap=decision.cap,
                    state=str(decision.state),
                    reason=str(decision.final_reason),
                    yellow=[str(r) for r in decision.yellow_reasons],
                    red=[str(r) for r in decision.red_reasons],
                    source=str(decision.source),
                    predicted=(
                        None if report.prediction is None else explanation(report.prediction)
                    ),
                )
            )

    # -- writing -------------------------------------------------------------------------------

    def _write(self, lines: list[bytes]) -> None:
        self._stream.write(b"".join(lines))
        self._stream.flush()

    async def run(self) -> None:
        """Flush pending lines in a worker thread until cancelled; then flush the rest."""
        try:
            while True:
                await trio.sleep(_FLUSH_EVERY_S)
                await self.flush()
        finally:
            with trio.CancelScope(shield=True):
                await self.aclose()

    async def aclose(self) -> None:
        """Write what is pending and close the file."""
        await self.flush()
        if self.dropped:
            log.warning(
                "recording %s: %d records dropped (the disk did not keep up)",
                self.path,
                self.dropped,
            )
        await trio.to_thread.run_sync(self._stream.close)

    async def flush(self) -> None:
        if not self._pending:
            return
        lines, self._pending = self._pending, []
        await trio.to_thread.run_sync(self._write, lines)
