"""What the ``inference-guard`` subcommands share: common options, argument types, tables.

Reads: nothing but its arguments.

Guarantees:

- :func:`add_overrides` adds the repeatable ``--set VAR=VALUE`` option, collected in
  ``args.overrides`` (empty when not given).
- :func:`read_input` reads a file with the reader given, or says on ``err`` why it could not
  (``inference-guard <command>: <the file's fault>`` or ``...: cannot read <path>: <reason>``)
  and gives ``None``; :func:`settings_with` does the same for settings with ``--set``
  overrides (``...: invalid settings:`` and every problem, one a line).
- :func:`number` builds an argparse type for a float with a condition; a text that is no
  number is refused with ``not a number: '<text>'``, a number outside the condition with
  ``must be <requirement>, got '<text>'``.
- :func:`table` lays rows out in columns two spaces apart, the first ``left`` columns
  left-aligned and the rest right-aligned, no trailing blanks; :func:`figure` writes an
  optional figure as ``-`` when there is none.
- :func:`write_json` writes a document as indented JSON with a final newline.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, TypeVar

from guard_adapters._errors import LineError
from guard_adapters.config import ConfigError, Settings, apply_overrides, load_config

_T = TypeVar("_T")


def add_overrides(parser: argparse.ArgumentParser, *, help: str) -> None:
    """Add ``--set VAR=VALUE`` (repeatable) to ``parser``; the texts land in ``args.overrides``."""
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="VAR=VALUE", help=help
    )


def read_input(command: str, path: Path, read: Callable[[Path], _T], err: IO[str]) -> _T | None:
    """``read(path)``, or ``None`` once ``err`` says why the file cannot be used."""
    try:
        return read(path)
    except LineError as error:
        err.write(f"inference-guard {command}: {error}\n")
    except OSError as error:
        err.write(f"inference-guard {command}: cannot read {path}: {error.strerror or error}\n")
    return None


def settings_with(
    command: str, environ: Mapping[str, str], overrides: Sequence[str], err: IO[str]
) -> Settings | None:
    """The settings of ``environ`` with ``overrides``, or ``None`` once ``err`` lists the faults."""
    try:
        return load_config(apply_overrides(environ, overrides))
    except ConfigError as invalid:
        err.write(f"inference-guard {command}: invalid settings:\n{invalid}\n")
        return None


def number(ok: Callable[[float], bool], requirement: str) -> Callable[[str], float]:
    """An argparse type: a float for which ``ok`` holds, else a message naming ``requirement``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text!r}")
        return value

    return parse


def whole_number(low: int, high: int, unit: str) -> Callable[[str], int]:
    """An argparse type: a whole number from ``low`` to ``high`` (of ``unit``), else a message
    saying so."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {low} to {high} {unit}, got {value}")
        return value

    return parse


def figure(value: float | None, digits: int = 1) -> str:
    """``value`` with ``digits`` decimals, or ``-`` when there is none."""
    return "-" if value is None else f"{value:.{digits}f}"


def table(rows: Sequence[Sequence[str]], *, left: int = 1) -> str:
    """The rows as aligned columns, one line each (no final newline)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.ljust(width) if i < left else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def write_table(rows: Sequence[Sequence[str]], out: IO[str], *, left: int = 1) -> None:
    """:func:`table`, written to ``out`` with a final newline."""
    out.write(table(rows, left=left) + "\n")


def write_json(path: Path, document: object) -> None:
    """``document`` as indented JSON (UTF-8) with a final newline."""
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
