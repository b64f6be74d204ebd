"""Replay: recorded observations back through guard_core, poll by poll (docs/recording.md).

Reads: a recording's records in file order and a :class:`~guard_core.GuardConfig`.
Guarantees:
- scrapes are parsed again with the same metrics parser the live guard uses, and request events
  drive the same gate, so replaying a recording with the settings it was made with reproduces
  every recorded decision exactly;
- with other settings the gate may admit what was refused or refuse what was admitted; replay
  follows its own outcomes: a request it refuses never runs (its first token and completion
  are ignored), and a request it admits that the recording refused finishes at once;
- a scrape that no longer parses counts as a failed scrape; nothing here raises on bad data;
- the predictive learner (``DYNAMIC_POLICY=predictive``) is replayed from the same records: an
  arrival's ``body_bytes`` is its prompt estimate and a first token names its request, as they
  did live. Each poll then carries the learner's explanation of its cap, compared with the
  recorded one when the recording has it (version 2), and each refusal its predicted
  ``Retry-After`` and binding constraint, compared with the recorded outcome likewise; a
  version-1 recording has neither and replays as before.
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter
from collections.abc import Iterable
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
from guard_adapters.recording import (
    Arrival,
    Completion,
    Decision,
    FirstToken,
    Gone,
    Header,
    Outcome,
    Record,
    Retry,
    Scrape,
    ScrapeFailed,
)
from guard_core import (
    Admitted,
    BackendPoll,
    FirstTokenObserved,
    GuardConfig,
    GuardState,
    MetricsPolled,
    Prediction,
    PrefillEnded,
    PrefillStarted,
    PublishedDecision,
    Queued,
    Rejected,
    SlotReleased,
    SlotRequested,
    Tier,
    WaitAbandoned,
    WaitRetried,
    apply_guard_event,
)
from guard_core.guard import GuardEvent

__all__ = ("ReplayResult", "ReplayedPoll", "replay", "summarise")


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


@attrs.define
class _Request:
    tier: Tier
    body_bytes: int | None
    queued: Queued | None = None
    admitted: bool = False
    finished: bool = False
    prefill_started: bool = False
    #: The replay's refusal: its predicted Retry-After and binding (predictive learner only).
    retry_after_s: int | None = None
    binding: str | None = None


@attrs.define
class _Replayer:
    state: GuardState
    polls: list[ReplayedPoll] = attrs.field(factory=list)
    requests: dict[int, _Request] = attrs.field(factory=dict)
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
    #: The binding constraint of the latest refusal :meth:`step` returned.
    last_binding: str | None = None

    def step(self, event: GuardEvent) -> object:
        before = self.state
        result = apply_guard_event(before, event)
        self.state = result.state
        if result.decision is not None:
            assert self.round_poll is not None
            self.polls.append(
                ReplayedPoll(
                    poll=self.round_poll,
                    decision=result.decision,
                    prediction=poll_prediction(before, result.state),
                )
            )
        outcome = result.outcome
        if isinstance(outcome, Rejected) and result.state.predictive is not None:
            verdict = attempt_prediction(before, result.state)
            self.last_binding = str(refusal_binding(verdict, before.gate.decision, outcome.code))
        return outcome

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
        self.step(MetricsPolled(self.round_at, tuple(self.round)))
        self.round, self.round_at = [], None

    def decision(self, record: Decision) -> None:
        if self.round_at is not None and self.round_poll == record.poll:
            self.flush()
        if self.polls and self.polls[-1].poll == record.poll and self.polls[-1].recorded is None:
            self.polls[-1] = attrs.evolve(self.polls[-1], recorded=record)

    # -- requests -------------------------------------------------------------------------------

    def settle(self, request: _Request, outcome: object) -> None:
        if isinstance(outcome, Admitted):
            request.admitted, request.queued = True, None
            self.admitted += 1
        elif isinstance(outcome, Queued):
            request.queued = outcome
        elif isinstance(outcome, Rejected):
            request.queued, request.finished = None, True
            self.rejected += 1
            if self.last_binding is not None:
                request.retry_after_s, request.binding = outcome.retry_after_s, self.last_binding
                self.refusals[self.last_binding] += 1

    def arrival(self, record: Arrival) -> None:
        tier = Tier.PREMIUM if record.tier == "premium" else Tier.BASIC
        request = _Request(tier=tier, body_bytes=record.body_bytes)
        self.requests[record.id] = request
        self.settle(request, self.step(SlotRequested(record.at, tier, record.body_bytes)))

    def retry(self, record: Retry) -> None:
        request = self.requests.get(record.id)
        if request is None or request.queued is None:
            return
        outcome = self.step(WaitRetried(record.at, request.queued))
        self.settle(request, outcome)

    def gone(self, record: Gone) -> None:
        request = self.requests.get(record.id)
        if request is None or request.queued is None:
            return
        self.step(WaitAbandoned(record.at, request.queued))
        request.queued, request.finished = None, True

    def outcome(self, record: Outcome) -> None:
        forwarded = record.outcome == "forwarded"
        if forwarded:
            self.recorded_forwarded += 1
        else:
            self.recorded_rejected += 1
        request = self.requests.get(record.id)
        if request is None:
            return
        if request.queued is not None:
            # Recorded as over while the replay still waits: end the wait now.
            late = max(record.at, request.queued.deadline)
            self.settle(request, self.step(WaitRetried(late, request.queued)))
        if self.outcome_differs(record, request):
            self.differing_outcomes += 1
        if request.admitted and not request.prefill_started and not request.finished:
            request.prefill_started = True
            self.step(PrefillStarted(record.at, record.id, request.body_bytes, tier=request.tier))
            if not forwarded:
                self.finish(record.id, request, record.at)  # never ran for real

    @staticmethod
    def outcome_differs(record: Outcome, request: _Request) -> bool:
        if (record.outcome == "forwarded") != request.admitted:
            return True
        if request.admitted:
            return False
        return (
            record.retry_after_s is not None and record.retry_after_s != request.retry_after_s
        ) or (record.binding is not None and record.binding != request.binding)

    def first_token(self, record: FirstToken) -> None:
        request = self.requests.get(record.id)
        if request is not None and request.admitted and not request.finished:
            self.step(FirstTokenObserved(record.at, record.seconds, request_id=record.id))

    def completion(self, record: Completion) -> None:
        request = self.requests.get(record.id)
        if request is not None and request.admitted and not request.finished:
            self.finish(record.id, request, record.at)

    def finish(self, request_id: int, request: _Request, at: float) -> None:
        request.finished = True
        self.step(SlotReleased(at, request.tier))
        if request.prefill_started:
            self.step(PrefillEnded(at, request_id))


def replay(records: Iterable[Record | Header], config: GuardConfig) -> ReplayResult:
    """Feed a recording's records to a fresh guard and collect one decision per poll."""
    replayer = _Replayer(state=GuardState.initial(config, at=0.0))
    for record in records:
        if isinstance(record, Header):
            continue
        replayer.end_at = max(replayer.end_at, record.at)
        if isinstance(record, Scrape | ScrapeFailed):
            replayer.scrape(record)
            continue
        if isinstance(record, Decision):
            replayer.decision(record)
            continue
        replayer.flush()
        if isinstance(record, Arrival):
            replayer.arrival(record)
        elif isinstance(record, Retry):
            replayer.retry(record)
        elif isinstance(record, Gone):
            replayer.gone(record)
        elif isinstance(record, Outcome):
            replayer.outcome(record)
        elif isinstance(record, FirstToken):
            replayer.first_token(record)
        elif isinstance(record, Completion):
            replayer.completion(record)
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
