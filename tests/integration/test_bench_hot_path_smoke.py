"""``bench/bench_hot_path.py`` runs end to end and times every piece it names (its figures are
the benchmark's, never tested); it also checks on the way that its guard refuses the POST."""

from __future__ import annotations

from tests.integration.conftest import run_bench


def test_the_hot_path_benchmark_runs_and_prints_every_row() -> None:
    out = run_bench("bench_hot_path.py", "--scale", "0.01")
    _, _, table = out.partition("best of 7 repeats\n")
    rows = [line for line in table.splitlines() if line.strip()]
    assert len(rows) == 16, out
    for row in rows:
        assert float(row.rsplit(maxsplit=1)[1]) > 0, row
