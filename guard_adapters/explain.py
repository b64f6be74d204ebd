"""The predictive learner's explanations, picked out of the guard's state for people to read.

Reads: the guard's state before and after one step of :func:`guard_core.apply_guard_event`
(an admission attempt or a poll), and the :class:`~guard_core.Prediction` values it holds.
Guarantees:
- pure: nothing here changes a state or reads a clock;
- :func:`attempt_prediction` and :func:`poll_prediction` give the prediction made *by that
  step* and ``None`` when the step made none (PIG's learner, a refusal by the gate's own counts
  before the learner was asked, a poll without metrics). The learner stores each new prediction
  as a new value, so a step made one exactly when the stored value is not the one held before;
- :func:`refusal_binding` names the constraint a 429 is counted under: the learner's binding
  when its verdict refused the attempt, ``predicted_speed`` when the gate's count refused it at
  a cap the learner set from the predicted speed, and ``none`` when any other rule refused it
  (tiers and the premium reserve, ``GLOBAL_LIMIT``, closed intake);
- :func:`explanation` turns a prediction into the recording's :class:`Explanation` losslessly,
  so a replay can compare what it predicted with what the live guard predicted.
"""

from __future__ import annotations

from typing import Any

import attrs

from guard_adapters.recording import Explanation
from guard_core import (
    Binding,
    GuardState,
    LimitReason,
    Prediction,
    PublishedDecision,
    RejectCode,
)

__all__ = (
    "as_json",
    "attempt_prediction",
    "explanation",
    "poll_prediction",
    "refusal_binding",
)


def attempt_prediction(before: GuardState, after: GuardState) -> Prediction | None:
    """The verdict the predictive learner gave on the attempt that led from ``before`` to
    ``after``, or ``None`` when it was not asked."""
    if after.predictive is None or after.verdict is None:
        return None
    if before.verdict is after.verdict:
        return None
    return after.verdict


def poll_prediction(before: GuardState, after: GuardState) -> Prediction | None:
    """The explanation of the cap the poll that led from ``before`` to ``after`` published, or
    ``None`` when the predictive learner set no cap at that poll."""
    model = after.predictive
    if model is None or model.last_cap is None:
        return None
    previous = before.predictive
    if previous is not None and previous.last_cap is model.last_cap:
        return None
    return model.last_cap


def refusal_binding(
    verdict: Prediction | None, decision: PublishedDecision, code: RejectCode
) -> Binding:
    """The constraint a refusal with ``code`` is counted under (see the module notes).

    ``verdict`` is the attempt's own prediction (:func:`attempt_prediction`), ``decision`` the
    decision in force when it was refused.
    """
    if verdict is not None and verdict.binding is not Binding.NONE:
        return verdict.binding
    if (
        code is RejectCode.GLOBAL_DYNAMIC_LIMIT
        and decision.final_reason is LimitReason.PREDICTED_SPEED
    ):
        return Binding.SPEED
    return Binding.NONE


def _figures(prediction: Prediction) -> dict[str, Any]:
    """What ``prediction`` predicts and binds, by name (the fit apart)."""
    return {
        "cap": prediction.cap,
        "user_tps": prediction.user_tps,
        "ttft_s": prediction.ttft_s,
        "kv_usage": prediction.kv_usage,
        "binding": str(prediction.binding),
    }


def explanation(prediction: Prediction) -> Explanation:
    """The recording's form of ``prediction`` (every number kept exactly)."""
    fit = {f"fit_{name}": value for name, value in attrs.asdict(prediction.fit).items()}
    return Explanation(**_figures(prediction), **fit)


def as_json(prediction: Prediction) -> dict[str, Any]:
    """A JSON-ready view for replay output: the predictions, the binding and the fit."""
    return {**_figures(prediction), "fit": attrs.asdict(prediction.fit)}
