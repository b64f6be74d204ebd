"""``bench/bench_hot_path.py`` runs end to end and times every piece it names (its figures are
the benchmark's, never tested); it also checks on the way that its guard refuses the POST."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_hot_path_benchmark_runs_and_prints_every_row() -> None:
    result = subprocess.run(
        [sys.executable, "bench/bench_hot_path.py", "--scale", "0.01"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [
        line
        for line in result.stdout.splitlines()
        if line.startswith(("the ", "its ", "a ", "trio"))
    ]
    assert len(rows) == 9, result.stdout
    for row in rows:
        assert float(row.rsplit(maxsplit=1)[1]) > 0, row
