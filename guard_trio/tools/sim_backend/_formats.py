"""The bytes of a simulated response: streamed events and whole bodies, per API and server.

Reads: an :class:`~guard_trio.tools.sim_backend._asks.Ask`, the number of tokens to generate and
how many the engine has produced so far; a seeded generator for ids and the filler text.

Guarantees: chat chunks are shaped like the vLLM 0.24 capture in ``../shared/data/sse`` (role
chunk at the first token, one chunk per token, a finish chunk, a usage chunk when
``stream_options.include_usage`` is true, ``data: [DONE]``) or like SGLang's explicit-null
deltas; completions and Responses API events likewise. Token ``i`` of a response is always the
same word of a fixed ring, so a stream cut into any number of writes joins into the same text,
and the whole body of a non-streaming reply says what the stream would have said.
"""

from __future__ import annotations

import json
import random
from typing import Any, Final

import attrs

from guard_trio.tools.sim_backend._asks import Ask
from guard_trio.tools.sim_backend._config import Flavour
from guard_trio.tools.sim_backend._errors import (
    ENGINE_DEAD_MESSAGE,
    json_bytes,
    stream_error_event,
)

_WORD_RING: Final = 8192  # a power of two: token i of a request is word (offset + i) & _MASK
_MASK: Final = _WORD_RING - 1

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


class WordRing:
    """A fixed random walk through the vocabulary, as text and as JSON string literals.

    Roughly one word in twelve carries a comma or a full stop, so the text reads like prose.
    """

    __slots__ = ("texts", "words")

    def __init__(self, rng: random.Random) -> None:
        texts: list[str] = []
        for _ in range(_WORD_RING):
            word = " " + _VOCABULARY[rng.randrange(len(_VOCABULARY))]
            roll = rng.random()
            if roll < 0.05:
                word += ","
            elif roll < 0.09:
                word += "."
            texts.append(word)
        self.texts: tuple[str, ...] = tuple(texts)
        self.words: tuple[bytes, ...] = tuple(json.dumps(word).encode() for word in texts)


# -- response formats ------------------------------------------------------------------------------


def hex_id(rng: random.Random, digits: int) -> str:
    """``digits`` random lower-case hex digits, as the servers' ids carry them."""
    return f"{rng.getrandbits(4 * digits):0{digits}x}"


@attrs.frozen
class Reply:
    """What every format of one response starts from: the request, its output length, the filler
    text and where in it this response starts, and the ``created`` second."""

    ask: Ask
    out_tokens: int
    ring: WordRing
    offset: int
    created: int


class Format:
    """Bytes of one request's response; token ``i`` of the output is ring word ``offset + i``."""

    def __init__(self, reply: Reply) -> None:
        self.ask = reply.ask
        self.out_tokens = reply.out_tokens
        self.words = reply.ring.words
        self.texts = reply.ring.texts
        self.offset = reply.offset
        self.created = reply.created

    def text(self, start: int, stop: int) -> str:
        texts, offset, mask = self.texts, self.offset, _MASK
        return "".join(texts[(offset + i) & mask] for i in range(start, stop))

    def opening(self) -> bytes:
        """Sent with the response head, before any token."""
        return b""

    def tokens(self, start: int, count: int) -> bytes:
        raise NotImplementedError

    def finish(self, generated: int, reason: str) -> bytes:
        raise NotImplementedError

    def failure(self) -> bytes:
        return stream_error_event(500, "InternalServerError", ENGINE_DEAD_MESSAGE)

    def body(self, generated: int, reason: str) -> bytes:
        raise NotImplementedError


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }


def _chunk_top(rid: str, kind: str, created: int, model: str) -> bytes:
    """The opening of every chunk of a chat or completions stream, up to the model's name."""
    top = f'{{"id":"{rid}","object":"{kind}","created":{created},"model":'
    return top.encode() + json_bytes(model)


def _usage_and_done(top: bytes, ask: Ask, generated: int) -> bytes:
    """The end of a chat or completions stream: the usage chunk if asked for, then ``[DONE]``."""
    done = b"data: [DONE]\n\n"
    if not ask.include_usage:
        return done
    usage = json_bytes(_usage(ask.prompt_tokens, generated))
    return b"data: " + top + b',"choices":[],"usage":' + usage + b"}\n\n" + done


class _ChatFormat(Format):
    """``chat.completion.chunk`` events (vLLM 0.24 capture, or SGLang's explicit-null deltas)."""

    def __init__(
        self, reply: Reply, *, flavour: Flavour, rid: str, reasoning_field: str, tool_id: str
    ) -> None:
        super().__init__(reply)
        ask = reply.ask
        self.flavour = flavour
        self.reasoning_field = reasoning_field if flavour == "vllm" else "reasoning_content"
        self.rid = rid
        self.tool_id = tool_id
        self.reasoning_tokens = reply.out_tokens // 2 if ask.reasoning else 0
        self.top = _chunk_top(rid, "chat.completion.chunk", reply.created, ask.model)
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
        return self.head + json_bytes(call) + self.tail

    def tokens(self, start: int, count: int) -> bytes:
        parts: list[bytes] = []
        if start == 0:
            parts.append(self.head + self.role)
        head, words, offset, mask = self.head, self.words, self.offset, _MASK
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
        parts.append(_usage_and_done(self.top, self.ask, generated))
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
        return json_bytes(document)


class _CompletionFormat(Format):
    """``text_completion`` events and body."""

    def __init__(self, reply: Reply, *, flavour: Flavour, rid: str) -> None:
        super().__init__(reply)
        self.rid = rid
        self.flavour = flavour
        self.top = _chunk_top(rid, "text_completion", reply.created, reply.ask.model)
        self.head = b"data: " + self.top + b',"choices":[{"index":0,"text":'
        self.stop_key = b'"stop_reason"' if flavour == "vllm" else b'"matched_stop"'
        self.tail = b',"logprobs":null,"finish_reason":null,' + self.stop_key + b":null}]}\n\n"

    def tokens(self, start: int, count: int) -> bytes:
        head, tail, words, offset = self.head, self.tail, self.words, self.offset
        parts: list[bytes] = []
        for i in range(start, start + count):
            parts += (head, words[(offset + i) & _MASK], tail)
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
        parts.append(_usage_and_done(self.top, self.ask, generated))
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
        return json_bytes(document)


class _ResponsesFormat(Format):
    """The Responses API event sequence: created, in_progress, item and part added, text deltas,
    then the done events and ``response.completed`` with usage; every event numbered."""

    def __init__(self, reply: Reply, *, response_id: str, item_id: str) -> None:
        super().__init__(reply)
        self.response_id = response_id
        self.item_id = item_id
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

    def _completed(
        self, output: list[dict[str, Any]], generated: int, reason: str
    ) -> dict[str, Any]:
        """The final response object: ``incomplete`` when the output limit ended it."""
        response = self._response("completed", output, self._usage(generated))
        if reason == "length":
            response |= {
                "status": "incomplete",
                "incomplete_details": {"reason": "max_output_tokens"},
            }
        return response

    def _event(self, kind: str, fields: dict[str, Any]) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence} | fields
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + json_bytes(payload) + b"\n\n"

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
        head, mid, tail = self.delta_head, self.delta_mid, self.delta_tail
        words, offset, sequence = self.words, self.offset, self.sequence
        for i in range(start, start + count):
            parts += (head, str(sequence).encode(), mid, words[(offset + i) & _MASK], tail)
            sequence += 1
        self.sequence = sequence
        return b"".join(parts)

    def finish(self, generated: int, reason: str) -> bytes:
        text = self.text(0, generated)
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item = self._item("completed", text)
        response = self._completed([item], generated, reason)
        return b"".join(
            (
                self._event("response.output_text.done", where | {"text": text, "logprobs": []}),
                self._event("response.content_part.done", where | {"part": part}),
                self._event("response.output_item.done", {"output_index": 0, "item": item}),
                self._event("response.completed", {"response": response}),
            )
        )

    def failure(self) -> bytes:
        error = {"code": "server_error", "message": ENGINE_DEAD_MESSAGE}
        response = self._response("failed", [], None) | {"error": error}
        return self._event("response.failed", {"response": response})

    def body(self, generated: int, reason: str) -> bytes:
        text = self.text(0, generated)
        response = self._completed([self._item("completed", text)], generated, reason)
        return json_bytes(response)


def new_format(
    ask: Ask,
    out_tokens: int,
    ring: WordRing,
    rng: random.Random,
    *,
    created: int,
    flavour: Flavour,
    reasoning_field: str,
) -> Format:
    """The format of one response, its ids drawn from ``rng`` as the server would make them."""
    reply = Reply(ask, out_tokens, ring, rng.randrange(_WORD_RING), created)
    if ask.kind == "chat":
        rid = f"chatcmpl-{hex_id(rng, 16)}" if flavour == "vllm" else hex_id(rng, 32)
        tool_id = (
            f"chatcmpl-tool-{hex_id(rng, 32)}" if flavour == "vllm" else f"call_{hex_id(rng, 24)}"
        )
        return _ChatFormat(
            reply, flavour=flavour, rid=rid, reasoning_field=reasoning_field, tool_id=tool_id
        )
    if ask.kind == "completions":
        rid = f"cmpl-{hex_id(rng, 16)}" if flavour == "vllm" else hex_id(rng, 32)
        return _CompletionFormat(reply, flavour=flavour, rid=rid)
    return _ResponsesFormat(
        reply, response_id=f"resp_{hex_id(rng, 32)}", item_id=f"msg_{hex_id(rng, 32)}"
    )
