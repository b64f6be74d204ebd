"""``bench/bench_task_steps.py`` runs end to end, and the guard's tasks stay within the steps
its design allows per request (a count of scheduler trips, not a time).

An admitted small POST takes at most two waits in its connection's handler (the next request's
head, the backend's answer) and a third when the client is slow to send its next request, and
two in the connection's watcher (woken for the request, stopped after it): at most five, where
a watcher task per request took six or more (its own three, and one more of the handler's to
wait for it to end). A refusal takes the handler's wait for the next head, and at most one more.
"""

from __future__ import annotations

from tests.integration.conftest import run_bench


def test_the_task_steps_benchmark_counts_steps_within_the_design() -> None:
    out = run_bench("bench_task_steps.py", "--requests", "400", "--connections", "4")
    rows = {line.split()[0]: line.split() for line in out.splitlines()[3:] if line.strip()}
    assert set(rows) == {"admitted", "refused"}, out
    admitted, refused = float(rows["admitted"][3]), float(rows["refused"][3])
    assert 1.0 <= admitted <= 5.5, out
    assert 0.5 <= refused <= 2.5, out
    assert float(rows["admitted"][2]) > 0, out  # the watcher ran
