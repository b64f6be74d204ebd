"""``inference-guard demo --quick``: a real run as a subprocess, its table and its JSON figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_quick_demo_shows_the_predictive_learner_serving_the_most_good_requests(
    tmp_path: Path,
) -> None:
    out = tmp_path / "demo.json"
    done = subprocess.run(
        [sys.executable, "-m", "guard_trio", "demo", "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "tok/s p5" in done.stdout
    assert "TTFT p95" in done.stdout
    assert "good" in done.stdout
    assert "predictive  basic" in done.stdout
    # The live line of a guarded phase is watch's own line (the same renderer).
    live = [line for line in done.stdout.splitlines() if line.startswith("predictive")]
    assert any(" | t " in line and "  cap " in line and "admitted/s" in line for line in live)
    unguarded_lines = [line for line in done.stdout.splitlines() if line.startswith("unguarded")]
    assert any(line.endswith("| no guard") for line in unguarded_lines)

    document = json.loads(out.read_text())
    phases = document["phases"]
    assert list(phases) == ["unguarded", "pig", "predictive"]
    for tiers in phases.values():
        assert set(tiers) == {"premium", "basic", "all"}
        for figures in tiers.values():
            assert figures["requests"] >= figures["served"] + figures["rejected"]
            assert figures["good"] <= figures["served"]
        assert tiers["all"]["requests"] == tiers["premium"]["requests"] + tiers["basic"]["requests"]
        assert tiers["all"]["good"] == tiers["premium"]["good"] + tiers["basic"]["good"]

    unguarded, pig, predictive = (
        phases[name]["all"] for name in ("unguarded", "pig", "predictive")
    )
    # Without a guard nothing is refused; at about three times capacity both guards refuse.
    assert unguarded["rejected"] == 0
    assert pig["rejected"] > 0
    assert predictive["rejected"] > 0
    # What the README claims: the predictive learner's slowest 5 % of streams keep 20 tok/s, and
    # it serves more requests within the objective than PIG's learner and than no guard.
    assert predictive["user_tps_p5"] is not None
    assert predictive["user_tps_p5"] >= 20.0
    assert predictive["good"] > pig["good"]
    assert predictive["good"] > unguarded["good"]
