"""Exceptions raised by the adapters when outside input cannot be turned into guard_core values."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

from guard_core._errors import GuardError

__all__ = ("AdapterError", "BodyRewriteError", "ConfigError", "LineError", "MetricsParseError")


class AdapterError(GuardError):
    """Input from a backend or a client that an adapter refuses to translate."""


class LineError(AdapterError):
    """A numbered line of a file (a recording, a trace) that cannot be used.

    ``line_no`` is 1-based; ``source`` names the file (``""`` when unknown) and the message starts
    with ``source:line_no`` (or ``line N``); ``reason`` is the bare explanation. A subclass pickles
    as itself.
    """

    def __init__(self, line_no: int, reason: str, *, source: str = "") -> None:
        self.line_no = line_no
        self.reason = reason
        self.source = source
        where = f"{source}:{line_no}" if source else f"line {line_no}"
        super().__init__(f"{where}: {reason}")

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_line_error, (type(self), self.line_no, self.reason, self.source))


def _rebuild_line_error(cls: type[LineError], line_no: int, reason: str, source: str) -> LineError:
    return cls(line_no, reason, source=source)


class _PlacedError(AdapterError):
    """A fault in one input, found at an optional place in it (``None``: the input as a whole).

    The message reads ``<subject>: <reason>`` or ``<subject>, <unit> <place>: <reason>``;
    ``reason`` is the bare explanation. A subclass names its subject and unit and pickles as
    itself.
    """

    _SUBJECT: ClassVar[str]
    _UNIT: ClassVar[str]

    def __init__(self, reason: str, place: int | None = None) -> None:
        where = self._SUBJECT if place is None else f"{self._SUBJECT}, {self._UNIT} {place}"
        super().__init__(f"{where}: {reason}")
        self.reason = reason
        self._place = place

    def __reduce__(self) -> tuple[type[_PlacedError], tuple[str, int | None]]:
        return (type(self), (self.reason, self._place))


class MetricsParseError(_PlacedError):
    """A backend's metrics page that cannot be read.

    ``line_no`` is the 1-based number of the offending line (lines are counted by ``\\n``), or
    ``None`` when the fault concerns the page as a whole (for instance its size). ``reason`` is the
    bare explanation, without the line prefix that the message carries.
    """

    _SUBJECT = "metrics page"
    _UNIT = "line"

    @property
    def line_no(self) -> int | None:
        return self._place


class ConfigError(AdapterError):
    """Settings that cannot be used.

    ``messages`` holds every problem found, one entry each, each starting with the name of the
    variable (or the override) it concerns; the string form lists them one per line.
    """

    def __init__(self, messages: Iterable[str]) -> None:
        self.messages: tuple[str, ...] = tuple(messages)
        super().__init__("\n".join(self.messages))

    def __reduce__(self) -> tuple[type[ConfigError], tuple[tuple[str, ...]]]:
        return (type(self), (self.messages,))


class BodyRewriteError(_PlacedError):
    """A request body that the priority / compat rewriter cannot re-emit (spec 6.3).

    ``offset`` is the 0-based position in the original body where the fault was found, or
    ``None`` when it concerns the body as a whole; ``reason`` is the bare explanation. A caller
    that is fail-open forwards the original bytes instead.
    """

    _SUBJECT = "request body"
    _UNIT = "byte"

    @property
    def offset(self) -> int | None:
        return self._place
