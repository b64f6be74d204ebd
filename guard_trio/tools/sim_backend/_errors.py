"""The errors a real vLLM or SGLang server writes, as the simulated backend writes them.

Reads: ``sim_error`` case names and the lengths of a request, from the server module.

Guarantees: bodies are byte for byte what the servers write (the templates of
``../shared/data/errors``, serialised the way Starlette's ``JSONResponse`` does it: compact
separators, UTF-8); vLLM (>= 0.10) nests the error object and SGLang writes it flat; a stream
that already started ends with vLLM's error event and ``data: [DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

import attrs

from guard_trio.tools.sim_backend._config import Flavour


@attrs.frozen
class ErrorCase:
    """One error a real server writes: status, ``type``, ``param`` and the message template.

    Placeholders: ``{max_model_len}``, ``{prompt_tokens}``, ``{max_tokens}``,
    ``{max_tokens_param}``, ``{model}``.
    """

    status: int
    type: str
    param: str | None
    message: str
    kills_engine: bool = False


ENGINE_DEAD_MESSAGE: Final = "The server had an error while processing your request."

#: ``sim_error`` cases, named after the files of ``../shared/data/errors``, with vLLM 0.33.0's
#: wording (the newest the files give).
ERROR_CASES: Final[Mapping[str, ErrorCase]] = MappingProxyType(
    {
        "context_length_exceeded": ErrorCase(
            400,
            "BadRequestError",
            "input_tokens",
            "This model's maximum context length is {max_model_len} tokens. However, your prompt"
            " contains {prompt_tokens} input tokens, which exceeds this limit even without any"
            " output tokens. Please reduce the length of the input prompt.",
        ),
        "max_tokens_greater_than_context": ErrorCase(
            400,
            "BadRequestError",
            "{max_tokens_param}",
            "{max_tokens_param}={max_tokens} cannot be greater than"
            " max_total_tokens={max_model_len}. Please request fewer output tokens.",
        ),
        "multimodal_image_url_http_4xx": ErrorCase(
            422,
            "UnprocessableEntityError",
            "image_url",
            "Failed to fetch media from URL: HTTP 403 error",
        ),
        "multimodal_image_decode_or_invalid_url": ErrorCase(
            400,
            "BadRequestError",
            None,
            "Failed to load image: cannot identify image file <_io.BytesIO object at"
            " 0x7f3a5c2e1b20>",
        ),
        "tool_call_arguments_invalid_json_in_history": ErrorCase(
            400, "BadRequestError", None, "Expecting value: line 1 column 1 (char 0)"
        ),
        "model_not_found": ErrorCase(
            404, "NotFoundError", "model", "The model `{model}` does not exist."
        ),
        "admission_queue_full": ErrorCase(
            503,
            "Service Unavailable",
            None,
            "The engine is currently busy and cannot accept new requests. Please try again"
            " later or on a different instance.",
        ),
        "generation_error_finish_reason_error": ErrorCase(
            500, "InternalServerError", None, "Internal server error"
        ),
        "engine_dead": ErrorCase(500, "InternalServerError", None, ENGINE_DEAD_MESSAGE),
        # A CUDA fault kills the engine; the request (and every later one) sees the dead engine.
        "runtime_cuda_error_or_oom": ErrorCase(
            500, "InternalServerError", None, ENGINE_DEAD_MESSAGE, kills_engine=True
        ),
        # Handled in the stream: a 200 whose stream ends with an error event and [DONE].
        "streaming_error_mid_stream": ErrorCase(
            500, "InternalServerError", None, "Internal server error"
        ),
    }
)

#: SGLang's answer when its scheduler's waiting queue is at ``--max-queued-requests`` (the
#: request is aborted unstarted with a 503). ``../shared/data/errors`` has no SGLang sample of
#: it; the wording is SGLang's scheduler's, the body its flat error shape.
SGLANG_QUEUE_FULL: Final = ErrorCase(503, "ServiceUnavailable", None, "The request queue is full.")

SGLANG_INPUT_TOO_LONG: Final = (
    "The input ({prompt_tokens} tokens) is longer than the model's context length"
    " ({max_model_len} tokens)."
)
SGLANG_TOTAL_TOO_LONG: Final = (
    "Requested token count exceeds the model's maximum context length of {max_model_len} tokens."
    " You requested a total of {total_tokens} tokens: {prompt_tokens} tokens from the input"
    " messages and {max_tokens} tokens for the completion. Please reduce the number of tokens in"
    " the input messages or the completion to fit within the limit."
)


def json_bytes(value: object) -> bytes:
    """JSON as Starlette's ``JSONResponse`` writes it (and pydantic's ``model_dump_json``)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def error_body(
    flavour: Flavour, status: int, error_type: str, param: str | None, message: str
) -> bytes:
    """vLLM (>= 0.10) nests the error object; SGLang (like vLLM <= 0.9) writes it flat."""
    if flavour == "sglang":
        return json_bytes(
            {
                "object": "error",
                "message": message,
                "type": error_type,
                "param": None,
                "code": status,
            }
        )
    return json_bytes(
        {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    )


def stream_error_event(status: int, error_type: str, message: str) -> bytes:
    """The error event vLLM writes into a stream that already started (``json.dumps`` spacing)."""
    payload = {"error": {"message": message, "type": error_type, "param": None, "code": status}}
    return b"data: " + json.dumps(payload).encode("utf-8") + b"\n\ndata: [DONE]\n\n"
