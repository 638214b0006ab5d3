"""`POST /v1/chat/completions` through the queue: vLLM's chat API, rendered on the workers.

A request becomes one job of one group (the conversation, `n` samples), submitted with
`RolloutClient.submit_chat` as the caller's completions trainer and awaited like
`/v1/completions` (`api.run_job`). The worker renders the conversation with its model's chat
template through vLLM's own renderer, so the gateway needs no tokenizer: token strings, text and
prompt token ids all come back from the worker, and so do tool calls and reasoning (the
worker runs vLLM's parsers: `rollq worker --enable-auto-tool-choice --tool-call-parser NAME`).
The response has the keys of vLLM's `ChatCompletionResponse` plus rollq's `policy_versions`
(and `worker_id`) per choice.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from rollq import __version__, conversations
from rollq.engine.chat import check_tools
from rollq.gateway.api import heavy_turn, run_job
from rollq.gateway.auth import allowed
from rollq.gateway.completions import OpenAIRequest, shared_sampling
from rollq.gateway.http import JSON, ApiError, body_bytes, decode_body, reply
from rollq.gateway.render import check_chat, refuse_template
from rollq.gateway.structured import structured_outputs_of
from rollq.gateway.state import GATEWAY
from rollq.gateway.streaming import chat_chunks, respond
from rollq.protocol import GroupResult, InvalidInput, Sample, Sampling, unpack_tokens


GREEDY_EPS = 1e-5
"""vLLM's _SAMPLING_EPS: a temperature below it is greedy sampling."""


class ChatCompletionRequest(OpenAIRequest, kw_only=True, forbid_unknown_fields=True):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    """Takes precedence over `max_tokens`, as in vLLM; neither given: 256."""
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    """vLLM's; absent with tools: "auto", as vLLM (an explicit null counts as absent)."""
    parallel_tool_calls: bool | None = True
    reasoning_effort: str | None = None
    metadata: dict[str, Any] | None = None
    """Accepted and unused, as vLLM's server (OpenAI stores it with `store`)."""
    store: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    response_format: dict[str, Any] | None = None
    """text, json_object or json_schema (vLLM's `ResponseFormat`)."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's `StructuredOutputsParams`; `response_format` overrides the fields it sets."""


def sampling_of(req: ChatCompletionRequest) -> Sampling:
    unsupported = dict(echo=req.echo)
    for name, value in unsupported.items():
        if value:
            raise InvalidInput(name, "is not supported by rollq's chat completions")
    if req.top_logprobs and not req.logprobs:
        raise InvalidInput("top_logprobs", "needs logprobs=true")
    if req.n > 1 and req.temperature is not None and req.temperature < GREEDY_EPS:
        raise InvalidInput("n", f"n must be 1 when using greedy sampling, got {req.n}.")  # vLLM's words
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return Sampling(**shared_sampling(req, max_tokens), logprobs=req.top_logprobs or 0, return_text=True,
                    structured_outputs=structured_outputs_of(req.structured_outputs, req.response_format))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    who = gw.tokens.principal(request)
    data = await body_bytes(request)
    async with heavy_turn(request, data):  # as a submit's: a 16 MiB body decodes on the loop
        req = decode_body(request, data, ChatCompletionRequest)
    req.return_tokens_as_token_ids = gw.words.by_id(req.return_tokens_as_token_ids)  # null: the flag's
    policy = allowed(who, req.model)
    sampling = sampling_of(req)
    check_chat(req.messages, req.tools, req.chat_template_kwargs, req.response_format)
    check_tools(req.tools)  # the workers check too; here it is a 400 before anything is queued
    tool_choice = check_tool_choice(req.tools, req.tool_choice)
    # As vLLM's server: a caller's template would run on every worker that renders it.
    refuse_template(gw.settings.trust_request_chat_template, req.chat_template_kwargs, req.chat_template)
    conversation = conversations.check_header(request.headers.get(conversations.HEADER))
    at, key, budget = conversations.Prior(), "", gw.settings.max_conversation_bytes
    if conversation is not None:
        check_conversation(req)
        key, retried = conversations.request_key(request.headers, data)
        at = await conversations.prior(gw.client(policy, who.trainer), conversation, req.messages, key=key,
                                       retried=retried, budget=budget)
        if at.replay:  # an HTTP retry of the last turn, served and recorded: its reply again
            return await _replay(request, req, at.replay)

    async def submit(client, job_id: str, window: dict):
        async with heavy_turn(request, data):  # the images' walk and the work item's encoding
            return await client.submit_chat(
                [req.messages], req.n, sampling, tools=req.tools, chat_template=req.chat_template,
                chat_template_kwargs=req.chat_template_kwargs,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, tool_choice=tool_choice,
                parallel_tool_calls=req.parallel_tool_calls, reasoning_effort=req.reasoning_effort,
                prefix_tokens=unpack_tokens(at.prefix_tokens) if at.prefix_tokens else None,
                prefix_messages=at.prefix_messages,
                job_id=job_id, deadline_s=req.timeout_s, wait=False, **window, **req.scoring())

    job_id = f"chatcmpl-{uuid.uuid4().hex}"
    try:
        [result] = await run_job(gw, policy, who, job_id, 1, req, submit)
    except InvalidInput as e:  # the client names conversations[0]; the caller sent `messages`
        field = e.field.replace("conversations[0].", "").replace("conversations[0]", "messages")
        field = "messages" if field == "chat" else field
        raise InvalidInput(field, str(e).split(": ", 1)[1]) from None
    if conversation is not None and result.status == "ok":
        # The served turn joins the trajectory, with its reply for a retry, before its caller sees it.
        body = response(req, job_id, result, tool_choice)
        await conversations.append(gw.client(policy, who.trainer), conversation, job_id, at, req.messages,
                                   _message(result.samples[0]), result, body=msgspec.json.encode(body),
                                   key=key, budget=budget)
    if req.stream:
        tokens = [len(s.token_ids) for s in result.samples]
        return await respond(request, lambda: response(req, job_id, result, tool_choice),
                             lambda body: chat_chunks(body, req.stream_options, tokens))
    body = response(req, job_id, result, tool_choice)
    return web.Response(body=msgspec.json.encode(body), content_type=JSON)


async def _replay(request: web.Request, req: ChatCompletionRequest, reply: bytes) -> web.StreamResponse:
    """The recorded reply of the turn a request retries, as that turn answered it."""
    if not req.stream:
        return web.Response(body=reply, content_type=JSON)
    body = msgspec.json.decode(reply)
    tokens = [body["usage"]["completion_tokens"]]  # a conversation's turn has one choice
    return await respond(request, lambda: body, lambda b: chat_chunks(b, req.stream_options, tokens))


async def get_conversation(request: web.Request) -> web.Response:
    """An agent conversation's exact trajectory (`rollq.conversations.Trajectory`), the caller's own."""
    gw = request.app[GATEWAY]
    who = gw.tokens.principal(request)
    policy = allowed(who, request.match_info["policy"])
    conversation_id = request.match_info["conversation_id"]
    found = await gw.client(policy, who.trainer).conversation(conversation_id)
    if found is None:
        raise ApiError(404, f"no conversation {conversation_id!r} of this trainer (none of its chat requests "
                            f"named it with {conversations.HEADER}, or it expired {conversations.TTL_S} s "
                            "after its last turn)", "conversation_id")
    return reply(request, found)


def check_conversation(req: ChatCompletionRequest) -> None:
    """What a conversation's exact trajectory cannot honour is refused, never ignored."""
    header = conversations.HEADER
    if req.n != 1:
        raise InvalidInput("n", f"is {req.n}; with the {header} header a turn takes one sample "
                                "(the trajectory is one sequence): n must be 1")
    if req.continue_final_message or not req.add_generation_prompt:
        field = "continue_final_message" if req.continue_final_message else "add_generation_prompt"
        raise InvalidInput(field, f"with the {header} header every turn ends with the generation "
                                  "prompt: leave add_generation_prompt true, continue_final_message false")
    for i, message in enumerate(req.messages):
        content = message.get("content")
        parts = content if isinstance(content, list) else []
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in parts):
            raise InvalidInput(f"messages[{i}].content", f"holds a part that is not text; with the "
                                                         f"{header} header a conversation is text only")


def check_tool_choice(tools: list | None, choice: str | dict | None) -> str | dict | None:
    """vLLM's `check_tool_usage`, with its words: the tool choice to render with."""
    if tools == []:
        raise InvalidInput("tools", "`tools` must not be an empty array. Either provide at least one "
                                    "tool or omit the field entirely.")
    if choice is None:
        return "auto" if tools else None
    if choice == "none":
        return choice
    if not tools:
        raise InvalidInput("tool_choice", "When using `tool_choice`, `tools` must be set.")
    if isinstance(choice, str):
        if choice not in ("auto", "required"):
            raise InvalidInput("tool_choice", f"Invalid value for `tool_choice`: {choice}! Only named "
                                              'tools, "none", "auto" or "required" are supported.')
        return choice
    usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
    function = choice.get("function")
    if not isinstance(function, dict):
        raise InvalidInput("tool_choice.function",
                           f"Invalid value for `function`: `{function}` in `tool_choice`! {usage}")
    if "name" not in function:
        raise InvalidInput("tool_choice.function.name",
                           f"Expected field `name` in `function` in `tool_choice`! {usage}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidInput("tool_choice.function.name",
                           f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}")
    if all(t.get("function", {}).get("name") != name for t in tools):
        raise InvalidInput("tool_choice", "The tool specified in `tool_choice` does not match any of "
                                          "the specified `tools`")
    return choice


def _message(sample: Sample) -> dict:
    content = sample.content if sample.parsed else sample.text
    message = dict(role="assistant", content=content, refusal=None, annotations=None, audio=None,
                   function_call=None)
    if sample.tool_calls:  # vLLM leaves the key out when there are none
        message["tool_calls"] = sample.tool_calls
    message["reasoning"] = sample.reasoning
    return message


def _finish_reason(sample: Sample, tool_choice: str | dict | None) -> str:
    """vLLM's: "tool_calls" when "auto" called a tool, or for "required" that stopped."""
    reason = sample.finish_reason or "stop"
    if (tool_choice == "auto" and sample.tool_calls) or (tool_choice == "required" and reason == "stop"):
        return "tool_calls"
    return reason


def response(req: ChatCompletionRequest, job_id: str, r: GroupResult,
             tool_choice: str | dict | None = None) -> dict:
    if r.status != "ok":
        status = 504 if r.status == "expired" else 400 if r.status == "failed" else 409
        raise ApiError(status, f"{r.status}: {r.reason}", "messages")
    prompt_ids = r.prompt_ids
    choices = []
    for index, sample in enumerate(r.samples):
        choices.append(dict(
            index=index,
            message=_message(sample),
            logprobs=content_logprobs(sample, req.top_logprobs or 0, bool(req.return_tokens_as_token_ids))
            if req.logprobs else None,
            finish_reason=_finish_reason(sample, tool_choice), stop_reason=sample.stop_reason,
            token_ids=sample.token_ids if req.return_token_ids else None, routed_experts=None,
            policy_versions=[list(v) for v in sample.versions], worker_id=r.worker_id))
        if r.reward:  # a scored job's (rollq's own key, as policy_versions)
            choices[-1]["reward"] = r.rewards[index] if index < len(r.rewards) else None
    completion_tokens = sum(len(s.tokens) // 4 for s in r.samples)
    # vLLM's server counts reasoning tokens when it has a reasoning parser; so do the workers.
    counted = [s.reasoning_tokens for s in r.samples if s.reasoning_tokens is not None]
    usage = dict(prompt_tokens=len(prompt_ids), total_tokens=len(prompt_ids) + completion_tokens,
                 completion_tokens=completion_tokens, prompt_tokens_details=None,
                 completion_tokens_details=dict(reasoning_tokens=sum(counted)) if counted else None)
    return dict(id=job_id, object="chat.completion", created=int(time.time()), model=req.model,
                choices=choices, service_tier=None, system_fingerprint=f"rollq-{__version__}", usage=usage,
                prompt_logprobs=None, prompt_token_ids=prompt_ids if req.return_token_ids else None,
                prompt_text=None, kv_transfer_params=None, ec_transfer_params=None, metrics=None)


def content_logprobs(sample: Sample, top_n: int, as_ids: bool) -> dict:
    """vLLM's chat `logprobs.content`: per token its string, logprob, UTF-8 bytes, and the first
    `top_n` entries of vLLM's per-position dict, which holds the sampled token first, then the
    others by rank (so a sampled token outside the top N displaces the N-th)."""
    ids, values = sample.token_ids, sample.token_logprobs
    ranked = sample.top() if sample.top_counts else [[] for _ in ids]
    texts, at = sample.top_texts, 0
    content = []
    for i, (token, value) in enumerate(zip(ids, values)):
        decoded = sample.token_texts[i] if i < len(sample.token_texts) else ""
        named = {t: (texts[at + k] if at + k < len(texts) else "", v) for k, (t, v) in enumerate(ranked[i])}
        at += len(ranked[i])
        order = [token] + [t for t, _ in ranked[i] if t != token]
        top = []
        for t in order[:top_n]:
            name = f"token_id:{t}" if as_ids else named[t][0]
            top.append(dict(token=name, logprob=max(named[t][1], -9999.0), bytes=list(name.encode())))
        content.append(dict(token=f"token_id:{token}" if as_ids else decoded, logprob=max(value, -9999.0),
                            bytes=list(decoded.encode()), top_logprobs=top))
    return dict(content=content)
