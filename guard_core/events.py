"""The request vocabulary: what a runtime tells the guard about one request, as values.

Reads: nothing; these are plain values built by a runtime (the trio engine), a replay or a
simulation.
Guarantees:
- every event is frozen, carries ``at`` (seconds on the runtime's clock since the guard
  started) and names its request by ``request_id``, an integer the runtime chose at arrival;
- the same values are the recording's request lines (``guard_adapters.recording`` serialises
  them with cattrs), so what the live guard applied is exactly what a replay folds;
- how each event changes the guard's state, atomically, is in :mod:`guard_core.requests`;
  nothing here applies anything.

The life of a request: :class:`Arrived` asks for a slot; a request told to wait sends
:class:`Retried` until it is admitted or refused, or :class:`Abandoned` when its client leaves;
an admitted request is :class:`Forwarded`, may see its :class:`FirstToken`, and ends with
:class:`Finished`. A refusal the client was sent is :class:`Refused`.
"""

from __future__ import annotations

import attrs

from guard_core.decision import RejectCode
from guard_core.predictive import Binding
from guard_core.tier import Tier

__all__ = (
    "Abandoned",
    "Arrived",
    "Finished",
    "FirstToken",
    "Forwarded",
    "Refused",
    "RequestEvent",
    "Retried",
)


@attrs.frozen(kw_only=True)
class _Event:
    """What every request event carries: when, and which request."""

    at: float
    request_id: int


@attrs.frozen(kw_only=True)
class Arrived(_Event):
    """A request on an admitted path asks for a slot."""

    tier: Tier
    #: The body's size (its ``Content-Length``), the predictive learner's prompt estimate.
    body_bytes: int | None = None
    #: The request's path, for people reading a recording; the policy does not read it.
    path: str = ""
    #: The id the client was answered with (its ``X-Request-Id``), to find a request by it in a
    #: recording; the policy does not read it.
    trace_id: str = ""
    #: The priority band its trusted tier header named (``PIG_PRIORITY_BANDS``; "": the default
    #: band) and its trusted tenant key (``PIG_TENANT_HEADER``; "": none). Read only when flow
    #: control is configured; a recording made before these existed replays with both "".
    band: str = ""
    tenant: str = ""


@attrs.frozen(kw_only=True)
class Retried(_Event):
    """A waiting request tries again (a wake-up, its fallback re-check or its deadline)."""


@attrs.frozen(kw_only=True)
class Abandoned(_Event):
    """A waiting request's client left; it leaves the queue without an outcome."""


@attrs.frozen(kw_only=True)
class Forwarded(_Event):
    """An admitted request was sent to a backend: its prefill grace starts now."""


@attrs.frozen(kw_only=True)
class Refused(_Event):
    """The client was refused (a 429 or a 503), for ``code``.

    Under the predictive learner the refusal also says the ``Retry-After`` it predicted and the
    constraint that refused it (``binding``; ``none`` when the gate's own rules did).
    """

    code: RejectCode | None = None
    retry_after_s: int | None = None
    binding: Binding | None = None


@attrs.frozen(kw_only=True)
class FirstToken(_Event):
    """A forwarded stream delivered its first useful token, ``seconds`` after it arrived."""

    seconds: float


@attrs.frozen(kw_only=True)
class Finished(_Event):
    """A forwarded request ended, any way at all; ``status`` is what the client got (499: it
    left, 0: unknown)."""

    status: int = 0
    #: The output tokens it delivered, when the runtime counted them (``None``: unknown); tenant
    #: fairness counts them in the tenant's attained service. Older recordings replay as unknown.
    output_tokens: int | None = None


RequestEvent = Arrived | Retried | Abandoned | Forwarded | Refused | FirstToken | Finished
