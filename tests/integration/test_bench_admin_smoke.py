"""``bench/bench_admin.py`` runs end to end, and what it measures holds: the readers get the
decisions, and the viewer that never reads is dropped (timings are the benchmark's, not tested).
"""

from __future__ import annotations

import json

from tests.integration.conftest import run_bench


def test_the_admin_benchmark_runs_and_drops_the_stalled_viewer() -> None:
    out = run_bench(
        "bench_admin.py", "--rate", "2000", "--viewers", "2", "--seconds", "1.5", "--json"
    )
    idle, reading, stalled = json.loads(out)
    assert idle["viewers"] == 0
    assert idle["messages_per_s_per_viewer"] == 0
    assert reading["messages_per_s_per_viewer"] > 0
    assert reading["stalled_dropped"] == 0
    # 2,000 decisions a second overflow a 1,024-message buffer nobody reads within the phase.
    assert stalled["stalled"] is True
    assert stalled["stalled_dropped"] == 1
    assert stalled["messages_per_s_per_viewer"] > 0  # the readers go on
