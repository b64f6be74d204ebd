"""Shared test configuration: Hypothesis profiles.

``HYPOTHESIS_PROFILE`` picks one: ``dev`` (default, quick), ``ci`` (the CI run) or ``deep``
(``nox -s property``: many more examples, for hunting rare interleavings).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=100, deadline=None)
settings.register_profile(
    "ci", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "deep",
    max_examples=5000,
    deadline=None,
    stateful_step_count=100,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
