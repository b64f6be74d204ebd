"""``bench/bench_proxy.py`` still runs end to end: a few seconds of every phase, both tables.

Only that it works is checked, never a figure: timings belong to the benchmark, not to tests.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_proxy_benchmark_runs_in_smoke_mode_and_prints_both_tables() -> None:
    result = subprocess.run(
        [sys.executable, "bench/bench_proxy.py", "--quick", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "Python: " in out
    assert "POST load generator: " in out
    assert "Small non-streaming POST" in out
    assert "SSE streaming, 8 streams x 50 events/s" in out
    for column in ("direct", "guard static", "guard dynamic", "trio+h11 floor"):
        assert column in out
    assert "events per guard CPU-second" in out
