"""``inference-guard demo --quick``: a real run as a subprocess, its table and its JSON figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_quick_demo_shows_the_guard_protecting_users(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    done = subprocess.run(
        [sys.executable, "-m", "guard_trio", "demo", "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "tok/s p5" in done.stdout
    assert "TTFT p95" in done.stdout
    assert "unguarded  basic" in done.stdout

    document = json.loads(out.read_text())
    phases = document["phases"]
    assert set(phases) == {"guarded", "unguarded"}
    for tiers in phases.values():
        assert set(tiers) == {"premium", "basic", "all"}
        for figures in tiers.values():
            assert figures["requests"] >= figures["served"] + figures["rejected"]
        assert tiers["all"]["requests"] == tiers["premium"]["requests"] + tiers["basic"]["requests"]

    guarded, unguarded = phases["guarded"], phases["unguarded"]
    # At about three times capacity the guard refuses basic work; without it nothing is refused.
    assert guarded["basic"]["rejected"] > 0
    assert unguarded["all"]["rejected"] == 0
    # ... and what it admits starts sooner: the strongest effect, clear even in the short run
    # (about 0.6 s against 1.9 s at p95).
    assert guarded["all"]["ttft_p95_s"] is not None
    assert unguarded["all"]["ttft_p95_s"] is not None
    assert guarded["all"]["ttft_p95_s"] < unguarded["all"]["ttft_p95_s"]
    # Per-user speed of the slowest streams: in the short run the guard has little time to act,
    # so only require that it is not made clearly worse.
    assert guarded["all"]["user_tps_p5"] is not None
    assert unguarded["all"]["user_tps_p5"] is not None
    assert guarded["all"]["user_tps_p5"] >= 0.9 * unguarded["all"]["user_tps_p5"]
