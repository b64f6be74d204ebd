"""The policy benchmark: every admission policy in every cell of the matrix, in virtual time.

Run: ``python bench/policy.py`` (``nox -s policy``). For each cell of {Azure conversation,
Mooncake} x rate {1, 2, 4} x profile {a100-qwen2-7b, 2xa100-tp2-qwen2.5-32b, a100-qwen2-7b-kv5g}
and the slowdown cell (conversation, 2x, the engine 8x slower for 5 minutes from minute 20), it
prints one table: no policy, the best static cap in hindsight (swept over 4 ... 128), PIG's
learner (``guard``) and the predictive learner, with goodput (strict: TTFT <= 1 s; prompt-aware:
TTFT <= 1 s plus the request's own unloaded prefill; both with >= 20 tok/s), the admitted users'
tok/s p5 / p50, TTFT p95 (from arrival, waits included) and the same beyond each request's
unloaded prefill ("TTFT+"), and the reject rates per tier. Then the
ratios predictive / best static and predictive / PIG per cell, their means, and each cell's
missed acceptance criteria. Nothing is asserted; the exit status is 0.

Options: ``--duration S`` keeps the first S seconds of each trace (after rate scaling),
``--cells TEXT`` runs the cells whose name contains TEXT, ``--jobs N`` runs cells in N processes
(default: the number of CPUs), ``--plot DIR`` writes a PNG per cell (cap and engine load over
time for PIG's learner and the predictive one; needs matplotlib), ``--json FILE`` the results.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

import attrs

from guard_adapters.policy_matrix import (
    PREMIUM_SHARE,
    Cell,
    CellResult,
    PolicyRow,
    default_cells,
    load_cell_trace,
    run_cell,
)
from guard_adapters.simulation import simulate
from guard_trio._cli_support import figure as _cell
from guard_trio._cli_support import table as _table

TRACE_DIR = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "traces"


def _policy_line(label: str, row: PolicyRow) -> tuple[str, ...]:
    return (
        label,
        f"{row.goodput_per_s:.2f}",
        f"{row.goodput_prompt_aware_per_s:.2f}",
        _cell(row.user_tps_p5, 1),
        _cell(row.user_tps_p50, 1),
        _cell(row.ttft_p95_s, 2),
        _cell(row.ttft_excess_p95_s, 2),
        f"{100 * row.premium_reject_rate:.1f}",
        f"{100 * row.basic_reject_rate:.1f}",
    )


def render(result: CellResult) -> str:
    header = (
        "policy",
        "goodput/s",
        "goodput PA/s",
        "tok/s p5",
        "tok/s p50",
        "TTFT p95",
        "TTFT+ p95",
        "prem rej %",
        "basic rej %",
    )
    rows = [
        header,
        _policy_line("none", result.none),
        _policy_line(f"best static ({result.best_static.policy})", result.best_static),
        _policy_line("guard (PIG)", result.pig),
        _policy_line("predictive", result.predictive),
    ]
    text = [f"== {result.cell.name}", _table(rows)]
    notes = (
        f"predictive / best static {result.versus_static:.3f}, predictive / PIG"
        f" {result.versus_pig:.3f}; premium demand alone"
        f" {'below' if result.premium_below_capacity else 'at or above'} capacity"
    )
    if result.cell.slowdowns:
        notes += f"; cap down after {result.cap_down_polls} polls, back {result.cap_back_s} s"
        notes += " after the slowdown ended"
    text.append(notes)
    missed = result.failures()
    text.append("missed: " + "; ".join(missed) if missed else "all criteria met")
    return "\n".join(text) + "\n"


def _plot(result: CellResult, directory: Path) -> Path | None:
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        return None
    matplotlib.use("Agg")
    pyplot = importlib.import_module("matplotlib.pyplot")
    trace = load_cell_trace(result.cell, TRACE_DIR)
    figure, (cap_axes, inflight_axes, load_axes) = pyplot.subplots(
        3, 1, figsize=(11, 8), sharex=True
    )
    for policy in ("guard", "predictive", f"{result.best_static.policy}"):
        run = simulate(
            trace,
            policy,
            profile=result.cell.profile,
            premium_share=PREMIUM_SHARE,
            slowdowns=result.cell.slowdowns,
        )
        at = [p.at for p in run.series]
        cap_axes.plot(
            at, [math.nan if p.cap is None else p.cap for p in run.series], label=policy, lw=0.8
        )
        inflight_axes.plot(at, [p.inflight for p in run.series], label=policy, lw=0.8)
        load_axes.plot(
            at,
            [math.nan if p.user_tps is None else p.user_tps for p in run.series],
            label=policy,
            lw=0.8,
        )
    cap_axes.set_title(f"{result.cell.name}: admission cap")
    inflight_axes.set_title("admitted requests in flight")
    load_axes.set_title("mean per-user tok/s")
    load_axes.axhline(20, color="grey", lw=0.5)
    load_axes.set_xlabel("simulated seconds")
    for axes in (cap_axes, inflight_axes, load_axes):
        axes.grid(alpha=0.3)
        axes.legend()
    directory.mkdir(parents=True, exist_ok=True)
    name = result.cell.name.replace(" ", "_").replace(":", "").replace("/", "")
    path = directory / f"{name}.png"
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    pyplot.close(figure)
    return path


def _run(cell: Cell) -> CellResult:
    return run_cell(cell, TRACE_DIR)


def _as_json(result: CellResult) -> dict[str, Any]:
    return {
        "cell": result.cell.name,
        "rows": [attrs.asdict(row) for row in result.rows],
        "best_static": result.best_static.policy,
        "versus_static": result.versus_static,
        "versus_pig": result.versus_pig,
        "premium_below_capacity": result.premium_below_capacity,
        "cap_down_polls": result.cap_down_polls,
        "cap_back_s": result.cap_back_s,
        "missed": result.failures(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--duration", type=float, default=None, metavar="S")
    parser.add_argument("--cells", default="", metavar="TEXT")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, metavar="N")
    parser.add_argument("--plot", type=Path, default=None, metavar="DIR")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE")
    args = parser.parse_args(argv)
    cells = [c for c in default_cells(duration_s=args.duration) if args.cells in c.name]
    print(f"policy benchmark: {len(cells)} cells, Python {sys.version.split()[0]}", flush=True)
    started = time.monotonic()
    results: list[CellResult] = []
    with multiprocessing.get_context("spawn").Pool(max(1, args.jobs)) as pool:
        for done, result in enumerate(pool.imap(_run, cells), start=1):
            results.append(result)
            elapsed = time.monotonic() - started
            sys.stderr.write(f"[{done}/{len(cells)}] {result.cell.name} ({elapsed:.0f} s)\n")
            print(render(result), flush=True)
            if args.plot is not None:
                path = _plot(result, args.plot)
                print(f"wrote {path}" if path else "--plot needs matplotlib", flush=True)
    summary: list[tuple[str, ...]] = [
        ("cell", "best static", "PA vs static", "PA vs PIG", "p5", "missed")
    ]
    for result in results:
        summary.append(
            (
                result.cell.name,
                result.best_static.policy,
                f"{result.versus_static:.3f}",
                f"{result.versus_pig:.3f}",
                _cell(result.predictive.user_tps_p5, 1),
                str(len(result.failures())),
            )
        )
    print(_table(summary))
    finite = [r.versus_pig for r in results if math.isfinite(r.versus_pig)]
    if finite:
        print(f"mean predictive / PIG over {len(finite)} cells: {sum(finite) / len(finite):.3f}")
    print(f"cells meeting every criterion: {sum(not r.failures() for r in results)}/{len(results)}")
    if args.json is not None:
        args.json.write_text(json.dumps([_as_json(r) for r in results], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
