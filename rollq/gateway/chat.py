"""`POST /v1/chat/completions` through the queue: vLLM's chat API, rendered on the workers.

A request becomes one job of one group (the conversation, `n` samples), submitted with
`RolloutClient.submit_chat` as the caller's completions trainer and awaited like
`/v1/completions` (`api.run_job`). The worker renders the conversation with its model's chat
template through vLLM's own renderer, so the gateway needs no tokenizer: token strings, text and
prompt token ids all come back from the worker. The response has the keys of vLLM's
`ChatCompletionResponse` plus rollq's `policy_versions` per choice.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from rollq import __version__
from rollq.engine.chat import check_tools
from rollq.gateway.api import run_job
from rollq.gateway.auth import allowed
from rollq.gateway.completions import OpenAIRequest, shared_sampling
from rollq.gateway.http import JSON, ApiError, read_body
from rollq.gateway.state import GATEWAY
from rollq.gateway.streaming import chat_chunks, respond
from rollq.protocol import GroupResult, InvalidInput, Sample, Sampling


class ChatCompletionRequest(OpenAIRequest, kw_only=True, forbid_unknown_fields=True):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    """Takes precedence over `max_tokens`, as in vLLM; neither given: 256."""
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    """Only "none" (or absent): rollq returns text and does not parse tool calls."""
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    response_format: dict[str, Any] | None = None


def sampling_of(req: ChatCompletionRequest) -> Sampling:
    unsupported = dict(echo=req.echo, logit_bias=req.logit_bias,
                       response_format=req.response_format,
                       tool_choice=req.tool_choice not in (None, "none") and req.tool_choice)
    for name, value in unsupported.items():
        if value:
            hint = ' (only "none": rollq does not parse tool calls)' if name == "tool_choice" else ""
            raise InvalidInput(name, f"is not supported by rollq's chat completions{hint}")
    if req.top_logprobs and not req.logprobs:
        raise InvalidInput("top_logprobs", "needs logprobs=true")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return Sampling(**shared_sampling(req, max_tokens), logprobs=req.top_logprobs or 0, return_text=True)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    who = gw.tokens.principal(request)
    req = await read_body(request, ChatCompletionRequest)
    policy = allowed(who, req.model)
    sampling = sampling_of(req)
    check_tools(req.tools)  # the workers check too; here it is a 400 before anything is queued
    if not gw.settings.trust_request_chat_template and (
            req.chat_template is not None or "chat_template" in (req.chat_template_kwargs or {})):
        # As vLLM's server: a caller's template would run on every worker that renders it.
        raise ApiError(400, "a request's chat template is refused: start the gateway with "
                            "--trust-request-chat-template to allow it", "chat_template")

    def submit(client, job_id: str, window: dict):
        return client.submit_chat(
            [req.messages], req.n, sampling, tools=req.tools, chat_template=req.chat_template,
            chat_template_kwargs=req.chat_template_kwargs, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, job_id=job_id, deadline_s=req.timeout_s,
            wait=False, **window)

    job_id = f"chatcmpl-{uuid.uuid4().hex}"
    try:
        [result] = await run_job(gw, policy, who, job_id, 1, req, submit)
    except InvalidInput as e:  # the client names conversations[0]; the caller sent `messages`
        field = e.field.replace("conversations[0].", "").replace("conversations[0]", "messages")
        field = "messages" if field == "chat" else field
        raise InvalidInput(field, str(e).split(": ", 1)[1]) from None
    if req.stream:
        tokens = [len(s.token_ids) for s in result.samples]
        return await respond(request, lambda: response(req, job_id, result),
                             lambda body: chat_chunks(body, req.stream_options, tokens))
    body = response(req, job_id, result)
    return web.Response(body=msgspec.json.encode(body), content_type=JSON)


def response(req: ChatCompletionRequest, job_id: str, r: GroupResult) -> dict:
    if r.status != "ok":
        status = 504 if r.status == "expired" else 400 if r.status == "failed" else 409
        raise ApiError(status, f"{r.status}: {r.reason}", "messages")
    prompt_ids = r.prompt_ids
    choices = []
    for index, sample in enumerate(r.samples):
        choices.append(dict(
            index=index,
            message=dict(role="assistant", content=sample.text, refusal=None, annotations=None, audio=None,
                         function_call=None, reasoning=None),
            logprobs=_logprobs(sample, req.top_logprobs or 0, req.return_tokens_as_token_ids)
            if req.logprobs else None,
            finish_reason=sample.finish_reason or "stop", stop_reason=sample.stop_reason,
            token_ids=sample.token_ids if req.return_token_ids else None, routed_experts=None,
            policy_versions=[list(v) for v in sample.versions]))
    completion_tokens = sum(len(s.tokens) // 4 for s in r.samples)
    usage = dict(prompt_tokens=len(prompt_ids), total_tokens=len(prompt_ids) + completion_tokens,
                 completion_tokens=completion_tokens, prompt_tokens_details=None,
                 completion_tokens_details=None)
    return dict(id=job_id, object="chat.completion", created=int(time.time()), model=req.model,
                choices=choices, service_tier=None, system_fingerprint=f"rollq-{__version__}", usage=usage,
                prompt_logprobs=None, prompt_token_ids=prompt_ids if req.return_token_ids else None,
                prompt_text=None, kv_transfer_params=None, ec_transfer_params=None, metrics=None)


def _logprobs(sample: Sample, top_n: int, as_ids: bool) -> dict:
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
