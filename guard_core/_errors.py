"""Exceptions shared by the three packages.

Refusals, waits and rejects are *values* (see :mod:`guard_core.decision`); exceptions are kept for
contract violations by the caller, which mean a bug in the runtime that drives the core.
"""

from __future__ import annotations

__all__ = ("GuardError", "InvalidObservation", "PolicyConfigError", "require")


class GuardError(Exception):
    """Base class of every error raised by inference-guard."""


class InvalidObservation(GuardError):
    """An event that cannot happen in a correct runtime, e.g. releasing a slot nobody holds.

    The state given to the reducer is left untouched (it is immutable), so a caller that catches
    this can carry on with the state it had.
    """


class PolicyConfigError(GuardError, ValueError):
    """A policy setting outside its documented range."""


def require(condition: bool, message: str) -> None:
    """Raise :class:`PolicyConfigError` with ``message`` (which names the setting) unless
    ``condition`` holds: the one range check of every settings value in the core."""
    if not condition:
        raise PolicyConfigError(message)
