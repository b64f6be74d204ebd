"""A request's affinity key from its body's leading bytes (guard_adapters.affinity_key)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from guard_adapters.affinity_key import affinity_key

TEXT = st.text(max_size=300)
ROLES = st.sampled_from(["system", "user", "assistant", "tool"])


def chat(messages: list[dict[str, object]], **extra: object) -> bytes:
    return json.dumps({"model": "m", "messages": messages, **extra}).encode()


@given(st.text(min_size=1, max_size=200), TEXT, TEXT, st.integers(min_value=16, max_value=512))
def test_the_same_leading_prefix_gives_the_same_key_whatever_follows(
    system: str, first: str, second: str, prefix_bytes: int
) -> None:
    # The stream starts with the system role, a separator and the system text: when that alone
    # fills the prefix, what follows it cannot matter.
    long_system = system * (1 + prefix_bytes // max(1, len(system.encode())))
    one = chat([{"role": "system", "content": long_system}, {"role": "user", "content": first}])
    two = chat([{"role": "system", "content": long_system}, {"role": "user", "content": second}])
    key_one = affinity_key(one, prefix_bytes=prefix_bytes)
    key_two = affinity_key(two, prefix_bytes=prefix_bytes)
    assert key_one is not None
    assert key_one.kind == "prefix"
    assert key_one == key_two
    # The body cut anywhere after the prefix is reached still gives the same key.
    assert affinity_key(one[: len(one) - 3], prefix_bytes=prefix_bytes) == key_one


@given(st.text(min_size=1, max_size=100), st.text(min_size=1, max_size=100), TEXT)
def test_different_system_prompts_give_different_keys(a: str, b: str, user: str) -> None:
    if a == b:
        return
    one = chat([{"role": "system", "content": a}, {"role": "user", "content": user}])
    two = chat([{"role": "system", "content": b}, {"role": "user", "content": user}])
    assert affinity_key(one) != affinity_key(two)


@given(st.binary(max_size=400))
def test_garbage_gives_none_or_a_key_and_never_raises(body: bytes) -> None:
    result = affinity_key(body)
    assert result is None or 0 <= result.key < 1 << 64


@given(
    st.lists(
        st.fixed_dictionaries(
            {
                "role": ROLES,
                "content": st.one_of(
                    TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}))
                ),
            }
        ),
        min_size=1,
        max_size=4,
    ),
    st.data(),
)
def test_a_body_cut_anywhere_gives_a_key_or_none_and_never_raises(
    messages: list[dict[str, object]], data: st.DataObject
) -> None:
    body = chat(messages)
    cut = data.draw(st.integers(min_value=0, max_value=len(body)))
    result = affinity_key(body[:cut])
    assert result is None or result.kind == "prefix"
    assert affinity_key(body) is not None


def test_precedence_session_then_user_then_prefix() -> None:
    body = chat([{"role": "user", "content": "hello"}], user="alice")
    assert affinity_key(body, session="s-1") == affinity_key(b"", session="s-1")
    assert affinity_key(body, session="s-1").kind == "session"  # type: ignore[union-attr]
    by_user = affinity_key(body)
    assert by_user is not None
    assert by_user.kind == "user"
    assert by_user == affinity_key(chat([{"role": "user", "content": "other"}], user="alice"))
    # A user field the cut ends inside of is not trusted: the prompt gives the key then.
    cut = body[: body.index(b"alice") + 3]
    partial = affinity_key(cut)
    assert partial is not None
    assert partial.kind == "prefix"
    assert affinity_key(json.dumps({"user": "", "prompt": "x"}).encode()).kind == "prefix"  # type: ignore[union-attr]


def test_completions_prompts_and_bodies_without_a_prompt() -> None:
    text = affinity_key(json.dumps({"prompt": "once upon a time"}).encode())
    listed = affinity_key(json.dumps({"prompt": ["once upon a time", "x"]}).encode())
    assert text is not None
    assert text == listed
    tokens = affinity_key(json.dumps({"prompt": [1, 2, 3]}).encode())
    assert tokens is not None
    assert tokens != affinity_key(json.dumps({"prompt": [1, 2, 4]}).encode())
    assert affinity_key(json.dumps({"model": "m"}).encode()) is None
    assert affinity_key(b"[1, 2]") is None
    assert affinity_key(b"   ") is None
    deep = b'{"messages": ' + b"[" * 500
    assert affinity_key(deep) is None


def test_the_body_limit_bounds_what_is_read() -> None:
    filler = "f" * 5000
    body = json.dumps({"tools": filler, "messages": [{"role": "user", "content": "hi"}]})
    assert affinity_key(body.encode(), body_limit=1000) is None
    assert affinity_key(body.encode()) is not None


@given(
    system=st.text(min_size=1, max_size=200),
    opening=st.text(min_size=1, max_size=200),
    later=st.lists(st.tuples(st.text(max_size=100), st.text(max_size=100)), max_size=4),
)
def test_every_turn_of_a_conversation_keeps_its_openings_key(
    system: str, opening: str, later: list[tuple[str, str]]
) -> None:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": opening}]
    first = affinity_key(json.dumps({"messages": messages}).encode())
    for answer, question in later:
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": question},
        ]
        turn = affinity_key(json.dumps({"messages": messages}).encode())
        assert turn == first
    other = [{"role": "system", "content": system}, {"role": "user", "content": opening + "!"}]
    assert affinity_key(json.dumps({"messages": other}).encode()) != first
