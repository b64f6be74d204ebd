"""The serving path stays small: issue 13's bound, checked on the source.

The serving path is every ``guard_trio`` module a request or a poll passes through, from the
accepted connection to the last byte of the response and from the poll to the published cap:
the server, both connection sides, the proxy and its own routes and pools, the relay and its
pumps, the backend connections and their health reports, the engine, the poller, its HTTP
client, and start-up discovery. Its size is counted in code lines: the lines that hold a token
of code, so docstrings, comments and blank lines do not count (what ``cloc`` and ``sloc`` call
code). Every ``guard_trio`` module also stays within 600 physical lines.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

SHELL = Path(__file__).resolve().parents[2] / "guard_trio"
SERVING_PATH = (
    "_server.py",
    "_downstream.py",
    "_proxy.py",
    "_own_routes.py",
    "_pools.py",
    "_relay.py",
    "_copy.py",
    "_upstream.py",
    "_health.py",
    "_engine.py",
    "_poller.py",
    "_http.py",
    "_discovery.py",
)
MAX_CODE_LINES = 2500
MAX_MODULE_LINES = 600
_NOT_CODE = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
}


def code_lines(source: str) -> int:
    """The lines of ``source`` that hold a code token, docstrings left out."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _NOT_CODE:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def test_the_counter_counts_code_only() -> None:
    source = "\n".join(
        [
            '"""Doc',
            "",
            'string."""',
            "# a comment",
            "x = (",
            "    1,",
            ")",
            "",
            "def f():",
            '    """Doc."""',
            "    return x",
        ]
    )
    assert code_lines(source) == 5


def test_the_serving_path_is_at_most_its_bound() -> None:
    counts = {name: code_lines((SHELL / name).read_text(encoding="utf-8")) for name in SERVING_PATH}
    total = sum(counts.values())
    assert total <= MAX_CODE_LINES, f"{total} code lines on the serving path: {counts}"


@pytest.mark.parametrize("path", sorted(SHELL.rglob("*.py")), ids=lambda p: p.name)
def test_no_shell_module_is_over_600_lines(path: Path) -> None:
    assert len(path.read_text(encoding="utf-8").splitlines()) <= MAX_MODULE_LINES
