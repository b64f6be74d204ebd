"""Peers on the same work as the guard: sglang-router 0.3.2 and the LiteLLM proxy 1.108.7.

Run: ``python bench/bench_peers.py [--quick | --smoke] [--peers sglang-router,litellm]
[--peers-dir DIR] [--no-install]`` (also the last step of ``nox -s bench``).

Each peer that installs from PyPI gets its own virtual environment under ``--peers-dir``
(default ``.nox/peers``, ignored by git; ``$PIG_BENCH_PEERS_DIR`` also sets it), made on the first
run and reused after. The same phases as bench/bench_proxy.py (small POSTs with wrk at 32 and 128
connections; SSE streams at 50 events/s, 64 and 512 of them) run against the backend directly,
through the guard in static mode and through every peer that started, each in front of the same
fake backend (the one of bench_proxy.py, which also answers what sglang-router probes on a
worker: ``/health``,
``/server_info``, ``/model_info``, ``/get_load``, ``/v1/models``). The backend writes each event's
sequence number and clock reading into its content, because LiteLLM re-serialises every chunk;
the client then reads them from there on every path, so the figures compare like with like.

The guard and each peer are started pinned to the same single core; the backend and the load
generator share the others. A peer that cannot be installed or started is skipped with a line
that says why: this script never fails because of a peer. Asserts nothing and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import bench_proxy as bp

ROOT = Path(__file__).resolve().parent.parent


class Peer:
    """One peer: what to install, how to check it is there, how to start it."""

    def __init__(self, name: str, version: str, requirement: str, distribution: str) -> None:
        self.name = name
        self.version = version
        self.requirement = requirement
        self.distribution = distribution

    def venv(self, directory: Path) -> Path:
        return directory / f"{self.name}-{self.version}"


PEERS = {
    "sglang-router": Peer("sglang-router", "0.3.2", "sglang-router==0.3.2", "sglang-router"),
    "litellm": Peer("litellm", "1.108.7", "litellm[proxy]==1.108.7", "litellm"),
}
INSTALL_TIMEOUT_S = 900  # LiteLLM's proxy extra pulls in many packages (about 6 minutes)
START_TIMEOUT_S = {"sglang-router": 60.0, "litellm": 150.0}


def installed_version(python: Path, distribution: str) -> str | None:
    if not python.exists():
        return None
    code = f"import importlib.metadata as m; print(m.version({distribution!r}))"
    try:
        done = subprocess.run(
            [str(python), "-c", code], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def ensure_installed(peer: Peer, directory: Path, *, install: bool) -> tuple[Path | None, str]:
    """The peer's virtual environment (made and filled if needed), or None and why not."""
    venv = peer.venv(directory)
    python = venv / "bin" / "python"
    if installed_version(python, peer.distribution) == peer.version:
        return venv, f"installed in {venv}"
    if not install:
        return None, f"not installed in {venv} and --no-install was given"
    print(f"installing {peer.requirement} into {venv} ...", flush=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    steps = [
        ("python -m venv", [sys.executable, "-m", "venv", "--clear", str(venv)]),
        (f"pip install {peer.requirement}", [*pip, peer.requirement]),
    ]
    for what, step in steps:
        try:
            done = subprocess.run(
                step, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired:
            return None, f"`{what}` took over {INSTALL_TIMEOUT_S} s"
        except OSError as exc:
            return None, f"`{what}` could not run: {exc}"
        if done.returncode != 0:
            lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
            errors = [line for line in lines if "error" in line.lower()] or lines or ["no output"]
            return None, f"`{what}` failed: {errors[-1].strip()[:200]}"
    version = installed_version(python, peer.distribution)
    if version != peer.version:
        return None, f"installed, but {peer.distribution} reports version {version}"
    return venv, f"installed in {venv} (just now)"


def wait_ready(
    port: int,
    headers: tuple[tuple[str, str], ...],
    child: subprocess.Popen[Any],
    timeout_s: float,
    log: Path,
) -> float:
    """Until a small chat completion through ``port`` answers 200; the seconds that took."""
    started = time.monotonic()
    deadline = started + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if child.poll() is not None:
            last = f"exited with {child.returncode}"
            break
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            connection.request(
                "POST",
                bp.CHAT.decode(),
                body=bp.POST_BODY,
                headers={"content-type": "application/json", **dict(headers)},
            )
            answer = connection.getresponse()
            answer.read()
            if answer.status == 200:
                return time.monotonic() - started
            last = f"status {answer.status}"
        except (OSError, http.client.HTTPException) as exc:
            last = type(exc).__name__
        finally:
            connection.close()
        time.sleep(0.5)
    tail = log.read_text(errors="replace").strip().splitlines()[-5:] if log.exists() else []
    raise RuntimeError(f"not ready after {timeout_s:g} s ({last}); log: {' | '.join(tail)[-600:]}")


@contextlib.contextmanager
def scratch_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as name:
        yield Path(name)


class PeerTargets:
    """Starts each peer in front of the backend and runs every phase through it."""

    def __init__(self, setup: bp.Setup, venvs: dict[str, Path], key: str) -> None:
        self.setup = setup
        self.venvs = venvs
        self.key = key
        self.startup_s: dict[str, float] = {}
        self.commands: dict[str, str] = {}

    def env(self, **extra: str) -> dict[str, str]:
        keep = ("PATH", "HOME", "LANG", "TMPDIR")
        env = {k: v for k, v in os.environ.items() if k in keep}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", NO_PROXY="*", **extra)
        return env

    def run_through(
        self,
        name: str,
        command: list[str],
        *,
        env: dict[str, str],
        port: int,
        scratch: Path,
        plan: bp.Plan,
        backend: subprocess.Popen[Any],
        backend_port: int,
    ) -> bp.Results:
        setup = self.setup
        self.commands[name] = " ".join(command)
        log = scratch / f"{name}.log"
        cores = setup.guard_cores if setup.pinning else None
        with (
            log.open("wb") as log_file,
            bp.process(
                command, cores=cores, env=env, cwd=scratch, stdout=log_file, stderr=log_file
            ) as child,
        ):
            self.startup_s[name] = wait_ready(
                port, setup.request_headers, child, START_TIMEOUT_S[name], log
            )
            pids = {"backend": backend.pid, "guard": child.pid}
            return bp.run_target(plan, port, backend_port, pids, setup)

    def sglang_router(
        self, plan: bp.Plan, backend: subprocess.Popen[Any], backend_port: int
    ) -> bp.Results:
        python = self.venvs["sglang-router"] / "bin" / "python"
        port, metrics_port = bp.free_port(), bp.free_port()
        command = [
            str(python), "-m", "sglang_router.launch_router",
            "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", f"http://127.0.0.1:{backend_port}",
            "--policy", "round_robin",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--worker-startup-check-interval", "1",
            "--shutdown-grace-period-secs", "2",
            "--log-level", "warn",
        ]  # fmt: skip
        with scratch_dir() as scratch:
            return self.run_through(
                "sglang-router", command, env=self.env(), port=port, scratch=scratch,
                plan=plan, backend=backend, backend_port=backend_port,
            )  # fmt: skip

    def litellm(
        self, plan: bp.Plan, backend: subprocess.Popen[Any], backend_port: int
    ) -> bp.Results:
        program = self.venvs["litellm"] / "bin" / "litellm"
        port = bp.free_port()
        config = {
            "model_list": [
                {
                    "model_name": "bench",
                    "litellm_params": {
                        "model": "openai/bench",
                        "api_base": f"http://127.0.0.1:{backend_port}/v1",
                        "api_key": "none",
                    },
                }
            ],
            "litellm_settings": {"telemetry": False, "num_retries": 0},
        }
        with scratch_dir() as scratch:
            path = scratch / "config.yaml"
            path.write_text(json.dumps(config, indent=2))  # JSON is valid YAML
            command = [str(program), "--config", str(path), "--host", "127.0.0.1"]
            command += ["--port", str(port), "--num_workers", "1"]
            env = self.env(
                LITELLM_MASTER_KEY=self.key,
                LITELLM_LOCAL_MODEL_COST_MAP="True",
                LITELLM_LOG="ERROR",
            )
            return self.run_through(
                "litellm", command, env=env, port=port, scratch=scratch,
                plan=plan, backend=backend, backend_port=backend_port,
            )  # fmt: skip


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bp.add_common_arguments(parser)
    parser.add_argument(
        "--peers",
        default=",".join(PEERS),
        help=f"comma-separated peers to run (default: {','.join(PEERS)}; 'none' for none)",
    )
    parser.add_argument("--peers-dir", help="where each peer's virtual environment lives")
    parser.add_argument(
        "--no-install", action="store_true", help="skip a peer that is not installed yet"
    )
    return parser.parse_known_args()


def main() -> int:
    args, ignored = parse_args()
    if ignored:
        print(f"bench_peers: ignoring options it does not take: {' '.join(ignored)}")
    bp.raise_file_limit()
    directory = Path(
        args.peers_dir or os.environ.get("PIG_BENCH_PEERS_DIR") or ROOT / ".nox" / "peers"
    ).resolve()
    wanted = [name.strip() for name in args.peers.split(",") if name.strip() not in ("", "none")]
    plan = bp.Plan(args)
    if args.streams is None and not (args.smoke or args.quick):
        # 512 is the guard's goal; 64 shows what a peer adds when it is not overloaded
        plan.streams = [] if args.only == "post" else [64, 512]
    plan.post_one = False  # the 1-connection figures are bench_proxy's
    setup = bp.Setup(args)  # direct and the guard in static mode; no dynamic mode, no nginx
    key = "sk-bench-" + secrets.token_hex(8)
    setup.request_headers = (("authorization", f"Bearer {key}"),)
    setup.loose_events = True
    venvs: dict[str, Path] = {}
    installs: list[str] = []
    for name in wanted:
        peer = PEERS.get(name)
        if peer is None:
            setup.notes.append(f"{name}: skipped, unknown peer (known: {', '.join(PEERS)})")
            continue
        venv, how = ensure_installed(peer, directory, install=not args.no_install)
        if venv is None:
            setup.notes.append(f"{name} {peer.version}: skipped, {how}")
            continue
        venvs[name] = venv
        installs.append(f"{name} {peer.version}: {how}")
    targets = PeerTargets(setup, venvs, key)
    starters: dict[str, Callable[[bp.Plan, subprocess.Popen[Any], int], bp.Results]] = {
        "sglang-router": targets.sglang_router,
        "litellm": targets.litellm,
    }
    for name in venvs:
        setup.columns.append(name)
        setup.targets[name] = starters[name]
    with scratch_dir() as model_dir:
        # An empty local model directory: a router that loads the worker's tokenizer fails here
        # (a warning) instead of trying to download one.
        setup.backend_args = ["--peer-events", "--model-path", str(model_dir)]
        results, header = bp.measure_with_load(setup, plan)
    bp.print_header(setup, plan, "bench_peers", header)
    print("guard static: DYNAMIC_PIG_ENABLED=false GLOBAL_LIMIT=100000")
    for line in installs:
        print(line)
    for name in setup.columns[2:]:
        print(f"{name}: ready {targets.startup_s.get(name, float('nan')):.1f} s after start;")
        print(f"  {targets.commands.get(name, '')}")
    print(
        "every column gets the same requests, with an Authorization header (LiteLLM needs its"
        " master key); rows named 'guard' describe the process in front of the backend in each"
        " column, pinned to the same core; a peer that falls behind still holds events when"
        " the backend ends every stream: those it has not delivered 30 s later count as lost,"
        " and their streams as cut"
    )
    for note in setup.notes:
        print(f"SKIP {note}" if "skipped" in note or "not installed" in note else note)
    print()
    if plan.post:
        rows = bp.post_rows(plan)
        print("\n".join(bp.table("Peers: small non-streaming POST", setup.columns, results, rows)))
    for streams in plan.streams:
        title = f"Peers: SSE streaming, {streams} streams x {plan.rate:g} events/s"
        print()
        print("\n".join(bp.table(title, setup.columns, results, bp.stream_rows(streams))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
