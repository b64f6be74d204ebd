"""The engine retries waiters exactly as the fairness property's driver does.

``tests/property/core/test_flow_fairness.py`` checks the tenant guarantees (below-share first,
idle share used, shares under saturation) on a pure driver that retries the waiters as the
runtimes are meant to: the core's fair order, a pass stopped once no retry can be admitted, a
second pass when a wait ended. This test holds the live engine to that driver: the same
arrivals and releases, at the same instants (trio's clock stands still but for the test's own
jumps, so no waiter's own timer fires), must leave the core's state equal after every step, so
the property's guarantees are the engine's. A change of the order the engine retries in, or of
which waiters a wake-up retries, fails here (reversing the order fails at once). Each release
here frees one slot and wakes the engine at once, so a second pass seldom finds anyone: that
the engine makes at most ``RETRY_PASSES`` is held by ``test_engine_flow_retry.py``.
"""

from __future__ import annotations

import trio
import trio.testing
from hypothesis import example, given
from hypothesis import strategies as st

from guard_core import Finished, Forwarded, RequestEvent, Tier
from guard_trio._engine import Attempt, GuardEngine
from tests.property.core.test_flow_fairness import NAMES, _Driver, _guard, top_up

#: The time between rounds: small enough that a round list ends before any waiter's fallback
#: re-check (50 ms at the least) or deadline, which the driver does not model.
STEP_S = 0.0005


class _Live:
    """The engine with one task settling each queued attempt, as the proxy has."""

    def __init__(self, engine: GuardEngine, nursery: trio.Nursery) -> None:
        self.engine = engine
        self.nursery = nursery
        self.attempts: dict[int, Attempt] = {}
        self.held: list[int] = []  # in admission order, as the driver keeps it
        engine.on_event = self._saw

    def _saw(self, event: RequestEvent) -> None:
        if isinstance(event, Forwarded):
            self.held.append(event.request_id)
        elif isinstance(event, Finished):
            self.held.remove(event.request_id)

    def arrive(self, tenant: str) -> None:
        attempt = self.engine.begin(Tier.BASIC, tenant=tenant)
        self.attempts[attempt.request_id] = attempt
        if attempt.result is None:
            self.nursery.start_soon(self.engine.settle, attempt)

    def release(self, index: int) -> None:
        result = self.attempts[self.held[index]].result
        assert result is not None
        assert result.slot is not None
        result.slot.release(200)  # a wake-up: the engine retries its waiters now


async def _run_both(
    cap: int, weights: dict[str, float], spare: float, rounds: list[tuple[int, int]]
) -> None:
    clock = trio.lowlevel.current_clock()
    assert isinstance(clock, trio.testing.MockClock)
    start = _guard(cap, weights, spare=spare)
    driver = _Driver(start, weights)
    names = list(weights)
    async with trio.open_nursery() as nursery:
        live = _Live(GuardEngine(start.config), nursery)

        def arrive(tenant: str) -> None:
            driver.arrive(tenant, at)
            live.arrive(tenant)

        async def same(step: str) -> None:
            await trio.testing.wait_all_tasks_blocked()  # every waiter is registered
            assert live.held == driver.held, step
            assert live.engine.state == driver.state, step

        at = 0.0
        for number, (releases, oldest) in enumerate(rounds):
            clock.jump(STEP_S)
            at += STEP_S
            top_up(driver, names, arrive)  # backlogged, as the fairness property keeps it
            await same(f"round {number}: arrivals")
            for _ in range(min(releases, len(driver.held))):
                index = min(oldest, len(driver.held) - 1)
                driver.release(index, at)
                driver.retry_all(at)
                live.release(index)
                await same(f"round {number}: a release and its wake-up")
            for tenant in names:
                if not driver.waiting()[tenant]:
                    arrive(tenant)
            await same(f"round {number}: late arrivals")
        nursery.cancel_scope.cancel()


@given(
    st.integers(2, 12),
    st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=2, max_size=4),
    st.lists(st.tuples(st.integers(1, 2), st.integers(0, 1)), min_size=10, max_size=60),
    st.sampled_from([0.0, 0.1, 0.25]),
)
# The two cases the fairness property keeps as examples.
@example(11, [3.0, 1.0, 2.0], [(1, 0)] * 30, 0.25)
@example(11, [1.0, 1.0, 1.0, 3.0], [(1, 0)] * 4 + [(2, 0)] + [(1, 0)] * 25, 0.25)
def test_the_engine_retries_as_the_fairness_driver_does(
    cap: int, weight_list: list[float], rounds: list[tuple[int, int]], spare: float
) -> None:
    weights = dict(zip(NAMES, weight_list, strict=False))
    trio.run(_run_both, cap, weights, spare, rounds, clock=trio.testing.MockClock(rate=0))
