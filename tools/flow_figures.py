"""Measure tenant fairness with ``simulate`` (docs/flow-control.md's tables).

``python tools/flow_figures.py [--quick] [--policy=guard|predictive|static40 ...]``: for each
trace and policy, a heavy tenant (``t0``) sending 2x and 4x what each of the 9 light tenants
sends, run without tenant fairness (``--unfair``), with it, and as the balanced reference (the
heavy tenant at 1x, the rate lowered so the light tenants send exactly as much as in the heavy
run); then the same with three bands. Prints one Markdown row per run, one simulation at a
time (each a few CPU seconds).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "tests/fixtures/traces"
TENANTS = 10
#: (name, trace, rate scale, engine profile, duration): each overloaded about 1.3 to 3x.
RUNS = (
    ("azure/7b", TRACES / "azure-llm-2023-conv.csv", 1.5, "a100-qwen2-7b", 600),
    ("azure/7b-kv5g", TRACES / "azure-llm-2023-conv.csv", 1.5, "a100-qwen2-7b-kv5g", 600),
    (
        "mooncake/7b",
        TRACES / "mooncake-fast25-conversation-trace.jsonl",
        0.3,
        "a100-qwen2-7b",
        1200,
    ),
)
#: (label, policy, settings): PIG's learner, the predictive one, and a fixed cap of 40 slots
#: (no learner: the fairness mechanism alone, with no cap moving under it).
POLICIES = (
    ("guard", "guard", ()),
    ("predictive", "predictive", ()),
    ("static40", "guard", ("--set", "DYNAMIC_PIG_ENABLED=false", "--set", "DYNAMIC_POLICY=pig",
                           "--set", "GLOBAL_LIMIT=40")),
)  # fmt: skip
BANDS = "premium:reserve=0.1,standard,batch:wait=0"


def simulate(
    run: tuple[str, Path, float, str, int], policy: str, rate: float, share: float, *extra: str
) -> dict[str, Any]:
    _name, trace, _rate, profile, duration = run
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "run.json"
        command = [
            sys.executable, "-m", "guard_trio", "simulate", "--trace", str(trace),
            "--policy", policy, "--rate-scale", f"{rate:.4f}", "--duration", str(duration),
            "--profile", profile,
            "--tenants", str(TENANTS), "--heavy-share", f"{share:.4f}", "--json", str(out),
            *extra,
        ]  # fmt: skip
        subprocess.run(command, check=True, capture_output=True, cwd=ROOT)
        result: dict[str, Any] = json.loads(out.read_text())["policies"][policy]
        return result


def row(label: str, entry: dict[str, Any], light_demand: float | None = None) -> str:
    fair = entry["fairness"]
    total = entry["all"]
    implied = ""
    if light_demand:
        share = total["admitted"] / TENANTS
        implied = f"{max(0.0, 1 - share / light_demand):.3f}"
    return (
        f"| {label} | {fair['light_reject_rate']:.3f} | {fair['heavy_reject_rate']:.3f} |"
        f" {implied} | {fair['jain_index_light']:.3f} | {fair['light_goodput_per_s']:.2f} |"
        f" {fair['heavy_goodput_per_s']:.2f} | {total['goodput_per_s']:.2f} |"
    )


def main(argv: list[str]) -> int:
    runs = RUNS[:1] if "--quick" in argv else RUNS
    only = [arg.removeprefix("--policy=") for arg in argv if arg.startswith("--policy=")]
    print("| run | light reject | heavy reject | fluid fair-share light reject | Jain light |"
          " light goodput/s | heavy goodput/s | total goodput/s |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for run in runs:
        name, _trace, rate, _profile, _duration = run
        for label_of_policy, policy, settings in POLICIES:
            if only and label_of_policy not in only:
                continue
            for given in ((), ("--bands", BANDS, "--premium-share", "0.1")):
                bands = (*given, *settings)
                tag = " 3 bands" if given else ""
                for times in (2, 4):
                    share = times / (TENANTS - 1 + times)
                    balanced_rate = rate * (1 - share) / (1 - 1 / TENANTS)
                    label = f"{name} {label_of_policy}{tag} heavy {times}x"
                    unfair = simulate(run, policy, rate, share, "--unfair", *bands)
                    fair = simulate(run, policy, rate, share, *bands)
                    light = [t for t in fair["tenants"] if t["tenant"] != "t0"]
                    demand = sum(t["requests"] for t in light) / len(light)
                    print(row(f"{label}, unfair", unfair), flush=True)
                    print(row(f"{label}, fair", fair, demand), flush=True)
                    balanced = simulate(run, policy, balanced_rate, 1 / TENANTS, "--unfair", *bands)
                    print(row(f"{label}, balanced reference", balanced), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
