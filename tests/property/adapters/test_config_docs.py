"""docs/configuration.md is generated from the config classes; it must match them."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from guard_adapters.config import VARIABLES
from tests.load_tool import load_tool

ROOT = Path(__file__).parents[3]


def load_generator() -> ModuleType:
    return load_tool("gen_config_docs")


def test_configuration_reference_is_up_to_date() -> None:
    generated: str = load_generator().render()
    on_disk = (ROOT / "docs/configuration.md").read_text(encoding="utf-8")
    assert on_disk == generated, "run: python tools/gen_config_docs.py"


def test_every_variable_is_documented_once() -> None:
    text = (ROOT / "docs/configuration.md").read_text(encoding="utf-8")
    for name in VARIABLES:
        assert text.count(f"| `{name}` |") == 1, name
