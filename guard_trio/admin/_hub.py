"""The admin stream's hub: one message per poll round and per request outcome, to every viewer.

Reads: the guard server's state at the moment something happens (``server.engine.state`` and
the per-tier admission counts of ``server.metrics``), the poller's round reports and the
engine's request events; it keeps no copy of either beyond the requests still waiting for an
outcome (their arrival, and the learner's verdict on their latest attempt).
Guarantees:
- nothing here ever waits: a round or an event is turned into a message and offered to each
  viewer's bounded buffer with ``send_nowait``, on the caller's task (the poller's, or the
  request's on the hot path); a message is built and encoded once, and only when a viewer
  wants it;
- a viewer whose buffer is full is dropped: it gets no further message, its buffer is closed
  (so its writer sends what is buffered, then closes the WebSocket with :data:`DROPPED_CODE`),
  and it never holds more than its buffer's messages;
- request outcomes follow the engine's events: ``Forwarded`` is ``admitted``, ``Refused`` is
  ``refused`` with its code, ``Abandoned`` is ``abandoned``; the tier and the wait come from
  the request's ``Arrived``; a request that arrived before the hub listened is not reported;
- at most :data:`MAX_PENDING` requests are remembered while they wait for an outcome (the
  oldest is forgotten first), so a request whose outcome never comes cannot grow it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import attrs
import trio

from guard_adapters.admin_stream import (
    Subscription,
    TierCounts,
    admission_message,
    decision_message,
    encode,
    keeps_admission,
)
from guard_core import (
    Abandoned,
    Arrived,
    Forwarded,
    GuardState,
    Prediction,
    Refused,
    RequestEvent,
    Retried,
    Tier,
)

if TYPE_CHECKING:
    from guard_trio._poller import PollReport
    from guard_trio._server import GuardServer

__all__ = ("DROPPED_CODE", "GOING_AWAY_CODE", "MAX_PENDING", "AdminHub", "Viewer")

#: WebSocket close code for a viewer dropped because it did not keep up (1013: try again later).
DROPPED_CODE: Final = 1013
#: WebSocket close code when the admin plane shuts down (1001: going away).
GOING_AWAY_CODE: Final = 1001
#: Messages a viewer's buffer holds before the viewer is dropped. Sending one message costs
#: its writer a few scheduler rounds, so under a flood of refusals a viewer of every admission
#: falls behind by design; this absorbs bursts, and ``sample`` is the answer to a flood.
DEFAULT_BUFFER: Final = 1024
#: Requests remembered while they wait for an outcome.
MAX_PENDING: Final = 65_536


@attrs.define(eq=False)
class Viewer:
    """One subscriber: what it asked for, and its bounded buffer of encoded messages."""

    subscription: Subscription
    send: trio.MemorySendChannel[str]
    receive: trio.MemoryReceiveChannel[str]
    #: Set when its buffer was full: it is gone from the hub and its buffer is closed.
    dropped: bool = False


@attrs.define(eq=False)
class _Pending:
    arrived: Arrived
    #: The predictive learner's verdict on its latest attempt (None: it gave none).
    verdict: Prediction | None


def tier_counts(server: GuardServer) -> tuple[TierCounts, TierCounts]:
    """A guard's cumulative admissions and refusals per tier (``pig_tier_requests_total``)."""
    accepted, rejected = server.metrics.tier_accepted, server.metrics.tier_rejected
    return (
        TierCounts(int(accepted[Tier.BASIC].value), int(accepted[Tier.PREMIUM].value)),
        TierCounts(int(rejected[Tier.BASIC].value), int(rejected[Tier.PREMIUM].value)),
    )


def decision_now(server: GuardServer) -> dict[str, Any]:
    """The decision message for a guard's state as it is now (what the stream sends a round)."""
    admitted, refused = tier_counts(server)
    return decision_message(
        server.engine.state,
        at=server.engine.seconds_since_start(),
        admitted=admitted,
        refused=refused,
    )


class AdminHub:
    """Turns rounds and request events into messages for the viewers of one guard."""

    def __init__(self, server: GuardServer, *, buffer: int = DEFAULT_BUFFER) -> None:
        self.server = server
        self.buffer = buffer
        self.viewers: list[Viewer] = []
        self._admission_viewers: list[Viewer] = []
        self._pending: dict[int, _Pending] = {}
        self._last_verdict: Prediction | None = server.engine.state.verdict
        #: Viewers dropped for a full buffer since start.
        self.dropped_total = 0
        self.closed = False

    # -- what is read at the moment -------------------------------------------------------------

    def state(self) -> GuardState:
        return self.server.engine.state

    def counts(self) -> tuple[TierCounts, TierCounts]:
        """Cumulative admissions and refusals per tier (``pig_tier_requests_total``)."""
        return tier_counts(self.server)

    # -- viewers --------------------------------------------------------------------------------

    def subscribe(self, subscription: Subscription) -> Viewer:
        send, receive = trio.open_memory_channel[str](self.buffer)
        viewer = Viewer(subscription, send, receive)
        if self.closed:
            send.close()
            return viewer
        self.viewers.append(viewer)
        self._refresh()
        return viewer

    def unsubscribe(self, viewer: Viewer) -> None:
        if viewer in self.viewers:
            self.viewers.remove(viewer)
            self._refresh()
        viewer.send.close()

    def close(self) -> None:
        """The plane is shutting down: every viewer's buffer is closed, no new one opens."""
        self.closed = True
        for viewer in self.viewers:
            viewer.send.close()
        self.viewers.clear()
        self._refresh()

    def _refresh(self) -> None:
        self._admission_viewers = [v for v in self.viewers if v.subscription.wants("admission")]

    def _offer(self, viewer: Viewer, text: str) -> None:
        try:
            viewer.send.send_nowait(text)
        except trio.WouldBlock:
            self._drop(viewer)
        except trio.ClosedResourceError:
            self._drop(viewer)

    def _drop(self, viewer: Viewer) -> None:
        if viewer.dropped:
            return
        viewer.dropped = True
        self.dropped_total += 1
        if viewer in self.viewers:
            self.viewers.remove(viewer)
            self._refresh()
        viewer.send.close()

    # -- the poller's rounds --------------------------------------------------------------------

    def on_round(self, report: PollReport) -> None:
        """One decision message per round, read from the state the round left."""
        wanting = [v for v in self.viewers if v.subscription.wants("decision")]
        if not wanting:
            return
        admitted, refused = self.counts()
        text = encode(
            decision_message(self.state(), at=report.at, admitted=admitted, refused=refused)
        )
        for viewer in wanting:
            self._offer(viewer, text)

    # -- the engine's request events (the hot path: every branch returns at once) ----------------

    def on_event(self, event: RequestEvent) -> None:
        kind = type(event)
        if kind is Arrived:
            assert isinstance(event, Arrived)
            pending = self._pending
            if len(pending) >= MAX_PENDING:
                del pending[next(iter(pending))]
            pending[event.request_id] = _Pending(event, self._verdict())
        elif kind is Retried:
            known = self._pending.get(event.request_id)
            verdict = self._verdict()
            if known is not None and verdict is not None:
                known.verdict = verdict
        elif kind is Forwarded:
            self._conclude(event, "admitted", None)
        elif kind is Refused:
            assert isinstance(event, Refused)
            self._conclude(event, "refused", event)
        elif kind is Abandoned:
            self._conclude(event, "abandoned", None)

    def _verdict(self) -> Prediction | None:
        """The learner's verdict on the attempt just applied, if that attempt made one."""
        state = self.server.engine.state
        if state.predictive is None:
            return None
        verdict = state.verdict
        if verdict is self._last_verdict:
            return None
        self._last_verdict = verdict
        return verdict

    def _conclude(self, event: RequestEvent, outcome: str, refused: Refused | None) -> None:
        pending = self._pending.pop(event.request_id, None)
        viewers = self._admission_viewers
        if pending is None or not viewers:
            return
        arrived = pending.arrived
        request_id = arrived.trace_id or str(arrived.request_id)
        keeping = [v for v in viewers if keeps_admission(request_id, v.subscription.sample)]
        if not keeping:
            return
        text = encode(
            admission_message(
                pending.arrived,
                at=event.at,
                outcome=outcome,
                code=None if refused is None else refused.code,
                prediction=pending.verdict,
            )
        )
        for viewer in keeping:
            self._offer(viewer, text)
