"""Measure tenant fairness with ``simulate`` (docs/flow-control.md's tables).

``python tools/flow_figures.py [--quick] [--policy=fixed|guard|predictive ...] [--run=NAME ...]
[--seed=N] [--jobs=N] [--set VAR=VALUE ...]``: for each trace and policy, a heavy tenant
(``t0``) sending 2x and 4x what each of the 9 light tenants sends, alone in its band or with
three bands, run six ways:

- *unfair*: the same labels, tenant fairness off (the baseline of the goodput criterion);
- *rank only*: tenant fairness with ``PIG_TENANT_SPARE=0`` (ranked waiters, no spare slots);
- *fair*: tenant fairness with the settings given (the defaults unless ``--set``);
- *balanced*: the heavy tenant sending only its share (1x), the rate lowered so the light
  tenants send exactly what they send in the heavy run, fairness off: what the light tenants
  see when the heavy one keeps to its share. A *reachable reference*;
- *matched*: the fair run's own requests with the heavy tenant's surplus dropped (each of its
  requests kept with chance 1/2 or 1/4, ``--heavy-keep``), fairness off: the very same light
  requests, the heavy tenant at its share. The other reachable reference, printed with its
  goodput change against the unfair run, since dropping the surplus also drops its good work.
- *share*: tenant fairness with strict shares (``PIG_TENANT_LEND=false``): every tenant held to
  its weighted fair share of the band's slots, nothing lent. The reject rate each tenant's fair
  share gives it when it gets exactly that share; printed with its goodput change.

and prints one Markdown row per case, with the *fluid* reference beside it: the light reject
rate that splitting the fair run's admissions max-min fairly by demand would give (water
filling: every tenant gets ``min(its requests, L)`` with ``L`` such that the sum is what the
fair run admitted), the figure a system without timing losses would reach; a loss system with
a 0.5 s wait and requests that hold a slot for seconds cannot. ``met`` says which references
the fair run's light reject rate is at or below. Beside the fair run's Jain index over the
light tenants stands, in brackets, the index they would score *by chance alone* if every light
request had the same chance of being good: with few requests per tenant a perfectly fair
server scores below 1. ``--jobs=N`` runs N simulations at a time (a few CPU seconds each; one
by default); the rows come out in the same order.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from guard_adapters.fairness_results import TenantRow, chance_jain_index

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "tests/fixtures/traces"
TENANTS = 10
HEAVY = "t0"
#: (name, trace, rate scale, engine profile, duration, fixed cap): each overloaded about 1.3 to
#: 3x; the fixed cap is one that binds on that trace (Mooncake's requests are few and long:
#: at x0.3 not even 10 slots fill, at x0.6 20 slots do and refuse about 12 % of the requests).
RUNS = (
    ("azure/7b", TRACES / "azure-llm-2023-conv.csv", 1.5, "a100-qwen2-7b", 600, 40),
    ("azure/7b-kv5g", TRACES / "azure-llm-2023-conv.csv", 1.5, "a100-qwen2-7b-kv5g", 600, 40),
    (
        "mooncake/7b",
        TRACES / "mooncake-fast25-conversation-trace.jsonl",
        0.6,
        "a100-qwen2-7b",
        1200,
        20,
    ),
)
#: The policies: a fixed cap (no learner: the fairness mechanism alone, with no cap moving
#: under it), PIG's learner and the predictive one.
POLICIES = ("fixed", "guard", "predictive")
BANDS = "premium:reserve=0.1,standard,batch:wait=0"

Run = tuple[str, Path, float, str, int, int]


def _policy_args(run: Run, policy: str) -> tuple[str, ...]:
    if policy == "fixed":
        cap = run[5]
        return ("--policy", "guard", "--set", "DYNAMIC_PIG_ENABLED=false",
                "--set", "DYNAMIC_POLICY=pig", "--set", f"GLOBAL_LIMIT={cap}")  # fmt: skip
    return ("--policy", policy)


def simulate(run: Run, policy: str, rate: float, share: float, *extra: str) -> dict[str, Any]:
    _name, trace, _rate, profile, duration, _cap = run
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "run.json"
        command = [
            sys.executable, "-m", "guard_trio", "simulate", "--trace", str(trace),
            *_policy_args(run, policy), "--rate-scale", f"{rate:.4f}",
            "--duration", str(duration), "--profile", profile,
            "--tenants", str(TENANTS), "--heavy-share", f"{share:.4f}", "--json", str(out),
            *extra,
        ]  # fmt: skip
        subprocess.run(command, check=True, capture_output=True, cwd=ROOT)
        document: dict[str, Any] = json.loads(out.read_text())
        result: dict[str, Any] = next(iter(document["policies"].values()))
        return result


def water_level(demands: list[int], capacity: float) -> float:
    """The level ``L`` with ``sum(min(d, L)) == capacity`` (every demand when it suffices)."""
    ordered = sorted(demands)
    left = capacity
    for index, demand in enumerate(ordered):
        rest = len(ordered) - index
        if demand * rest >= left:
            return left / rest
        left -= demand
    return float(ordered[-1]) if ordered else 0.0


def fluid_light_reject(entry: dict[str, Any]) -> float:
    """The light tenants' reject rate under a max-min split of ``entry``'s admissions."""
    demands: dict[str, int] = {row["tenant"]: row["requests"] for row in entry["tenants"]}
    level = water_level(list(demands.values()), float(entry["all"]["admitted"]))
    light = [d for tenant, d in demands.items() if tenant != HEAVY and d > 0]
    return sum(1 - min(d, level) / d for d in light) / len(light)


def chance_jain(entry: dict[str, Any]) -> float:
    """The Jain index the light tenants of ``entry`` would score by chance alone, served alike
    (:func:`~guard_adapters.fairness_results.chance_jain_index`)."""
    fields = ("tenant", "requests", "rejected", "good", "goodput_per_s")
    light = [row for row in entry["tenants"] if row["tenant"] != HEAVY]
    index = chance_jain_index([TenantRow(**{key: row[key] for key in fields}) for row in light])
    return 1.0 if index is None else index


def row(label: str, cases: dict[str, dict[str, Any]]) -> str:
    fair = cases["fair"]
    light = {k: v["fairness"]["light_reject_rate"] for k, v in cases.items()}
    heavy = {k: v["fairness"]["heavy_reject_rate"] for k, v in cases.items()}
    good = {k: v["all"]["goodput_per_s"] for k, v in cases.items()}
    fluid = fluid_light_reject(fair)
    references = (
        ("balanced", light["balanced"]),
        ("matched", light["matched"]),
        ("share", light["share"]),
        ("fluid", fluid),
    )
    met = [name for name, ref in references if light["fair"] <= ref + 1e-9]

    def change_of(case: str) -> float:
        return 100 * (good[case] / good["unfair"] - 1) if good["unfair"] else 0.0

    change = change_of("fair")
    return (
        f"| {label} | {light['unfair']:.3f} / {light['ranked']:.3f} / **{light['fair']:.3f}**"
        f" | {light['balanced']:.3f} | {light['matched']:.3f} ({change_of('matched'):+.1f} %)"
        f" | {light['share']:.3f} ({change_of('share'):+.1f} %)"
        f" | {fluid:.3f} | {', '.join(met) or 'none'}"
        f" | {heavy['unfair']:.3f} / {heavy['fair']:.3f}"
        f" | {fair['fairness']['jain_index_light']:.3f} ({chance_jain(fair):.3f})"
        f" | {good['unfair']:.2f} / {good['ranked']:.2f} / {good['fair']:.2f}"
        f" ({change:+.1f} %) |"
    )


def main(argv: list[str]) -> int:
    runs = RUNS[:1] if "--quick" in argv else RUNS
    only = [arg.removeprefix("--policy=") for arg in argv if arg.startswith("--policy=")]
    names = [arg.removeprefix("--run=") for arg in argv if arg.startswith("--run=")]
    settings: list[str] = []
    seeds = [arg.removeprefix("--seed=") for arg in argv if arg.startswith("--seed=")]
    seeded = ("--seed", seeds[-1]) if seeds else ()
    jobs = [int(arg.removeprefix("--jobs=")) for arg in argv if arg.startswith("--jobs=")]
    for index, arg in enumerate(argv):
        if arg == "--set":
            settings += ["--set", argv[index + 1]]
    print("| case | light reject: unfair / rank only / fair | balanced ref. |"
          " matched ref. (goodput) | share ref. (goodput) | fluid ref. | met |"
          " heavy reject: unfair / fair | Jain light (by chance) |"
          " goodput/s: unfair / rank only / fair |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    pending: list[tuple[str, dict[str, Future[dict[str, Any]]]]] = []
    with ThreadPoolExecutor(max_workers=max(1, jobs[-1] if jobs else 1)) as pool:
        for run in runs:
            name, _trace, rate, _profile, _duration, cap = run
            if names and name not in names:
                continue
            for policy in POLICIES:
                if only and policy not in only:
                    continue
                for bands in ((), ("--bands", BANDS, "--premium-share", "0.1")):
                    given = (*bands, *seeded)
                    tag = ", 3 bands" if bands else ""
                    for times in (2, 4):
                        share = times / (TENANTS - 1 + times)
                        balanced_rate = rate * (1 - share) / (1 - 1 / TENANTS)
                        shown = f"fixed {cap}" if policy == "fixed" else policy
                        cases = {
                            "unfair": (rate, share, "--unfair", *given),
                            "ranked": (rate, share, *given, *settings,
                                       "--set", "PIG_TENANT_SPARE=0"),
                            "fair": (rate, share, *given, *settings),
                            "balanced": (balanced_rate, 1 / TENANTS, "--unfair", *given),
                            "matched": (rate, share, "--unfair", "--heavy-keep",
                                        f"{1 / times:.4f}", *given),
                            "share": (rate, share, *given, *settings,
                                      "--set", "PIG_TENANT_LEND=false"),
                        }  # fmt: skip
                        futures = {
                            case: pool.submit(simulate, run, policy, *args)
                            for case, args in cases.items()
                        }
                        pending.append((f"{name} {shown}{tag}, heavy {times}x", futures))
        for label, futures in pending:
            results = {case: future.result() for case, future in futures.items()}
            print(row(label, results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
