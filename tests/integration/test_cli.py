"""The ``inference-guard`` command line, run as a real process."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import trio

from guard_adapters.recording import Header, Scrape, read_records

FIXTURES = Path(__file__).parents[1] / "fixtures"
EXAMPLE = FIXTURES / "recordings/example-vllm-overload.jsonl.gz"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "guard_trio", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_without_a_command_it_prints_help_and_exits_2() -> None:
    result = cli()
    assert result.returncode == 2
    assert "replay" in result.stderr
    assert "record" in result.stderr


def test_replay_prints_the_summary_and_reproduces_the_recording() -> None:
    result = cli("replay", str(EXAMPLE))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "150 polls over 150.0 s (settings: as recorded)" in out
    for heading in ("state", "cap: min 0", "final reason", "state reason", "admitted"):
        assert heading in out
    assert "polls whose decision differs from the recording: 0" in out


def test_a_lower_ttft_target_visibly_changes_the_decisions(tmp_path: Path) -> None:
    out_file = tmp_path / "decisions.jsonl"
    result = cli(
        "replay",
        str(EXAMPLE),
        "--set",
        "DYNAMIC_TTFT_TARGET_SECONDS=0.5",
        "--diff",
        "--out",
        str(out_file),
    )
    assert result.returncode == 0, result.stderr
    assert "settings: DYNAMIC_TTFT_TARGET_SECONDS=0.5" in result.stdout
    differing = [line for line in result.stdout.splitlines() if line.startswith("poll ")]
    assert differing
    assert "-> replayed cap" in differing[0]
    polls = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert len(polls) == 150
    assert {"at", "poll", "cap", "state", "reason", "reasons", "recorded"} <= set(polls[0])
    assert any(p["cap"] != p["recorded"]["cap"] for p in polls)


def test_replay_json_summary() -> None:
    result = cli("replay", str(EXAMPLE), "--json")
    summary = json.loads(result.stdout)
    assert summary["polls"] == 150
    assert summary["differing_polls"] == 0


def test_replay_under_the_predictive_learner_shows_its_explanation(tmp_path: Path) -> None:
    out_file = tmp_path / "decisions.jsonl"
    result = cli(
        "replay", str(EXAMPLE), "--set", "DYNAMIC_POLICY=predictive", "--out", str(out_file)
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "predictive learner: user tok/s predicted at the cap min" in out
    assert "engine model at the end: step" in out
    assert "ms per decoder" in out
    assert "relative error" in out
    assert "cap bound by" in out
    assert "refused by" in out
    polls = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert all(set(p["predicted"]) >= {"user_tps", "binding", "fit"} for p in polls)
    summary = json.loads(
        cli("replay", str(EXAMPLE), "--set", "DYNAMIC_POLICY=predictive", "--json").stdout
    )
    assert summary["predictive"]["polls"] == 150
    # Under PIG's learner none of it is printed.
    assert "predictive learner" not in cli("replay", str(EXAMPLE)).stdout


def test_malformed_lines_are_skipped_and_counted_or_stop_with_strict(tmp_path: Path) -> None:
    lines = gzip.decompress(EXAMPLE.read_bytes()).splitlines(keepends=True)
    lines.insert(40, b'{"kind": "scrape", "at": "later"}\n')
    lines.insert(80, b"this is not json\n")
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(b"".join(lines))
    result = cli("replay", str(broken))
    assert result.returncode == 0
    assert f"skipped {broken}:41: missing or non-numeric 'at'" in result.stderr
    assert f"{broken}:81: not JSON" in result.stderr
    assert "malformed lines skipped: 2" in result.stdout
    strict = cli("replay", str(broken), "--strict")
    assert strict.returncode == 1
    assert f"{broken}:41" in strict.stderr


def test_bad_settings_are_reported_with_exit_2() -> None:
    result = cli("replay", str(EXAMPLE), "--set", "GLOBAL_LIMIT=lots", "--set", "NOEQUALS")
    assert result.returncode == 2
    assert "NOEQUALS" in result.stderr or "GLOBAL_LIMIT" in result.stderr


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    result = cli("replay", str(tmp_path / "nope.jsonl"))
    assert result.returncode == 1
    assert "cannot read" in result.stderr


async def test_record_then_replay(tmp_path: Path, nursery: trio.Nursery) -> None:
    page = (FIXTURES / "metrics/sglang-0.4-docs-llama3.1-8b-under-load.prom").read_bytes()

    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            await stream.receive_some(65536)
            head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(page)}\r\nConnection: close\r\n\r\n"
            await stream.send_all(head.encode() + page)

    listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    out = tmp_path / "run.jsonl.gz"
    result = await trio.run_process(
        [
            sys.executable, "-m", "guard_trio", "record",
            "--metrics-url", f"http://127.0.0.1:{port}/metrics",
            "--interval-ms", "200", "--duration", "0.4", "--out", str(out),
        ],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    with gzip.open(out, "rb") as stream:
        items = list(read_records(stream, strict=True))
    assert isinstance(items[0], Header)
    scrapes = [item for item in items if isinstance(item, Scrape)]
    assert len(scrapes) == 3
    assert scrapes[0].flavour == "sglang"
    replayed = await trio.run_process(
        [sys.executable, "-m", "guard_trio", "replay", str(out), "--json"],
        capture_stdout=True,
        check=False,
    )
    summary = json.loads(replayed.stdout)
    assert summary["polls"] == 3
    # The SGLang docs page shows 2826 queued requests: intake stays closed.
    assert summary["final_reasons"] == {"backend_waiting": 3}
    nursery.cancel_scope.cancel()
