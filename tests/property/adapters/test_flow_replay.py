"""A recording of a guard with flow control replays to the same admissions.

Random traffic from several tenants in two bands goes through a guard with tenants and bands
configured, as the engine drives it (arrivals, ordered retries, forwarding, ends, refusals told
as ``Refused``); every event applied is written as a recording line, read back, and replayed
by :func:`guard_adapters.replay.replay` under the same settings: no outcome differs, and the
admitted and refused counts are the live ones. Replayed under PIG's settings instead (no flow
control), the same recording still reads and replays (the labels are ignored). Ends carry an
output token count or none; a line without one reads as it always did. The spare is set high
(half the band) so that its refusals, which read the recent service decayed to each event's
``at``, are in the recording too.
"""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

import guard_core as core
from guard_adapters.recording import decode_line, encode
from guard_adapters.replay import replay
from guard_core.bands import Band, BandSpec
from guard_core.events import Arrived, Finished, Forwarded, Refused, RequestEvent, Retried
from guard_core.flow import FlowConfig, retry_order
from guard_core.guard import GuardConfig, GuardState
from guard_core.guard import apply as apply_guard_event
from guard_core.tenants import TenantConfig

BANDS = BandSpec.of((Band("gold", reserve=1), Band("std"), Band("bulk", wait_s=0.1)), "std")


def _config(flow: bool) -> GuardConfig:
    return GuardConfig(
        gate=core.GateConfig(global_limit=6, dynamic=False, queue_wait_s=0.5),
        learning=False,
        flow=FlowConfig(bands=BANDS, tenants=TenantConfig(weights={"a": 2.0}, spare=0.5))
        if flow
        else None,
    )


def _drive(seed: int, steps: int) -> tuple[list[RequestEvent], int, int]:
    rng = random.Random(seed)
    state = GuardState.initial(_config(True), at=0.0)
    events: list[RequestEvent] = []
    held: list[int] = []
    admitted = refused = 0
    at = 0.0
    next_id = 1

    def apply(event: RequestEvent) -> object:
        nonlocal state
        step = apply_guard_event(state, event)
        state = step.state
        events.append(event)
        return step.outcome

    def settle(rid: int, outcome: object) -> None:
        nonlocal admitted, refused
        if isinstance(outcome, core.Admitted):
            admitted += 1
            held.append(rid)
            apply(Forwarded(at=at, request_id=rid))
        elif isinstance(outcome, core.Rejected):
            refused += 1
            apply(Refused(at=at, request_id=rid, code=outcome.code))

    for _ in range(steps):
        at += rng.choice([0.0, 0.01, 0.05, 0.3])
        if held and rng.random() < 0.4:
            # Some ends carry the output tokens the runtime counted (attained service), some not.
            tokens = rng.choice([None, 0, 40, 3000])
            rid = held.pop(rng.randrange(len(held)))
            apply(Finished(at=at, request_id=rid, output_tokens=tokens))
        else:
            band, tenant = rng.choice(["gold", "std", "bulk", "?"]), rng.choice("abcd")
            event = Arrived(
                at=at, request_id=next_id, tier=core.Tier.BASIC, band=band, tenant=tenant
            )
            next_id += 1
            settle(event.request_id, apply(event))
        flow = state.flow
        assert flow is not None
        order = retry_order(flow, state.requests, limit=6, inflight=state.gate.inflight)
        for rid in order:
            if rid in state.requests and state.requests[rid].queued is not None:
                settle(rid, apply(Retried(at=at, request_id=rid)))
    return events, admitted, refused


@given(st.integers(0, 2**16), st.integers(5, 80))
def test_a_flow_recording_replays_to_the_same_admissions(seed: int, steps: int) -> None:
    events, admitted, refused = _drive(seed, steps)
    lines = [encode(event) for event in events]
    records = [decode_line(line, line_no=i + 2) for i, line in enumerate(lines)]
    assert records == events
    result = replay(records, _config(True))
    assert result.differing_outcomes == 0
    assert (result.recorded_forwarded, result.recorded_rejected) == (admitted, refused)
    assert result.admitted == admitted
    # Without flow control the labels are ignored: the recording still replays.
    replay(records, _config(False))


def test_an_end_without_an_output_count_is_written_as_before() -> None:
    """``output_tokens`` is written only when counted: an older end line reads unchanged."""
    assert b"output_tokens" not in encode(Finished(at=1.0, request_id=3, status=200))
    line = encode(Finished(at=1.0, request_id=3, status=200, output_tokens=17))
    assert decode_line(line, line_no=2) == Finished(
        at=1.0, request_id=3, status=200, output_tokens=17
    )
    old = b'{"kind":"finished","at":1.0,"request_id":3,"status":200}'
    assert decode_line(old, line_no=2) == Finished(at=1.0, request_id=3, status=200)
