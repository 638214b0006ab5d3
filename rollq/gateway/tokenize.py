"""vLLM's `POST /tokenize` and `POST /detokenize`, answered with the gateway's `--tokenizer`.

The bodies and replies are vLLM 0.32's (`vllm/entrypoints/serve/tokenize/`): `/tokenize` takes
a text `prompt` (vLLM's `TokenizeCompletionRequest`) or chat `messages`
(`TokenizeChatRequest`) and answers `{count, max_model_len, tokens, token_strs}`; `/detokenize`
takes `tokens` and answers `{prompt}`. The work runs in the render helpers
(`gateway/render.py`: capped first, then off the event loop, within a time and a memory bound),
never on the loop. Differences, each a 400 naming the field:

- no `--tokenizer`: nothing to tokenize with (vLLM's server always has its model's);
- a caller's `chat_template` (or `chat_template_kwargs.chat_template`) unless the gateway was
  started with `--trust-request-chat-template`, as vLLM's server;
- content parts in chat messages (lists of parts, images): vLLM's renderer chooses a content
  format by the template and fetches media; the gateway renders string content only, and
  `media_io_kwargs` / `mm_processor_kwargs` are refused;
- a token id outside the tokenizer's vocabulary in `/detokenize`;
- both `prompt` and `messages`, or neither.

`model` names the policy (optional, as in vLLM: the token's one policy). `max_model_len` is the
least the policy's live workers report in their heartbeats (`queue/workers.py`); null while no
worker of the policy is live (vLLM's server reports its one engine's, always an integer).
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from rollq.gateway.api import heavy_turn
from rollq.gateway.http import body_bytes, decode_body, reply
from rollq.gateway.render import refuse_template
from rollq.gateway.state import GATEWAY
from rollq.gateway.trl_compat import policy_of
from rollq.protocol import InvalidInput
from rollq.queue.keys import Keys
from rollq.queue.workers import live_workers, max_model_len


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `TokenizeCompletionRequest` (`prompt`) or `TokenizeChatRequest` (`messages`)."""

    model: str | None = None
    """The policy (vLLM: the served model); absent: the token's one policy."""
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    """Absent: true for a prompt, false for messages (vLLM's defaults). vLLM 0.32's chat form
    tokenizes inside the template, where this has no effect: nor does it here."""
    return_token_strs: bool | None = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct):
    prompt: str


def _chat_kwargs(req: TokenizeRequest) -> dict[str, Any]:
    """What the template is called with, as vLLM's: the request's kwargs, then its own fields."""
    for name in ("media_io_kwargs", "mm_processor_kwargs"):
        if getattr(req, name):
            raise InvalidInput(name, "is not supported: the gateway renders text messages only")
    if req.prompt is not None:
        raise InvalidInput("prompt", "give a prompt or messages, not both")
    if req.continue_final_message and req.add_generation_prompt:
        # vLLM's words (TokenizeChatRequest.check_generation_prompt)
        raise InvalidInput("continue_final_message", "Cannot set both `continue_final_message` and "
                                                     "`add_generation_prompt` to True.")
    kwargs = dict(req.chat_template_kwargs or {})
    if "tokenize" in kwargs:  # vLLM's resolve_chat_template_kwargs refuses it too
        raise InvalidInput("chat_template_kwargs.tokenize", "is not a template variable; it is refused")
    for i, message in enumerate(req.messages or ()):
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise InvalidInput(f"messages[{i}].content", "must be a string here: the gateway renders text "
                                                          "content only (send content parts to "
                                                          "/v1/chat/completions, rendered on the workers)")
    kwargs.update(add_generation_prompt=req.add_generation_prompt,
                  continue_final_message=req.continue_final_message)
    if req.tools is not None:
        kwargs["tools"] = req.tools
    if req.chat_template is not None:
        kwargs["chat_template"] = req.chat_template
    return kwargs


def _need_tokenizer(request: web.Request, field: str) -> None:
    if request.app[GATEWAY].render.tokenizer is None:
        raise InvalidInput(field, "this gateway has no tokenizer: start it with --tokenizer DIR (the "
                                  "policy's tokenizer) to serve /tokenize and /detokenize")


async def _max_model_len(request: web.Request, policy: str) -> int | None:
    return max_model_len(await live_workers(request.app[GATEWAY].redis, Keys(policy)))


async def tokenize(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    data = await body_bytes(request)
    async with heavy_turn(request, data):  # as a completion's: a 16 MiB prompt decodes on the loop
        req = decode_body(request, data, TokenizeRequest)
    policy = await policy_of(request, req.model)
    _need_tokenizer(request, "messages" if req.messages is not None else "prompt")
    trusted = gw.settings.trust_request_chat_template
    if req.messages is None:
        if req.prompt is None:
            raise InvalidInput("prompt", "give a prompt (text) or messages (a chat)")
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids, strs = await gw.render.tokenize(req.prompt, {"add_special_tokens": special},
                                             bool(req.return_token_strs), trusted)
    else:
        kwargs = _chat_kwargs(req)
        refuse_template(trusted, None, req.chat_template)  # the kwargs' key: in render.tokenize
        ids, strs = await gw.render.tokenize(req.messages, kwargs, bool(req.return_token_strs), trusted)
    body = TokenizeResponse(len(ids), await _max_model_len(request, policy), ids, strs)
    return reply(request, body)


async def detokenize(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    data = await body_bytes(request)
    async with heavy_turn(request, data):
        req = decode_body(request, data, DetokenizeRequest)
    await policy_of(request, req.model)
    _need_tokenizer(request, "tokens")
    text = await gw.render.decode(req.tokens)
    return reply(request, DetokenizeResponse(text))
