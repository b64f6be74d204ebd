"""Docker cannot run here, so the Dockerfile is checked with a parser: a pinned slim base, a
non-root user, the NVIDIA variables, a /healthz health check and an exec-form entrypoint that
runs ``serve`` (so SIGTERM reaches the proxy and drains it)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).parents[2]


def instructions() -> list[tuple[str, str]]:
    parser = DockerfileParser(path=str(ROOT / "Dockerfile"))
    return [
        (i["instruction"], i["value"]) for i in parser.structure if i["instruction"] != "COMMENT"
    ]


def test_base_image_is_a_pinned_slim_python() -> None:
    parser = DockerfileParser(path=str(ROOT / "Dockerfile"))
    assert re.fullmatch(r"python:3\.1[1-9]\.\d+-slim-\w+", parser.baseimage or "")


def test_runs_as_a_non_root_user_with_the_nvidia_variables() -> None:
    steps = instructions()
    users = [value for name, value in steps if name == "USER"]
    assert users
    assert users[-1] not in ("root", "0")
    env = " ".join(value for name, value in steps if name == "ENV")
    assert "NVIDIA_VISIBLE_DEVICES=all" in env


def test_health_check_and_exec_form_entrypoint() -> None:
    steps = dict(instructions())
    assert "/healthz" in steps["HEALTHCHECK"]
    assert json.loads(steps["ENTRYPOINT"]) == ["inference-guard"]
    assert json.loads(steps["CMD"]) == ["serve"]


def test_it_installs_the_same_package_the_tests_install() -> None:
    # .ci/run installs the project from pyproject.toml through nox; the image installs the same
    # project with pip, and copies every package the distribution declares.
    steps = instructions()
    copied = " ".join(value for name, value in steps if name == "COPY")
    for package in ("guard_core", "guard_adapters", "guard_trio", "pyproject.toml"):
        assert package in copied
    assert any(name == "RUN" and "pip install" in value and " ." in value for name, value in steps)
