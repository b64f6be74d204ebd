"""Which request paths are admitted paths (QoS) or protected generation paths (spec 1).

Reads: the decoded request path (the query string, if the caller left one on, is ignored) and a
list of configured paths.
Guarantees: matching is exact unless suffix matching is on, in which case a path matches when it
ends with a configured path; the path list is validated once, when the policy is built.
"""

from __future__ import annotations

import re
from typing import Any

import attrs

from guard_core._errors import PolicyConfigError

__all__ = ("DEFAULT_QOS_PATHS", "PathPolicy")

#: PIG's default ``PIG_PATHS`` (and, by default, ``API_AUTH_PATHS``).
DEFAULT_QOS_PATHS: tuple[str, ...] = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
)

_PATH_SHAPE = re.compile(r"/[A-Za-z0-9_./-]*")


def _check_paths(
    _instance: object, attribute: attrs.Attribute[Any], value: tuple[str, ...]
) -> None:
    if not value:
        raise PolicyConfigError(f"{attribute.name} must name at least one path")
    seen: set[str] = set()
    for path in value:
        if not _PATH_SHAPE.fullmatch(path):
            raise PolicyConfigError(
                f"{attribute.name}: {path!r} must start with '/' and use only letters, digits"
                " and _ . - /"
            )
        if path in seen:
            raise PolicyConfigError(f"{attribute.name}: {path!r} is listed twice")
        seen.add(path)


@attrs.frozen
class PathPolicy:
    """A validated path list and the matching rule."""

    paths: tuple[str, ...] = attrs.field(default=DEFAULT_QOS_PATHS, validator=_check_paths)
    suffix_match: bool = False

    def matches(self, path: str) -> bool:
        """True when ``path`` (without its query) is one of the configured paths."""
        path = path.partition("?")[0]
        if self.suffix_match:
            return any(path.endswith(candidate) for candidate in self.paths)
        return path in self.paths
