"""What the relay tells the core about each backend's health, and when a request may go on to
another backend.

Reads: what happened to one request at its backend (the connection, whether any byte of the
request left, the response status), from :class:`~guard_trio._relay.Relay`.
Guarantees:
- nothing at all is told with one backend (PIG's contract: :attr:`BackendHealthReports.on`);
- a failed connect, or a reset or close before the response head, is a failure; a status of
  :data:`ENGINE_REFUSALS` is the engine's "full" answer; another 5xx (after the client-caused
  500s were rewritten) is a failure; any other head is a success; a body cut after the head is
  no verdict (the head gave one);
- a request may go on to another backend only when not one of its bytes left for this one, or
  when the engine refused it unstarted and its body is held (:meth:`go_on`);
- a probe whose request ended with no verdict is handed back, so the next request can probe.
"""

from __future__ import annotations

from collections.abc import Callable

from guard_core.health import BackendFailed, BackendFull, BackendSucceeded, Failure, ProbeAbandoned
from guard_trio._engine import GuardEngine
from guard_trio._upstream import UpstreamConnection, UpstreamError

__all__ = ("ENGINE_REFUSALS", "BackendHealthReports", "EngineRefused")

#: Statuses an engine refuses a request with, unstarted: vLLM's 503 (``--max-num-queued-reqs``,
#: its prefill backlog limit), SGLang's queue-full 503, a 429 from an engine's own queue.
ENGINE_REFUSALS = frozenset({503, 429})


class EngineRefused(Exception):
    """The backend's engine refused the request before starting it (its queue is full)."""


class BackendHealthReports:
    """Tells the engine what each backend did (see the module rules)."""

    def __init__(self, engine_of: Callable[[str], GuardEngine], *, backends: int) -> None:
        #: The engine a backend's health is told to (its pool's).
        self.engine_of = engine_of
        #: Health is told, and acted on, only with several backends.
        self.on = backends > 1

    def head(self, name: str, status: int) -> None:
        """The backend answered with ``status`` (after any reclassification)."""
        if not self.on:
            return
        if status in ENGINE_REFUSALS:
            self.engine_of(name).tell(BackendFull, name)
        elif status >= 500:
            self.engine_of(name).tell(BackendFailed, name, Failure.SERVER_ERROR)
        else:
            self.engine_of(name).tell(BackendSucceeded, name)

    def refuses(self, name: str, status: int, *, can_respond: bool) -> bool:
        """The engine refused the request unstarted and the client has seen nothing yet: the
        backend is marked full and the relay goes on elsewhere or answers its own 429."""
        if not (self.on and can_respond and status in ENGINE_REFUSALS):
            return False
        self.engine_of(name).tell(BackendFull, name)
        return True

    def stalled(self, name: str) -> None:
        """No response head within the head timeout."""
        if self.on:
            self.engine_of(name).tell(BackendFailed, name, Failure.STALLED_HEAD)

    def failed(self, name: str, up: UpstreamConnection | None) -> None:
        """The exchange broke (``up``: its connection, ``None`` when the connect failed)."""
        if not self.on or (up is not None and up.head_seen):
            return  # the head already said how the backend is; a cut body is not a verdict
        failure = Failure.CONNECT if up is None else Failure.RESET
        self.engine_of(name).tell(BackendFailed, name, failure)

    def go_on(
        self,
        exc: UpstreamError | EngineRefused,
        name: str,
        up: UpstreamConnection | None,
        can_respond: bool,
        replayable: bool,
    ) -> bool:
        """After ``exc`` at ``name`` (its failure told): may the request go on to another
        backend? Only when not a byte of it reached this one, or when the engine refused it
        unstarted and its body is held, and the client has seen nothing yet."""
        if isinstance(exc, EngineRefused):
            return self.on and can_respond and replayable
        self.failed(name, up)
        return self.on and can_respond and exc.unsent

    def probe_ended(self, name: str, up: UpstreamConnection | None) -> None:
        """The request that was ``name``'s probe ended: hand the probe back if no verdict came."""
        if up is not None and up.head_seen:
            return
        health = self.engine_of(name).state.health.of(name)
        if health is not None and health.probing:
            self.engine_of(name).tell(ProbeAbandoned, name)
