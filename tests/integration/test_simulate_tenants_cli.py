"""`simulate --tenants N --heavy-share F [--bands SPEC] [--unfair]`, run as a process."""

from __future__ import annotations

import json
from pathlib import Path

from tests.integration.test_simulate_cli import AZURE, cli

FAIRNESS_KEYS = {
    "jain_index_light",
    "light_reject_rate",
    "heavy_reject_rate",
    "light_goodput_per_s",
    "heavy_goodput_per_s",
}


def test_tenants_add_a_fairness_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    common = ("--trace", str(AZURE), "--policy", "guard", "--rate-scale", "2", "--duration", "60")
    result = cli(
        *common,
        "--tenants",
        "5",
        "--heavy-share",
        "0.4",
        "--bands",
        "premium:reserve=0.1,standard,batch:wait=0",
        "--premium-share",
        "0.1",
        "--json",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    assert "tenants: Jain index" in result.stdout
    assert "bands premium,standard,batch" in result.stdout
    document = json.loads(out.read_text(encoding="utf-8"))
    entry = document["policies"]["guard"]
    assert set(entry["fairness"]) == FAIRNESS_KEYS
    assert [row["tenant"] for row in entry["tenants"]] == [f"t{i}" for i in range(5)]
    assert sum(row["requests"] for row in entry["tenants"]) == entry["all"]["requests"]
    assert document["run"]["tenant_fairness"] is True
    assert document["run"]["bands"] == ["premium", "standard", "batch"]


def test_without_tenants_the_json_has_no_fairness(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    result = cli("--trace", str(AZURE), "--policy", "guard", "--duration", "30", "--json", str(out))
    assert result.returncode == 0, result.stderr
    document = json.loads(out.read_text(encoding="utf-8"))
    assert "fairness" not in document["policies"]["guard"]
    assert document["run"]["bands"] is None


def test_bad_flags_exit_2() -> None:
    for flags in (
        ("--tenants", "1"),
        ("--heavy-share", "1"),
        ("--bands", "a:reserve=x"),
        ("--tenants", "5", "--heavy-keep", "0"),
        ("--heavy-share", "0.3"),  # a heavy tenant needs --tenants
        ("--heavy-keep", "0.5"),
    ):
        result = cli("--trace", str(AZURE), *flags)
        assert result.returncode == 2, flags
