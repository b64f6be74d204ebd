"""``guard_adapters.live_view``: the admin stream folded into a view, and its renderings.

Messages are built as the admin plane's schema (version 1) describes them; Hypothesis also
feeds arbitrary JSON values. Checks:

* any sequence of schema messages, mixed with arbitrary JSON values, folds without error; every
  message is counted and the ones of no known type are counted as ignored;
* the view stays bounded; the latest decision is the last one folded; outcome counts add up;
* unknown fields, a higher ``v`` and messages of unknown types change nothing else;
* rates are never negative, equal the counts' growth over the window for steady traffic, and
  counters that go backwards (a guard restart) start a new segment: a restart is counted, the
  rates are unknown for that round and then measure the new segment only;
* the screen has at most ``height`` lines of at most ``width`` printable ASCII characters, and
  with room enough shows the latest decision's reasons and the recent refusals; the compact
  line fits ``width``; text from the stream cannot smuggle terminal escapes;
* the stream's address: schemes, paths and query strings, and the faults it names.
"""

from __future__ import annotations

import json
import math
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from guard_adapters.live_view import LiveView, compact_line, fold, fold_all, screen
from guard_adapters.live_view_messages import events_url, parse_message

TIERS = ("basic", "premium")
names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=30)
maybe_float = st.none() | st.floats(min_value=0, max_value=1e6, allow_nan=False)
counts = st.fixed_dictionaries({tier: st.integers(0, 10**9) for tier in TIERS})


def hello(**extra: Any) -> dict[str, Any]:
    return {
        "v": 1,
        "type": "hello",
        "version": "0.1.0",
        "policy": "pig",
        "backends": ["a"],
        "kinds": ["decision", "admission"],
        **extra,
    }


def decision(
    at: float, admitted: dict[str, int], refused: dict[str, int], **extra: Any
) -> dict[str, Any]:
    return {
        "v": 1,
        "type": "decision",
        "at": at,
        "cap": 8,
        "state": "green",
        "reasons": [],
        "in_flight": 3,
        "waiting": {"basic": 0, "premium": 0},
        "admitted": admitted,
        "refused": refused,
        "backends": [],
        "tps": {"observed": None, "predicted": None},
        "ttft_s": {"observed": None, "predicted": None},
        **extra,
    }


backends = st.lists(
    st.fixed_dictionaries(
        {
            "name": names,
            "failed": st.booleans(),
            "running": st.integers(0, 10**6),
            "waiting": st.integers(0, 10**6),
            "kv_usage": st.floats(0, 1),
            "generation_tps": maybe_float,
            "ttft_avg_s": maybe_float,
        }
    ),
    max_size=4,
)
hellos = st.fixed_dictionaries(
    {
        "v": st.just(1),
        "type": st.just("hello"),
        "version": names,
        "policy": st.sampled_from(["pig", "predictive"]),
        "backends": st.lists(names, max_size=4),
        "kinds": st.lists(st.sampled_from(["decision", "admission"]), unique=True),
    }
)
decisions = st.fixed_dictionaries(
    {
        "v": st.just(1),
        "type": st.just("decision"),
        "at": st.floats(0, 1e7),
        "cap": st.none() | st.integers(0, 10**6),
        "state": st.sampled_from(["green", "yellow", "red", "startup"]) | names,
        "reasons": st.lists(names, max_size=5),
        "in_flight": st.integers(0, 10**6),
        "waiting": counts,
        "admitted": counts,
        "refused": counts,
        "backends": backends,
        "tps": st.fixed_dictionaries({"observed": maybe_float, "predicted": maybe_float}),
        "ttft_s": st.fixed_dictionaries({"observed": maybe_float, "predicted": maybe_float}),
    }
)
admissions = st.fixed_dictionaries(
    {
        "v": st.just(1),
        "type": st.just("admission"),
        "at": st.floats(0, 1e7),
        "id": names,
        "tier": st.sampled_from(TIERS),
        "outcome": st.sampled_from(["admitted", "refused", "abandoned"]),
        "reason": st.none() | st.sampled_from(["tier_basic_limit", "queue_timeout"]) | names,
        "waited_s": st.floats(0, 100),
        "predicted_tps": maybe_float,
        "predicted_ttft_s": maybe_float,
    }
)
schema_messages = hellos | decisions | admissions
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | names,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(names, inner, max_size=4),
    max_leaves=12,
)
# Anything a server might send: known types with fields of any JSON type, and other values.
anything = (
    schema_messages
    | json_values
    | st.builds(
        lambda kind, fields: {**fields, "type": kind},
        st.sampled_from(["hello", "decision", "admission", "other"]),
        st.dictionaries(
            st.sampled_from(["v", "at", "cap", "state", "reasons", "admitted", "backends", "tps"]),
            json_values,
        ),
    )
)
small_views = st.builds(
    LiveView,
    decision_limit=st.integers(1, 30),
    admission_limit=st.integers(1, 30),
    rate_window_s=st.floats(0.1, 60),
)


def is_known(message: object) -> bool:
    return isinstance(message, dict) and message.get("type") in ("hello", "decision", "admission")


@given(small_views, st.lists(anything, max_size=40))
def test_any_sequence_folds_and_is_counted(start: LiveView, messages: list[object]) -> None:
    view = fold_all(messages, start)
    assert view.messages == len(messages)
    assert view.ignored == sum(not is_known(m) for m in messages)
    assert len(view.decisions) <= start.decision_limit
    assert len(view.admissions) <= start.admission_limit
    assert sum(count for _, count in view.outcome_counts) == len(view.admissions)
    if view.decisions:
        assert view.latest is view.decisions[-1]
    for rate in view.rates:
        for value in (rate.admitted_per_s, rate.refused_per_s):
            assert value is None or (value >= 0 and math.isfinite(value))


@given(st.lists(schema_messages, max_size=30))
def test_the_last_decision_folded_is_the_latest(messages: list[dict[str, Any]]) -> None:
    view = fold_all(messages)
    folded = [m for m in messages if m["type"] == "decision"]
    if folded:
        assert view.latest is not None
        assert view.latest.at == folded[-1]["at"]
        assert view.latest.cap == folded[-1]["cap"]
    else:
        assert view.latest is None


@given(
    st.lists(schema_messages, max_size=25),
    st.integers(2, 9),
    st.dictionaries(st.text(min_size=1, max_size=8), json_values, max_size=3),
    st.lists(st.integers(0, 25), max_size=5),
)
def test_unknown_fields_higher_versions_and_unknown_types_change_nothing_else(
    messages: list[dict[str, Any]], version: int, extra: dict[str, Any], positions: list[int]
) -> None:
    known = set().union(*(m.keys() for m in messages)) | {"name", "observed", "predicted"}
    assume(not known & set(extra))
    newer = [{**m, **extra, "v": version} for m in messages]
    for position in sorted(positions, reverse=True):
        newer.insert(min(position, len(newer)), {"v": 1, "type": "future_kind", "x": 1})
    plain, extended = fold_all(messages), fold_all(newer)
    assert extended.ignored == len(positions)
    assert extended.messages == plain.messages + len(positions)
    # Everything but the counters is the same view.
    assert extended.latest == plain.latest
    assert extended.decisions == plain.decisions
    assert extended.admissions == plain.admissions
    assert extended.rates == plain.rates
    assert extended.restarts == plain.restarts


@given(
    st.floats(0.05, 5),
    st.integers(0, 1000),
    st.integers(0, 1000),
    st.integers(2, 30),
    st.floats(0.5, 30),
)
def test_steady_traffic_gives_the_counts_growth_per_second(
    spacing: float, admitted_per_round: int, refused_per_round: int, rounds: int, window: float
) -> None:
    view = LiveView(rate_window_s=window)
    ats = [100 + i * spacing for i in range(rounds)]
    for i, at in enumerate(ats):
        view = fold(
            view,
            decision(
                at,
                {"basic": 7 + i * admitted_per_round, "premium": 0},
                {"basic": i * refused_per_round, "premium": 3},
            ),
        )
    basic, premium = view.rate("basic"), view.rate("premium")
    assert basic.admitted_per_s == pytest.approx(admitted_per_round / spacing, rel=1e-6)
    assert basic.refused_per_s == pytest.approx(refused_per_round / spacing, rel=1e-6)
    assert premium.admitted_per_s == 0
    assert premium.refused_per_s == 0
    assert basic.admitted_total == 7 + (rounds - 1) * admitted_per_round
    # The base of the rates is within the window, or the previous round when that is older.
    base = view.samples[0].at
    assert base is not None  # a timed decision: each round publishes one at its own time
    assert ats[-1] - base <= max(window, spacing) * (1 + 1e-9)


@given(
    st.lists(
        st.tuples(st.floats(-5, 20), st.integers(-50, 100), st.integers(-50, 100)), max_size=40
    )
)
def test_rates_are_never_negative_whatever_the_counts_do(
    steps: list[tuple[float, int, int]],
) -> None:
    view, at, admitted, refused = LiveView(), 0.0, 0, 0
    for dt, da, dr in steps:
        at, admitted, refused = max(0.0, at + dt), max(0, admitted + da), max(0, refused + dr)
        view = fold(view, decision(at, {"basic": admitted}, {"basic": refused}))
        rate = view.rate("basic")
        assert rate.admitted_per_s is None or rate.admitted_per_s >= 0
        assert rate.refused_per_s is None or rate.refused_per_s >= 0
        assert rate.admitted_total == admitted


@given(
    st.integers(1, 10**6),
    st.integers(0, 10**6),
    st.floats(0.1, 3),
    st.integers(1, 100),
    st.booleans(),
)
def test_a_restart_starts_a_new_segment(
    before: int, after: int, spacing: float, per_round: int, time_resets: bool
) -> None:
    assume(after < before)
    view = fold_all(
        [
            hello(),
            decision(1000.0, {"basic": before - 1}, {"basic": 0}),
            decision(1000.0 + spacing, {"basic": before}, {"basic": 0}),
        ]
    )
    assert view.restarts == 0
    assert view.rate("basic").admitted_per_s is not None
    # The guard restarts: its counts start again (and its clock too, when time_resets).
    restart_at = 1.0 if time_resets else 1000.0 + 2 * spacing
    view = fold(view, decision(restart_at, {"basic": after}, {"basic": 0}))
    assert view.restarts == 1
    assert view.rate("basic").admitted_per_s is None
    assert view.rate("basic").admitted_total == after
    view = fold(view, decision(restart_at + spacing, {"basic": after + per_round}, {"basic": 0}))
    assert view.restarts == 1
    assert view.rate("basic").admitted_per_s == pytest.approx(per_round / spacing)


def test_a_restart_by_time_alone_is_seen() -> None:
    view = fold_all(
        [
            decision(50.0, {"basic": 10}, {"basic": 1}),
            decision(51.0, {"basic": 12}, {"basic": 1}),
            decision(2.0, {"basic": 20}, {"basic": 1}),
        ]
    )
    assert view.restarts == 1
    assert view.rate("basic").admitted_per_s is None


def test_a_hello_starts_a_new_segment_without_counting_a_restart() -> None:
    view = fold_all(
        [
            decision(10.0, {"basic": 10}, {"basic": 0}),
            decision(11.0, {"basic": 20}, {"basic": 0}),
            hello(),
            decision(12.0, {"basic": 25}, {"basic": 0}),
        ]
    )
    assert view.restarts == 0
    assert view.rate("basic").admitted_per_s is None
    view = fold(view, decision(13.0, {"basic": 30}, {"basic": 0}))
    assert view.rate("basic").admitted_per_s == pytest.approx(5.0)


@given(st.lists(anything, max_size=30), st.integers(-5, 250), st.integers(-5, 80))
def test_the_screen_fits_the_terminal(messages: list[object], width: int, height: int) -> None:
    lines = screen(fold_all(messages), width, height)
    assert 1 <= len(lines) <= max(1, height)
    for line in lines:
        assert len(line) <= max(1, width)
        assert all(" " <= ch <= "~" for ch in line)


@given(st.lists(anything, max_size=30), st.none() | st.integers(1, 250))
def test_the_compact_line_is_one_line_that_fits(messages: list[object], width: int | None) -> None:
    line = compact_line(fold_all(messages), width)
    assert line
    assert all(" " <= ch <= "~" for ch in line)
    if width is not None:
        assert len(line) <= width


@given(st.lists(decisions | admissions, min_size=1, max_size=12))
def test_with_room_the_screen_shows_the_reasons_and_the_refusals(
    messages: list[dict[str, Any]],
) -> None:
    view = fold_all(messages, LiveView(admission_limit=12))
    text = "\n".join(screen(view, 400, 200))
    if view.latest is not None:
        assert f"cap {view.latest.cap if view.latest.cap is not None else '-'}" in text
        assert f"reasons: {', '.join(view.latest.reasons) or '-'}" in text
    for admission in view.admissions:
        row_present = f"{admission.outcome:<9}  {admission.reason or '-'}" in text
        assert row_present == (admission.outcome in ("refused", "abandoned"))


def test_text_from_the_stream_cannot_send_terminal_escapes() -> None:
    hostile = "\x1b[2J\x1b]0;owned\x07\r\nred"
    view = fold_all(
        [
            hello(version=hostile, backends=[hostile]),
            decision(1.0, {"basic": 1}, {"basic": 0}, state=hostile, reasons=[hostile]),
            {"v": 1, "type": "admission", "outcome": "refused", "reason": hostile, "id": hostile},
        ]
    )
    rendered = [*screen(view, 200, 60), compact_line(view)]
    assert all("\x1b" not in line and "\r" not in line and "\n" not in line for line in rendered)
    assert any("?[2J" in line for line in rendered)


def test_a_small_screen_keeps_the_header_first() -> None:
    view = fold_all([hello(), decision(3.0, {"basic": 1}, {"basic": 2}, cap=17, state="red")])
    assert screen(view, 30, 1) == ["cap 17  state red  in-flight 3"]
    assert screen(view, 1, 1) == ["c"]


def test_an_example_screen() -> None:
    view = fold_all(
        [
            hello(policy="predictive", backends=["vllm-a"]),
            decision(
                10.0,
                {"basic": 100, "premium": 20},
                {"basic": 10, "premium": 0},
                cap=12,
                state="yellow",
                reasons=["kv_cache"],
                waiting={"basic": 2, "premium": 1},
                backends=[
                    {
                        "name": "vllm-a",
                        "failed": False,
                        "running": 9,
                        "waiting": 1,
                        "kv_usage": 0.83,
                        "generation_tps": 412.0,
                        "ttft_avg_s": 0.21,
                    }
                ],
                tps={"observed": 18.5, "predicted": 20.25},
                ttft_s={"observed": 0.42, "predicted": 0.5},
            ),
            decision(12.0, {"basic": 106, "premium": 22}, {"basic": 18, "premium": 0}, cap=12),
            {"v": 1, "type": "admission", "at": 11.5, "id": "r-1", "tier": "basic",
             "outcome": "refused", "reason": "tier_basic_limit", "waited_s": 0.25},
        ]
    )  # fmt: skip
    lines = screen(view, 120, 30)
    assert lines[0] == (
        "cap 12  state green  in-flight 3  queue 0 (basic 0, premium 0)  at 12.0 s"
        "  inference-guard 0.1.0 (predictive)"
    )
    assert "basic           3.0        4.0       106       18        0" in lines
    assert "premium         1.0        0.0        22        0        0" in lines
    assert "recent refusals (last 1 outcomes: 1 refused)" in lines
    assert any("r-1" in line and "tier_basic_limit" in line for line in lines)
    assert any("10.0 s  cap   12  yellow   kv_cache" in line for line in lines)
    assert compact_line(view).startswith("t 12.0 s  cap 12  green  in-flight 3  queue 0")
    assert "admitted/s basic 3.0 premium 1.0  refused/s basic 4.0 premium 0.0" in compact_line(view)


def test_repeated_rounds_are_one_row_of_recent_decisions() -> None:
    view = fold_all(decision(float(i), {"basic": i}, {"basic": 0}) for i in range(5))
    rows = [line for line in screen(view, 100, 40) if "cap    8" in line]
    assert rows == ["       4.0 s  cap    8  green    -  (5 rounds)"]


def test_a_stream_without_admissions_says_so() -> None:
    view = fold_all([hello(kinds=["decision"]), decision(1.0, {}, {})])
    assert any("admissions are not in this stream" in line for line in screen(view, 100, 40))


@given(st.lists(schema_messages, max_size=10))
def test_messages_decode_from_their_json_text(messages: list[dict[str, Any]]) -> None:
    texts = [json.dumps(m) for m in messages]
    assert fold_all(parse_message(t) for t in texts) == fold_all(messages)


@pytest.mark.parametrize("text", ["", "{", "not json", b"\xff\xfe", "[" * 100_000])
def test_text_that_is_not_json_decodes_to_nothing(text: str | bytes) -> None:
    assert parse_message(text) is None


# -- the stream's address -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("base", "expected"),
    [
        ("http://127.0.0.1:9000", "ws://127.0.0.1:9000/admin/events"),
        ("http://127.0.0.1:9000/", "ws://127.0.0.1:9000/admin/events"),
        ("https://guard.example/admin", "wss://guard.example/admin/events"),
        ("ws://[::1]:9000/admin/events", "ws://[::1]:9000/admin/events"),
        ("WSS://H:1/prefix/", "wss://h:1/prefix/admin/events"),
        ("http://user:secret@h:9000", "ws://h:9000/admin/events"),
    ],
)
def test_the_events_url(base: str, expected: str) -> None:
    assert events_url(base) == expected


def test_kinds_and_sample_go_to_the_query_string() -> None:
    url = events_url("http://h:9000", kinds=["decision", "decision"], sample=0.1)
    assert url == "ws://h:9000/admin/events?kinds=decision&sample=0.1"
    both = urlsplit(events_url("http://h:9000", kinds=["admission", "decision"]))
    assert parse_qs(both.query) == {"kinds": ["admission,decision"]}


@pytest.mark.parametrize(
    ("base", "kinds", "fault"),
    [
        ("ftp://h:21", (), "not an http, https, ws or wss URL"),
        ("127.0.0.1:9000", (), "not an http, https, ws or wss URL"),
        ("http://:9000", (), "no host"),
        ("http://h:99999", (), "not a URL"),
        ("http://h:0", (), "port 0"),
        ("http://h:9000", ("decisions",), "unknown kinds decisions"),
    ],
)
def test_a_bad_address_is_named(base: str, kinds: tuple[str, ...], fault: str) -> None:
    with pytest.raises(ValueError, match=fault):
        events_url(base, kinds=kinds)


@given(st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True), st.integers(1, 65535))
def test_any_host_and_port_give_the_events_path(host: str, port: int) -> None:
    parts = urlsplit(events_url(f"http://{host}:{port}"))
    assert (parts.scheme, parts.hostname, parts.port, parts.path) == (
        "ws",
        host,
        port,
        "/admin/events",
    )
