"""``replay --explain ID``: a refused request, found by its X-Request-Id in a live recording,
is told with the rule that refused it and the figures that rule read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio

from guard_adapters.config import load_config
from guard_adapters.recording import open_for_reading, read_records
from guard_adapters.request_story import explain_request

CHAT = "/v1/chat/completions"
_BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":40,"stream":true}'


def _replay_cli(*args: str) -> subprocess.CompletedProcess[str]:
    keep = ("PATH", "HOME", "PYTHONPATH")
    return subprocess.run(
        [sys.executable, "-m", "guard_trio", "replay", *args],
        env={k: v for k, v in os.environ.items() if k in keep},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_a_refusal_is_explained_by_its_request_id(
    start_sim: Any, http: Any, until: Any, tmp_path: Path, nursery: trio.Nursery
) -> None:
    from guard_trio._recorder import Recorder
    from guard_trio._server import GuardServer

    sim, _ = await start_sim(max_num_seqs=4)
    settings = load_config(
        {
            "LISTEN": "127.0.0.1:0",
            "UPSTREAM": sim,
            "DYNAMIC_PIG_ENABLED": "false",
            "GLOBAL_LIMIT": "3",  # one slot is kept for premium: basic may hold 2
            "PIG_QUEUE_WAIT_SECONDS": "0",
        }
    )
    path = tmp_path / "live.jsonl"
    recorder = Recorder(path, config=settings.redacted(), producer="test")
    server = GuardServer(settings, on_event=recorder.event, on_poll=recorder.poll)
    nursery.start_soon(recorder.run)
    host, port = await nursery.start(server.serve)
    guard = f"http://{host}:{port}"

    statuses: dict[str, int] = {}

    async def stream(name: str) -> None:
        reply = await http.request(guard, "POST", CHAT, [("X-Request-Id", name)], _BODY)
        statuses[name] = reply.status

    async with trio.open_nursery() as clients:
        for name in ("held-1", "held-2"):
            clients.start_soon(stream, name)
        await until(lambda: server.engine.state.gate.inflight == 2)
        refused = await http.request(guard, "POST", CHAT, [("X-Request-Id", "turned-away")], _BODY)
        assert refused.status == 429
    assert statuses == {"held-1": 200, "held-2": 200}
    await recorder.aclose()

    with open_for_reading(path) as source:
        items = list(read_records(source, strict=True))
    story = explain_request(items[1:], settings.guard_config(), "turned-away")  # type: ignore[arg-type]
    assert story is not None
    assert story.verdict == "refused: tier_basic_limit"
    (attempt,) = [step for step in story.steps if step.outcome is not None]
    assert attempt.basic_inflight == 2
    assert attempt.rule == (
        "basic requests held 2 of the 2 slots not reserved for premium (cap 3, 0 premium in flight)"
    )
    assert explain_request(items[1:], settings.guard_config(), "nobody") is None  # type: ignore[arg-type]

    text = _replay_cli(str(path), "--explain", "turned-away")
    assert text.returncode == 0, text.stderr
    assert "verdict: refused: tier_basic_limit" in text.stdout
    assert "rule: basic requests held 2 of the 2 slots" in text.stdout
    as_json = _replay_cli(str(path), "--explain", "held-1", "--json")
    assert as_json.returncode == 0, as_json.stderr
    document = json.loads(as_json.stdout)
    assert document["trace_id"] == "held-1"
    assert document["verdict"] == "admitted"
    assert [s["event"] for s in document["steps"]][:2] == ["arrived", "forwarded"]
    missing = _replay_cli(str(path), "--explain", "nobody")
    assert missing.returncode == 1
    assert "no request 'nobody'" in missing.stderr
