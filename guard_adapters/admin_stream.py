"""The admin plane's messages (stream schema version 1): built from core values, as JSON.

Reads: the guard's state (:class:`~guard_core.GuardState`: the value the latest poll published,
the gate's counts, the predictive learner's latest predictions), the per-tier admission counts
the shell's instruments hold, one request's arrival and outcome events, and the query string
of a subscription.
Guarantees:
- pure: no clock, no I/O; the same values always give the same messages;
- every message is a JSON object with ``"v": 1`` and a ``"type"`` (``hello``, ``decision``,
  ``admission``, and ``state`` for ``GET /admin/state``), holding only JSON numbers that are
  finite (a value that is not, or is unknown, is ``null``), strings, booleans, lists and
  objects; :func:`encode` writes one without NaN or infinities, in one compact line;
- a ``state`` document holds every field of a ``decision`` message, read from the same state;
- :func:`keeps_admission` samples admissions by request id alone: the same id is kept or
  dropped the same way by every subscriber with the same share, and about ``share`` of ids are
  kept;
- :func:`parse_subscription` accepts exactly ``kinds`` (a comma-separated subset of
  ``decision,admission``, not empty) and ``sample`` (a decimal number in [0, 1]), each at most
  once; anything else is a :class:`SubscriptionError` saying what is wrong.

The schema is written out in docs/admin.md.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Sequence
from typing import Any, Final
from urllib.parse import parse_qsl

import attrs

from guard_core import Arrived, GuardState, Prediction, RejectCode
from guard_core.gate import current_limit
from guard_core.published import BackendFigures
from guard_core.signals import PollSignals

__all__ = (
    "KINDS",
    "OUTCOMES",
    "SCHEMA_VERSION",
    "Subscription",
    "SubscriptionError",
    "TierCounts",
    "admission_message",
    "decision_message",
    "encode",
    "hello_message",
    "keeps_admission",
    "parse_subscription",
    "state_document",
)

#: The version every message carries as ``"v"``.
SCHEMA_VERSION: Final = 1
#: The message kinds a subscriber may ask for, in the order the hello lists them.
KINDS: Final = ("decision", "admission")
#: The outcomes an admission message reports.
OUTCOMES: Final = ("admitted", "refused", "abandoned")

_SAMPLE = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")
#: Ids are hashed onto [0, 2**32); an id is kept when its hash falls below share * 2**32.
_HASH_RANGE: Final = 2**32


@attrs.frozen
class TierCounts:
    """A count per tier (cumulative admissions or refusals since start)."""

    basic: int = 0
    premium: int = 0

    def as_json(self) -> dict[str, int]:
        return {"basic": self.basic, "premium": self.premium}


class SubscriptionError(ValueError):
    """A subscription's query string is not one this schema accepts."""


@attrs.frozen
class Subscription:
    """What one subscriber asked for: the kinds of message, and the share of admissions kept."""

    kinds: tuple[str, ...] = KINDS
    sample: float = 1.0

    def wants(self, kind: str) -> bool:
        return kind in self.kinds


def parse_subscription(query: str) -> Subscription:
    """The subscription a ``/admin/events`` query string asks for (see the module rules)."""
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise SubscriptionError("the query string is malformed") from None
    seen: dict[str, str] = {}
    for name, value in pairs:
        if name not in ("kinds", "sample"):
            raise SubscriptionError(f"unknown parameter {name[:40]!r}")
        if name in seen:
            raise SubscriptionError(f"{name} is given twice")
        seen[name] = value
    kinds: tuple[str, ...] = KINDS
    if "kinds" in seen:
        asked = [part.strip() for part in seen["kinds"].split(",") if part.strip()]
        unknown = [kind for kind in asked if kind not in KINDS]
        if unknown:
            raise SubscriptionError(
                f"unknown kind {unknown[0][:40]!r} (known: decision, admission)"
            )
        if not asked:
            raise SubscriptionError("kinds names no kind")
        kinds = tuple(kind for kind in KINDS if kind in asked)
    sample = 1.0
    if "sample" in seen:
        text = seen["sample"].strip()
        if not _SAMPLE.fullmatch(text) or not 0.0 <= float(text) <= 1.0:
            raise SubscriptionError("sample must be a number between 0 and 1")
        sample = float(text)
    return Subscription(kinds, sample)


def keeps_admission(request_id: str, share: float) -> bool:
    """Whether a subscriber sampling ``share`` of admissions gets the one of ``request_id``."""
    if share >= 1.0:
        return True
    return zlib.crc32(request_id.encode()) < share * _HASH_RANGE


def encode(message: dict[str, Any]) -> str:
    """One message as compact JSON text (never NaN or an infinity: the builders give none)."""
    return json.dumps(message, separators=(",", ":"), allow_nan=False)


def _finite(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return float(value)


def hello_message(
    *, version: str, policy: str, backends: Sequence[str], kinds: Sequence[str]
) -> dict[str, Any]:
    """The first message of every stream: who is speaking and what will follow."""
    return {
        "v": SCHEMA_VERSION,
        "type": "hello",
        "version": version,
        "policy": policy,
        "backends": list(backends),
        "kinds": list(kinds),
    }


def _backend(figures: BackendFigures) -> dict[str, Any]:
    ttft = figures.ttft
    return {
        "name": figures.name,
        "failed": figures.failed,
        "running": figures.running,
        "waiting": figures.waiting,
        "kv_usage": _finite(figures.kv_usage),
        "generation_tps": _finite(figures.generation_tps),
        "ttft_avg_s": None if ttft is None else _finite(ttft.avg),
        "ttft_p95_s": None if ttft is None else _finite(ttft.p95),
    }


def _observed_user_tps(signals: PollSignals) -> float | None:
    """The per-user speed of the poll: the learner's own per-user decode speed when it computes
    one (``DYNAMIC_SINGLE_USER_TPS_ENABLED``, outside prefill transitions), else the backends'
    generation rate over the requests they run."""
    if signals.user_tps is not None:
        return signals.user_tps
    if signals.generation_tps is not None and signals.running > 0:
        return signals.generation_tps / signals.running
    return None


def _predicted_cap(state: GuardState) -> Prediction | None:
    return None if state.predictive is None else state.predictive.last_cap


def decision_message(
    state: GuardState, *, at: float, admitted: TierCounts, refused: TierCounts
) -> dict[str, Any]:
    """What the guard holds after a poll round, read from ``state`` (see the schema).

    ``cap`` is the limit in force (the published cap, or ``GLOBAL_LIMIT`` in static mode);
    ``reasons`` are the load state's red reasons then its yellow ones; ``limit_reason`` is the
    component that set the cap. ``tps.observed`` is the per-user decode speed of the poll,
    ``ttft_s.observed`` the average of the TTFT window behind it; the predictions are the
    predictive learner's for the cap it set (``null`` under PIG's learner).
    """
    published = state.published
    decision = published.decision
    gate = state.gate
    snapshot = published.snapshot
    predicted = _predicted_cap(state)
    return {
        "v": SCHEMA_VERSION,
        "type": "decision",
        "at": _finite(at),
        "cap": current_limit(gate)[0],
        "state": str(decision.state),
        "reasons": [str(r) for r in (*decision.red_reasons, *decision.yellow_reasons)],
        "limit_reason": str(decision.final_reason),
        "source": str(decision.source),
        "in_flight": gate.inflight,
        "waiting": {"basic": gate.basic_waiting, "premium": gate.premium_waiting},
        "admitted": admitted.as_json(),
        "refused": refused.as_json(),
        "running": decision.running,
        "backend_waiting": decision.waiting,
        "backends": [_backend(figures) for figures in published.backends],
        "tps": {
            "observed": None if snapshot is None else _finite(_observed_user_tps(snapshot.signals)),
            "predicted": None if predicted is None else _finite(predicted.user_tps),
        },
        "ttft_s": {
            "observed": None if published.ttft is None else _finite(published.ttft.avg),
            "predicted": None if predicted is None else _finite(predicted.ttft_s),
        },
    }


def _prediction(prediction: Prediction) -> dict[str, Any]:
    fit = prediction.fit
    return {
        "user_tps": _finite(prediction.user_tps),
        "ttft_s": _finite(prediction.ttft_s),
        "kv_usage": _finite(prediction.kv_usage),
        "binding": str(prediction.binding),
        "cap": prediction.cap,
        "fit": {
            "step_base_s": _finite(fit.step_base_s),
            "per_decoder_s": _finite(fit.per_decoder_s),
            "per_kv_s": _finite(fit.per_kv_s),
            "per_prompt_token_s": _finite(fit.per_prompt_token_s),
            "relative_error": _finite(fit.relative_error),
            "observations": fit.observations,
        },
    }


def state_document(
    state: GuardState,
    *,
    at: float,
    version: str,
    policy: str,
    admitted: TierCounts,
    refused: TierCounts,
    viewers: int,
) -> dict[str, Any]:
    """``GET /admin/state``: a decision message's fields for ``state`` as of ``at``, plus the
    version and policy, when the decision was published, why the latest poll failed, the
    viewers of the stream and, under the predictive learner, its predictions (for the cap it
    set and for the latest attempt it judged) with the engine fit behind them."""
    document = decision_message(state, at=at, admitted=admitted, refused=refused)
    predicted = _predicted_cap(state)
    verdict = state.verdict if state.predictive is not None else None
    document.update(
        type="state",
        version=version,
        policy=policy,
        decision_at=_finite(state.published.decision.at),
        error=state.published.error,
        viewers=viewers,
        predictive=None
        if state.predictive is None
        else {
            "cap": None if predicted is None else _prediction(predicted),
            "verdict": None if verdict is None else _prediction(verdict),
        },
    )
    return document


def admission_message(
    arrived: Arrived,
    *,
    at: float,
    outcome: str,
    code: RejectCode | None = None,
    prediction: Prediction | None = None,
) -> dict[str, Any]:
    """One request's outcome: ``arrived`` is its arrival, ``at`` when the outcome came;
    ``code`` the refusal's reason (only for ``refused``); ``prediction`` the predictive
    learner's verdict on its latest attempt, if it gave one; ``band`` and ``tenant`` when
    flow control labelled the request."""
    if outcome not in OUTCOMES:
        raise ValueError(f"unknown outcome {outcome!r}")
    message = {
        "v": SCHEMA_VERSION,
        "type": "admission",
        "at": _finite(at),
        "id": arrived.trace_id or str(arrived.request_id),
        "tier": str(arrived.tier),
        "outcome": outcome,
        "reason": str(code) if outcome == "refused" and code is not None else None,
        "waited_s": _finite(max(0.0, at - arrived.at)),
        "predicted_tps": None if prediction is None else _finite(prediction.user_tps),
        "predicted_ttft_s": None if prediction is None else _finite(prediction.ttft_s),
    }
    if arrived.band or arrived.tenant:
        # Flow control's labels, only when it gave them (PIG's messages are unchanged).
        message["band"] = arrived.band or None
        message["tenant"] = arrived.tenant or None
    return message
