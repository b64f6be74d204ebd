"""More than one listener of the engine's request events (the recorder and the admin plane).

Reads: the engine's ``on_event`` attribute (:class:`~guard_trio._engine.GuardEngine`).
Guarantees:
- :class:`EventFanout` tells every listener each event, in the order the listeners were
  added, one after the other in the caller's task (the engine's, on the request path): a
  listener must return at once and must not raise;
- :func:`add_event_listener` adds a listener to an engine without replacing the one it has:
  the engine's listener becomes a fan-out holding the old listener first, then the new one;
  an engine with no listener gets the new one alone, so an engine nobody listens to stays
  without the fan-out's cost; :func:`remove_event_listener` takes one away again.
"""

from __future__ import annotations

from guard_core import RequestEvent
from guard_trio._engine import GuardEngine, RequestListener

__all__ = ("EventFanout", "add_event_listener", "remove_event_listener")


class EventFanout:
    """A request listener that calls each of its listeners in turn."""

    def __init__(self, *listeners: RequestListener) -> None:
        self.listeners: list[RequestListener] = list(listeners)

    def __call__(self, event: RequestEvent) -> None:
        for listener in self.listeners:
            listener(event)


def add_event_listener(engine: GuardEngine, listener: RequestListener) -> None:
    """Have ``engine`` tell ``listener`` every request event, after its current listener."""
    current = engine.on_event
    if current is None:
        engine.on_event = listener
    elif isinstance(current, EventFanout):
        current.listeners.append(listener)
    else:
        engine.on_event = EventFanout(current, listener)


def remove_event_listener(engine: GuardEngine, listener: RequestListener) -> None:
    """Stop telling ``listener`` the engine's events (nothing when it was not told them)."""
    current = engine.on_event
    if current == listener:
        engine.on_event = None
    elif isinstance(current, EventFanout) and listener in current.listeners:
        current.listeners.remove(listener)
