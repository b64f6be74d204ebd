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
    "goodput_prompt_aware_per_s",
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
    assert text.count("goodput PA/s") == 3
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


PROFILE = {
    "name": "my-l4",
    "max_num_seqs": 32,
    "kv_capacity_tokens": 60_000,
    "max_num_batched_tokens": 1024,
    "max_model_len": 8192,
    "step_base_s": 0.03,
    "decode_token_s": 0.0003,
    "prefill_token_s": 0.0002,
    "kv_token_s": 1e-7,
}


def test_an_operators_profile_file_and_slowdowns_drive_the_run(tmp_path: Path) -> None:
    profile = tmp_path / "l4.json"
    profile.write_text(json.dumps(PROFILE))
    runs = {}
    for name, extra in (
        ("plain", ()),
        ("slowed", ("--slowdown", "10:20:8", "--slowdown", "40:5:2")),
    ):
        out = tmp_path / f"{name}.json"
        result = cli(
            "--trace", str(AZURE), "--policy", "static:16", "--duration", "60",
            "--profile-file", str(profile), "--json", str(out), *extra,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert "engine my-l4" in result.stdout
        assert "goodput PA/s" in result.stdout
        runs[name] = json.loads(out.read_text())
    assert "engine x8 slower from 10 s for 20 s" in result.stdout
    plain, slowed = runs["plain"], runs["slowed"]
    assert plain["run"]["profile"] == slowed["run"]["profile"] == "my-l4"
    assert plain["run"]["profile_file"] == str(profile)
    assert plain["run"]["slowdowns"] == []
    assert slowed["run"]["slowdowns"] == [[10.0, 20.0, 8.0], [40.0, 5.0, 2.0]]
    before, after = plain["policies"]["static:16"]["all"], slowed["policies"]["static:16"]["all"]
    assert set(after) == TIER_KEYS
    assert after["goodput_prompt_aware_per_s"] >= after["goodput_per_s"]
    assert after["goodput_per_s"] < before["goodput_per_s"]
    assert after["user_tps_p5"] < before["user_tps_p5"]


def test_the_mooncake_trace_reports_prompt_aware_goodput(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    result = cli(
        "--trace", str(MOONCAKE), "--policy", "static:12", "--duration", "120",
        "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    row = json.loads(out.read_text())["policies"]["static:12"]["all"]
    # prompts of 12,000 tokens on average: many cannot start within 1 s even on an idle engine
    assert row["goodput_prompt_aware_per_s"] > row["goodput_per_s"]


def test_bad_profile_files_and_slowdowns_exit_2(tmp_path: Path) -> None:
    cases = {
        "unknown.json": (
            json.dumps(PROFILE | {"gpus": 2}),
            "unknown engine profile field(s): gpus",
        ),
        "negative.json": (json.dumps(PROFILE | {"step_base_s": -1}), "step_base_s"),
        "fraction.json": (json.dumps(PROFILE | {"max_num_seqs": 2.5}), "max_num_seqs"),
        "missing.json": (json.dumps({"name": "x"}), "missing max_num_seqs"),
        "list.json": ("[1, 2]", "must be a JSON object"),
        "broken.json": ("{", "is not JSON"),
    }
    for name, (text, expected) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        result = cli("--trace", str(AZURE), "--duration", "5", "--profile-file", str(path))
        assert result.returncode == 2, (name, result.stderr)
        assert expected in result.stderr, (name, result.stderr)
        assert str(path) in result.stderr
    absent = cli("--trace", str(AZURE), "--profile-file", str(tmp_path / "absent.json"))
    assert absent.returncode == 2
    assert "cannot read" in absent.stderr
    good = tmp_path / "good.json"
    good.write_text(json.dumps(PROFILE))
    both = cli("--trace", str(AZURE), "--profile", "a100-qwen2-7b", "--profile-file", str(good))
    assert both.returncode == 2
    assert "not allowed with argument" in both.stderr
    for bad, expected in (
        ("10:20", "AT_S:DURATION_S:FACTOR"),
        ("a:b:c", "three numbers"),
        ("-1:5:2", "start"),
        ("1:0:2", "duration"),
        ("1:5:0", "factor"),
        ("1:5:nan", "factor"),
    ):
        # "=" keeps argparse from reading "-1:5:2" as an option
        result = cli("--trace", str(AZURE), "--duration", "5", f"--slowdown={bad}")
        assert result.returncode == 2, (bad, result.stderr)
        assert expected in result.stderr, (bad, result.stderr)
    overlap = cli(
        "--trace", str(AZURE), "--duration", "5", "--slowdown", "0:10:2", "--slowdown", "5:10:3"
    )
    assert overlap.returncode == 2
    assert "overlap" in overlap.stderr


def test_the_predictive_policy_runs_beside_pigs_and_takes_its_settings(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    result = cli(
        "--trace",
        str(AZURE),
        "--policy",
        "guard",
        "--policy",
        "predictive",
        "--rate-scale",
        "2",
        "--premium-share",
        "0.2",
        "--duration",
        "300",
        "--json",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    assert "policy guard:" in result.stdout
    assert "policy predictive:" in result.stdout
    assert "predicted_speed" in result.stdout  # the reason its polls set the cap
    policies = json.loads(out.read_text())["policies"]
    guard, predictive = policies["guard"]["all"], policies["predictive"]["all"]
    assert predictive["goodput_prompt_aware_per_s"] > guard["goodput_prompt_aware_per_s"]
    assert predictive["user_tps_p5"] >= 20
    bad = cli(
        "--trace", str(AZURE), "--policy", "predictive", "--set", "DYNAMIC_PREDICTIVE_KV_LIMIT=2"
    )
    assert bad.returncode == 2
    assert "DYNAMIC_PREDICTIVE_KV_LIMIT" in bad.stderr
