"""The live view of the admin plane's event stream: its folded state and its two renderings.

Reads: the admin stream's messages (:mod:`guard_adapters.live_view_messages` reads their
fields), one at a time, in the order they came.

Guarantees:

- pure: no clock, no I/O; :func:`fold` returns a new :class:`LiveView` and never raises, whatever
  the message (a value that is no object or has an unknown ``type`` is counted as ignored; a
  known type with ``v`` above 1 is read for the fields it has);
- the view is bounded: the last :attr:`LiveView.decision_limit` decisions and
  :attr:`LiveView.admission_limit` admissions;
- the tier rates come from the cumulative ``admitted``/``refused`` counts of the decisions of
  the last :attr:`LiveView.rate_window_s` seconds (or the previous decision when that is older)
  and are never negative: a decision whose ``at`` or any count went backwards starts a new
  segment (a guard restart, counted in :attr:`LiveView.restarts`) and the rates are unknown
  until the next decision of that segment; so are they after a ``hello`` (a new connection);
- :func:`screen` gives at most ``height`` lines of at most ``width`` characters each (both taken
  as at least 1), :func:`compact_line` one line, at most ``width`` characters when given.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final

import attrs

from guard_adapters.live_view_messages import (
    KINDS,
    Admission,
    Counts,
    Decision,
    count_of,
    read_admission,
    read_decision,
    read_text,
    read_texts,
    tier_key,
)

__all__ = (
    "LiveView",
    "TierRate",
    "compact_line",
    "fold",
    "fold_all",
    "screen",
)

#: How many rate samples a segment keeps at most, whatever the window.
_MAX_SAMPLES: Final = 256
#: Outcomes shown under "recent refusals".
_NOT_ADMITTED: Final = frozenset({"refused", "abandoned"})


@attrs.frozen(kw_only=True)
class TierRate:
    """A tier's admissions and refusals per second (``None``: not known yet) and totals."""

    tier: str
    admitted_per_s: float | None = None
    refused_per_s: float | None = None
    admitted_total: int | None = None
    refused_total: int | None = None


@attrs.frozen(kw_only=True)
class LiveView:
    """What the stream said so far, bounded: the view the screen and the line are drawn from."""

    #: How many decisions and admissions are kept (newest last).
    decision_limit: int = 50
    admission_limit: int = 100
    #: The span the tier rates are measured over.
    rate_window_s: float = 5.0
    version: str | None = None
    policy: str | None = None
    backend_names: tuple[str, ...] = ()
    #: The kinds the hello announced (``None``: no hello yet).
    kinds: tuple[str, ...] | None = None
    messages: int = 0
    ignored: int = 0
    restarts: int = 0
    latest: Decision | None = None
    decisions: tuple[Decision, ...] = ()
    admissions: tuple[Admission, ...] = ()
    rates: tuple[TierRate, ...] = ()
    #: The recent decisions that carried a time, oldest first: what the rates are measured on.
    samples: tuple[Decision, ...] = ()

    @property
    def outcome_counts(self) -> Counts:
        """How many of the kept admissions had each outcome, most frequent first."""
        counts: dict[str, int] = {}
        for admission in self.admissions:
            counts[admission.outcome] = counts.get(admission.outcome, 0) + 1
        return tuple(sorted(counts.items(), key=lambda item: (-item[1], item[0])))

    def rate(self, tier: str) -> TierRate:
        """The rates of ``tier`` (all unknown when the stream has not named it)."""
        for rate in self.rates:
            if rate.tier == tier:
                return rate
        return TierRate(tier=tier)


# -- folding ---------------------------------------------------------------------------------------


def _seconds(decision: Decision) -> float:
    return decision.at if decision.at is not None else 0.0  # samples always carry one


def _went_back(new: Decision, old: Decision) -> bool:
    if _seconds(new) < _seconds(old):
        return True
    for mine, theirs in ((new.admitted, old.admitted), (new.refused, old.refused)):
        for tier, count in mine:
            before = count_of(theirs, tier)
            if before is not None and count < before:
                return True
    return False


def _per_second(new: Counts, base: Counts, tier: str, seconds: float) -> float | None:
    now, then = count_of(new, tier), count_of(base, tier)
    if now is None or then is None or seconds <= 0:
        return None
    return max(0.0, (now - then) / seconds)


def _rates(decision: Decision, samples: tuple[Decision, ...]) -> tuple[TierRate, ...]:
    newest = samples[-1] if samples else None
    base = samples[0] if len(samples) > 1 else None
    tiers = sorted({t for t, _ in decision.admitted + decision.refused}, key=tier_key)
    rates = []
    for tier in tiers:
        admitted = refused = None
        if newest is not None and base is not None:
            seconds = _seconds(newest) - _seconds(base)
            admitted = _per_second(newest.admitted, base.admitted, tier, seconds)
            refused = _per_second(newest.refused, base.refused, tier, seconds)
        rates.append(
            TierRate(
                tier=tier,
                admitted_per_s=admitted,
                refused_per_s=refused,
                admitted_total=count_of(decision.admitted, tier),
                refused_total=count_of(decision.refused, tier),
            )
        )
    return tuple(rates)


def _with_decision(view: LiveView, decision: Decision) -> LiveView:
    samples, restarts = view.samples, view.restarts
    at = decision.at
    if at is not None:
        if any(_went_back(decision, old) for old in samples):
            samples, restarts = (decision,), restarts + 1
        else:
            recent = [old for old in samples if at - _seconds(old) <= view.rate_window_s]
            if not recent and samples:
                recent = [samples[-1]]
            samples = (*recent[-(_MAX_SAMPLES - 1) :], decision)
    return attrs.evolve(
        view,
        latest=decision,
        decisions=(*view.decisions, decision)[-max(1, view.decision_limit) :],
        samples=samples,
        restarts=restarts,
        # A decision without a time gives its totals but no rates.
        rates=_rates(decision, samples if decision.at is not None else ()),
    )


def fold(view: LiveView, message: object) -> LiveView:
    """``view`` after one decoded message; whatever it is not understood is ignored."""
    kind = message.get("type") if isinstance(message, Mapping) else None
    counted = attrs.evolve(view, messages=view.messages + 1)
    if not isinstance(message, Mapping) or kind not in ("hello", "decision", "admission"):
        return attrs.evolve(counted, ignored=view.ignored + 1)
    if kind == "hello":
        kinds = message.get("kinds")
        return attrs.evolve(
            counted,
            version=read_text(message.get("version")),
            policy=read_text(message.get("policy")),
            backend_names=read_texts(message.get("backends")),
            kinds=read_texts(kinds) if isinstance(kinds, list) else KINDS,
            # A new connection: the counts may come from another guard process.
            samples=(),
        )
    if kind == "decision":
        return _with_decision(counted, read_decision(message))
    admissions = (*view.admissions, read_admission(message))
    return attrs.evolve(counted, admissions=admissions[-max(1, view.admission_limit) :])


def fold_all(messages: Iterable[object], view: LiveView | None = None) -> LiveView:
    """``view`` (a fresh one when ``None``) after every message in order."""
    folded = view if view is not None else LiveView()
    for message in messages:
        folded = fold(folded, message)
    return folded


# -- rendering -------------------------------------------------------------------------------------


def _fig(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _num(value: int | None) -> str:
    return "-" if value is None else str(value)


def _clip(line: str, width: int) -> str:
    return line[: max(1, width)].rstrip()


def _columns(rows: Sequence[Sequence[str]], *, left: int = 1, indent: str = "") -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        indent
        + "  ".join(
            cell.ljust(w) if i < left else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


def _queue(decision: Decision) -> str:
    total = sum(count for _, count in decision.waiting)
    if not decision.waiting:
        return "queue -"
    parts = ", ".join(f"{tier} {count}" for tier, count in decision.waiting)
    return f"queue {total} ({parts})"


def _title(view: LiveView) -> str:
    name = f"inference-guard {view.version}" if view.version else "inference-guard"
    return f"{name} ({view.policy})" if view.policy else name


def _header(view: LiveView) -> str:
    decision = view.latest
    restarts = f"  restarts {view.restarts}" if view.restarts else ""
    if decision is None:
        return f"{_title(view)}  waiting for the first decision{restarts}"
    return (
        f"cap {_num(decision.cap)}  state {decision.state or '-'}"
        f"  in-flight {_num(decision.in_flight)}  {_queue(decision)}"
        f"  at {_fig(decision.at)} s{restarts}  {_title(view)}"
    )


def _backend_lines(view: LiveView) -> list[str]:
    decision = view.latest
    rows: list[Sequence[str]] = [
        ("backend", "status", "running", "waiting", "KV", "gen tok/s", "TTFT avg s")
    ]
    backends = decision.backends if decision is not None else ()
    for row in backends:
        rows.append(
            (
                row.name,
                "FAILED" if row.failed else "ok",
                _num(row.running),
                _num(row.waiting),
                _fig(row.kv_usage, 2),
                _fig(row.generation_tps),
                _fig(row.ttft_avg_s, 2),
            )
        )
    if not backends:
        rows.extend((name, "-", "-", "-", "-", "-", "-") for name in view.backend_names)
    return _columns(rows, left=2)


def _tier_lines(view: LiveView) -> list[str]:
    decision = view.latest or Decision()
    tiers = sorted({rate.tier for rate in view.rates} | {t for t, _ in decision.waiting})
    rows: list[Sequence[str]] = [
        ("tier", "admitted/s", "refused/s", "admitted", "refused", "waiting")
    ]
    for tier in sorted(tiers, key=tier_key):
        rate = view.rate(tier)
        rows.append(
            (
                tier,
                _fig(rate.admitted_per_s),
                _fig(rate.refused_per_s),
                _num(rate.admitted_total),
                _num(rate.refused_total),
                _num(count_of(decision.waiting, tier)),
            )
        )
    return _columns(rows)


def _speed_line(decision: Decision | None) -> str:
    d = decision or Decision()
    return (
        f"tok/s  observed {_fig(d.tps_observed)}  predicted {_fig(d.tps_predicted)}"
        f"    TTFT s  observed {_fig(d.ttft_observed_s, 2)}"
        f"  predicted {_fig(d.ttft_predicted_s, 2)}"
    )


def _decision_rows(decisions: Sequence[Decision]) -> list[str]:
    """Newest first; a run of rounds with the same cap, state and reasons is one row."""
    runs: list[tuple[Decision, int]] = []
    for decision in reversed(decisions):
        same = (decision.cap, decision.state, decision.reasons)
        if runs and (runs[-1][0].cap, runs[-1][0].state, runs[-1][0].reasons) == same:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((decision, 1))
    return [
        f"  {_fig(d.at):>8} s  cap {_num(d.cap):>4}  {d.state or '-':<7}"
        f"  {', '.join(d.reasons) or '-'}{f'  ({rounds} rounds)' if rounds > 1 else ''}"
        for d, rounds in runs
    ]


def _refusal_row(admission: Admission) -> str:
    return (
        f"  {_fig(admission.at):>8} s  {admission.tier or '-':<7}  {admission.outcome:<9}"
        f"  {admission.reason or '-':<22}  waited {_fig(admission.waited_s, 2)} s"
        f"  {admission.id}"
    )


def _refusal_title(view: LiveView) -> str:
    if view.kinds is not None and "admission" not in view.kinds:
        return "recent refusals: admissions are not in this stream (--kinds)"
    counts = ", ".join(f"{count} {outcome}" for outcome, count in view.outcome_counts)
    return f"recent refusals (last {len(view.admissions)} outcomes: {counts or 'none yet'})"


def _split(room: int, wanted: tuple[int, int]) -> tuple[int, int]:
    """Rows for two lists sharing ``room``: half each, the slack of one to the other."""
    first = min(wanted[0], (room + 1) // 2)
    second = min(wanted[1], room - first)
    return min(wanted[0], room - second), second


def screen(view: LiveView, width: int, height: int) -> list[str]:
    """The full screen: header, backends, tiers, speeds, recent decisions, recent refusals."""
    width, height = max(1, width), max(1, height)
    reasons = ", ".join(view.latest.reasons) if view.latest is not None else ""
    lines = [_header(view), f"reasons: {reasons or '-'}", ""]
    lines += [*_backend_lines(view), "", *_tier_lines(view), "", _speed_line(view.latest)]
    decisions = _decision_rows(view.decisions)
    refusals = [_refusal_row(a) for a in reversed(view.admissions) if a.outcome in _NOT_ADMITTED]
    # Below the fixed part: a blank and a title per list, then their rows.
    room = height - len(lines) - 4
    if room >= 0:
        shown_decisions, shown_refusals = _split(room, (len(decisions), len(refusals)))
        lines += ["", "recent decisions", *decisions[:shown_decisions]]
        lines += ["", _refusal_title(view), *refusals[:shown_refusals]]
    return [_clip(line, width) for line in lines[:height]]


def compact_line(view: LiveView, width: int | None = None) -> str:
    """One line for a log, a pipe or the demo's progress: cap, state, rates, speeds, reasons."""
    decision = view.latest
    if decision is None:
        line = _header(view)
    else:
        rates = view.rates
        admitted = " ".join(f"{r.tier} {_fig(r.admitted_per_s)}" for r in rates) or "-"
        refused = " ".join(f"{r.tier} {_fig(r.refused_per_s)}" for r in rates) or "-"
        waiting = sum(count for _, count in decision.waiting) if decision.waiting else None
        line = (
            f"t {_fig(decision.at)} s  cap {_num(decision.cap)}  {decision.state or '-'}"
            f"  in-flight {_num(decision.in_flight)}  queue {_num(waiting)}"
            f"  admitted/s {admitted}  refused/s {refused}"
            f"  tok/s {_fig(decision.tps_observed)}/{_fig(decision.tps_predicted)}"
            f"  TTFT {_fig(decision.ttft_observed_s, 2)}/{_fig(decision.ttft_predicted_s, 2)} s"
            f"  reasons {','.join(decision.reasons) or '-'}"
        )
        if view.restarts:
            line += f"  restarts {view.restarts}"
    return line if width is None else _clip(line, width)
