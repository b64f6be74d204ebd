"""The Grafana dashboard and the compose ``monitoring`` profile, checked against a live guard.

Reads: ``deploy/grafana/inference-guard.json``, ``deploy/compose.yaml``,
``deploy/prometheus/prometheus.yml`` and the Grafana provisioning files; a guard (PIG's learner)
and a second one with ``DYNAMIC_POLICY=predictive``, both on loopback in front of one simulated
backend, after an admitted stream, a refused request and a poll round that saw the stream.

Guarantees: every PromQL expression of every panel (parsed by ``promql_parser``) names only
series and labels that the live ``/pig/metrics`` page exports, the panels of the predictive row
against the predictive guard's page and all others against the default guard's; the checker
itself reports a wrong metric, suffix, label, grouping and a rate over a gauge; panel ids are
unique, each panel has a datasource and a target, grid positions do not overlap; the profile's
Prometheus scrapes the guard's port and path with the guard's TOKEN, and Grafana provisions that
Prometheus under the uid the dashboard defaults to and loads the dashboard from its mount.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import trio
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary
from prometheus_client.exposition import generate_latest

from guard_adapters.config import load_config
from tests.dashboard_check import (
    Catalogue,
    all_panels,
    dashboard_problems,
    datasource_uids,
    expression_problems,
    row_titles,
    structure_problems,
    variable_query_problems,
)

ROOT = Path(__file__).parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "inference-guard.json"
TOKEN = "s3cret"
AUTH = [("Authorization", f"Bearer {TOKEN}")]
CHAT = "/v1/chat/completions"
PREDICTIVE_ROW = "Predictive learner"


def load_dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def chat_body(max_tokens: int, *, stream: bool = False) -> bytes:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
    }
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


# -- the checker on a page of known content ----------------------------------------------------


@pytest.fixture(scope="module")
def small_page() -> Catalogue:
    registry = CollectorRegistry()
    requests = Counter("demo_requests", "r", ["tier", "decision"], registry=registry)
    requests.labels("basic", "accepted").inc()
    Gauge("demo_cap", "c", registry=registry).set(3)
    Gauge("demo_backend_running", "b", ["name"], registry=registry).labels("b1").set(1)
    Histogram("demo_ttft_seconds", "t", registry=registry).observe(0.2)
    Summary("demo_wait_seconds", "w", registry=registry).observe(0.1)
    return Catalogue.from_page(generate_latest(registry).decode())


@pytest.mark.parametrize(
    "expr",
    [
        'sum by (tier, decision) (rate(demo_requests_total{tier="basic"}[$__rate_interval]))',
        "histogram_quantile(0.95, sum by (le) (rate(demo_ttft_seconds_bucket[5m])))",
        "rate(demo_wait_seconds_sum[5m]) / rate(demo_wait_seconds_count[5m])",
        'max by (name) (demo_backend_running{instance=~"$instance", name=~"$backend"})',
        "demo_cap * on (instance) group_left (name) max by (instance, name) (demo_backend_running)",
        'up{job="inference-guard"} or 1 - demo_cap',
        "sum without (decision) (demo_requests_total)",
    ],
)
def test_the_checker_passes_what_the_page_offers(small_page: Catalogue, expr: str) -> None:
    assert expression_problems(expr, small_page, frozenset({"instance", "backend"})) == []


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("pig_made_up_metric", "series 'pig_made_up_metric' is not on the page"),
        # The exposition format's suffixes: a counter is stored as _total, a histogram as its
        # _bucket/_sum/_count and never under the family name.
        ("rate(demo_requests[5m])", "series 'demo_requests' is not on the page"),
        ("demo_ttft_seconds", "series 'demo_ttft_seconds' is not on the page"),
        ("demo_cap_total", "series 'demo_cap_total' is not on the page"),
        ('demo_requests_total{lane="x"}', "label 'lane' is not on series"),
        ("sum by (lane) (demo_requests_total)", "groups on 'lane'"),
        ("sum by (tier) (sum by (decision) (demo_requests_total))", "groups on 'tier'"),
        ("sum without (lane) (demo_requests_total)", "groups on 'lane'"),
        ("rate(demo_cap[5m])", "not a counter"),
        ("histogram_quantile(0.5, sum by (tier) (demo_requests_total))", "without an 'le'"),
        ("demo_cap * on (name) demo_backend_running", "on(name) needs 'name' on both sides"),
        (
            "demo_backend_running * on (instance) group_left (tier) demo_cap",
            "group label 'tier'",
        ),
        ('label_replace(demo_cap, "a", "$1", "b", "(.*)")', "not checked: label_replace"),
        ("demo_cap[5m", "does not parse"),
        ('demo_cap{name=~"$nobody"}', "unknown variable $nobody"),
    ],
)
def test_the_checker_reports_what_the_page_lacks(
    small_page: Catalogue, expr: str, expected: str
) -> None:
    problems = expression_problems(expr, small_page, frozenset({"instance"}))
    assert any(expected in problem for problem in problems), problems


def test_a_dashboard_with_one_wrong_name_or_label_fails(small_page: Catalogue) -> None:
    dashboard = {
        "templating": {
            "list": [{"type": "query", "name": "backend", "query": "label_values(demo_cap, name)"}]
        },
        "panels": [
            {"id": 1, "title": "ok", "targets": [{"expr": "demo_cap"}]},
            {"id": 2, "title": "typo", "targets": [{"expr": "demo_cap"}, {"expr": "demo_capp"}]},
            {"id": 3, "title": "label", "targets": [{"expr": "sum by (tiers) (demo_cap)"}]},
        ],
    }
    problems = dashboard_problems(dashboard, small_page)
    assert len(problems) == 3, problems
    assert "panel 'typo'" in problems[0]
    assert "panel 'label'" in problems[1]
    assert "variable 'backend'" in problems[2]
    assert not variable_query_problems(
        "label_values(demo_backend_running, name)", small_page, frozenset()
    )


def test_the_structure_check_finds_overlaps_duplicates_and_missing_parts() -> None:
    dashboard = load_dashboard()
    assert structure_problems(dashboard) == []
    broken = copy.deepcopy(dashboard)
    graphs = [p for p in broken["panels"] if p["type"] != "row"]
    graphs[1]["gridPos"] = dict(graphs[0]["gridPos"])
    graphs[2]["id"] = graphs[3]["id"]
    del graphs[4]["datasource"]
    graphs[5]["targets"] = []
    graphs[6]["gridPos"]["x"] = 20
    problems = "\n".join(structure_problems(broken))
    assert f"{graphs[0]['title']!r} and {graphs[1]['title']!r} overlap" in problems
    assert f"panel id {graphs[3]['id']} is used more than once" in problems
    assert f"panel {graphs[4]['title']!r} has no datasource" in problems
    assert f"panel {graphs[5]['title']!r} has no target" in problems
    assert f"panel {graphs[6]['title']!r} lies outside the grid" in problems


# -- the dashboard itself ----------------------------------------------------------------------


def test_dashboard_shape() -> None:
    dashboard = load_dashboard()
    assert dashboard["schemaVersion"] >= 39
    assert dashboard["uid"] == "inference-guard"
    assert datasource_uids(dashboard) == {"${datasource}"}
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    titles = {p["title"] for p in all_panels(dashboard) if p["type"] == "row"}
    assert any(title.startswith(PREDICTIVE_ROW) for title in titles)
    assert sum(1 for p in all_panels(dashboard) if p["type"] != "row") >= 20


async def scraped_page(base: str, http: Any, must_hold: str) -> str:
    """The guard's page once it shows ``must_hold`` (a poll round that saw the stream)."""
    with trio.fail_after(10):
        while True:
            reply = await http.request(base, "GET", "/pig/metrics", AUTH)
            assert reply.status == 200
            page: str = reply.body.decode()
            if must_hold in page:
                return page
            await trio.sleep(0.05)


async def page_after_traffic(base: str, http: Any) -> str:
    """An admitted premium stream held open, a refused basic request, then the page once the
    stream shows in the load state (DYNAMIC_RUNNING_YELLOW=1 makes it a reason)."""
    holder = await http.connect(base)
    try:
        await holder.send_request(
            "POST", CHAT, [*AUTH, ("X-User-Tier", "premium")], chat_body(400, stream=True)
        )
        assert (await holder.response_head()).status_code == 200
        assert await holder.next_chunk()
        refused = await http.request(base, "POST", CHAT, AUTH, chat_body(4))
        assert refused.status == 429
        return await scraped_page(base, http, "pig_dynamic_reason_info{")
    finally:
        await holder.aclose()


async def test_every_panel_uses_what_a_live_guard_exports(
    start_sim: Any, start_guard: Any, http: Any
) -> None:
    sim, _ = await start_sim()
    environ = {
        "UPSTREAM": sim,
        "DYNAMIC_METRICS_URL": f"{sim}/metrics",
        "TOKEN": TOKEN,
        "GLOBAL_LIMIT": "1",
        "PIG_QUEUE_WAIT_SECONDS": "0",
        "DYNAMIC_POLL_INTERVAL_MS": "100",
        "DYNAMIC_RUNNING_YELLOW": "1",
        "DYNAMIC_RUNNING_RED": "8",
    }
    pig, _ = await start_guard(environ)
    predictive, _ = await start_guard({**environ, "DYNAMIC_POLICY": "predictive"})
    # The page needs the token, so the Prometheus scrape config must send it.
    assert (await http.request(pig, "GET", "/pig/metrics")).status == 401

    pig_page = Catalogue.from_page(await page_after_traffic(pig, http))
    predictive_page = Catalogue.from_page(await page_after_traffic(predictive, http))
    # The traffic left labelled series behind: both tiers' outcomes, the reasons, a poll.
    for name, label in (
        ("pig_tier_requests_total", "decision"),
        ("pig_dynamic_reason_info", "reason"),
        ("pig_dynamic_poll_total", "result"),
        ("pig_backend_observed_running", "name"),
    ):
        assert label in pig_page.labels[name]
    assert "inference_guard_predictive_refusals_total" in predictive_page.labels

    dashboard = load_dashboard()
    rows = row_titles(dashboard)

    def page_for(panel: Any) -> Catalogue:
        in_predictive_row = rows.get(panel["id"], "").startswith(PREDICTIVE_ROW)
        return predictive_page if in_predictive_row else pig_page

    assert dashboard_problems(dashboard, pig_page, page_for) == []
    # The predictive row really needs the predictive page: against the default one it fails.
    assert dashboard_problems(dashboard, pig_page, lambda _panel: pig_page)


# -- the compose profile -----------------------------------------------------------------------


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return loaded


def host_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> host path of each bind mount (short syntax, relative to deploy/)."""
    mounts: dict[str, Path] = {}
    for volume in service.get("volumes", []):
        host, container, *_ = volume.split(":")
        mounts[container] = (DEPLOY / host).resolve()
    return mounts


def test_the_monitoring_profile_adds_prometheus_and_grafana_only() -> None:
    services = compose()["services"]
    monitoring = {name for name, s in services.items() if "monitoring" in s.get("profiles", [])}
    assert monitoring == {"prometheus", "grafana"}
    # The default stack is the one it was: no profile on the gateway, the guard and the backend.
    for name in ("haproxy", "guard", "backend"):
        assert "profiles" not in services[name]
    assert services["nginx"]["profiles"] == ["nginx"]
    for name in monitoring:
        assert ":" in services[name]["image"]
        assert not services[name]["image"].endswith(":latest")
        for host in host_mounts(services[name]).values():
            assert host.exists(), host


def test_prometheus_scrapes_the_guard_page_with_its_token() -> None:
    services = compose()["services"]
    mounts = host_mounts(services["prometheus"])
    config = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    (job,) = config["scrape_configs"]
    guard_env = services["guard"]["environment"]
    settings = load_config(dict(guard_env))
    assert job["metrics_path"] == "/pig/metrics"
    assert job["authorization"] == {"type": "Bearer", "credentials": guard_env["TOKEN"]}
    ((target,),) = (c["targets"] for c in job["static_configs"])
    assert target == f"guard:{settings.listen_port}"
    # The dashboard's "Guard up" panel names this job.
    exprs = [t["expr"] for p in all_panels(load_dashboard()) for t in p.get("targets", [])]
    assert any(f'up{{job="{job["job_name"]}"' in expr for expr in exprs)


def test_grafana_provisions_the_datasource_and_the_dashboard() -> None:
    services = compose()["services"]
    grafana = services["grafana"]
    assert grafana["depends_on"] == ["prometheus"]
    mounts = host_mounts(grafana)
    sources_dir = mounts["/etc/grafana/provisioning/datasources"]
    boards_dir = mounts["/etc/grafana/provisioning/dashboards"]
    (source,) = (
        s
        for f in sorted(sources_dir.glob("*.yaml"))
        for s in yaml.safe_load(f.read_text())["datasources"]
    )
    assert source["type"] == "prometheus"
    url = urlsplit(source["url"])
    assert url.hostname == "prometheus"
    assert f"{url.port}:{url.port}" in services["prometheus"]["ports"]
    variables = {v["name"]: v for v in load_dashboard()["templating"]["list"]}
    assert variables["datasource"]["current"]["value"] == source["uid"]

    (provider,) = (
        p
        for f in sorted(boards_dir.glob("*.yaml"))
        for p in yaml.safe_load(f.read_text())["providers"]
    )
    assert provider["type"] == "file"
    folder = provider["options"]["path"].rstrip("/")
    dashboards = [host for container, host in mounts.items() if container.startswith(folder + "/")]
    assert dashboards == [DASHBOARD.resolve()]
