"""`stream=True` for /v1/chat/completions and /v1/completions: a finished response as vLLM's chunks.

A group is streamed once it is done: the worker runs one n-sample request as for any group, and
the gateway turns the finished OpenAI response object into the chunk sequence vLLM 0.32's server
sends (`chat_completion/serving.py`, `completion/serving.py`, stream generators). So each choice
comes as one delta holding its whole text (or tool calls), logprobs and token ids, with its
finish reason, and joined per choice the chunks equal vLLM's joined deltas; the first chunk
arrives when the whole group is done, not after the first token (docs/benchmarks.md).

Chunk keys are those vLLM's pydantic models dump with `exclude_unset` (the usage chunk:
`exclude_none`), so a client that parses them with vLLM's own models gets the same fields.
A group that fails is what vLLM's server does with an error during generation: one
`data: {"error": ...}` event, then `data: [DONE]`, in a 200 stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import msgspec
from aiohttp import web

from rollq.gateway.http import ApiError, error_body


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `stream_options`."""

    include_usage: bool | None = False
    """A last chunk with the usage of all choices and no choices."""
    continuous_usage_stats: bool | None = False
    """With include_usage: every chunk carries the usage so far of its choice."""


def _usage(prompt: int, completion: int, chat: bool) -> dict:
    usage = dict(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
    return usage | dict(completion_tokens_details=None) if chat else usage


def chat_chunks(body: dict, options: StreamOptions | None, tokens: list[int]) -> Iterator[dict]:
    """A chat.completion `body` as chat.completion.chunk objects; `tokens`: completion tokens
    per choice (for continuous usage)."""
    include, continuous = _wanted(options)
    head = dict(id=body["id"], object="chat.completion.chunk", created=body["created"], model=body["model"])
    prompt_tokens = body["usage"]["prompt_tokens"]
    for choice in body["choices"]:  # vLLM: every choice's role chunk first, prompt ids on each
        chunk = head | dict(choices=[dict(index=choice["index"], delta=dict(role="assistant", content=""),
                                          logprobs=None, finish_reason=None)],
                            prompt_token_ids=body.get("prompt_token_ids"),
                            prompt_text=body.get("prompt_text"))
        yield chunk | (dict(usage=_usage(prompt_tokens, 0, True)) if continuous else {})
    for choice, count in zip(body["choices"], tokens):
        message = choice["message"]
        delta: dict[str, Any] = {}
        if message.get("reasoning"):
            delta["reasoning"] = message["reasoning"]
        if message.get("content") is not None or not message.get("tool_calls"):
            delta["content"] = message.get("content") or ""
        if message.get("tool_calls"):
            # As vLLM's tool parsers stream them: `index` per call, the id, type and name with it.
            delta["tool_calls"] = [dict(index=k, id=call.get("id"), type=call.get("type", "function"),
                                        function=dict(call["function"]))
                                   for k, call in enumerate(message["tool_calls"])]
        chunk = head | dict(choices=[dict(index=choice["index"], delta=delta, logprobs=choice.get("logprobs"),
                                          finish_reason=choice["finish_reason"],
                                          stop_reason=choice.get("stop_reason"),
                                          token_ids=choice.get("token_ids"))])
        yield _closing(chunk, body, include, continuous, _usage(prompt_tokens, count, True))
    if include:
        yield _final_usage(head, body)


def completion_chunks(body: dict, options: StreamOptions | None, tokens: list[tuple[int, int]],
                      echoed: list[list[int]] | None = None) -> Iterator[dict]:
    """A text_completion `body` as its stream chunks; `tokens`: (prompt, completion) tokens per
    choice; `echoed`: each choice's prompt ids when the request echoes (vLLM's stream then sends
    them on the choice's first chunk, `return_token_ids` or not)."""
    include, continuous = _wanted(options)
    head = dict(id=body["id"], object="text_completion", created=body["created"], model=body["model"])
    for k, (choice, (prompt, completion)) in enumerate(zip(body["choices"], tokens)):
        prompt_ids = choice.get("prompt_token_ids")
        if prompt_ids is None and echoed is not None:
            prompt_ids = echoed[k]
        chunk = head | dict(choices=[dict(index=choice["index"], text=choice["text"],
                                          logprobs=choice["logprobs"],
                                          finish_reason=choice["finish_reason"],
                                          stop_reason=choice.get("stop_reason"),
                                          prompt_token_ids=prompt_ids,
                                          token_ids=choice.get("token_ids"))])
        yield _closing(chunk, body, include, continuous, _usage(prompt, completion, False))
    if include:
        yield _final_usage(head, body)


def _wanted(options: StreamOptions | None) -> tuple[bool, bool]:
    """vLLM's `should_include_usage` (without its --enable-force-include-usage)."""
    include = bool(options and options.include_usage)
    return include, include and bool(options.continuous_usage_stats)


def _closing(chunk: dict, body: dict, include: bool, continuous: bool, usage: dict) -> dict:
    # vLLM stamps the fingerprint on a choice's finish chunk unless a usage chunk will follow.
    if not include and body.get("system_fingerprint") is not None:
        chunk["system_fingerprint"] = body["system_fingerprint"]
    if continuous:
        chunk["usage"] = usage
    return chunk


def _final_usage(head: dict, body: dict) -> dict:
    usage = {k: v for k, v in body["usage"].items() if v is not None}
    chunk = head | dict(choices=[], usage=usage, system_fingerprint=body.get("system_fingerprint"))
    return {k: v for k, v in chunk.items() if v is not None}


async def respond(request: web.Request, build: Callable[[], dict],
                  chunks: Callable[[dict], Iterator[dict]]) -> web.StreamResponse:
    """The finished response `build()` gives, streamed as `chunks(body)` and `[DONE]`; a group
    `build()` refuses (failed, expired, cancelled) as vLLM's in-stream error event."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})
    try:
        body = build()
    except ApiError as e:
        await response.prepare(request)
        await response.write(b"data: %s\n\n" % error_body(e.status, e.message, e.field))
    else:
        await response.prepare(request)
        for chunk in chunks(body):
            await response.write(b"data: %s\n\n" % msgspec.json.encode(chunk))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
