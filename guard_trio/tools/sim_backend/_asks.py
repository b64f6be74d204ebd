"""What a generation request asks the simulated backend for.

Reads: the JSON body of a chat, completions or Responses API request.

Guarantees: :func:`parse_ask` either returns an :class:`Ask` (the prompt's size in the
simulation's tokens, about four characters each, or the count of token ids; the output limit
and the name of the field that set it; streaming and usage options; reasoning; a forced tool
call; a ``sim_error`` case) or raises :class:`BadRequest` with the message and ``param`` a real
server gives for that body. Nothing else about the body is read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final, Literal

import attrs

#: The three generation endpoints, by the API they speak.
Kind = Literal["chat", "completions", "responses"]

_TEXT_KEYS: Final = frozenset({"content", "text", "input", "prompt", "instructions", "messages"})


def _text_chars(value: object) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_text_chars(item) for item in value)
    if isinstance(value, dict):
        return sum(_text_chars(item) for key, item in value.items() if key in _TEXT_KEYS)
    return 0


@attrs.frozen
class Tool:
    name: str
    argument: str
    finish_reason: str


@attrs.frozen
class Ask:
    """The parts of a generation request the simulation uses."""

    kind: Kind
    stream: bool
    include_usage: bool
    prompt_tokens: int
    max_tokens: int | None
    max_tokens_param: str
    reasoning: bool
    tool: Tool | None
    sim_error: str | None
    model: str


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _prompt_tokens(kind: str, body: Mapping[str, Any]) -> int:
    if kind == "chat":
        chars = _text_chars(body.get("messages"))
    elif kind == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt)  # token ids
        chars = _text_chars(prompt)
    else:
        chars = _text_chars(body.get("input")) + _text_chars(body.get("instructions"))
    return max(1, chars // 4)


def _requested_max_tokens(kind: str, body: Mapping[str, Any]) -> tuple[int | None, str]:
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        param = "max_completion_tokens"
    elif kind == "responses":
        param = "max_output_tokens"
    else:
        param = "max_tokens"
    value = body.get(param)
    if value is None:
        return None, param
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"{param} must be at least 1, got {value!r}.", param)
    return value, param


def _wants_reasoning(body: Mapping[str, Any]) -> bool:
    if body.get("reasoning_effort") is not None:
        return True
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and (kwargs.get("enable_thinking") or kwargs.get("thinking")):
        return True
    reasoning = body.get("reasoning")
    return isinstance(reasoning, dict) and reasoning.get("effort") is not None


def _forced_tool(body: Mapping[str, Any]) -> Tool | None:
    """The function a chat request forces: ``tool_choice`` "required" or a named function."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools:
        return None
    functions = [
        t["function"] for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)
    ]
    if not functions:
        return None
    choice = body.get("tool_choice")
    if choice == "required":
        function, finish = functions[0], "tool_calls"
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        wanted = choice["function"].get("name")
        function = next((f for f in functions if f.get("name") == wanted), functions[0])
        finish = "stop"  # vLLM ends a named-function call with "stop"
    else:
        return None
    parameters = function.get("parameters")
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    argument = (
        next(iter(properties), "input") if isinstance(properties, dict) and properties else "input"
    )
    return Tool(str(function.get("name") or "function"), str(argument), finish)


def parse_ask(kind: Kind, raw: bytes, default_model: str) -> Ask:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise BadRequest("Expecting value: line 1 column 1 (char 0)") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.", "body")
    required = {"chat": "messages", "completions": "prompt", "responses": "input"}[kind]
    if body.get(required) is None:
        raise BadRequest(f"Field required: {required}", f"body.{required}")
    max_tokens, param = _requested_max_tokens(kind, body)
    options = body.get("stream_options")
    sim_error = body.get("sim_error")
    return Ask(
        kind=kind,
        stream=body.get("stream") is True,
        include_usage=isinstance(options, dict) and options.get("include_usage") is True,
        prompt_tokens=_prompt_tokens(kind, body),
        max_tokens=max_tokens,
        max_tokens_param=param,
        reasoning=kind != "completions" and _wants_reasoning(body),
        tool=_forced_tool(body) if kind == "chat" else None,
        sim_error=sim_error if isinstance(sim_error, str) else None,
        model=str(body.get("model") or default_model),
    )
