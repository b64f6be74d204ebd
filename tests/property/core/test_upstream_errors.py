"""Upstream 500 reclassification, checked against real vLLM and SGLang error wording.

The example tests read ``tests/fixtures/errors/*.json`` (a copy of ``../shared/data/errors``; see
the README there). Every message template in a file is filled with plausible values and sent the
way a misbehaving or older backend would send it: as a 500 whose ``error.type`` is
``InternalServerError``, in vLLM's nested ``{"error": {...}}`` body and, where the file shows it,
in the flat ``{"object": "error", ...}`` body of SGLang and vLLM <= 0.9. The same wording is also
sent as the backend really answers it (its own 4xx/5xx status and type), which must pass through.
Only the verdict per case is written down here (``CASE_VERDICT``); the wording comes from the data,
so a new or changed fixture file changes what is tested.

The properties at the end cover the gate (status, media type, size, type and code), what a
rewrite keeps, and that no input at all makes ``reclassify`` raise.
"""

from __future__ import annotations

import ast
import copy
import json
import re
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard_core.upstream_errors import (
    BODY_LIMIT,
    ClientErrorKind,
    Reclassified,
    is_candidate,
    reclassify,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "errors"
JSON = "application/json"
INTERNAL = "InternalServerError"
SSE = "text/event-stream"


class Verdict(NamedTuple):
    status: int
    error_type: str
    kind: ClientErrorKind


CONTEXT = Verdict(400, "BadRequestError", ClientErrorKind.CONTEXT_LENGTH)
VALIDATION = Verdict(400, "BadRequestError", ClientErrorKind.VALIDATION)
BAD_JSON = Verdict(400, "BadRequestError", ClientErrorKind.JSON_DECODE)
MEDIA = Verdict(422, "UnprocessableEntityError", ClientErrorKind.IMAGE_INPUT)

#: What a 500 carrying a case's wording must become; ``None`` means "pass it through as is".
CASE_VERDICT: dict[str, Verdict | None] = {
    # the client's fault: rewritten
    "context_length_exceeded": CONTEXT,
    "max_tokens_greater_than_context": CONTEXT,
    "sglang_context_length_and_error_shape": CONTEXT,
    "vllm_validation_error_generic": VALIDATION,
    "request_body_schema_validation": VALIDATION,
    "tool_call_arguments_invalid_json_in_history": BAD_JSON,
    "multimodal_image_decode_or_invalid_url": MEDIA,
    "multimodal_image_url_http_4xx": MEDIA,
    # the server's (or the media host's) fault: never rewritten
    "multimodal_image_url_transient_fetch_failure": None,
    "engine_dead": None,
    "runtime_cuda_error_or_oom": None,
    "scheduler_stall_request_larger_than_kv_cache": None,
    "startup_memory_errors": None,
    "generation_error_finish_reason_error": None,
    "admission_queue_full": None,
    "streaming_error_mid_stream": None,
    # a client mistake, but outside the four families: there is no 404 rewrite
    "model_not_found": None,
}

#: Messages whose verdict differs from their case's, picked by how the message starts.
MESSAGE_VERDICT: tuple[tuple[str, Verdict | None], ...] = (
    # vLLM answers this one with 501: the server lacks a feature, the client made no mistake.
    ("Only base64 data URLs are supported", None),
    # The client's image host does not resolve: PIG's rule 4 treats that as the client's doing,
    # unlike the timeouts and 5xx/408/429 answers in the same (transient fetch) file.
    ("Cannot connect to host", MEDIA),
)

#: Values for the ``{placeholders}`` in the templates.
FILL: dict[str, str] = {
    "max_model_len": "8192",
    "qualifier": "at least ",
    "prompt_tokens": "9000",
    "n_chars": "41000",
    "max_input_chars": "32768",
    "max_input_tokens": "8192",
    "max_output_tokens": "1024",
    "total": "10024",
    "max_tokens": "16384",
    "prompt_tokens+max_tokens": "25384",
    "max_output_tokens_param": "max_completion_tokens",
    "max_total_tokens_param": "max_total_tokens",
    "model": "gpt-4o-mini",
    "served_names": "['Qwen/Qwen2.5-7B-Instruct']",
    "w": "12000",
    "h": "10000",
    "w*h": "120000000",
    "max_pixels": "89478485",
    "url[:32]": "data:image/png;base64iVBORw0KGgo",
    "allowed": "['upload.wikimedia.org']",
    "host": "images.attacker.example",
    "mb": "25",
    "n": "26214400",
    "status": "403",
    "needed": "16.0",
    "available": "9.42",
    "est": "77120",
    "num_reqs": "256",
    "pydantic error dict, input truncated to 200 chars": (
        "{'type': 'missing', 'loc': ('body', 'messages'), 'msg': 'Field required', "
        "'input': {'model': 'Qwen/Qwen2.5-7B-Instruct', 'max_tokens': 64}}"
    ),
    "str(exc)": (
        "[{'type': 'missing', 'loc': ('body', 'messages'), 'msg': 'Field required', "
        "'input': {'model': 'Qwen/Qwen2.5-7B-Instruct'}}]"
    ),
    "str(exc.errors())": (
        "[{'type': 'missing', 'loc': ('body', 'messages'), 'msg': 'Field required', "
        "'input': {'model': 'Qwen/Qwen2.5-7B-Instruct'}}]"
    ),
}
CASE_FILL: dict[str, dict[str, str]] = {
    "request_body_schema_validation": {"count": "12", "n": "2"},
    "sglang_context_length_and_error_shape": {
        "input_tokens": "40000",
        "context_len": "32768",
        "max_new_tokens": "2048",
        "total": "42048",
    },
}

#: Wording a file gives only in its prose, quoted (a test checks that each quote is in the file)
#: and made concrete.
QUOTED: tuple[tuple[str, str, str], ...] = (
    (
        "tool_call_arguments_invalid_json_in_history",
        "Expecting value: line 1 column 1 (char 0)",
        "Expecting value: line 1 column 1 (char 0)",
    ),
    (
        "tool_call_arguments_invalid_json_in_history",
        "Expecting ',' delimiter: line 1 column N (char M)",
        "Expecting ',' delimiter: line 1 column 87 (char 86)",
    ),
    (
        # vLLM 0.9.x/0.10.x chat path: f"{e} {e.__cause__}" adds " None"
        "tool_call_arguments_invalid_json_in_history",
        "appends ' None'",
        "Expecting ',' delimiter: line 1 column 87 (char 86) None",
    ),
    (
        "runtime_cuda_error_or_oom",
        "CUDA error: an illegal memory access",
        "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
        "asynchronously reported at some other API call, so the stacktrace below might be "
        "incorrect.",
    ),
    (
        "runtime_cuda_error_or_oom",
        "failed (engine dead).",
        "Request chatcmpl-6a1f0c2e9b7d4e35 failed (engine dead).",
    ),
    (
        "multimodal_image_url_transient_fetch_failure",
        "asyncio.exceptions.TimeoutError",
        "asyncio.exceptions.TimeoutError",
    ),
    (
        "scheduler_stall_request_larger_than_kv_cache",
        "Scheduler deadlocks when request exceeds KV cache capacity but is within max_model_len",
        "Scheduler deadlocks when request exceeds KV cache capacity but is within max_model_len",
    ),
)

_IMAGE = "https://upload.wikimedia.org/wikipedia/commons/a/a7/Camponotus_flavomarginatus_ant.jpg"

#: Messages a file describes without spelling them out, written the way the library that raises
#: them (aiohttp, asyncio, PyTorch, SGLang) words them.
DESCRIBED: tuple[tuple[str, str], ...] = (
    # str(asyncio.TimeoutError()) is empty, and vLLM puts str(exc) in the message
    ("multimodal_image_url_transient_fetch_failure", ""),
    ("multimodal_image_url_transient_fetch_failure", f"Connection timeout to host {_IMAGE}"),
    ("multimodal_image_url_transient_fetch_failure", "Timeout on reading data from socket"),
    (
        "multimodal_image_url_transient_fetch_failure",
        f"408, message='Request Timeout', url='{_IMAGE}'",
    ),
    (
        "multimodal_image_url_transient_fetch_failure",
        f"429, message='Too Many Requests', url='{_IMAGE}'",
    ),
    (
        "multimodal_image_url_transient_fetch_failure",
        f"500, message='Internal Server Error', url='{_IMAGE}'",
    ),
    ("multimodal_image_url_transient_fetch_failure", f"502, message='Bad Gateway', url='{_IMAGE}'"),
    (
        "multimodal_image_url_transient_fetch_failure",
        f"503, message='Service Unavailable', url='{_IMAGE}'",
    ),
    (
        "multimodal_image_url_transient_fetch_failure",
        f"504, message='Gateway Timeout', url='{_IMAGE}'",
    ),
    (
        "multimodal_image_url_transient_fetch_failure",
        "Cannot connect to host images.nonexistent.example:443 ssl:default "
        "[Name or service not known]",
    ),
    (
        "runtime_cuda_error_or_oom",
        "CUDA out of memory. Tried to allocate 1.95 GiB. GPU 0 has a total capacity of 79.19 GiB "
        "of which 1.02 GiB is free. Of the allocated memory 75.30 GiB is allocated by PyTorch, and "
        "1.10 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is "
        "large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
        "fragmentation.",
    ),
    (
        "scheduler_stall_request_larger_than_kv_cache",
        "Scheduler hit an exception: Traceback (most recent call last):\n"
        '  File "scheduler.py", line 2402, in run_scheduler_process\n'
        "    scheduler.event_loop_overlap()\n"
        "RuntimeError: the waiting queue made no progress for 600 s",
    ),
)


class Sample(NamedTuple):
    id: str
    status: int
    content_type: str | None
    body: bytes
    expect: Verdict | None


# -- reading the fixture files ------------------------------------------------------------------

_TEMPLATE_KEYS = (
    "message_template",
    "message_templates",
    "message",
    "also",
    "message_template_0_33",
    "message_template_0_10",
    "example_templates_0_33",
    "server_log_message",
    "log",
)
#: Files whose "message" fields are prose about the wording, used through ``QUOTED`` instead.
_PROSE_ONLY = frozenset({"tool_call_arguments_invalid_json_in_history"})
_PLACEHOLDER = re.compile(r"\{([^{}]+)\}")
_VALIDATION_SUFFIX = re.compile(r"appends '([^']*)'")
_EXCEPTION_ARGS = re.compile(r"VLLMValidationError\(parameter='(\w+)', value=<(\w+)>\)")
_PRINTED_MESSAGE = re.compile(r"""'message': ("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')""")


def _load(case: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((FIXTURES / f"{case}.json").read_text(encoding="utf-8"))
    return document


def _raw(case: str) -> str:
    return (FIXTURES / f"{case}.json").read_text(encoding="utf-8")


def _fill(case: str, template: str) -> str:
    values = {**FILL, **CASE_FILL.get(case, {})}

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in values:
            return values[name]
        example = name.partition("e.g. ")[2]
        if example:
            return example.replace("0x...", "0x7f3a2c1b9e40")
        raise KeyError(f"{case}: no test value for {{{name}}}; add one to FILL")

    return _PLACEHOLDER.sub(one, template).replace("error(s)", "errors")


def _concrete(value: Any) -> Any:
    """A body-shape value made real: ``"<dotted loc, e.g. body.messages>"`` -> ``body.messages``."""
    if isinstance(value, str) and value.startswith("<") and "e.g. " in value:
        return value.partition("e.g. ")[2].rstrip(">")
    return value


def _is_stand_in(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("<message")


def _verdict(case: str, message: str) -> Verdict | None:
    for prefix, verdict in MESSAGE_VERDICT:
        if message.startswith(prefix):
            return verdict
    return CASE_VERDICT[case]


def _templates(entry: dict[str, Any], shape: dict[str, Any] | None) -> list[str]:
    found: list[str] = []
    for key in _TEMPLATE_KEYS:
        value = entry.get(key)
        if isinstance(value, str):
            found.append(value.splitlines()[0] if key == "log" else value)
        elif isinstance(value, list):
            found.extend(item for item in value if isinstance(item, str))
    for body in (shape, entry.get("observed_body")):
        error = _error_of(body)
        message = None if error is None else error.get("message")
        if isinstance(message, str) and not _is_stand_in(message):
            found.append(message)
    return list(dict.fromkeys(found))


def _error_of(document: Any) -> dict[str, Any] | None:
    if not isinstance(document, dict):
        return None
    inner = document.get("error")
    if isinstance(inner, dict):
        return inner
    return document if "message" in document else None


def _body(document: Any) -> bytes:
    return json.dumps(document).encode("utf-8")


def _nested(message: str, param: Any, error_type: Any = INTERNAL, code: Any = 500) -> Any:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _flat(message: str, param: Any, error_type: Any = INTERNAL, code: Any = 500) -> Any:
    return {"object": "error", "message": message, "type": error_type, "param": param, "code": code}


def _documented(shape: dict[str, Any], message: str, error_type: Any, code: Any) -> Any:
    """The file's body shape with the message filled in and the given type and code."""
    document = copy.deepcopy(shape)
    error = _error_of(document)
    assert error is not None
    for key, value in list(error.items()):
        error[key] = message if _is_stand_in(value) else _concrete(value)
    if error_type is not None:
        error["type"] = error_type
    error["code"] = code
    return document


def _message_forms(case: str, doc: dict[str, Any], entry: dict[str, Any], text: str) -> list[str]:
    """The messages a backend produces from one filled template."""
    if case == "vllm_validation_error_generic":
        # vLLM never sends these sentences bare: str(VLLMValidationError) adds its parameter,
        # and inside a request model validator FastAPI wraps it into a validation entry whose
        # ctx holds the exception's repr.
        suffix_match = _VALIDATION_SUFFIX.search(doc["mapping"])
        assert suffix_match is not None
        named = re.search(r"`(\w+)", text)
        parameter = named.group(1) if named else "response_format"
        suffix = suffix_match.group(1).replace("<p>", parameter).replace("<v>", "auto")
        wrapped = (
            "1 validation error:\n  {'type': 'value_error', 'loc': ('body',), "
            f"'msg': {'Value error, ' + text!r}, 'input': {{'model': 'm'}}, "
            f"'ctx': {{'error': VLLMValidationError({text!r})}}}}"
        )
        return [text + suffix, wrapped]
    forms = [text]
    raised = _EXCEPTION_ARGS.search(str(entry.get("exception", "")))
    if raised is not None:  # the str() of the VLLMValidationError the file names
        forms.append(f"{text} (parameter={raised.group(1)}, value={FILL[raised.group(2)]})")
    return forms


def _template_samples(case: str, doc: dict[str, Any]) -> list[Sample]:
    samples: list[Sample] = []
    versions: list[dict[str, Any]] = doc.get("by_version") or [doc]
    for v_index, version in enumerate(versions):
        entries = version.get("variants") or [version]
        for e_index, entry in enumerate(entries):
            status = entry.get("http_status", version.get("http_status", doc.get("http_status")))
            error_type = entry.get("error_type", version.get("error_type", doc.get("error_type")))
            shape = (
                version.get("body_shape")
                or doc.get("body_shape")
                or doc.get("body_shape_non_streaming")
            )
            shape_error = _error_of(shape)
            param = _concrete(shape_error.get("param")) if shape_error else entry.get("param")
            flat = isinstance(shape, dict) and shape.get("object") == "error"
            filled = dict.fromkeys(_fill(case, template) for template in _templates(entry, shape))
            for t_index, text in enumerate(filled):
                for f_index, message in enumerate(_message_forms(case, doc, version, text)):
                    stem = f"{case}[{v_index}.{e_index}]#{t_index}.{f_index}"
                    verdict = _verdict(case, message)
                    samples.append(
                        Sample(
                            f"{stem}:nested-500", 500, JSON, _body(_nested(message, param)), verdict
                        )
                    )
                    if flat:
                        samples.append(
                            Sample(
                                f"{stem}:flat-500", 500, JSON, _body(_flat(message, param)), verdict
                            )
                        )
                    if isinstance(status, int) and status != 500:
                        # as the backend really answers it
                        answered = (
                            _documented(shape, message, error_type, status)
                            if shape is not None
                            else _nested(message, param, error_type, status)
                        )
                        samples.append(
                            Sample(f"{stem}:as-sent-{status}", status, JSON, _body(answered), None)
                        )
                    if isinstance(error_type, str) and error_type != INTERNAL:
                        # only the status is wrong: the backend's own type still marks it as handled
                        kept = _nested(message, param, error_type, 500)
                        samples.append(
                            Sample(f"{stem}:type-kept-500", 500, JSON, _body(kept), None)
                        )
            observed = version.get("observed_body")
            if isinstance(observed, dict) and isinstance(status, int):
                samples.append(
                    Sample(
                        f"{case}[{v_index}]:observed-{status}", status, JSON, _body(observed), None
                    )
                )
    return samples


def _printed(printed: str) -> tuple[int, dict[str, Any]]:
    """Status and body from openai-python's ``Error code: 400 - {...}`` (maybe cut short)."""
    head, _, text = printed.partition(" - ")
    status = int(head.rsplit(" ", 1)[-1])
    try:
        document = ast.literal_eval(text)
    except (ValueError, SyntaxError):  # the repr is cut with "..."
        found = _PRINTED_MESSAGE.search(text)
        assert found is not None, printed
        message = ast.literal_eval(found.group(1))
        if text.startswith("{'object': 'error'"):
            document = _flat(message, None, "BadRequestError", status)
        else:
            document = _nested(message, None, "BadRequestError", status)
    assert isinstance(document, dict)
    return status, document


def _observed_samples(case: str, doc: dict[str, Any]) -> list[Sample]:
    samples: list[Sample] = []
    for index, item in enumerate(doc.get("observed_bodies", [])):
        status, document = _printed(item["as_printed_by_openai_python"])
        samples.append(
            Sample(f"{case}:observed{index}-as-sent-{status}", status, JSON, _body(document), None)
        )
        error = _error_of(document)
        assert error is not None
        error["type"], error["code"] = INTERNAL, 500
        verdict = _verdict(case, error["message"])
        samples.append(
            Sample(f"{case}:observed{index}-as-500", 500, JSON, _body(document), verdict)
        )
    for index, item in enumerate(doc.get("contrast_non_vllm", [])):
        if "body" in item:
            status, document = 400, item["body"]
        else:
            status, document = _printed(item["as_printed_by_openai_python"])
        name = item["provider"].split()[0].lower()
        samples.append(
            Sample(f"{case}:{name}{index}-as-sent-{status}", status, JSON, _body(document), None)
        )
        # another provider's own type (invalid_request_error) is never ours to rewrite
        samples.append(Sample(f"{case}:{name}{index}-as-500", 500, JSON, _body(document), None))
    return samples


def _sse(event: str) -> bytes:
    return f"{event}\n\ndata: [DONE]\n\n".encode()


def _special_samples() -> list[Sample]:
    """Cases whose file documents a body that is not an error object at all."""
    samples: list[Sample] = []
    assert "empty body" in _raw("engine_dead")  # vLLM 0.10.2 answers a bare 500
    samples.append(Sample("engine_dead:empty-500", 500, None, b"", None))
    samples.append(Sample("engine_dead:empty-500-json", 500, JSON, b"", None))

    assert "plain-text 'Internal Server Error' body" in _raw("multimodal_image_url_http_4xx")
    plain = b"Internal Server Error"
    samples.append(
        Sample(
            "multimodal_image_url_http_4xx:starlette-plain-500",
            500,
            "text/plain; charset=utf-8",
            plain,
            None,
        )
    )

    wire = _load("streaming_error_mid_stream")["wire_format"].split(" then ")[0]
    context = _fill(
        "context_length_exceeded",
        _load("context_length_exceeded")["by_version"][0]["message_template"],
    )
    for name, message, error_type, code in (
        # even a payload that would be rewritten as a JSON 500 is left alone inside a stream
        ("client-wording", context, INTERNAL, 500),
        ("server-wording", "Internal server error", INTERNAL, 500),
    ):
        event = (
            wire.replace('"message": "..."', f'"message": {json.dumps(message)}', 1)
            .replace('"type": "..."', f'"type": {json.dumps(error_type)}', 1)
            .replace("<int>", str(code))
            .replace("\\n", "")
        )
        for status in (200, 500):
            samples.append(
                Sample(
                    f"streaming_error_mid_stream:{name}-{status}", status, SSE, _sse(event), None
                )
            )

    streamed = _load("sglang_context_length_and_error_shape")["body_shape_streaming"]
    sglang = _fill(
        "sglang_context_length_and_error_shape",
        _load("sglang_context_length_and_error_shape")["message_templates"][0],
    )
    event = streamed.split("  (", 1)[0].replace('"<message>"', json.dumps(sglang))
    samples.append(
        Sample("sglang_context_length_and_error_shape:stream-200", 200, SSE, _sse(event), None)
    )
    samples.append(
        Sample("sglang_context_length_and_error_shape:stream-500", 500, SSE, _sse(event), None)
    )
    return samples


def _all_samples() -> list[Sample]:
    samples: list[Sample] = []
    for case in sorted(CASE_VERDICT):
        doc = _load(case)
        if case not in _PROSE_ONLY:
            samples += _template_samples(case, doc)
        samples += _observed_samples(case, doc)
    for index, (case, _quote, message) in enumerate(QUOTED):
        body = _body(_nested(message, None))
        samples.append(
            Sample(f"{case}:quoted{index}:nested-500", 500, JSON, body, _verdict(case, message))
        )
    for index, (case, message) in enumerate(DESCRIBED):
        body = _body(_nested(message, None))
        samples.append(
            Sample(f"{case}:described{index}:nested-500", 500, JSON, body, _verdict(case, message))
        )
    samples += _special_samples()
    return samples


SAMPLES = _all_samples()


def _rewritten_messages(client: bool) -> list[str]:
    found: list[str] = []
    for sample in SAMPLES:
        if sample.id.endswith(":nested-500") and (sample.expect is not None) == client:
            found.append(json.loads(sample.body)["error"]["message"])
    return sorted(set(found))


CLIENT_MESSAGES = _rewritten_messages(client=True)
SERVER_MESSAGES = _rewritten_messages(client=False)


def _assert_only_code_and_type_changed(original: bytes, result: Reclassified) -> None:
    expected = json.loads(original)
    error = _error_of(expected)
    assert error is not None
    message = error["message"]
    error["code"], error["type"] = result.status, result.error_type
    after = json.loads(result.body.decode("utf-8"))
    assert after == expected
    out_error = _error_of(after)
    assert out_error is not None
    assert out_error["code"] == result.status
    assert out_error["message"] == message


# -- example tests from the data ----------------------------------------------------------------


def test_every_fixture_file_has_a_verdict() -> None:
    assert sorted(CASE_VERDICT) == sorted(path.stem for path in FIXTURES.glob("*.json"))


@pytest.mark.parametrize(("case", "quote", "message"), QUOTED, ids=[q[1][:40] for q in QUOTED])
def test_quoted_wording_is_in_its_file(case: str, quote: str, message: str) -> None:
    assert quote in _raw(case)
    assert message


@pytest.mark.parametrize("case", sorted(CASE_VERDICT))
def test_every_case_is_exercised(case: str) -> None:
    assert any(sample.id.startswith(case) for sample in SAMPLES)


@pytest.mark.parametrize("sample", SAMPLES, ids=[sample.id for sample in SAMPLES])
def test_fixture_wording(sample: Sample) -> None:
    result = reclassify(sample.status, sample.content_type, sample.body)
    if sample.expect is None:
        assert result is None
        return
    assert result is not None
    assert (result.status, result.error_type, result.kind) == sample.expect
    _assert_only_code_and_type_changed(sample.body, result)


_FETCH_STATUS = [(s, MEDIA) for s in (400, 401, 403, 404, 410, 451)] + [
    (s, None) for s in (408, 429, 500, 502, 503, 504)
]


@pytest.mark.parametrize(
    ("status", "verdict"), _FETCH_STATUS, ids=[str(s) for s, _ in _FETCH_STATUS]
)
def test_media_fetch_status_in_vllm_wording(status: int, verdict: Verdict | None) -> None:
    """vLLM's own sentence for a failed media fetch: only the host's real 4xx is the client's."""
    template = _load("multimodal_image_url_http_4xx")["by_version"][0]["message_template"]
    message = template.replace("{status}", str(status))
    result = reclassify(500, JSON, _body(_nested(message, "image_url")))
    if verdict is None:
        assert result is None
    else:
        assert result is not None
        assert (result.status, result.error_type, result.kind) == verdict


_LOOKALIKES = {
    # FastAPI's response validation: the server built a bad response
    "response-validation": (
        "1 validation error:\n  {'type': 'string_type', 'loc': ('response', 'choices', 0, "
        "'message', 'content'), 'msg': 'Input should be a valid string', 'input': 42}"
    ),
    # pydantic on an internal model
    "pydantic-internal": (
        "1 validation error for ChatCompletionResponse\nchoices.0.message.content\n  Input "
        "should be a valid string [type=string_type, input_value=42, input_type=int]"
    ),
    "engine-dead": "EngineDeadError: EngineCore encountered an issue.",
    "kv-cache": "Request exceeds the KV cache capacity (4096 blocks); waiting for free blocks",
    "startup-len": "the estimated maximum model length is 77120; decrease `max_model_len`",
}


@pytest.mark.parametrize("message", _LOOKALIKES.values(), ids=_LOOKALIKES.keys())
def test_server_failures_that_resemble_client_ones(message: str) -> None:
    assert reclassify(500, JSON, _body(_nested(message, None))) is None


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (
            "Failed to load image: cannot identify image file "
            "<_io.BytesIO object at 0x7f3a2c1b9e40>",
            b'{"error":{"code":422,"message":"Failed to load image: cannot identify image file '
            b'\\u003c_io.BytesIO object at 0x7f3a2c1b9e40\\u003e","param":"image_url",'
            b'"type":"UnprocessableEntityError"}}',
        ),
    ],
    ids=["image-decode-nested"],
)
def test_exact_bytes_nested(message: str, expected: bytes) -> None:
    # spaces, indentation and key order of the input do not survive: PIG writes Go's encoding
    body = json.dumps(_nested(message, "image_url"), indent=2).encode()
    result = reclassify(500, JSON, body)
    assert result is not None
    assert result.body == expected


def test_exact_bytes_flat_with_ampersand_and_empty_type() -> None:
    body = _body(
        _flat("403, message='Forbidden', url='https://img.example.com/c.png?w=64&h=64'", None, "")
    )
    result = reclassify(500, "application/json; charset=utf-8", body)
    assert result is not None
    assert result.body == (
        b'{"code":422,"message":"403, message=\'Forbidden\', '
        b'url=\'https://img.example.com/c.png?w=64\\u0026h=64\'","object":"error",'
        b'"param":null,"type":"UnprocessableEntityError"}'
    )


@pytest.mark.parametrize("ascii_input", [True, False], ids=["escaped-input", "utf8-input"])
def test_non_ascii_message_is_written_as_utf8(ascii_input: bool) -> None:
    message = (
        "This model's maximum context length is 4096 tokens. "
        "R\u00e9sum\u00e9 \u65e5\u672c\u8a9e \U0001f642 line\u2028sep"
    )
    body = json.dumps(_nested(message, None), ensure_ascii=ascii_input).encode("utf-8")
    result = reclassify(500, JSON, body)
    assert result is not None
    assert "R\u00e9sum\u00e9 \u65e5\u672c\u8a9e \U0001f642".encode() in result.body
    assert b"\\u00e9" not in result.body
    assert b"\\u2028" in result.body  # Go escapes the JavaScript line separators
    assert json.loads(result.body.decode("utf-8"))["error"]["message"] == message


def test_lone_surrogate_escape_becomes_replacement_character() -> None:
    body = (
        b'{"error":{"message":"maximum context length \\ud800!",'
        b'"type":"InternalServerError","code":500}}'
    )
    result = reclassify(500, JSON, body)
    assert result is not None
    assert (
        json.loads(result.body.decode("utf-8"))["error"]["message"]
        == "maximum context length \ufffd!"
    )


@pytest.mark.parametrize(
    "body",
    [
        _body(_nested("maximum context length", None))[:-1] + b',"x":1e400}',
        _body(_nested("maximum context length", None))[:-1]
        + b',"x":'
        + b"[" * 5000
        + b"]" * 5000
        + b"}",
        b"[" * 60000,
        b'{"error":' * 7000,
        b'{"error":{"message":"extra data: \xff","code":500,"type":"InternalServerError"}}',
    ],
    ids=["number-beyond-float64", "deep-nesting", "deep-unclosed", "deep-objects", "bad-utf8"],
)
def test_bodies_go_cannot_decode_pass_through(body: bytes) -> None:
    assert len(body) <= BODY_LIMIT
    assert reclassify(500, JSON, body) is None


def test_body_limit_is_inclusive() -> None:
    base = _body(_nested("This model's maximum context length is 8192 tokens.", None))
    at_limit = base + b" " * (BODY_LIMIT - len(base))
    assert reclassify(500, JSON, at_limit) is not None
    assert reclassify(500, JSON, at_limit + b" ") is None


@pytest.mark.parametrize(
    ("status", "content_type", "length", "expected"),
    [
        (500, JSON, None, True),
        (500, JSON, BODY_LIMIT, True),
        (500, JSON, BODY_LIMIT + 1, False),
        (500, b"application/problem+json", 10, True),
        (500, "Application/JSON; charset=UTF-8", 10, True),
        (500, "text/plain", 10, False),
        (500, None, 10, False),
        (502, JSON, 10, False),
        (200, SSE, None, False),
    ],
)
def test_is_candidate(
    status: int, content_type: str | bytes | None, length: int | None, expected: bool
) -> None:
    assert is_candidate(status, content_type, length) is expected


# -- properties ---------------------------------------------------------------------------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
_json_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
_client_messages = st.sampled_from(CLIENT_MESSAGES)


@st.composite
def _client_documents(draw: st.DrawFn, message: str | None = None) -> dict[str, Any]:
    """A 500 error document that names a client mistake, with arbitrary extra fields."""
    if message is None:
        message = draw(st.text(max_size=20)) + draw(_client_messages) + draw(st.text(max_size=20))
    flat = draw(st.booleans())
    error_extra = draw(
        st.dictionaries(
            st.text(max_size=8).filter(
                lambda k: k not in {"message", "type", "code", "error", "object"}
            ),
            _json_values,
            max_size=3,
        )
    )
    top_extra = draw(
        st.dictionaries(
            st.text(max_size=8).filter(
                lambda k: k not in {"message", "type", "code", "error", "object"}
            ),
            _json_values,
            max_size=3,
        )
    )
    error_type = draw(st.sampled_from([INTERNAL, "", None]))
    code = draw(st.sampled_from([500, 500.0, "500", " 500 ", "500.0", None]))
    if code is None:
        error_type = INTERNAL  # without a code only an explicit InternalServerError counts
    error: dict[str, Any] = {**error_extra, "message": message}
    if error_type is not None:
        error["type"] = error_type
    if code is not None:
        error["code"] = code
    if flat:
        return {**top_extra, **error, "object": "error"}
    return {**top_extra, "error": error}


_json_types = st.one_of(
    st.just("application/json"),
    st.from_regex(r"application/(vnd\.[a-z]{1,8}|problem|[a-z]{1,8})\+json", fullmatch=True),
)
_params = st.lists(
    st.sampled_from(["charset=utf-8", 'charset="UTF-8"', "q=0.9", "v=2"]), max_size=2
)


@st.composite
def _json_content_types(draw: st.DrawFn) -> str | bytes:
    base = draw(_json_types)
    upper = draw(st.lists(st.booleans(), min_size=len(base), max_size=len(base)))
    text = "".join(c.upper() if up else c for c, up in zip(base, upper, strict=True))
    text += "".join(";" + draw(st.sampled_from(["", " "])) + p for p in draw(_params))
    text = draw(st.sampled_from(["", " "])) + text + draw(st.sampled_from(["", " "]))
    return text.encode("latin-1") if draw(st.booleans()) else text


_non_json_types = st.one_of(
    st.none(),
    st.sampled_from(
        [
            "",
            "text/plain",
            "text/plain; charset=utf-8",
            "text/event-stream",
            "text/html; charset=utf-8",
            "text/json",
            "application/x-ndjson",
            "application/jsonl",
            "application/json-seq",
            "application/json+",
            "application/problem+xml",
            "application/octet-stream",
            "multipart/form-data; boundary=x",
        ]
    ),
    st.from_regex(r"[a-z]{1,12}/[a-z0-9.-]{1,20}", fullmatch=True).filter(lambda t: t != JSON),
    st.just(b"text/plain"),
)


@given(
    status=st.integers(100, 599).filter(lambda s: s != 500),
    content_type=_json_content_types(),
    document=_client_documents(),
)
def test_a_status_other_than_500_is_never_rewritten(
    status: int, content_type: str | bytes, document: Any
) -> None:
    body = _body(document)
    assert reclassify(500, JSON, body) is not None  # the same body as a 500 would be
    assert reclassify(status, content_type, body) is None


@given(content_type=_non_json_types, document=_client_documents())
def test_a_non_json_media_type_is_never_rewritten(
    content_type: str | bytes | None, document: Any
) -> None:
    assert reclassify(500, content_type, _body(document)) is None


@given(
    document=_client_documents(),
    extra=st.integers(1, 4096),
    how=st.sampled_from(["whitespace", "field", "message"]),
)
def test_a_body_over_64_kib_is_never_rewritten(
    document: dict[str, Any], extra: int, how: str
) -> None:
    target = BODY_LIMIT + extra
    if how == "whitespace":
        body = _body(document)
        body += b" " * max(0, target - len(body))
    else:
        holder = _error_of(document) if how == "message" else document
        assert holder is not None
        key = "message" if how == "message" else "padding"
        start = holder.get(key, "") if how == "message" else ""
        holder[key] = start
        filler = target - len(_body(document))
        holder[key] = start + "x" * max(0, filler)
        body = _body(document)
    assert len(body) > BODY_LIMIT
    assert reclassify(500, JSON, body) is None


@given(document=_client_documents(), ascii_only=st.booleans())
def test_a_rewrite_keeps_everything_but_code_and_type(
    document: dict[str, Any], ascii_only: bool
) -> None:
    body = json.dumps(document, ensure_ascii=ascii_only).encode("utf-8")
    if len(body) > BODY_LIMIT:
        return
    result = reclassify(500, JSON, body)
    assert result is not None
    assert result.status in (400, 422)
    assert result.error_type == (
        "UnprocessableEntityError" if result.status == 422 else "BadRequestError"
    )
    _assert_only_code_and_type_changed(body, result)
    assert not any(mark in result.body for mark in (b"<", b">", b"&"))


_other_types = st.one_of(
    st.sampled_from(
        [
            "BadRequestError",
            "Bad Request",
            "Internal Server Error",
            "internalservererror",
            "INTERNALSERVERERROR",
            " InternalServerError",
            "invalid_request_error",
            "ServiceUnavailableError",
            "UnprocessableEntityError",
            "NotFoundError",
        ]
    ),
    st.text(max_size=24).filter(lambda t: t not in ("", INTERNAL)),
    st.integers(),
    st.booleans(),
    st.lists(st.text(max_size=4), max_size=2),
)
_non_500_codes = st.one_of(
    st.integers().filter(lambda c: c != 500),
    st.floats(allow_nan=False, allow_infinity=False).filter(lambda c: c != 500),
    st.integers().filter(lambda c: c != 500).map(str),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz _-", max_size=24),
    st.sampled_from(
        ["500 Internal Server Error", "5OO", "", "internal_error", "context_length_exceeded"]
    ),
    st.booleans(),
    st.lists(st.just(500), max_size=2),
    st.dictionaries(st.just("status"), st.just(500), max_size=1),
)


@given(
    document=_client_documents(),
    override=st.one_of(
        st.tuples(st.just("type"), _other_types),
        st.tuples(st.just("code"), _non_500_codes),
        st.tuples(st.just("no-code-untyped"), st.sampled_from(["", None])),
    ),
)
def test_a_handled_type_or_a_code_other_than_500_is_never_rewritten(
    document: dict[str, Any], override: tuple[str, Any]
) -> None:
    error = _error_of(document)
    assert error is not None
    what, value = override
    if what == "no-code-untyped":
        error.pop("code", None)
        if value is None:
            error.pop("type", None)
        else:
            error["type"] = value
    else:
        error[what] = value
    assert reclassify(500, JSON, _body(document)) is None


@st.composite
def _mutated_bodies(draw: st.DrawFn) -> bytes:
    data = bytearray(_body(draw(_client_documents())))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        chunk = draw(st.binary(min_size=1, max_size=4))
        op = draw(st.sampled_from(["insert", "replace", "delete"]))
        if op == "insert":
            data[at:at] = chunk
        elif op == "replace":
            data[at : at + len(chunk)] = chunk
        else:
            del data[at : at + len(chunk)]
    return bytes(data)


@st.composite
def _surrogate_bodies(draw: st.DrawFn) -> bytes:
    odd = draw(st.text(st.characters(categories=["Cs"]) | st.characters(), max_size=8))
    document = draw(_client_documents(message=draw(_client_messages) + odd))
    return json.dumps(document, ensure_ascii=True).encode("ascii")


@given(
    status=st.one_of(st.just(500), st.integers(-1, 1000)),
    content_type=st.one_of(st.just(JSON), st.none(), st.text(max_size=30), st.binary(max_size=30)),
    body=st.one_of(
        st.binary(max_size=512),
        st.text(max_size=200).map(str.encode),
        _json_values.map(_body),
        _mutated_bodies(),
        _surrogate_bodies(),
    ),
)
def test_no_input_makes_it_raise(
    status: int, content_type: str | bytes | None, body: bytes
) -> None:
    result = reclassify(status, content_type, body)
    assert result is None or isinstance(result, Reclassified)
    if result is not None:
        assert result.status in (400, 422)
        assert _error_of(json.loads(result.body.decode("utf-8"))) is not None


@given(content_type=_json_content_types(), document=_client_documents())
def test_json_media_types_with_parameters_suffix_or_odd_case_count(
    content_type: str | bytes, document: Any
) -> None:
    body = _body(document)
    plain = reclassify(500, JSON, body)
    assert plain is not None
    assert reclassify(500, content_type, body) == plain


@given(message=st.sampled_from(SERVER_MESSAGES), document=_client_documents(message="placeholder"))
def test_server_wording_is_never_rewritten_whatever_else_the_body_holds(
    message: str, document: dict[str, Any]
) -> None:
    error = _error_of(document)
    assert error is not None
    error["message"] = message
    assert reclassify(500, JSON, _body(document)) is None
