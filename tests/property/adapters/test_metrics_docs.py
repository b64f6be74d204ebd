"""docs/observability.md's metric tables are generated from the page's own table; they must
match it, and the table must say what the rendered page serves."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from prometheus_client.parser import text_string_to_metric_families

from guard_adapters.config import load_config
from guard_core import BackendPoll, BackendSample, GuardState, MetricsPolled, apply_guard_event
from guard_trio._observability import SECTIONS, GuardMetrics
from tests.load_tool import load_tool

ROOT = Path(__file__).parents[3]


def load_generator() -> ModuleType:
    return load_tool("gen_metrics_docs")


def test_observability_reference_is_up_to_date() -> None:
    on_disk = (ROOT / "docs/observability.md").read_text(encoding="utf-8")
    generated: str = load_generator().render(on_disk)
    assert on_disk == generated, "run: python tools/gen_metrics_docs.py"


def test_pigs_headline_metrics_are_documented() -> None:
    text = (ROOT / "docs/observability.md").read_text(encoding="utf-8")
    for name in (
        "pig_rejected_total",
        "pig_dynamic_global_limit",
        "pig_dynamic_final_limit_info",
        "pig_tier_requests_total",
        "pig_request_semantic_ttft_seconds",
        "pig_backend_inflight",
    ):
        assert f"| `{name}` |" in text, name


def _page(env: dict[str, str], *samples: BackendSample | None) -> str:
    settings = load_config(env)
    state = GuardState.initial(settings.guard_config(), at=0.0)
    for at, sample in enumerate(samples, start=1):
        polls = (BackendPoll(name="metrics1", sample=sample, error="refused"),)
        state = apply_guard_event(state, MetricsPolled(float(at), polls)).state
    metrics = GuardMetrics(settings, lambda: state, version="docs", clock=lambda: 1.0)
    pools = settings.model_pools
    if pools is not None:  # as the server sets it: the pools, one state each
        metrics.pooled = True
        metrics.pool_states = lambda: tuple((name, state) for name in pools.models)
    return metrics.exposition().decode()


def test_the_table_says_what_the_page_serves() -> None:
    """Every family on a rendered page has its table row's name, type and label names, in
    table order; a row missing from every page is an info row left out while unset."""
    rows = {row.name: row for section in SECTIONS for row in section.rows}
    env = {"DYNAMIC_METRICS_URL": "http://backend:8000/metrics", "DYNAMIC_POLICY": "predictive"}
    good = BackendSample(running=4.0, waiting=0.0, kv_usage=0.2, generation_tokens=100.0)
    seen: set[str] = set()
    pages = (
        _page(env, good),
        _page(env, good, None),
        _page({"UPSTREAM": "http://b:8000"}),
        _page({"UPSTREAMS": "http://a:8000,http://b:8000", "PIG_FAILURE_MODE": "open"}),
        _page({"BACKENDS": "a=http://a:8000,b=http://b:8000", "PIG_POOLS": "m1=a;m2=b"}),
        _page({"UPSTREAM": "http://b:8000", "PIG_PRIORITY_BANDS": "a,b", "PIG_TENANT_HEADER": "t"}),
    )
    for page in pages:
        order = []
        for family in text_string_to_metric_families(page):
            name = f"{family.name}_total" if family.type == "counter" else family.name
            row = rows[name]
            kind = "gauge" if row.kind == "info" else str(row.kind)
            assert family.type == kind, name
            labels = {k for s in family.samples for k in s.labels if k != "le"}
            assert labels == set(row.labels) or not family.samples, (name, labels, row.labels)
            order.append(name)
        assert order == [n for n in rows if n in order]
        seen.update(order)
    assert all(rows[name].kind == "info" for name in set(rows) - seen)
