"""``bench/bench_admin.py`` runs end to end, and what it measures holds: the readers get the
decisions, and the viewer that never reads is dropped (timings are the benchmark's, not tested).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_admin_benchmark_runs_and_drops_the_stalled_viewer() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "bench/bench_admin.py",
            "--rate",
            "2000",
            "--viewers",
            "2",
            "--seconds",
            "1.5",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    idle, reading, stalled = json.loads(result.stdout)
    assert idle["viewers"] == 0
    assert idle["messages_per_s_per_viewer"] == 0
    assert reading["messages_per_s_per_viewer"] > 0
    assert reading["stalled_dropped"] == 0
    # 2,000 decisions a second overflow a 1,024-message buffer nobody reads within the phase.
    assert stalled["stalled"] is True
    assert stalled["stalled_dropped"] == 1
    assert stalled["messages_per_s_per_viewer"] > 0  # the readers go on
