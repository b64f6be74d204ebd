"""The engine's fair-order retry under flow control: bounded work per wake-up, no lost slot.

Virtual time (trio's autojump clock). Many tenants keep a full band backlogged; every release
wakes the waiters, which the engine retries in the core's fair order. Checked: a wake-up
retries each waiter at most ``RETRY_PASSES`` times (the old loop made one more pass for each
pass that ended a wait, up to one per waiter: quadratic) and stops once the gate is full again,
a freed slot is still taken at once by a waiter, and every waiter ends with a slot or a refusal
by its deadline.
"""

from __future__ import annotations

import trio

from guard_core import GateConfig, GuardConfig, RequestEvent, Retried, Tier
from guard_core.bands import Band, BandSpec
from guard_core.flow import RETRY_PASSES, FlowConfig
from guard_core.tenants import TenantConfig
from guard_trio._engine import AdmissionResult, GuardEngine

CAP = 6
WAITERS = 60
TENANTS = 5


def _engine(events: list[RequestEvent]) -> GuardEngine:
    config = GuardConfig(
        gate=GateConfig(global_limit=CAP, dynamic=False, queue_wait_s=0.5),
        learning=False,
        flow=FlowConfig(bands=BandSpec.of((Band("shared"),)), tenants=TenantConfig()),
    )
    return GuardEngine(config, on_event=events.append)


async def test_a_release_retries_each_waiter_at_most_retry_passes_times(
    autojump_clock: trio.abc.Clock,
) -> None:
    events: list[RequestEvent] = []
    engine = _engine(events)
    held = []
    for i in range(CAP):
        attempt = engine.begin(Tier.BASIC, tenant=f"t{i % TENANTS}")
        assert attempt.result is not None
        assert attempt.result.slot is not None
        held.append(attempt.result.slot)
    results: list[AdmissionResult] = []

    async def wait(tenant: str) -> None:
        results.append(await engine.settle(engine.begin(Tier.BASIC, tenant=tenant)))

    async with trio.open_nursery() as nursery:
        for i in range(WAITERS):
            nursery.start_soon(wait, f"t{i % TENANTS}")
        await trio.sleep(0.1)  # every waiter is queued now
        assert engine.state.gate.waiting == WAITERS
        for _ in range(CAP):
            waiting = engine.state.gate.waiting
            before = len(events)
            held.pop().release(200)
            retries = sum(isinstance(e, Retried) for e in events[before:])
            assert retries <= RETRY_PASSES * waiting, (retries, waiting)
            # The fairest waiter takes it, and with the gate full again nobody else is tried
            # (the loop before retried every waiter twice here).
            assert retries == 1, retries
            # The freed slot went to a waiter at once, in the same wake-up.
            assert engine.state.gate.inflight == CAP
            assert engine.state.gate.waiting == waiting - 1
        await trio.sleep(1.0)  # past every deadline: the rest are refused
    admitted = [r for r in results if r.slot is not None]
    assert len(admitted) == CAP
    assert len(results) == WAITERS
    assert all(r.waited_s <= 0.5 + 1e-9 for r in results)
    for result in admitted:
        assert result.slot is not None
        result.slot.release(200)
    assert engine.state.gate.inflight == 0
    assert engine.state.gate.waiting == 0
