"""``bench/bench_proxy.py`` still runs end to end: a few seconds of every phase, both tables.

Only that it works is checked, never a figure: timings belong to the benchmark, not to tests.
"""

from __future__ import annotations

from tests.integration.conftest import run_bench


def test_the_proxy_benchmark_runs_in_smoke_mode_and_prints_both_tables() -> None:
    out = run_bench("bench_proxy.py", "--quick", "--smoke")
    assert "Python: " in out
    assert "POST load generator: " in out
    assert "Small non-streaming POST" in out
    assert "SSE streaming, 8 streams x 50 events/s" in out
    for column in ("direct", "guard static", "guard dynamic", "trio+h11 floor"):
        assert column in out
    assert "events per guard CPU-second" in out
