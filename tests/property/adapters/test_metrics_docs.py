"""docs/observability.md is generated from the guard's metrics page; it must match it."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from tests.load_tool import load_tool

ROOT = Path(__file__).parents[3]


def load_generator() -> ModuleType:
    return load_tool("gen_metrics_docs")


def test_observability_reference_is_up_to_date() -> None:
    generated: str = load_generator().render()
    on_disk = (ROOT / "docs/observability.md").read_text(encoding="utf-8")
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
