"""``inference-guard simulate`` run as a real process on a short prefix of a real trace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TRACES = Path(__file__).parents[1] / "fixtures/traces"
AZURE = TRACES / "azure-llm-2023-conv.csv"
MOONCAKE = TRACES / "mooncake-fast25-conversation-trace.jsonl"
TIER_KEYS = {
    "requests",
    "admitted",
    "rejected",
    "user_tps_p5",
    "user_tps_p50",
    "ttft_p50_s",
    "ttft_p95_s",
    "ttft_p99_s",
    "goodput_per_s",
}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "guard_trio", "simulate", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_three_policies_print_tables_and_write_the_json_summary(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    result = cli(
        "--trace",
        str(AZURE),
        "--policy",
        "none",
        "--policy",
        "static:32",
        "--policy",
        "guard",
        "--set",
        "DYNAMIC_TTFT_TARGET_SECONDS=0.8",
        "--rate-scale",
        "3",
        "--premium-share",
        "0.25",
        "--seed",
        "5",
        "--duration",
        "60",
        "--json",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    text = result.stdout
    for name in ("policy none:", "policy static:32:", "policy guard:"):
        assert name in text
    assert text.count("TTFT p95") == 3
    assert "cap set by (polls):" in text
    document = json.loads(out.read_text())
    assert list(document["policies"]) == ["none", "static:32", "guard"]
    for tiers in document["policies"].values():
        assert set(tiers) == {"all", "premium", "basic"}
        for row in tiers.values():
            assert set(row) == TIER_KEYS
        every, premium, basic = tiers["all"], tiers["premium"], tiers["basic"]
        assert every["requests"] == premium["requests"] + basic["requests"]
        assert every["admitted"] + every["rejected"] == every["requests"]
        assert premium["requests"] > 0
    assert document["policies"]["none"]["all"]["rejected"] == 0
    requests = document["policies"]["none"]["all"]["requests"]
    assert requests == document["run"]["requests"] > 0
    assert document["run"]["rate_scale"] == 3.0
    assert document["run"]["settings"] == ["DYNAMIC_TTFT_TARGET_SECONDS=0.8"]


def test_the_mooncake_format_runs_too(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    result = cli(
        "--trace", str(MOONCAKE), "--policy", "none", "--duration", "20", "--json", str(out)
    )
    assert result.returncode == 0, result.stderr
    document = json.loads(out.read_text())
    assert document["run"]["format"] == "mooncake-jsonl"
    assert set(document["policies"]) == {"none"}


def test_bad_input_is_reported_with_an_exit_code(tmp_path: Path) -> None:
    bad_policy = cli("--trace", str(AZURE), "--policy", "static:lots")
    assert bad_policy.returncode == 2
    assert "static:N" in bad_policy.stderr
    bad_setting = cli("--trace", str(AZURE), "--set", "GLOBAL_LIMIT=-3", "--duration", "5")
    assert bad_setting.returncode == 2
    assert "GLOBAL_LIMIT" in bad_setting.stderr
    broken = tmp_path / "broken.csv"
    broken.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "not a time,1,1\n"
        "2023-11-16 18:15:47.0,10,10\n"
    )
    lenient = cli("--trace", str(broken), "--policy", "none")
    assert lenient.returncode == 0, lenient.stderr
    assert f"skipped {broken}:3: " in lenient.stderr
    assert "1 malformed rows skipped" in lenient.stdout
    strict = cli("--trace", str(broken), "--policy", "none", "--strict")
    assert strict.returncode == 1
    assert f"{broken}:3: " in strict.stderr
    missing = cli("--trace", str(tmp_path / "absent.csv"))
    assert missing.returncode == 1
    assert "cannot read" in missing.stderr
