"""Replay: recorded observations back through guard_core, poll by poll (docs/recording.md).

Reads: a recording's records in file order and a :class:`~guard_core.GuardConfig`.
Guarantees:
- scrapes are parsed again with the same metrics parser the live guard uses, and the recorded
  request events, the very values the live engine applied, are folded by the same reducer
  (:func:`guard_core.apply_guard_event`), so replaying a recording with the settings it was
  made with reproduces every recorded decision exactly;
- with other settings the gate may admit what was refused or refuse what was admitted; the
  core then follows its own outcomes (:mod:`guard_core.requests`): a request it refuses never
  runs (its first token and end are ignored), and a request it admits that the recording
  refused finishes at once; replay only counts where its outcomes and the recorded ones part;
- a scrape that no longer parses counts as a failed scrape; nothing here raises on bad data;
- the predictive learner (``DYNAMIC_POLICY=predictive``) is replayed from the same records: an
  arrival's ``body_bytes`` is its prompt estimate and a first token names its request, as they
  did live. Each poll then carries the learner's explanation of its cap, compared with the
  recorded one when the recording has it (from version 2), and each refusal its predicted
  ``Retry-After`` and binding constraint, compared with the recorded refusal likewise; a
  version-1 recording has neither and replays as before.
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from guard_adapters._errors import MetricsParseError
from guard_adapters.explain import (
    as_json,
    attempt_prediction,
    explanation,
    poll_prediction,
    refusal_binding,
)
from guard_adapters.metrics import parse_metrics
from guard_adapters.recording import Decision, Header, Record, Scrape, ScrapeFailed
from guard_core import (
    Admitted,
    Arrived,
    BackendPoll,
    Forwarded,
    GuardConfig,
    GuardState,
    GuardStep,
    MetricsPolled,
    Prediction,
    PublishedDecision,
    Refused,
    Rejected,
    RequestEvent,
    apply_guard_event,
)

__all__ = ("ReplayResult", "ReplayedPoll", "RequestWatcher", "replay", "summarise")


@attrs.frozen(kw_only=True)
class ReplayedPoll:
    """One poll: the recomputed decision and, when the recording has one, the recorded."""

    poll: int
    decision: PublishedDecision
    recorded: Decision | None = None
    #: The predictive learner's explanation of the cap (None under PIG's learner).
    prediction: Prediction | None = None

    @property
    def differs(self) -> bool:
        recorded = self.recorded
        if recorded is None:
            return False
        decision = self.decision
        return (
            recorded.cap != decision.cap
            or recorded.state != decision.state
            or recorded.reason != decision.final_reason
            or recorded.yellow != [str(r) for r in decision.yellow_reasons]
            or recorded.red != [str(r) for r in decision.red_reasons]
            or self.explanation_differs
        )

    @property
    def explanation_differs(self) -> bool:
        """The recording has the live explanation of this poll, and the replay's is another."""
        recorded = self.recorded
        if recorded is None or recorded.predicted is None:
            return False
        prediction = self.prediction
        return prediction is None or explanation(prediction) != recorded.predicted

    def as_json(self) -> dict[str, Any]:
        decision = self.decision
        out: dict[str, Any] = {
            "at": decision.at,
            "poll": self.poll,
            "cap": decision.cap,
            "state": str(decision.state),
            "reason": str(decision.final_reason),
            "reasons": {
                "yellow": [str(r) for r in decision.yellow_reasons],
                "red": [str(r) for r in decision.red_reasons],
            },
            "running": decision.running,
            "waiting": decision.waiting,
        }
        if self.prediction is not None:
            out["predicted"] = as_json(self.prediction)
        if self.recorded is not None:
            out["recorded"] = {
                "cap": self.recorded.cap,
                "state": self.recorded.state,
                "reason": self.recorded.reason,
            }
        return out


@attrs.frozen(kw_only=True)
class ReplayResult:
    polls: tuple[ReplayedPoll, ...]
    #: Admission outcomes in the replay.
    admitted: int
    rejected: int
    #: Outcomes as recorded.
    recorded_forwarded: int
    recorded_rejected: int
    #: Scrapes whose text no longer parsed.
    unparsable_scrapes: int
    end_at: float
    #: Replayed refusals by the constraint that refused them (the predictive learner only).
    refusals_by_binding: dict[str, int] = attrs.field(factory=dict)
    #: Recorded outcomes the replay ended otherwise: forwarded against refused, or (where the
    #: recording has them) another predicted Retry-After or binding constraint.
    differing_outcomes: int = 0
    #: The guard's state after the last record.
    state: GuardState | None = None


#: Told each request event a replay folds: the state before it, the event, the step it made.
RequestWatcher = Callable[[GuardState, RequestEvent, GuardStep], None]


@attrs.frozen
class _Own:
    """How the replay itself ended one request's attempt, for comparison with the recording."""

    admitted: bool = False
    #: The replay's refusal: its predicted Retry-After and binding (predictive learner only).
    retry_after_s: int | None = None
    binding: str | None = None


@attrs.define
class _Replayer:
    state: GuardState
    polls: list[ReplayedPoll] = attrs.field(factory=list)
    own: dict[int, _Own] = attrs.field(factory=dict)
    round_at: float | None = None
    round_poll: int | None = None
    round: list[BackendPoll] = attrs.field(factory=list)
    admitted: int = 0
    rejected: int = 0
    recorded_forwarded: int = 0
    recorded_rejected: int = 0
    unparsable: int = 0
    end_at: float = 0.0
    refusals: Counter[str] = attrs.field(factory=Counter)
    differing_outcomes: int = 0
    watch: RequestWatcher | None = None

    # -- polls ----------------------------------------------------------------------------------

    def scrape(self, record: Scrape | ScrapeFailed) -> None:
        if self.round_poll is not None and record.poll != self.round_poll:
            self.flush()
        self.round_poll, self.round_at = record.poll, record.at
        if isinstance(record, ScrapeFailed):
            self.round.append(BackendPoll(name=record.backend, sample=None, error=record.error))
            return
        try:
            sample = parse_metrics(record.text)
        except MetricsParseError as exc:
            self.unparsable += 1
            self.round.append(BackendPoll(name=record.backend, sample=None, error=str(exc)))
            return
        self.round.append(BackendPoll(name=record.backend, sample=sample))

    def flush(self) -> None:
        if self.round_at is None:
            return
        before = self.state
        step = apply_guard_event(before, MetricsPolled(self.round_at, tuple(self.round)))
        self.state = step.state
        self.round, self.round_at = [], None
        if step.decision is not None:
            assert self.round_poll is not None
            self.polls.append(
                ReplayedPoll(
                    poll=self.round_poll,
                    decision=step.decision,
                    prediction=poll_prediction(before, step.state),
                )
            )

    def decision(self, record: Decision) -> None:
        if self.round_at is not None and self.round_poll == record.poll:
            self.flush()
        if self.polls and self.polls[-1].poll == record.poll and self.polls[-1].recorded is None:
            self.polls[-1] = attrs.evolve(self.polls[-1], recorded=record)

    # -- requests -------------------------------------------------------------------------------

    def request(self, event: RequestEvent) -> None:
        """Fold one recorded request event; count how the replay's attempts end."""
        before = self.state
        step = apply_guard_event(before, event)
        self.state = step.state
        if self.watch is not None:
            self.watch(before, event, step)
        request_id = event.request_id
        if isinstance(event, Arrived) and request_id not in before.requests:
            self.own[request_id] = _Own()
        outcome = step.outcome
        if isinstance(outcome, Admitted):
            self.admitted += 1
            self.own[request_id] = _Own(admitted=True)
        elif isinstance(outcome, Rejected):
            self.rejected += 1
            if step.state.predictive is not None:
                verdict = attempt_prediction(before, step.state)
                binding = str(refusal_binding(verdict, before.gate.decision, outcome.code))
                self.own[request_id] = _Own(retry_after_s=outcome.retry_after_s, binding=binding)
                self.refusals[binding] += 1
        if isinstance(event, Forwarded | Refused):
            self.compare(event)

    def compare(self, event: Forwarded | Refused) -> None:
        """A recorded end of an attempt, against the replay's own end of it."""
        forwarded = isinstance(event, Forwarded)
        if forwarded:
            self.recorded_forwarded += 1
        else:
            self.recorded_rejected += 1
        own = self.own.get(event.request_id)
        if own is None:
            return
        if isinstance(event, Forwarded) or own.admitted:
            differs = forwarded != own.admitted
        else:
            recorded_binding = None if event.binding is None else str(event.binding)
            differs = (
                event.retry_after_s is not None and event.retry_after_s != own.retry_after_s
            ) or (recorded_binding is not None and recorded_binding != own.binding)
        if differs:
            self.differing_outcomes += 1


def replay(
    records: Iterable[Record | Header],
    config: GuardConfig,
    *,
    watch: RequestWatcher | None = None,
) -> ReplayResult:
    """Feed a recording's records to a fresh guard and collect one decision per poll;
    ``watch`` is told each request event with the state before it and the step it made."""
    replayer = _Replayer(state=GuardState.initial(config, at=0.0), watch=watch)
    for record in records:
        if isinstance(record, Header):
            continue
        replayer.end_at = max(replayer.end_at, record.at)
        if isinstance(record, Scrape | ScrapeFailed):
            replayer.scrape(record)
        elif isinstance(record, Decision):
            replayer.decision(record)
        else:
            replayer.flush()
            replayer.request(record)
    replayer.flush()
    return ReplayResult(
        polls=tuple(replayer.polls),
        admitted=replayer.admitted,
        rejected=replayer.rejected,
        recorded_forwarded=replayer.recorded_forwarded,
        recorded_rejected=replayer.recorded_rejected,
        unparsable_scrapes=replayer.unparsable,
        end_at=replayer.end_at,
        refusals_by_binding=dict(replayer.refusals.most_common()),
        differing_outcomes=replayer.differing_outcomes,
        state=replayer.state,
    )


def summarise(result: ReplayResult) -> dict[str, Any]:
    """Time per state, cap min/median/max, reasons by count, and admission totals."""
    polls = result.polls
    time_in_state: dict[str, float] = {}
    if polls and polls[0].decision.at > 0:
        time_in_state["startup"] = polls[0].decision.at  # intake closed until the first poll
    for current, following in itertools.pairwise(polls):
        state = str(current.decision.state)
        time_in_state[state] = (
            time_in_state.get(state, 0.0) + following.decision.at - current.decision.at
        )
    if polls:
        last = polls[-1].decision
        state = str(last.state)
        time_in_state[state] = time_in_state.get(state, 0.0) + max(0.0, result.end_at - last.at)
    caps = [p.decision.cap for p in polls]
    final_reasons = Counter(str(p.decision.final_reason) for p in polls)
    state_reasons: Counter[str] = Counter()
    for p in polls:
        state_reasons.update(str(r) for r in (*p.decision.yellow_reasons, *p.decision.red_reasons))
    return {
        "polls": len(polls),
        "seconds": result.end_at,
        "time_in_state_s": dict(sorted(time_in_state.items())),
        "cap": {
            "min": min(caps) if caps else None,
            "median": statistics.median(caps) if caps else None,
            "max": max(caps) if caps else None,
        },
        "final_reasons": dict(final_reasons.most_common()),
        "state_reasons": dict(state_reasons.most_common()),
        "admissions": {
            "admitted": result.admitted,
            "rejected": result.rejected,
            "recorded_forwarded": result.recorded_forwarded,
            "recorded_rejected": result.recorded_rejected,
        },
        "differing_polls": sum(p.differs for p in polls),
        "differing_outcomes": result.differing_outcomes,
        "unparsable_scrapes": result.unparsable_scrapes,
        **_predictive_summary(result),
    }


def _predictive_summary(result: ReplayResult) -> dict[str, Any]:
    """The predictive learner's side of the summary; empty under PIG's learner."""
    explained = [p.prediction for p in result.polls if p.prediction is not None]
    if not explained:
        return {}
    speeds = [p.user_tps for p in explained]
    return {
        "predictive": {
            "polls": len(explained),
            "cap_binding": dict(Counter(str(p.binding) for p in explained).most_common()),
            "predicted_user_tps_at_cap": {
                "min": min(speeds),
                "median": statistics.median(speeds),
                "max": max(speeds),
            },
            "final_fit": as_json(explained[-1])["fit"],
            "fit_relative_error_median": statistics.median(p.fit.relative_error for p in explained),
            "refusals_by_binding": dict(result.refusals_by_binding),
            "differing_explanations": sum(p.explanation_differs for p in result.polls),
        }
    }
