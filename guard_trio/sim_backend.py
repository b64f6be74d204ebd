"""A simulated vLLM or SGLang server: the engine model of ``guard_adapters.engine_model`` on HTTP.

Reads: a :class:`SimBackendConfig`; HTTP/1.1 requests on the bound socket.

Guarantees:

- One task owns the engine's clock. :class:`SimBackend` runs one *driver* task that advances the
  engine to ``trio.current_time() - start`` whenever its next step ends, sleeping in between
  until that instant or until a handler changes the engine. Every other call into the engine is
  preceded by the same catch-up (:meth:`SimBackend._sync`), so the engine is always at "now" when
  it is asked or told something, and every event it produces is handed to its request before
  that request is dropped.
- Handing tokens over is cheap: each request has a counter of tokens not yet written and a
  waiting task. The driver adds to the counter and wakes it; the request's own task writes
  everything that arrived since its last write as one send, and parks again. No task, channel
  or cancel scope is created per token or per step.
- Wire formats follow the real servers. Chat chunks are shaped like the vLLM 0.24 capture in
  ``../shared/data/sse`` (role chunk at the first token, one chunk per token, a finish chunk, a
  usage chunk when ``stream_options.include_usage`` is true, ``data: [DONE]``); completions and
  Responses API events likewise; error bodies are the templates of ``../shared/data/errors``,
  written the way Starlette's ``JSONResponse`` writes them (compact separators, UTF-8).
- ``/metrics`` is produced by prometheus-client from a private registry with one custom
  collector; :func:`guard_adapters.metrics.parse_metrics` reads the engine's own numbers back
  from it (running, waiting, KV usage, preemptions, prompt and generated tokens, the TTFT and
  inter-token latency histograms).
- A client that closes its connection while its request waits or streams gets its sequence
  aborted in the engine at once (its KV is freed); a watcher reads the socket while the request
  is served, so the close is seen even when nothing is being written.

Faults (from the command line or, at run time, from ``POST /sim/control`` on loopback only):
a slow-down factor from a given time, engine death (``/health`` turns 503, requests get vLLM's
engine-dead 500, streams in flight end with an error event), a delay before or failures of
``/metrics``, and ``--replay-sse`` which answers every streaming request with a recorded
transcript, byte for byte, one event per interval.

A request body may carry ``"sim_error": "<case>"`` to get the error a real server writes for that
case (see :data:`ERROR_CASES`); the case names are the file names of ``../shared/data/errors``.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import math
import os
import random
import sys
import time
import traceback
from bisect import bisect_left
from collections import deque
from collections.abc import Awaitable, Iterable, Iterator, Mapping, Sequence
from http import HTTPStatus
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, Literal

import attrs
import h11
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from guard_adapters.engine_model import (
    DEFAULT_PROFILE,
    ITL_BUCKETS,
    PROFILES,
    Engine,
    EngineDead,
    EngineMetrics,
    EngineProfile,
    SimRequest,
    TokenEvent,
)
from guard_core import GuardError

__all__ = (
    "ERROR_CASES",
    "SGLANG_ITL_BUCKETS",
    "SGLANG_TTFT_BUCKETS",
    "VLLM_ITL_BUCKETS",
    "VLLM_LEGACY_TPOT_BUCKETS",
    "VLLM_LEGACY_TTFT_BUCKETS",
    "VLLM_TTFT_BUCKETS",
    "SimBackend",
    "SimBackendConfig",
    "SimBackendError",
    "is_loopback",
    "serve_sim_backend",
    "split_sse_events",
)

Flavour = Literal["vllm", "sglang"]
MetricsNames = Literal["current", "legacy"]

#: TTFT bucket bounds per flavour: vLLM 0.33.0 (unchanged since 0.8.5), vLLM 0.7.3 (the older
#: names' era; its top bound is 10 s) and SGLang 0.5.x, from the ``*-histogram-buckets-by-version``
#: tables in ``../shared/data/metrics``.
VLLM_TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_LEGACY_TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
SGLANG_TTFT_BUCKETS: Final = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0,
    400.0,
)  # fmt: skip
#: Inter-token latency bounds per flavour, from the same tables: vLLM 0.33.0's
#: ``inter_token_latency_seconds`` (the engine model's own :data:`ITL_BUCKETS`), vLLM 0.7.3's
#: ``time_per_output_token_seconds`` (the name of that era; top bound 2.5 s) and SGLang 0.5.x's
#: ``inter_token_latency_seconds`` (unchanged since 0.4.6.post5).
VLLM_ITL_BUCKETS: Final = ITL_BUCKETS
VLLM_LEGACY_TPOT_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
SGLANG_ITL_BUCKETS: Final = (
    0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1, 0.2,
    0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0,
)  # fmt: skip

_READ_SIZE: Final = 65536
_MAX_BODY_BYTES: Final = 32 * 1024 * 1024
_REQUEST_READ_S: Final = 30.0
_WORD_RING: Final = 8192  # a power of two: token i of a request is word (offset + i) & mask
_GEN_RATE_WINDOW_S: Final = 5.0


class SimBackendError(GuardError):
    """The simulated backend cannot start with this configuration."""


# -- configuration ---------------------------------------------------------------------------------


def _check_positive(_instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not value > 0:
        raise SimBackendError(f"{attribute.name} must be > 0, got {value!r}")


def _check_non_negative(_instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not value >= 0:
        raise SimBackendError(f"{attribute.name} must be >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class SimBackendConfig:
    """Everything ``inference-guard sim-backend`` can be told; the defaults are its flags'.

    ``slow_down`` holds ``(factor, at_s)`` pairs: from ``at_s`` seconds after start every engine
    step takes ``factor`` times as long. ``speed`` divides every step's duration (a benchmark
    knob; 1 is the profile's calibrated speed). ``mean_output_tokens`` ends requests early with
    a seeded geometric length of that mean (finish reason ``stop``); without it each request
    generates exactly its ``max_tokens`` (finish reason ``length``), as benchmarks do.
    """

    host: str = "127.0.0.1"
    port: int = 8001
    flavour: Flavour = "vllm"
    metrics_names: MetricsNames = "current"
    profile: str = DEFAULT_PROFILE
    max_num_seqs: int | None = attrs.field(default=None, validator=_check_positive)
    seed: int = 0
    model: str = "Qwen/Qwen2-7B-Instruct"
    max_output: int = attrs.field(default=4096, validator=_check_positive)
    default_max_tokens: int = attrs.field(default=256, validator=_check_positive)
    max_model_len: int = attrs.field(default=8192, validator=_check_positive)
    speed: float = attrs.field(default=1.0, validator=_check_positive)
    mean_output_tokens: float | None = attrs.field(default=None, validator=_check_positive)
    reasoning_field: str = "reasoning_content"
    slow_down: tuple[tuple[float, float], ...] = ()
    die_at_s: float | None = attrs.field(default=None, validator=_check_non_negative)
    metrics_delay_s: float = attrs.field(default=0.0, validator=_check_non_negative)
    metrics_fail_after_s: float | None = attrs.field(default=None, validator=_check_non_negative)
    replay_sse: Path | None = None
    replay_interval_s: float = attrs.field(default=0.02, validator=_check_non_negative)
    keep_alive_s: float = attrs.field(default=5.0, validator=_check_positive)

    def __attrs_post_init__(self) -> None:
        if self.flavour not in ("vllm", "sglang"):
            raise SimBackendError(f"flavour must be vllm or sglang, got {self.flavour!r}")
        if self.metrics_names not in ("current", "legacy"):
            raise SimBackendError(
                f"metrics names must be current or legacy, not {self.metrics_names!r}"
            )
        if self.profile not in PROFILES:
            known = ", ".join(sorted(PROFILES))
            raise SimBackendError(f"unknown profile {self.profile!r} (known: {known})")
        for factor, at_s in self.slow_down:
            if not factor > 0 or not at_s >= 0:
                raise SimBackendError(
                    f"slow-down needs a factor > 0 and a time >= 0: {factor}@{at_s}"
                )
        self.engine_profile()  # the overrides must make a valid profile

    def engine_profile(self) -> EngineProfile:
        """The profile with this configuration's overrides applied."""
        profile = PROFILES[self.profile]
        seqs = profile.max_num_seqs if self.max_num_seqs is None else self.max_num_seqs
        try:
            return attrs.evolve(
                profile,
                max_model_len=self.max_model_len,
                max_num_seqs=seqs,
                max_num_batched_tokens=max(profile.max_num_batched_tokens, seqs + 1),
            )
        except ValueError as invalid:
            raise SimBackendError(str(invalid)) from None


# -- error bodies ----------------------------------------------------------------------------------


@attrs.frozen
class _ErrorCase:
    """One error a real server writes: status, ``type``, ``param`` and the message template.

    Placeholders: ``{max_model_len}``, ``{prompt_tokens}``, ``{max_tokens}``,
    ``{max_tokens_param}``, ``{model}``.
    """

    status: int
    type: str
    param: str | None
    message: str
    kills_engine: bool = False


_ENGINE_DEAD_MESSAGE: Final = "The server had an error while processing your request."

#: ``sim_error`` cases, named after the files of ``../shared/data/errors``, with vLLM 0.33.0's
#: wording (the newest the files give).
ERROR_CASES: Final[Mapping[str, _ErrorCase]] = MappingProxyType(
    {
        "context_length_exceeded": _ErrorCase(
            400,
            "BadRequestError",
            "input_tokens",
            "This model's maximum context length is {max_model_len} tokens. However, your prompt"
            " contains {prompt_tokens} input tokens, which exceeds this limit even without any"
            " output tokens. Please reduce the length of the input prompt.",
        ),
        "max_tokens_greater_than_context": _ErrorCase(
            400,
            "BadRequestError",
            "{max_tokens_param}",
            "{max_tokens_param}={max_tokens} cannot be greater than"
            " max_total_tokens={max_model_len}. Please request fewer output tokens.",
        ),
        "multimodal_image_url_http_4xx": _ErrorCase(
            422,
            "UnprocessableEntityError",
            "image_url",
            "Failed to fetch media from URL: HTTP 403 error",
        ),
        "multimodal_image_decode_or_invalid_url": _ErrorCase(
            400,
            "BadRequestError",
            None,
            "Failed to load image: cannot identify image file <_io.BytesIO object at"
            " 0x7f3a5c2e1b20>",
        ),
        "tool_call_arguments_invalid_json_in_history": _ErrorCase(
            400, "BadRequestError", None, "Expecting value: line 1 column 1 (char 0)"
        ),
        "model_not_found": _ErrorCase(
            404, "NotFoundError", "model", "The model `{model}` does not exist."
        ),
        "admission_queue_full": _ErrorCase(
            503,
            "Service Unavailable",
            None,
            "The engine is currently busy and cannot accept new requests. Please try again"
            " later or on a different instance.",
        ),
        "generation_error_finish_reason_error": _ErrorCase(
            500, "InternalServerError", None, "Internal server error"
        ),
        "engine_dead": _ErrorCase(500, "InternalServerError", None, _ENGINE_DEAD_MESSAGE),
        # A CUDA fault kills the engine; the request (and every later one) sees the dead engine.
        "runtime_cuda_error_or_oom": _ErrorCase(
            500, "InternalServerError", None, _ENGINE_DEAD_MESSAGE, kills_engine=True
        ),
        # Handled in the stream: a 200 whose stream ends with an error event and [DONE].
        "streaming_error_mid_stream": _ErrorCase(
            500, "InternalServerError", None, "Internal server error"
        ),
    }
)

_SGLANG_INPUT_TOO_LONG: Final = (
    "The input ({prompt_tokens} tokens) is longer than the model's context length"
    " ({max_model_len} tokens)."
)
_SGLANG_TOTAL_TOO_LONG: Final = (
    "Requested token count exceeds the model's maximum context length of {max_model_len} tokens."
    " You requested a total of {total_tokens} tokens: {prompt_tokens} tokens from the input"
    " messages and {max_tokens} tokens for the completion. Please reduce the number of tokens in"
    " the input messages or the completion to fit within the limit."
)


def _json(value: object) -> bytes:
    """JSON as Starlette's ``JSONResponse`` writes it (and pydantic's ``model_dump_json``)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _error_body(
    flavour: Flavour, status: int, error_type: str, param: str | None, message: str
) -> bytes:
    """vLLM (>= 0.10) nests the error object; SGLang (like vLLM <= 0.9) writes it flat."""
    if flavour == "sglang":
        return _json(
            {
                "object": "error",
                "message": message,
                "type": error_type,
                "param": None,
                "code": status,
            }
        )
    return _json(
        {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    )


def _stream_error_event(status: int, error_type: str, message: str) -> bytes:
    """The error event vLLM writes into a stream that already started (``json.dumps`` spacing)."""
    payload = {"error": {"message": message, "type": error_type, "param": None, "code": status}}
    return b"data: " + json.dumps(payload).encode("utf-8") + b"\n\ndata: [DONE]\n\n"


# -- the network side ------------------------------------------------------------------------------


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def is_loopback(host: str) -> bool:
    """Whether a peer address is a loopback address (IPv4, IPv6 or IPv4-mapped IPv6)."""
    try:
        address = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def split_sse_events(transcript: bytes) -> list[bytes]:
    """Cut an SSE transcript after each blank line; joined back, the pieces are the input."""
    pieces: list[bytes] = []
    start = 0
    while True:
        end = transcript.find(b"\n\n", start)
        if end < 0:
            break
        end += 2
        while end < len(transcript) and transcript[end : end + 1] == b"\n":
            end += 1  # extra blank lines stay with the event they follow
        pieces.append(transcript[start:end])
        start = end
    if start < len(transcript):
        pieces.append(transcript[start:])
    return pieces


# -- filler text -----------------------------------------------------------------------------------

_VOCABULARY_TEXT: Final = (
    "the of and to in a is that for it as was with be by on not he this are or his from at"
    " which but have an they you were her all she there would their we him been has when who"
    " will more no if out so said what up its about into than them can only other new some"
    " could time these two may then do first any my now such like our over man me even most"
    " made after also did many before must through back years where much your way well down"
    " should because each just those people how too little state good very make world still"
    " own see men work long get here between both life being under never day same another know"
    " while last might us great old year off come since against go came right used take three"
    " river stone lantern harbor meadow signal orbit copper quiet engine window garden"
)
_VOCABULARY: Final = tuple(_VOCABULARY_TEXT.split())


def _word_ring(rng: random.Random) -> tuple[tuple[str, ...], tuple[bytes, ...]]:
    """A fixed random walk through the vocabulary, as text and as JSON string literals.

    Roughly one word in twelve carries a comma or a full stop, so the text reads like prose.
    """
    words: list[str] = []
    for _ in range(_WORD_RING):
        word = " " + _VOCABULARY[rng.randrange(len(_VOCABULARY))]
        roll = rng.random()
        if roll < 0.05:
            word += ","
        elif roll < 0.09:
            word += "."
        words.append(word)
    return tuple(words), tuple(json.dumps(word).encode() for word in words)


# -- what a request asks for -----------------------------------------------------------------------

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
class _Tool:
    name: str
    argument: str
    finish_reason: str


@attrs.frozen
class _Ask:
    """The parts of a generation request the simulation uses."""

    kind: Literal["chat", "completions", "responses"]
    stream: bool
    include_usage: bool
    prompt_tokens: int
    max_tokens: int | None
    max_tokens_param: str
    reasoning: bool
    tool: _Tool | None
    sim_error: str | None
    model: str


class _BadRequest(Exception):
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
        raise _BadRequest(f"{param} must be at least 1, got {value!r}.", param)
    return value, param


def _wants_reasoning(body: Mapping[str, Any]) -> bool:
    if body.get("reasoning_effort") is not None:
        return True
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and (kwargs.get("enable_thinking") or kwargs.get("thinking")):
        return True
    reasoning = body.get("reasoning")
    return isinstance(reasoning, dict) and reasoning.get("effort") is not None


def _forced_tool(body: Mapping[str, Any]) -> _Tool | None:
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
    return _Tool(str(function.get("name") or "function"), str(argument), finish)


def _parse_ask(
    kind: Literal["chat", "completions", "responses"], raw: bytes, default_model: str
) -> _Ask:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise _BadRequest("Expecting value: line 1 column 1 (char 0)") from None
    if not isinstance(body, dict):
        raise _BadRequest("The request body must be a JSON object.", "body")
    required = {"chat": "messages", "completions": "prompt", "responses": "input"}[kind]
    if body.get(required) is None:
        raise _BadRequest(f"Field required: {required}", f"body.{required}")
    max_tokens, param = _requested_max_tokens(kind, body)
    options = body.get("stream_options")
    sim_error = body.get("sim_error")
    return _Ask(
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


# -- response formats ------------------------------------------------------------------------------


def _hex(rng: random.Random, digits: int) -> str:
    return f"{rng.getrandbits(4 * digits):0{digits}x}"


class _Format:
    """Bytes of one request's response; token ``i`` of the output is ring word ``offset + i``."""

    def __init__(
        self,
        ask: _Ask,
        out_tokens: int,
        words: tuple[bytes, ...],
        texts: tuple[str, ...],
        offset: int,
    ) -> None:
        self.ask = ask
        self.out_tokens = out_tokens
        self.words = words
        self.texts = texts
        self.offset = offset

    def text(self, start: int, stop: int) -> str:
        texts, offset, mask = self.texts, self.offset, _WORD_RING - 1
        return "".join(texts[(offset + i) & mask] for i in range(start, stop))

    def opening(self) -> bytes:
        """Sent with the response head, before any token."""
        return b""

    def tokens(self, start: int, count: int) -> bytes:
        raise NotImplementedError

    def finish(self, generated: int, reason: str) -> bytes:
        raise NotImplementedError

    def failure(self) -> bytes:
        return _stream_error_event(500, "InternalServerError", _ENGINE_DEAD_MESSAGE)

    def body(self, generated: int, reason: str) -> bytes:
        raise NotImplementedError


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }


class _ChatFormat(_Format):
    """``chat.completion.chunk`` events (vLLM 0.24 capture, or SGLang's explicit-null deltas)."""

    def __init__(
        self,
        ask: _Ask,
        out_tokens: int,
        words: tuple[bytes, ...],
        texts: tuple[str, ...],
        offset: int,
        *,
        flavour: Flavour,
        rid: str,
        created: int,
        reasoning_field: str,
        tool_id: str,
    ) -> None:
        super().__init__(ask, out_tokens, words, texts, offset)
        self.flavour = flavour
        self.reasoning_field = reasoning_field if flavour == "vllm" else "reasoning_content"
        self.rid = rid
        self.created = created
        self.tool_id = tool_id
        self.reasoning_tokens = out_tokens // 2 if ask.reasoning else 0
        top = f'{{"id":"{rid}","object":"chat.completion.chunk","created":{created},"model":'
        self.top = top.encode() + _json(ask.model)
        self.head = b"data: " + self.top + b',"choices":[{"index":0,"delta":'
        if flavour == "vllm":
            self.tail = b',"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
            self.role = (
                b'{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
                b'"prompt_token_ids":null,"prompt_text":null}\n\n'
            )
            self.content = (b'{"content":', b"}" + self.tail)
            self.thinking = (b'{"' + self.reasoning_field.encode() + b'":', b"}" + self.tail)
            self.argument = (
                b'{"tool_calls":[{"index":0,"function":{"arguments":',
                b"}}]}" + self.tail,
            )
        else:
            self.tail = (
                b',"logprobs":null,"finish_reason":null,"matched_stop":null}],"usage":null}\n\n'
            )
            self.role = (
                b'{"role":"assistant","content":"","reasoning_content":null,"tool_calls":null}'
                + self.tail
            )
            self.content = (
                b'{"role":null,"content":',
                b',"reasoning_content":null,"tool_calls":null}' + self.tail,
            )
            self.thinking = (
                b'{"role":null,"content":null,"reasoning_content":',
                b',"tool_calls":null}' + self.tail,
            )
            self.argument = (
                b'{"role":null,"content":null,"reasoning_content":null,"tool_calls":[{"index":0,"function":{"arguments":',
                b"}}]}" + self.tail,
            )

    def _tool_opening(self, word_index: int) -> bytes:
        assert self.ask.tool is not None
        tool = self.ask.tool
        fragment = json.dumps({tool.argument: ""})[:-2] + self.texts[word_index]
        call = {
            "tool_calls": [
                {
                    "id": self.tool_id,
                    "type": "function",
                    "index": 0,
                    "function": {"name": tool.name, "arguments": fragment},
                }
            ]
        }
        return self.head + _json(call) + self.tail

    def tokens(self, start: int, count: int) -> bytes:
        parts: list[bytes] = []
        if start == 0:
            parts.append(self.head + self.role)
        head, words, offset, mask = self.head, self.words, self.offset, _WORD_RING - 1
        stop = start + count
        index = start
        split = min(stop, self.reasoning_tokens)
        if index < split:
            pre, post = self.thinking
            for i in range(index, split):
                parts += (head, pre, words[(offset + i) & mask], post)
            index = split
        if index < stop:
            if self.ask.tool is not None:
                if index == self.reasoning_tokens:
                    parts.append(self._tool_opening((offset + index) & mask))
                    index += 1
                pre, post = self.argument
            else:
                pre, post = self.content
            for i in range(index, stop):
                parts += (head, pre, words[(offset + i) & mask], post)
        return b"".join(parts)

    def finish(self, generated: int, reason: str) -> bytes:
        parts: list[bytes] = []
        tool = self.ask.tool
        if tool is not None:
            reason = tool.finish_reason
            if generated > self.reasoning_tokens:
                pre, post = self.argument
                parts += (self.head, pre, json.dumps('"}').encode(), post)
        if self.flavour == "vllm":
            parts.append(
                self.head
                + b'{},"logprobs":null,"finish_reason":"'
                + reason.encode()
                + b'","stop_reason":null,"token_ids":null}]}\n\n'
            )
        else:
            parts.append(
                self.head
                + b'{"role":null,"content":null,"reasoning_content":null,"tool_calls":null},'
                + b'"logprobs":null,"finish_reason":"'
                + reason.encode()
                + b'","matched_stop":null}],"usage":null}\n\n'
            )
        if self.ask.include_usage:
            usage = _usage(self.ask.prompt_tokens, generated)
            parts.append(b"data: " + self.top + b',"choices":[],"usage":' + _json(usage) + b"}\n\n")
        parts.append(b"data: [DONE]\n\n")
        return b"".join(parts)

    def body(self, generated: int, reason: str) -> bytes:
        ask = self.ask
        split = min(generated, self.reasoning_tokens)
        reasoning = self.text(0, split) if ask.reasoning else None
        content: str | None = self.text(split, generated)
        tool_calls: list[dict[str, Any]] = []
        if ask.tool is not None:
            reason = ask.tool.finish_reason
            arguments = json.dumps({ask.tool.argument: content}) if generated > split else ""
            tool_calls.append(
                {
                    "id": self.tool_id,
                    "type": "function",
                    "function": {"name": ask.tool.name, "arguments": arguments},
                }
            )
            content = None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.flavour == "vllm":
            message |= {
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "tool_calls": tool_calls,
                self.reasoning_field: reasoning,
            }
        else:
            message |= {"reasoning_content": reasoning, "tool_calls": tool_calls or None}
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": reason,
        }
        choice |= {"stop_reason": None} if self.flavour == "vllm" else {"matched_stop": None}
        document = {
            "id": self.rid,
            "object": "chat.completion",
            "created": self.created,
            "model": ask.model,
            "choices": [choice],
            "usage": _usage(ask.prompt_tokens, generated),
        }
        return _json(document)


class _CompletionFormat(_Format):
    """``text_completion`` events and body."""

    def __init__(
        self,
        ask: _Ask,
        out_tokens: int,
        words: tuple[bytes, ...],
        texts: tuple[str, ...],
        offset: int,
        *,
        flavour: Flavour,
        rid: str,
        created: int,
    ) -> None:
        super().__init__(ask, out_tokens, words, texts, offset)
        self.rid = rid
        self.created = created
        self.flavour = flavour
        top = f'{{"id":"{rid}","object":"text_completion","created":{created},"model":'
        self.top = top.encode() + _json(ask.model)
        self.head = b"data: " + self.top + b',"choices":[{"index":0,"text":'
        self.stop_key = b'"stop_reason"' if flavour == "vllm" else b'"matched_stop"'
        self.tail = b',"logprobs":null,"finish_reason":null,' + self.stop_key + b":null}]}\n\n"

    def tokens(self, start: int, count: int) -> bytes:
        head, tail, words, offset, mask = (
            self.head,
            self.tail,
            self.words,
            self.offset,
            _WORD_RING - 1,
        )
        parts: list[bytes] = []
        for i in range(start, start + count):
            parts += (head, words[(offset + i) & mask], tail)
        return b"".join(parts)

    def finish(self, generated: int, reason: str) -> bytes:
        parts = [
            self.head
            + b'"","logprobs":null,"finish_reason":"'
            + reason.encode()
            + b'",'
            + self.stop_key
            + b":null}]}\n\n"
        ]
        if self.ask.include_usage:
            usage = _json(_usage(self.ask.prompt_tokens, generated))
            parts.append(b"data: " + self.top + b',"choices":[],"usage":' + usage + b"}\n\n")
        parts.append(b"data: [DONE]\n\n")
        return b"".join(parts)

    def body(self, generated: int, reason: str) -> bytes:
        choice: dict[str, Any] = {
            "index": 0,
            "text": self.text(0, generated),
            "logprobs": None,
            "finish_reason": reason,
        }
        choice |= (
            {"stop_reason": None, "prompt_logprobs": None}
            if self.flavour == "vllm"
            else {"matched_stop": None}
        )
        document = {
            "id": self.rid,
            "object": "text_completion",
            "created": self.created,
            "model": self.ask.model,
            "choices": [choice],
            "usage": _usage(self.ask.prompt_tokens, generated),
        }
        return _json(document)


class _ResponsesFormat(_Format):
    """The Responses API event sequence: created, in_progress, item and part added, text deltas,
    then the done events and ``response.completed`` with usage; every event numbered."""

    def __init__(
        self,
        ask: _Ask,
        out_tokens: int,
        words: tuple[bytes, ...],
        texts: tuple[str, ...],
        offset: int,
        *,
        response_id: str,
        item_id: str,
        created: int,
    ) -> None:
        super().__init__(ask, out_tokens, words, texts, offset)
        self.response_id = response_id
        self.item_id = item_id
        self.created = created
        self.sequence = 0
        self.delta_head = (
            b"event: response.output_text.delta\n"
            b'data: {"type":"response.output_text.delta","sequence_number":'
        )
        self.delta_mid = (
            f',"item_id":"{item_id}","output_index":0,"content_index":0,"delta":'.encode()
        )
        self.delta_tail = b',"logprobs":[]}\n\n'

    def _response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": None,
            "max_output_tokens": self.ask.max_tokens,
            "model": self.ask.model,
            "output": output,
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "reasoning": None,
            "service_tier": "auto",
            "store": False,
            "temperature": 1.0,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "truncation": "disabled",
            "usage": usage,
            "user": None,
            "metadata": None,
        }

    def _event(self, kind: str, fields: dict[str, Any]) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence} | fields
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _json(payload) + b"\n\n"

    def _item(self, status: str, text: str | None) -> dict[str, Any]:
        content = (
            []
            if text is None
            else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        )
        return {
            "id": self.item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def _usage(self, generated: int) -> dict[str, Any]:
        prompt = self.ask.prompt_tokens
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": generated,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + generated,
        }

    def opening(self) -> bytes:
        response = self._response("in_progress", [], None)
        return self._event("response.created", {"response": response}) + self._event(
            "response.in_progress", {"response": response}
        )

    def tokens(self, start: int, count: int) -> bytes:
        parts: list[bytes] = []
        if start == 0:
            parts.append(
                self._event(
                    "response.output_item.added",
                    {"output_index": 0, "item": self._item("in_progress", None)},
                )
            )
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            parts.append(
                self._event(
                    "response.content_part.added",
                    {"item_id": self.item_id, "output_index": 0, "content_index": 0, "part": part},
                )
            )
        head, mid, tail, words, offset, mask = (
            self.delta_head,
            self.delta_mid,
            self.delta_tail,
            self.words,
            self.offset,
            _WORD_RING - 1,
        )
        sequence = self.sequence
        for i in range(start, start + count):
            parts += (head, str(sequence).encode(), mid, words[(offset + i) & mask], tail)
            sequence += 1
        self.sequence = sequence
        return b"".join(parts)

    def finish(self, generated: int, reason: str) -> bytes:
        text = self.text(0, generated)
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item = self._item("completed", text)
        response = self._response("completed", [item], self._usage(generated))
        if reason == "length":
            response |= {
                "status": "incomplete",
                "incomplete_details": {"reason": "max_output_tokens"},
            }
        return b"".join(
            (
                self._event("response.output_text.done", where | {"text": text, "logprobs": []}),
                self._event("response.content_part.done", where | {"part": part}),
                self._event("response.output_item.done", {"output_index": 0, "item": item}),
                self._event("response.completed", {"response": response}),
            )
        )

    def failure(self) -> bytes:
        error = {"code": "server_error", "message": _ENGINE_DEAD_MESSAGE}
        response = self._response("failed", [], None) | {"error": error}
        return self._event("response.failed", {"response": response})

    def body(self, generated: int, reason: str) -> bytes:
        text = self.text(0, generated)
        response = self._response(
            "completed", [self._item("completed", text)], self._usage(generated)
        )
        if reason == "length":
            response |= {
                "status": "incomplete",
                "incomplete_details": {"reason": "max_output_tokens"},
            }
        return _json(response)


# -- metrics ---------------------------------------------------------------------------------------


class _Histogram:
    """A cumulative-on-read histogram with the ``le`` semantics of prometheus-client."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def buckets(self) -> list[tuple[str, float]]:
        return _bucket_pairs(self.bounds, itertools.accumulate(self.counts))


def _bucket_pairs(bounds: Sequence[float], cumulative: Iterable[int]) -> list[tuple[str, float]]:
    """``(le, cumulative count)`` pairs as HistogramMetricFamily takes them, ``+Inf`` last."""
    return [
        ("+Inf" if bound == math.inf else repr(float(bound)), float(total))
        for bound, total in zip((*bounds, math.inf), cumulative, strict=True)
    ]


def _itl_family(
    name: str,
    documentation: str,
    *,
    labels: tuple[list[str], list[str]],
    metrics: EngineMetrics,
    bounds: Sequence[float],
) -> HistogramMetricFamily:
    """The engine's inter-token latency histogram under ``name``; ``labels``: names, values."""
    family = HistogramMetricFamily(name, documentation, labels=labels[0])
    family.add_metric(labels[1], _bucket_pairs(bounds, metrics.itl_bucket_counts), metrics.itl_sum)
    return family


class _Collector:
    """The engine's figures as vLLM (current or 0.7-era names) or SGLang expose them."""

    def __init__(self, backend: SimBackend) -> None:
        self._backend = backend

    def collect(self) -> Iterator[Metric]:
        backend = self._backend
        metrics = backend.engine_metrics()
        config = backend.config
        if config.flavour == "sglang":
            yield from self._sglang(metrics, config.model)
        else:
            yield from self._vllm(metrics, config.model, legacy=config.metrics_names == "legacy")

    def _vllm(self, m: EngineMetrics, model: str, *, legacy: bool) -> Iterator[Metric]:
        backend = self._backend
        names = ["model_name"] if legacy else ["model_name", "engine"]
        values = [model] if legacy else [model, "0"]
        created = backend.created_wall
        gauges = (
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                m.running,
            ),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", m.waiting),
            (
                ("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.")
                if legacy
                else ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
            )
            + (m.kv_usage,),
        )
        for name, documentation, value in gauges:
            gauge = GaugeMetricFamily(name, documentation, labels=names)
            gauge.add_metric(values, float(value))
            yield gauge
        counters = (
            (
                "vllm:num_preemptions",
                "Cumulative number of preemption from the engine.",
                m.preemptions_total,
            ),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", m.prompt_tokens_total),
            (
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                m.generation_tokens_total,
            ),
        )
        for name, documentation, value in counters:
            counter = CounterMetricFamily(name, documentation, labels=names)
            counter.add_metric(values, float(value), created=created)
            yield counter
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*names, "finished_reason"],
        )
        for reason, count in backend.finished_by_reason.items():
            success.add_metric([*values, reason], float(count), created=created)
        yield success
        ttft = HistogramMetricFamily(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels=names,
        )
        histogram = backend.ttft_histogram
        ttft.add_metric(values, histogram.buckets(), histogram.sum)
        yield ttft
        itl_name, itl_help = (
            ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.")
            if legacy
            else (
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
            )
        )
        yield _itl_family(
            itl_name, itl_help, labels=(names, values), metrics=m, bounds=backend.itl_buckets
        )

    def _sglang(self, m: EngineMetrics, model: str) -> Iterator[Metric]:
        backend = self._backend
        scheduler = ["model_name", "engine_type", "tp_rank", "pp_rank"]
        scheduler_values = [model, "unified", "0", "0"]
        tokenizer = ["model_name", "engine_type"]
        tokenizer_values = [model, "unified"]
        gauges = (
            ("sglang:num_running_reqs", "The number of running requests.", m.running),
            ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", m.waiting),
            ("sglang:token_usage", "The token usage.", m.kv_usage),
            (
                "sglang:gen_throughput",
                "The generation throughput (token/s).",
                backend.generation_rate(m),
            ),
            # Cumulative here: what a guard reads from this gauge is the count of retractions.
            ("sglang:num_retracted_reqs", "The number of retracted requests.", m.preemptions_total),
        )
        for name, documentation, value in gauges:
            gauge = GaugeMetricFamily(name, documentation, labels=scheduler)
            gauge.add_metric(scheduler_values, float(value))
            yield gauge
        counters = (
            ("sglang:prompt_tokens", "Number of prefill tokens processed.", m.prompt_tokens_total),
            (
                "sglang:generation_tokens",
                "Number of generation tokens processed.",
                m.generation_tokens_total,
            ),
        )
        for name, documentation, value in counters:
            counter = CounterMetricFamily(name, documentation, labels=tokenizer)
            counter.add_metric(tokenizer_values, float(value), created=backend.created_wall)
            yield counter
        ttft = HistogramMetricFamily(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels=tokenizer,
        )
        histogram = backend.ttft_histogram
        ttft.add_metric(tokenizer_values, histogram.buckets(), histogram.sum)
        yield ttft
        yield _itl_family(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels=(tokenizer, tokenizer_values),
            metrics=m,
            bounds=backend.itl_buckets,
        )


# -- the server ------------------------------------------------------------------------------------


class _Seq:
    """One request in the engine, as its handler sees it.

    The handler sleeps in :meth:`wait_for_news` and the driver wakes it with :meth:`notify`:
    a bare reschedule of one known task, lighter than a parking lot or an event per wake.
    """

    __slots__ = ("end", "pending", "rid", "submitted_at", "waiter")

    def __init__(self, rid: int, submitted_at: float) -> None:
        self.rid = rid
        self.submitted_at = submitted_at
        self.pending = 0  # tokens produced and not yet taken by the handler
        self.end: str | None = None  # "finished" or "failed" once the engine is done with it
        self.waiter: trio.lowlevel.Task | None = None

    def notify(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            trio.lowlevel.reschedule(waiter)

    async def wait_for_news(self) -> None:
        """Sleep until the driver hands over tokens or an end (return at once if it has)."""
        if self.pending or self.end is not None:
            await trio.lowlevel.checkpoint()
            return
        self.waiter = trio.lowlevel.current_task()

        def abort(_: Any) -> trio.lowlevel.Abort:
            self.waiter = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)


async def _write(stream: trio.SocketStream, fd: int, data: bytes) -> None:
    """Write ``data``, straight into the socket buffer when it has room.

    ``send_all`` always passes through the scheduler; at one write per stream per engine step
    that trip is a large share of the cost of a token, and it is needed only when the kernel
    buffer is full (then the rest goes through ``send_all``).
    """
    try:
        written = os.write(fd, data)
    except BlockingIOError:
        written = 0
    except OSError as error:
        raise trio.BrokenResourceError(f"write failed: {error.strerror or error}") from error
    if written < len(data):
        await stream.send_all(memoryview(data)[written:])


def _chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body (what h11 would write for it)."""
    return b"%x\r\n%b\r\n" % (len(data), data)


class _Exchange:
    """One request/response on a connection."""

    __slots__ = ("conn", "peer_gone", "stream")

    def __init__(self, stream: trio.SocketStream, conn: h11.Connection) -> None:
        self.stream = stream
        self.conn = conn
        self.peer_gone = False


_JSON: Final = "application/json"
_SSE_HEADERS: Final = [
    ("content-type", "text/event-stream; charset=utf-8"),
    ("cache-control", "no-cache"),
]
_NOT_FOUND: Final = b'{"detail":"Not Found"}'
_NOT_ALLOWED: Final = b'{"detail":"Method Not Allowed"}'


class SimBackend:
    """The simulated server. ``await nursery.start(backend.serve)`` returns ``(host, port)``."""

    def __init__(self, config: SimBackendConfig) -> None:
        self.config = config
        profile = config.engine_profile()
        itl_bounds: tuple[float, ...] = VLLM_ITL_BUCKETS
        if config.flavour == "sglang":
            itl_bounds = SGLANG_ITL_BUCKETS
        elif config.metrics_names == "legacy":
            itl_bounds = VLLM_LEGACY_TPOT_BUCKETS
        self._engine = Engine(
            profile,
            seed=config.seed,
            ignore_eos=config.mean_output_tokens is None,
            mean_output_tokens=config.mean_output_tokens or 256.0,
            itl_buckets=itl_bounds,
        )
        if config.speed != 1.0:
            self._engine.slow_down(1.0 / config.speed, at=0.0)
        self._rng = random.Random(config.seed)
        self._texts, self._words = _word_ring(self._rng)
        self._seqs: dict[int, _Seq] = {}
        self._next_rid = 0
        self._start: float | None = None
        self._driver_lot = trio.lowlevel.ParkingLot()
        self.created_wall = time.time()
        self.finished_by_reason = {"stop": 0, "length": 0, "abort": 0}
        bounds: tuple[float, ...] = VLLM_TTFT_BUCKETS
        if config.flavour == "sglang":
            bounds = SGLANG_TTFT_BUCKETS
        elif config.metrics_names == "legacy":
            bounds = VLLM_LEGACY_TTFT_BUCKETS
        self.ttft_histogram = _Histogram(bounds)
        self._gen_samples: deque[tuple[float, int]] = deque()
        # faults
        self._factor = 1.0
        self._scheduled: list[tuple[float, str, float]] = sorted(
            [(at_s, "slow_down", factor) for factor, at_s in config.slow_down]
            + ([(config.die_at_s, "kill", 0.0)] if config.die_at_s is not None else [])
        )
        self._metrics_delay_s = config.metrics_delay_s
        self._metrics_fail = False
        self._metrics_fail_after_s = config.metrics_fail_after_s
        self._replay: list[bytes] | None = None
        if config.replay_sse is not None:
            try:
                self._replay = split_sse_events(config.replay_sse.read_bytes())
            except OSError as error:
                raise SimBackendError(
                    f"cannot read {config.replay_sse}: {error.strerror or error}"
                ) from None
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_Collector(self))
        self._max_model_len = profile.max_model_len

    # -- time and the engine -----------------------------------------------------------------------

    def _now(self) -> float:
        if self._start is None:
            return 0.0
        return trio.current_time() - self._start

    def _sync(self) -> float:
        """Bring the engine to now and hand out what it produced; returns now (virtual)."""
        now = self._now()
        events = self._engine.advance(now)
        if events:
            self._dispatch(events)
        return now

    def _dispatch(self, events: list[TokenEvent]) -> None:
        seqs = self._seqs
        for event in events:
            seq = seqs.get(event.request_id)
            if seq is None:
                continue
            kind = event.kind
            if kind == "tokens":
                seq.pending += event.tokens
            elif kind == "first_token":
                seq.pending += event.tokens
                self.ttft_histogram.observe(event.at - seq.submitted_at)
            elif kind == "finished":
                seq.pending += event.tokens
                seq.end = "finished"
                del seqs[event.request_id]
            elif kind == "failed":
                seq.end = "failed"
                del seqs[event.request_id]
            else:  # "preempted": the stream just pauses
                continue
            seq.notify()

    def _kick(self) -> None:
        """The engine changed outside the driver: let it recompute when to wake."""
        self._driver_lot.unpark_all()

    def engine_metrics(self) -> EngineMetrics:
        """The engine's figures at this instant."""
        self._sync()
        return self._engine.metrics()

    @property
    def dead(self) -> bool:
        return self._engine.dead

    @property
    def itl_buckets(self) -> tuple[float, ...]:
        """The inter-token latency bounds this flavour exposes."""
        return self._engine.itl_buckets

    def generation_rate(self, metrics: EngineMetrics) -> float:
        """Generated tokens per second over the last few seconds (SGLang's ``gen_throughput``)."""
        if not self._gen_samples:
            return 0.0
        now = self._now()
        then, total = self._gen_samples[0]
        if now - then <= 0:
            return 0.0
        return (metrics.generation_tokens_total - total) / (now - then)

    def _sample_generation(self, now: float) -> None:
        samples = self._gen_samples
        if samples and now - samples[-1][0] < 0.5:
            return
        samples.append((now, self._engine.metrics().generation_tokens_total))
        while len(samples) > 1 and now - samples[1][0] >= _GEN_RATE_WINDOW_S:
            samples.popleft()

    async def _drive(self) -> None:
        engine = self._engine
        while True:
            now = self._sync()
            while self._scheduled and self._scheduled[0][0] <= now:
                at, action, value = self._scheduled.pop(0)
                events = engine.advance(at)
                if events:
                    self._dispatch(events)
                self._apply(action, value, at)
                now = self._sync()
            if self.config.flavour == "sglang":
                self._sample_generation(now)
            wake = engine.next_event_at()
            if self._scheduled:
                fault_at = self._scheduled[0][0]
                wake = fault_at if wake is None else min(wake, fault_at)
            if wake is not None and wake <= now:
                await trio.lowlevel.checkpoint()
                continue
            assert self._start is not None
            deadline = math.inf if wake is None else self._start + wake
            if self._gen_samples:
                deadline = min(deadline, trio.current_time() + 1.0)  # keep the rate window fresh
            with trio.move_on_at(deadline):
                await self._driver_lot.park()

    # -- faults ------------------------------------------------------------------------------------

    def _apply(self, action: str, value: float, at: float) -> None:
        if action == "slow_down":
            self._factor = value
            self._engine.slow_down(value / self.config.speed, at=at)
        elif action == "kill":
            self._engine.kill(at=at)
        self._kick()

    def control(self, command: Mapping[str, Any]) -> dict[str, Any]:
        """Apply a ``/sim/control`` command now; returns the fault state afterwards.

        Keys: ``slow_down`` (factor > 0), ``kill`` (true), ``metrics_delay_s`` (>= 0),
        ``metrics_fail`` (bool), ``reset_faults`` (true: factor 1, metrics healthy, scheduled
        faults dropped; a dead engine stays dead).

        Raises:
            ValueError: an unknown key or a value out of range (nothing is applied).
        """
        unknown = set(command) - {
            "slow_down",
            "kill",
            "metrics_delay_s",
            "metrics_fail",
            "reset_faults",
        }
        if unknown:
            raise ValueError(f"unknown control keys: {', '.join(sorted(unknown))}")
        factor = command.get("slow_down")
        if factor is not None and (
            isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 0
        ):
            raise ValueError("slow_down must be a number > 0")
        delay = command.get("metrics_delay_s")
        if delay is not None and (
            isinstance(delay, bool) or not isinstance(delay, int | float) or not delay >= 0
        ):
            raise ValueError("metrics_delay_s must be a number >= 0")
        now = self._sync()
        if command.get("reset_faults"):
            self._scheduled.clear()
            self._metrics_delay_s = 0.0
            self._metrics_fail = False
            self._metrics_fail_after_s = None
            self._apply("slow_down", 1.0, now)
        if factor is not None:
            self._apply("slow_down", float(factor), now)
        if delay is not None:
            self._metrics_delay_s = float(delay)
        if "metrics_fail" in command:
            self._metrics_fail = bool(command["metrics_fail"])
        if command.get("kill"):
            self._apply("kill", 0.0, now)
            self._sync()
        return self.fault_state()

    def fault_state(self) -> dict[str, Any]:
        return {
            "slow_down": self._factor,
            "dead": self._engine.dead,
            "metrics_delay_s": self._metrics_delay_s,
            "metrics_fail": self._metrics_failing(),
            "scheduled": [
                {"at_s": at, "action": action, "value": value}
                for at, action, value in self._scheduled
            ],
        }

    def _metrics_failing(self) -> bool:
        after = self._metrics_fail_after_s
        return self._metrics_fail or (after is not None and self._now() >= after)

    # -- serving -----------------------------------------------------------------------------------

    async def serve(
        self, *, task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen, report ``(host, port)`` through ``task_status`` and serve until cancelled."""
        config = self.config
        try:
            listeners = await trio.open_tcp_listeners(config.port, host=config.host)
        except OSError as error:
            raise SimBackendError(
                f"cannot listen on {config.host}:{config.port}: {error.strerror or error}"
            ) from None
        port = listeners[0].socket.getsockname()[1]
        self._start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._drive)
            await nursery.start(trio.serve_listeners, self._handle_connection, listeners)
            task_status.started((config.host, port))

    async def _handle_connection(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=16 * 1024)
        try:
            peer = str(stream.socket.getpeername()[0])
        except OSError:
            return
        try:
            while True:
                request = await self._read_request(stream, conn)
                if request is None:
                    return
                exchange = _Exchange(stream, conn)
                await self._route(exchange, request[0], request[1], peer)
                if (
                    exchange.peer_gone
                    or conn.our_state is not h11.DONE
                    or conn.their_state is not h11.DONE
                ):
                    return
                conn.start_next_cycle()
        except h11.RemoteProtocolError as error:
            await self._refuse(stream, conn, error.error_status_hint, str(error))
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError):
            conn.send_failed()
        except Exception:  # a bug here must not take the other connections down
            traceback.print_exc(file=sys.stderr)
            await self._refuse(stream, conn, 500, "Internal Server Error")

    async def _refuse(
        self, stream: trio.SocketStream, conn: h11.Connection, status: int, detail: str
    ) -> None:
        if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        body = _json({"detail": detail})
        headers = [
            ("content-type", _JSON),
            ("content-length", str(len(body))),
            ("connection", "close"),
        ]
        try:
            data = conn.send(
                h11.Response(status_code=status, headers=headers, reason=_reason(status))
            )
            await stream.send_all(
                data + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
            )
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError):
            conn.send_failed()

    async def _read_request(
        self, stream: trio.SocketStream, conn: h11.Connection
    ) -> tuple[h11.Request, bytes] | None:
        """The next whole request, or ``None`` when the client closed or idled out."""
        request: h11.Request | None = None
        body = bytearray()
        idle = conn.their_state is h11.IDLE and not conn.trailing_data[0]
        with trio.CancelScope(
            deadline=trio.current_time() + (self.config.keep_alive_s if idle else _REQUEST_READ_S)
        ) as scope:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(_READ_SIZE)
                    if idle and data:
                        idle = False
                        scope.deadline = trio.current_time() + _REQUEST_READ_S
                    conn.receive_data(data)
                elif isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.Data):
                    body += event.data
                    if len(body) > _MAX_BODY_BYTES:
                        await self._refuse(stream, conn, 413, "Request body too large")
                        return None
                elif isinstance(event, h11.EndOfMessage):
                    assert request is not None
                    return request, bytes(body)
                else:  # ConnectionClosed or PAUSED
                    return None
        if not idle:
            await self._refuse(stream, conn, 408, "Request timeout")
        return None

    async def _send(
        self, exchange: _Exchange, status: int, body: bytes, content_type: str = _JSON
    ) -> None:
        conn = exchange.conn
        headers = [("content-length", str(len(body)))]
        if content_type:
            headers.append(("content-type", content_type))
        data = conn.send(h11.Response(status_code=status, headers=headers, reason=_reason(status)))
        if body:
            data += conn.send(h11.Data(data=body))
        await exchange.stream.send_all(data + conn.send(h11.EndOfMessage()))

    async def _route(
        self, exchange: _Exchange, request: h11.Request, body: bytes, peer: str
    ) -> None:
        path = request.target.partition(b"?")[0]
        method = request.method
        generation = {
            b"/v1/chat/completions": "chat",
            b"/v1/completions": "completions",
            b"/v1/responses": "responses",
        }.get(path)
        if generation is not None:
            if method != b"POST":
                await self._send(exchange, 405, _NOT_ALLOWED)
                return
            await self._generation(exchange, generation, body)  # type: ignore[arg-type]
            return
        simple = {
            b"/health": (b"GET", self._health),
            b"/metrics": (b"GET", self._metrics),
            b"/v1/models": (b"GET", self._models),
        }.get(path)
        if path == b"/sim/control":
            await self._control(exchange, method, body, peer)
        elif simple is None:
            await self._send(exchange, 404, _NOT_FOUND)
        elif method != simple[0]:
            await self._send(exchange, 405, _NOT_ALLOWED)
        else:
            await simple[1](exchange)

    async def _health(self, exchange: _Exchange) -> None:
        await self._send(exchange, 503 if self._engine.dead else 200, b"", "")

    async def _metrics(self, exchange: _Exchange) -> None:
        if self._metrics_delay_s > 0:
            await trio.sleep(self._metrics_delay_s)
        if self._metrics_failing():
            await self._send(exchange, 500, b"Internal Server Error", "text/plain; charset=utf-8")
            return
        await self._send(exchange, 200, generate_latest(self._registry), CONTENT_TYPE_PLAIN_0_0_4)

    async def _models(self, exchange: _Exchange) -> None:
        config = self.config
        created = int(time.time())
        model: dict[str, Any] = {
            "id": config.model,
            "object": "model",
            "created": created,
            "owned_by": config.flavour,
            "root": config.model,
            "parent": None,
            "max_model_len": self._max_model_len,
        }
        if config.flavour == "vllm":
            model["permission"] = [
                {
                    "id": f"modelperm-{_hex(self._rng, 32)}",
                    "object": "model_permission",
                    "created": created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ]
        await self._send(exchange, 200, _json({"object": "list", "data": [model]}))

    async def _control(self, exchange: _Exchange, method: bytes, body: bytes, peer: str) -> None:
        if not is_loopback(peer):
            await self._send(exchange, 403, _json({"detail": "sim control is loopback-only"}))
            return
        if method == b"GET":
            await self._send(exchange, 200, _json(self.fault_state()))
            return
        if method != b"POST":
            await self._send(exchange, 405, _NOT_ALLOWED)
            return
        try:
            command = json.loads(body or b"{}")
            if not isinstance(command, dict):
                raise ValueError("the body must be a JSON object")
            state = self.control(command)
        except (ValueError, UnicodeDecodeError) as invalid:
            await self._send(exchange, 400, _json({"detail": str(invalid)}))
            return
        await self._send(exchange, 200, _json(state))

    # -- generation --------------------------------------------------------------------------------

    async def _error(
        self, exchange: _Exchange, case: _ErrorCase, fields: Mapping[str, object]
    ) -> None:
        message = case.message.format_map(fields)
        param = case.param.format_map(fields) if case.param is not None else None
        body = _error_body(self.config.flavour, case.status, case.type, param, message)
        await self._send(exchange, case.status, body)

    def _limits(self, ask: _Ask) -> tuple[int, _ErrorCase | None, str]:
        """Output tokens to generate, or the error a real server gives for these lengths."""
        limit = self._max_model_len
        prompt = ask.prompt_tokens
        requested = ask.max_tokens
        if self.config.flavour == "sglang":
            if prompt >= limit:
                return 0, ERROR_CASES["context_length_exceeded"], _SGLANG_INPUT_TOO_LONG
            if requested is not None and prompt + requested > limit:
                return 0, ERROR_CASES["context_length_exceeded"], _SGLANG_TOTAL_TOO_LONG
        else:
            if prompt >= limit:
                case = ERROR_CASES["context_length_exceeded"]
                return 0, case, case.message
            if requested is not None and requested > limit:
                case = ERROR_CASES["max_tokens_greater_than_context"]
                return 0, case, case.message
        wanted = requested if requested is not None else self.config.default_max_tokens
        return max(1, min(wanted, self.config.max_output, limit - prompt)), None, ""

    def _format(self, ask: _Ask, out_tokens: int) -> _Format:
        rng, flavour = self._rng, self.config.flavour
        offset = rng.randrange(_WORD_RING)
        created = int(time.time())
        words, texts = self._words, self._texts
        if ask.kind == "chat":
            rid = f"chatcmpl-{_hex(rng, 16)}" if flavour == "vllm" else _hex(rng, 32)
            tool_id = (
                f"chatcmpl-tool-{_hex(rng, 32)}" if flavour == "vllm" else f"call_{_hex(rng, 24)}"
            )
            return _ChatFormat(
                ask,
                out_tokens,
                words,
                texts,
                offset,
                flavour=flavour,
                rid=rid,
                created=created,
                reasoning_field=self.config.reasoning_field,
                tool_id=tool_id,
            )
        if ask.kind == "completions":
            rid = f"cmpl-{_hex(rng, 16)}" if flavour == "vllm" else _hex(rng, 32)
            return _CompletionFormat(
                ask, out_tokens, words, texts, offset, flavour=flavour, rid=rid, created=created
            )
        return _ResponsesFormat(
            ask,
            out_tokens,
            words,
            texts,
            offset,
            response_id=f"resp_{_hex(rng, 32)}",
            item_id=f"msg_{_hex(rng, 32)}",
            created=created,
        )

    async def _generation(
        self, exchange: _Exchange, kind: Literal["chat", "completions", "responses"], raw: bytes
    ) -> None:
        try:
            ask = _parse_ask(kind, raw, self.config.model)
        except _BadRequest as bad:
            body = _error_body(self.config.flavour, 400, "BadRequestError", bad.param, str(bad))
            await self._send(exchange, 400, body)
            return
        if ask.stream and self._replay is not None:
            await self._watched(exchange, self._replay_stream(exchange))
            return
        out_tokens, too_long, message = self._limits(ask)
        fields = {
            "max_model_len": self._max_model_len,
            "prompt_tokens": ask.prompt_tokens,
            "max_tokens": ask.max_tokens
            if ask.max_tokens is not None
            else self.config.default_max_tokens,
            "max_tokens_param": ask.max_tokens_param,
            "total_tokens": ask.prompt_tokens + (ask.max_tokens or 0),
            "model": ask.model,
        }
        if too_long is not None:
            await self._error(exchange, attrs.evolve(too_long, message=message), fields)
            return
        case = ERROR_CASES.get(ask.sim_error or "")
        if case is not None and not (ask.sim_error == "streaming_error_mid_stream" and ask.stream):
            if case.kills_engine:
                self._apply("kill", 0.0, self._sync())
                self._sync()
            await self._error(exchange, case, fields)
            return
        try:
            seq = self._submit(ask.prompt_tokens, out_tokens)
        except EngineDead:
            await self._error(exchange, ERROR_CASES["engine_dead"], fields)
            return
        fmt = self._format(ask, out_tokens)
        try:
            if ask.stream:
                mid_stream_error = ask.sim_error == "streaming_error_mid_stream"
                await self._watched(
                    exchange, self._stream(exchange, seq, fmt, out_tokens, mid_stream_error)
                )
            else:
                await self._watched(exchange, self._reply(exchange, seq, fmt, out_tokens))
        finally:
            self._release(seq)

    def _submit(self, prompt_tokens: int, out_tokens: int) -> _Seq:
        now = self._sync()
        self._next_rid += 1
        rid = self._next_rid
        self._engine.submit(
            SimRequest(request_id=rid, prompt_tokens=prompt_tokens, max_output_tokens=out_tokens),
            at=now,
        )
        seq = self._seqs[rid] = _Seq(rid, now)
        self._kick()
        return seq

    def _release(self, seq: _Seq) -> None:
        """Abort ``seq`` in the engine unless it already ended (the client left early)."""
        if seq.end is not None:
            return
        now = self._sync()
        if seq.end is None:
            self._engine.abort(seq.rid, at=now)
            self._seqs.pop(seq.rid, None)
            seq.end = "aborted"
            self.finished_by_reason["abort"] += 1
            self._kick()

    async def _watched(self, exchange: _Exchange, work: Awaitable[None]) -> None:
        """Run ``work`` (a coroutine) while watching the socket; a close cancels the work."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_peer, exchange, nursery.cancel_scope)
            try:
                await work
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                exchange.peer_gone = True
                exchange.conn.send_failed()
            nursery.cancel_scope.cancel()

    async def _watch_peer(self, exchange: _Exchange, scope: trio.CancelScope) -> None:
        """Read while the response is produced: EOF or a reset means the client is gone."""
        buffered = 0
        while buffered <= _READ_SIZE:
            try:
                data = await exchange.stream.receive_some(_READ_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                exchange.peer_gone = True
                scope.cancel()
                return
            buffered += len(data)
            exchange.conn.receive_data(data)  # a pipelined request, kept for the next cycle

    async def _wait(self, seq: _Seq) -> None:
        while seq.end is None:
            await seq.wait_for_news()

    async def _reply(self, exchange: _Exchange, seq: _Seq, fmt: _Format, out_tokens: int) -> None:
        await self._wait(seq)
        if seq.end == "failed":
            case = ERROR_CASES["engine_dead"]
            await self._send(
                exchange,
                case.status,
                _error_body(self.config.flavour, case.status, case.type, None, case.message),
            )
            return
        generated = seq.pending
        reason = self._finish_reason(generated, out_tokens)
        await self._send(exchange, 200, fmt.body(generated, reason))

    def _finish_reason(self, generated: int, out_tokens: int) -> str:
        reason = "length" if generated >= out_tokens else "stop"
        self.finished_by_reason[reason] += 1
        return reason

    async def _stream(
        self, exchange: _Exchange, seq: _Seq, fmt: _Format, out_tokens: int, mid_stream_error: bool
    ) -> None:
        conn, stream = exchange.conn, exchange.stream
        head = conn.send(h11.Response(status_code=200, headers=_SSE_HEADERS, reason=b"OK"))
        opening = fmt.opening()
        await stream.send_all(head + conn.send(h11.Data(data=opening)) if opening else head)
        # Body chunks are framed here rather than by h11 (one call less per write); h11 still
        # writes the end, and frames everything itself for an HTTP/1.0 client.
        chunked = b"transfer-encoding: chunked" in head.lower() and os.name == "posix"
        fd = stream.socket.fileno()
        sent = 0
        while True:
            if seq.pending == 0 and seq.end is None:
                await seq.wait_for_news()
                continue
            count, seq.pending = seq.pending, 0
            payload = fmt.tokens(sent, count) if count else b""
            sent += count
            end = seq.end
            if mid_stream_error and sent:
                payload += _stream_error_event(500, "InternalServerError", "Internal server error")
                end = "aborted"
            elif end == "failed":
                payload += fmt.failure()
            elif end is not None:
                payload += fmt.finish(sent, self._finish_reason(sent, out_tokens))
            if not payload:
                continue
            if end is not None:
                data = conn.send(h11.Data(data=payload)) + conn.send(h11.EndOfMessage())
                await stream.send_all(data)
                return
            if chunked:
                await _write(stream, fd, _chunk(payload))
            else:
                await stream.send_all(conn.send(h11.Data(data=payload)))

    async def _replay_stream(self, exchange: _Exchange) -> None:
        assert self._replay is not None
        conn, send = exchange.conn, exchange.stream.send_all
        data = conn.send(h11.Response(status_code=200, headers=_SSE_HEADERS, reason=b"OK"))
        interval = self.config.replay_interval_s
        for index, event in enumerate(self._replay):
            if index:
                await trio.sleep(interval)
            await send(data + conn.send(h11.Data(data=event)))
            data = b""
        await send(data + conn.send(h11.EndOfMessage()))


async def serve_sim_backend(
    config: SimBackendConfig,
    *,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve a simulated backend until cancelled; reports ``(host, port)`` once bound."""
    await SimBackend(config).serve(task_status=task_status)
