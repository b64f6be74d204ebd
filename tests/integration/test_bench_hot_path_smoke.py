"""``bench/bench_hot_path.py`` runs end to end and times every piece it names (its figures are
the benchmark's, never tested); it also checks on the way that its guard refuses the POST."""

from __future__ import annotations

from tests.integration.conftest import run_bench


def test_the_hot_path_benchmark_runs_and_prints_every_row() -> None:
    out = run_bench("bench_hot_path.py", "--scale", "0.01")
    rows = [line for line in out.splitlines() if line.startswith(("the ", "its ", "a ", "trio"))]
    assert len(rows) == 9, out
    for row in rows:
        assert float(row.rsplit(maxsplit=1)[1]) > 0, row
