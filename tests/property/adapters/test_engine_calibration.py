"""The engine's profiles against the published vLLM benchmark runs they were fitted to.

Each benchmark row is replayed in the simulated engine the way ``benchmark_serving.py`` ran it:
``num_prompts`` requests sent at t=0 with the row's input and output lengths. The simulated mean
per-user decode speed (1000 / mean TPOT, TPOT being the time from first to last token divided by
the tokens after the first) and mean TTFT must be within 15 % of the measured ones, for the rows
and metrics listed in ``CLAIMS``. Run with ``-s`` to see the whole table.

Why rows or metrics are left out
--------------------------------
The runs were made with vLLM's prefix cache on and a fixed dataset seed, so a run repeats the first
prompts of the previous, larger run on the same server. The engine logs quoted next to each result
in the source (its README) give the order of the runs, the server process and the cache hit rate:

* a row whose prompts were *all* cached has a TTFT that is HTTP and API-server time (20-240 ms),
  which the engine does not model: TTFT not compared, TPOT still is (cached rows replay with
  ``cached_prompt_tokens`` set for those requests, so their prefill is skipped as in vLLM);
* a row with *some* cached prompts replays with that many cached requests (``cached``) when the
  log's hit rate confirms the count; where it does not, or where preempted sequences were
  recomputed from the cache (high hit rates under KV pressure), TTFT is not compared;
* rows where fewer requests succeeded than were sent report means over an unknown subset: TTFT
  not compared;
* whole tests without a profile: Test 1 (tensor parallel across two nodes over the network),
  Tests 2 and 3 (7B tensor-parallel on two GPUs: not fitted yet), Test 8 (72B tensor-parallel:
  the same model form missed the KV-bound rows by up to 18 %), Test 9 (gpt-oss-120b across four
  nodes: requests stopped after 64-300 tokens and TPOT of seconds).
"""

from __future__ import annotations

import csv
import functools
import statistics
from pathlib import Path

import attrs
import pytest

from guard_adapters.engine_model import PROFILES, Engine, EngineProfile, SimRequest

CSV_PATH = (
    Path(__file__).parents[2] / "fixtures/capacity/dennislee22-vllm-a100-benchmark-serving.csv"
)
TOLERANCE = 0.15
BLOCK = 16  # vLLM's KV block: a fully cached prompt still computes its last block


@attrs.frozen
class Row:
    """One claimed benchmark row: identified by test number and size, plus how to replay it."""

    prompts: int
    cached: int = 0  # leading requests whose prompt the previous run left in the prefix cache
    ttft: bool = True  # compare TTFT too (TPOT is always compared)
    why: str = ""  # why TTFT is not compared, or where ``cached`` comes from


@attrs.frozen
class Claim:
    test: str  # the CSV ``section`` starts with "Test N:"
    rows: tuple[Row, ...]
    input_len: int = 1024
    output_len: int = 1024


ALL_CACHED = "all prompts cached by the previous run: TTFT is API-server time"
CLAIMS: dict[str, Claim] = {
    "a100-qwen2-7b": Claim(
        "Test 5",
        (
            Row(1, cached=1, ttft=False, why=ALL_CACHED),
            Row(10, why="first run on its server"),
            Row(20, cached=20, ttft=False, why=ALL_CACHED),
            Row(30, cached=30, ttft=False, why=ALL_CACHED),
            Row(50, why="first run on its server"),
            Row(75, cached=10, why="after the 10-prompt run (hit rate 13.6 % = 10/75)"),
            Row(100, why="first run on its server"),
            Row(200, cached=100, ttft=False, why="half cached (33 %): median TTFT is API time"),
            Row(500, cached=200, ttft=False, why="hit rate 47 % from recomputed preemptions"),
            Row(1000, ttft=False, why="924 of 1000 requests succeeded"),
        ),
    ),
    "a100-qwen2-7b-kv5g": Claim(
        "Test 4",
        (
            Row(1, cached=1, ttft=False, why=ALL_CACHED),
            Row(10, why="first run on its server"),
            Row(20, cached=10, ttft=False, why="partly cached; TTFT not monotone in load"),
            Row(30, cached=20, ttft=False, why="partly cached; TTFT not monotone in load"),
            Row(50, cached=30, ttft=False, why="partly cached; TTFT not monotone in load"),
            Row(75, cached=50, ttft=False, why="partly cached; TTFT not monotone in load"),
            Row(100, why="queueing for KV dominates TTFT"),
            Row(200, why="queueing for KV dominates TTFT"),
            Row(500, why="first run on its server; queueing for KV"),
            Row(1000, ttft=False, why="894 of 1000 requests succeeded"),
        ),
    ),
    "a100-qwen2.5-32b": Claim(
        "Test 7",
        (
            Row(10, why="first run on its server (hit rate 8.9 %)"),
            Row(50, cached=10, why="after the 10-prompt run"),
            Row(75, why="the 40k-token cache kept little of the previous run"),
            Row(100, why="first run on its server"),
        ),
    ),
    "2xa100-tp2-qwen2.5-32b": Claim(
        "Test 6",
        (
            Row(1, ttft=False, why="61 ms for 1024 tokens of 32B: served from the cache"),
            Row(10, cached=1, why="after the 1-prompt run"),
            Row(15, cached=15, ttft=False, why=ALL_CACHED),
            Row(20, cached=20, ttft=False, why=ALL_CACHED),
            Row(30, why="after the 100-prompt run whose churn evicted the prompts"),
            Row(50, cached=10, why="after the 10-prompt run"),
            Row(100, why="queueing for KV dominates TTFT"),
        ),
    ),
}


@attrs.frozen
class Outcome:
    profile: str
    row: Row
    measured_tok_s: float
    simulated_tok_s: float
    measured_ttft: float
    simulated_ttft: float

    @property
    def tok_s_error(self) -> float:
        return self.simulated_tok_s / self.measured_tok_s - 1

    @property
    def ttft_error(self) -> float:
        return self.simulated_ttft / self.measured_ttft - 1


def load_rows() -> list[dict[str, str]]:
    with CSV_PATH.open(newline="", encoding="utf-8") as stream:
        return list(csv.DictReader(stream))


def find(rows: list[dict[str, str]], claim: Claim, prompts: int) -> dict[str, str]:
    found = [
        r
        for r in rows
        if r["section"].startswith(claim.test + ":")
        and int(r["num_prompts"]) == prompts
        and int(r["random_input_len"]) == claim.input_len
        and int(r["random_output_len"]) == claim.output_len
    ]
    assert len(found) == 1, (claim.test, prompts)
    return found[0]


def replay(
    profile: EngineProfile, prompts: int, input_len: int, output_len: int, cached: int
) -> tuple[float, float]:
    """Mean TPOT and mean TTFT (seconds) of one benchmark burst in the engine."""
    engine = Engine(profile, token_events=False)
    hit = (input_len - 1) // BLOCK * BLOCK
    for rid in range(prompts):
        engine.submit(
            SimRequest(
                request_id=rid,
                prompt_tokens=input_len,
                max_output_tokens=output_len,
                cached_prompt_tokens=hit if rid < cached else 0,
            ),
            at=0.0,
        )
    first: dict[int, float] = {}
    ttfts: list[float] = []
    tpots: list[float] = []
    while (nxt := engine.next_event_at()) is not None:
        for event in engine.advance(nxt):
            if event.kind == "first_token":
                first[event.request_id] = event.at
                ttfts.append(event.at)
            elif event.kind == "finished":
                tpots.append((event.at - first[event.request_id]) / (output_len - 1))
    assert len(tpots) == prompts
    return statistics.fmean(tpots), statistics.fmean(ttfts)


@functools.cache
def outcomes(name: str) -> tuple[Outcome, ...]:
    claim = CLAIMS[name]
    rows = load_rows()
    result = []
    for row in claim.rows:
        measured = find(rows, claim, row.prompts)
        tpot, ttft = replay(
            PROFILES[name], row.prompts, claim.input_len, claim.output_len, row.cached
        )
        result.append(
            Outcome(
                profile=name,
                row=row,
                measured_tok_s=1000.0 / float(measured["mean_tpot_ms"]),
                simulated_tok_s=1.0 / tpot,
                measured_ttft=float(measured["mean_ttft_ms"]) / 1000.0,
                simulated_ttft=ttft,
            )
        )
    return tuple(result)


def table(name: str) -> str:
    claim = CLAIMS[name]
    lines = [
        f"{name}: {claim.test}, {claim.input_len}/{claim.output_len} tokens",
        f"{'prompts':>7} {'cached':>6} | {'tok/s meas':>10} {'sim':>6} {'err':>7} | "
        f"{'TTFT s meas':>11} {'sim':>8} {'err':>7}   note",
    ]
    for o in outcomes(name):
        mark = " " if o.row.ttft else "x"
        lines.append(
            f"{o.row.prompts:>7} {o.row.cached:>6} | {o.measured_tok_s:>10.1f} "
            f"{o.simulated_tok_s:>6.1f} {o.tok_s_error:>+7.1%} | {o.measured_ttft:>11.3f} "
            f"{o.simulated_ttft:>8.3f} {o.ttft_error:>+7.1%} {mark} {o.row.why}"
        )
    lines.append("(x: TTFT not compared)")
    return "\n".join(lines)


@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_profile_matches_its_benchmark_rows(name: str) -> None:
    print("\n" + table(name))
    misses = []
    for o in outcomes(name):
        if abs(o.tok_s_error) > TOLERANCE:
            misses.append(f"{o.row.prompts} prompts: per-user tok/s off by {o.tok_s_error:+.1%}")
        if o.row.ttft and abs(o.ttft_error) > TOLERANCE:
            misses.append(f"{o.row.prompts} prompts: mean TTFT off by {o.ttft_error:+.1%}")
    assert not misses, misses


def test_claims_cover_the_load_range() -> None:
    """The default profile is held to rows from one stream to far beyond its batch limit."""
    claim = CLAIMS["a100-qwen2-7b"]
    sizes = [row.prompts for row in claim.rows]
    assert min(sizes) == 1
    assert max(sizes) > 2 * PROFILES["a100-qwen2-7b"].max_num_seqs
    every = [
        int(r["num_prompts"]) for r in load_rows() if r["section"].startswith(claim.test + ":")
    ]
    assert sorted(every) == sorted(sizes)
    assert sum(row.ttft for row in claim.rows) >= 4


def test_fixture_is_the_published_table() -> None:
    rows = load_rows()
    assert len(rows) == 81
    assert {r["model"] for r in rows} >= {"Qwen2-7B-Instruct", "Qwen2.5-32B", "Qwen2-72B"}
