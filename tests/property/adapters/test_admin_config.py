"""``PIG_ADMIN_LISTEN``: off by default; ``host:port`` with a host; only with a ``TOKEN``."""

from __future__ import annotations

import pytest

from guard_adapters.config import ConfigError, load_config


def test_the_admin_plane_is_off_by_default() -> None:
    settings = load_config({})
    assert settings.env.pig_admin_listen == ""
    assert settings.admin_listen is None


@pytest.mark.parametrize(
    ("listen", "split"),
    [
        ("127.0.0.1:9000", ("127.0.0.1", 9000)),
        ("localhost:0", ("localhost", 0)),
        ("[::1]:9100", ("::1", 9100)),
        ("0.0.0.0:9000", ("0.0.0.0", 9000)),
    ],
)
def test_a_host_and_port_are_read(listen: str, split: tuple[str, int]) -> None:
    settings = load_config({"PIG_ADMIN_LISTEN": listen, "TOKEN": "t"})
    assert settings.admin_listen == split
    assert "PIG_ADMIN_LISTEN=" + listen in settings.describe().splitlines()


@pytest.mark.parametrize("listen", [":9000", "9000", "host:", "host:99999", "a b:1", "[::1:9"])
def test_a_bad_address_is_reported(listen: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config({"PIG_ADMIN_LISTEN": listen, "TOKEN": "t"})
    messages = [m for m in caught.value.messages if m.startswith("PIG_ADMIN_LISTEN: ")]
    assert len(messages) == 1
    assert "host:port" in messages[0]


def test_the_admin_plane_needs_a_token() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config({"PIG_ADMIN_LISTEN": "127.0.0.1:9000"})
    assert any("needs TOKEN" in m for m in caught.value.messages)
