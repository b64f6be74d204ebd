"""Rewrite the metric tables of docs/observability.md from the page's own table.

``python tools/gen_metrics_docs.py`` (``--check``: exit 1 when the file is stale instead).

The rows are :data:`guard_trio._observability.SECTIONS`, the same table the ``/pig/metrics``
page is rendered from: each row's name, type, label names and help text, in page order. Only
the text between the ``<!-- metrics:NAME -->`` and ``<!-- /metrics:NAME -->`` markers is
rewritten (``pig``: every section but the predictive and flow ones; ``predictive``: the
``DYNAMIC_POLICY=predictive`` block; ``flow``: the flow-control block); the prose around them
is edited by hand.
``tests/property/adapters/test_metrics_docs.py`` fails when the file and the table disagree.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from guard_trio._metrics_page import reference_rows
from guard_trio._observability import SECTIONS

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "observability.md"

_HEAD = "| metric | type | labels | meaning |\n| --- | --- | --- | --- |\n"


def tables() -> dict[str, str]:
    """Each marked block's text: a Markdown table of its rows."""
    own = ("predictive", "flow")
    pig = [row for s in SECTIONS if s.title not in own for row in s.rows]
    blocks = [("pig", pig)]
    blocks += [(name, [row for s in SECTIONS if s.title == name for row in s.rows]) for name in own]
    return {name: _HEAD + "\n".join(reference_rows(rows)) + "\n" for name, rows in blocks}


def _escaped(replacement: str) -> str:
    """``replacement`` as literal text in a ``re.sub`` template."""
    return replacement.replace("\\", "\\\\")


def render(text: str) -> str:
    """``text`` with every marked block replaced by the table's rows."""
    for name, table in tables().items():
        pattern = re.compile(
            rf"(<!-- metrics:{name} -->\n).*?(<!-- /metrics:{name} -->)", flags=re.DOTALL
        )
        text, count = pattern.subn(rf"\g<1>{_escaped(table)}\g<2>", text)
        if count != 1:
            raise SystemExit(f"{OUTPUT.name}: expected one '<!-- metrics:{name} -->' block")
    return text


def main(argv: list[str]) -> int:
    current = OUTPUT.read_text(encoding="utf-8")
    wanted = render(current)
    if "--check" in argv:
        if wanted != current:
            print(f"{OUTPUT.relative_to(ROOT)} is stale: run python tools/gen_metrics_docs.py")
            return 1
        return 0
    OUTPUT.write_text(wanted, encoding="utf-8")
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
