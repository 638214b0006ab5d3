"""vLLM's token-in token-out route, `POST /inference/v1/generate`, through the queue.

vLLM 0.32 serves it with `--enable-scale-out` (vllm/entrypoints/scale_out/token_in_token_out/:
`GenerateRequest` in, `GenerateTokensResponse` out). Here a request is one job of one group
(its `token_ids`, `sampling_params.n` samples), submitted and awaited as completions are
(`api.run_job`), and the answer has the keys of vLLM's response, plus `policy_versions` per
choice; `weight_versions` are rollq's version segments as vLLM's spans (version names are the
policy versions). What vLLM's route accepts is accepted with its meaning, or refused with a 400
naming the field and saying why: vLLM's `SamplingParams` fields that rollq's workers do not
take, multimodal inputs, disaggregated-serving fields, `stream`. `output_mode: "text"` asks the
worker for vLLM's text (its model needs a tokenizer) and answers `GenerateTextResponse`.

The gateway's `--return-tokens-as-token-ids` (vLLM's server flag) names every logprob's token
`token_id:N`: in text mode as vLLM 0.32's route does (placeholders, no bytes); in token mode,
where vLLM's entries carry only the integer `token_id`, each entry and top entry also gets
`token: "token_id:N"`: the key of the chat-shaped entries earlier vLLM releases answered this
route with, which verifiers' training client (`renderers.client.generate`) requires of each.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Annotated, Any, Literal

import msgspec
from aiohttp import web

from rollq.gateway import completions as oai
from rollq.gateway.api import heavy_turn, run_job
from rollq.gateway.chat import GREEDY_EPS, content_logprobs
from rollq.gateway.http import JSON, ApiError, body_bytes, decode_body
from rollq.gateway.state import GATEWAY
from rollq.gateway.structured import logit_bias_of, structured_outputs_of
from rollq.gateway.trl_compat import policy_of
from rollq.protocol import (MAX_PROMPT_TOKENS, GroupResult, GroupSize, InvalidInput, LogitBias, Sample,
                            Sampling, SwapMode, TokenId, VersionWindow, typed, unpack_tokens,
                            validate_sampling)
from rollq.queue.keys import Keys
from rollq.queue.workers import live_workers, max_model_len

class GenerateSamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The fields of vLLM's `SamplingParams` rollq's workers take, with vLLM's defaults. Others
    (`allowed_token_ids`, `bad_words`, `extra_args`, `logits_processors`, `prompt_logprob_token_ids`,
    ...) are refused by name; vLLM's server ignores a key it does not know, rollq refuses it."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None | msgspec.UnsetType = msgspec.UNSET
    """Absent or null: what the context leaves (vLLM's server default), from the workers'
    `max_model_len`."""
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    """Only stop strings and `prompt_logprobs`' `decoded_token` read the text in token mode."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: dict[str, Any] | None = None
    logit_bias: LogitBias | None = None


_SP_DEFAULTS = GenerateSamplingParams()


class GenerateRequest(VersionWindow, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `GenerateRequest`, and rollq's version window, `timeout_s` and `swap_modes` (as on
    the completions routes)."""

    token_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)]
    sampling_params: GenerateSamplingParams
    model: str | None = None
    """The policy; absent: the token's one policy (vLLM: its one served model)."""
    request_id: str | None = None
    token_offsets: list[tuple[int, int]] | None = None
    """Informational in vLLM too (the render step's character offsets): not used."""
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    """Read by vLLM only when streaming, which rollq's route refuses."""
    priority: int = 0
    cache_salt: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    features: dict[str, Any] | None = None
    content_parts: list[dict[str, Any]] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    timeout_s: float = 600.0
    swap_modes: list[SwapMode] | None = None


REFUSED = {
    "stream": "rollq returns a group whole once it is done: use /v1/completions with stream=true "
              "for Server-Sent Events",
    "priority": "rollq's workers schedule by trainer, not by request priority; leave it 0",
    "cache_salt": "rollq's workers do not salt their prefix cache per request",
    "reasoning_ended": "structured outputs gated on reasoning are not built in rollq",
    "reasoning_parser_kwargs": "structured outputs gated on reasoning are not built in rollq",
    "features": "multimodal inputs are not taken here: send images through /v1/chat/completions",
    "content_parts": "multimodal inputs are not taken here: send images through /v1/chat/completions",
    "kv_transfer_params": "disaggregated serving is not built in rollq",
    "ec_transfer_params": "disaggregated serving is not built in rollq",
}
"""Fields vLLM's route takes that rollq cannot honour, and why (each refused unless at its default)."""
_DEFAULTS = {"stream": (False, None), "priority": (0,)}


def refuse_unsupported(req: GenerateRequest) -> None:
    for name, why in REFUSED.items():
        if getattr(req, name) not in _DEFAULTS.get(name, (None,)):
            raise InvalidInput(name, f"is not supported: {why}")


def sampling_of(req: GenerateRequest, max_tokens: int) -> Sampling:
    """vLLM's SamplingParams -> rollq's Sampling, checked here so errors name `sampling_params.*`."""
    sp = req.sampling_params
    typed("sampling_params.n", sp.n, GroupSize)
    if sp.n > 1 and sp.temperature < GREEDY_EPS:  # vLLM's SamplingParams refuses this up front
        raise InvalidInput("sampling_params.n", f"n must be 1 when using greedy sampling, got {sp.n}.")
    if sp.stop and not sp.detokenize:
        raise InvalidInput("sampling_params.stop", "stop strings are matched on text: they need detokenize")
    text = req.output_mode == "text"
    if text and not sp.detokenize:  # vLLM's words
        raise InvalidInput("output_mode", "output_mode='text' requires sampling_params.detokenize to be true")
    # Text mode shows max(N, 1) top entries per position (the sampled token's own with N = 0).
    top_n = 1 if text and sp.logprobs == 0 else sp.logprobs or 0
    extra: dict[str, Any] = {k: v for k, v in dict(
        ignore_eos=sp.ignore_eos, min_tokens=sp.min_tokens, skip_special_tokens=sp.skip_special_tokens,
        spaces_between_special_tokens=sp.spaces_between_special_tokens,
        include_stop_str_in_output=sp.include_stop_str_in_output).items()
        if v != getattr(_SP_DEFAULTS, k)}
    given = dict(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
                 repetition_penalty=sp.repetition_penalty, presence_penalty=sp.presence_penalty,
                 frequency_penalty=sp.frequency_penalty, seed=sp.seed,
                 stop_token_ids=list(sp.stop_token_ids or []),
                 stop=[sp.stop] if isinstance(sp.stop, str) else list(sp.stop or []),
                 logprobs=top_n, prompt_logprobs=sp.prompt_logprobs, extra=extra,
                 # Text mode needs the worker's tokenizer (a worker without one fails the group,
                 # as vLLM's server without one refuses the request); token mode shows text only
                 # as the names of prompt_logprobs' tokens.
                 return_text=text, text_if_tokenizer=sp.detokenize and sp.prompt_logprobs is not None,
                 structured_outputs=structured_outputs_of(sp.structured_outputs, None),
                 logit_bias=logit_bias_of(sp.logit_bias), token_ranks=sp.logprobs is not None)
    if req.swap_modes is not None:
        given["swap_modes"] = tuple(req.swap_modes)
    sampling = Sampling(max_tokens=max_tokens, **given)
    validate_sampling(sampling, sp.n, "sampling_params")
    return sampling


async def max_tokens_of(request: web.Request, policy: str, req: GenerateRequest) -> int:
    """The asked max_tokens, else vLLM's server default: what the context leaves after the prompt
    (the least `max_model_len` the policy's live workers report)."""
    if isinstance(req.sampling_params.max_tokens, int):
        return req.sampling_params.max_tokens
    context = max_model_len(await live_workers(request.app[GATEWAY].redis, Keys(policy)))
    if context is None:
        raise InvalidInput("sampling_params.max_tokens", "is required while no live worker of the policy "
                                                         "reports its max_model_len (the default is what "
                                                         "the context leaves after the prompt)")
    return max(1, context - len(req.token_ids))


async def generate(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    data = await body_bytes(request)
    async with heavy_turn(request, data):  # 131,072 token ids decode on the loop
        req = decode_body(request, data, GenerateRequest)
    policy = await policy_of(request, req.model)
    refuse_unsupported(req)
    sampling = sampling_of(req, await max_tokens_of(request, policy, req))
    prompt = await gw.encode_text(req.token_ids)  # ids outside the vocabulary refused, with a tokenizer
    n = req.sampling_params.n

    async def submit(client, job_id: str, window: dict) -> str:
        return await client.submit([prompt], n, sampling, job_id=job_id, deadline_s=req.timeout_s,
                                   wait=False, **window)

    job_id = f"gen-{uuid.uuid4().hex}"
    [result] = await run_job(gw, policy, gw.tokens.principal(request), job_id, 1, req, submit)  # type: ignore[arg-type]
    # vLLM's: the X-Request-Id header, else the body's request_id, else a random one.
    request_id = request.headers.get("X-Request-Id") or req.request_id or uuid.uuid4().hex[:16]
    body = response(req, f"generate-tokens-{request_id}", policy, result, gw.words)
    return web.Response(body=msgspec.json.encode(body), content_type=JSON)


def response(req: GenerateRequest, request_id: str, policy: str, result: GroupResult,
             words: oai.TokenText) -> dict:
    """vLLM's `GenerateTokensResponse` (or `GenerateTextResponse`), key for key."""
    if result.status != "ok":
        status = 504 if result.status == "expired" else 400 if result.status == "failed" else 409
        raise ApiError(status, f"{result.status}: {result.reason}")
    sp, text = req.sampling_params, req.output_mode == "text"
    as_ids = words.by_id(None)  # vLLM's route has no request field of that name: the flag alone
    choices, completion_tokens = [], 0
    for j, sample in enumerate(result.samples):
        ids = sample.token_ids
        completion_tokens += len(ids)
        choices.append(dict(index=j, finish_reason=sample.finish_reason or "stop",
                            stop_reason=sample.stop_reason, token_ids=ids,
                            routed_experts=None, sampling_mask=None,
                            weight_versions=_spans(sample, len(ids)),
                            logprobs=None if sp.logprobs is None
                            else _text_logprobs(sample, max(sp.logprobs, 1), as_ids) if text
                            else _logprobs(sample, sp.logprobs, as_ids),
                            policy_versions=[list(v) for v in sample.versions]))
        if text:
            choices[-1]["text"] = sample.text
    prompt_ids = result.prompt_ids
    usage = dict(prompt_tokens=len(prompt_ids), total_tokens=len(prompt_ids) + completion_tokens,
                 completion_tokens=completion_tokens, prompt_tokens_details=None,
                 completion_tokens_details=None)
    prompt_logprobs = oai.prompt_logprobs_of(result.prompt_scores, sp.prompt_logprobs or 0, words)
    return dict(request_id=request_id, model=policy, created=int(time.time()), usage=usage,
                prompt_logprobs=prompt_logprobs, prompt_token_id_logprobs=None,
                prompt_token_ids=prompt_ids if req.return_token_ids else None, mm_placeholders=None,
                metrics=None, kv_transfer_params=None, ec_transfer_params=None, output_mode=req.output_mode,
                choices=choices)


def _spans(sample: Sample, length: int) -> list[dict]:
    """Version segments -> vLLM's `WeightVersionSpan`s (start, end over the output tokens)."""
    starts = [start for _, start in sample.versions] + [length]
    return [dict(version=str(v), start=start, end=end)
            for (v, start), end in zip(sample.versions, starts[1:]) if end > start or not length]


def _clamp(value: float | None) -> float:
    return -9999.0 if value is None or math.isnan(value) else max(value, -9999.0)


def _text_logprobs(sample: Sample, top_n: int, as_ids: bool) -> dict:
    """Text mode's logprobs, chat's shape; named by id, without bytes (vLLM's `_logprob_token`
    with no tokenizer, where chat's would keep the decoded token's bytes)."""
    logprobs = content_logprobs(sample, top_n, as_ids)
    if as_ids:
        for entry in logprobs["content"]:
            entry["bytes"] = None
            for top in entry["top_logprobs"]:
                top["bytes"] = None
    return logprobs


def _logprobs(sample: Sample, top_n: int, as_ids: bool = False) -> dict:
    """vLLM's `GenerateLogProbs`: per position the sampled token (logprob, rank) and `top_logprobs`
    in the engine's order, the sampled token first and then the others by rank, max(N, 1) in all.
    `as_ids`: each entry also names its token `token_id:N` (see the module's docstring)."""
    ranks = unpack_tokens(sample.token_ranks) if sample.token_ranks else []
    tops = sample.top() if sample.top_counts else [[] for _ in sample.token_logprobs]
    content = []
    for i, (token, value) in enumerate(zip(sample.token_ids, sample.token_logprobs)):
        if math.isnan(value):  # no entry from the engine: vLLM's sentinel
            content.append(dict(token_id=token, logprob=-9999.0, rank=None, top_logprobs=[]))
            continue
        ranked = {t: r for r, (t, _) in enumerate(tops[i], start=1)}
        rank = (ranks[i] if i < len(ranks) else 0) or (ranked[token] if ranked.get(token, top_n + 1) <= top_n
                                                        else None)
        top = [dict(token_id=token, logprob=_clamp(value), rank=rank)]
        top += [dict(token_id=t, logprob=_clamp(v), rank=r) for r, (t, v) in enumerate(tops[i], start=1)
                if t != token and r <= top_n]
        content.append(dict(token_id=token, logprob=_clamp(value), rank=rank,
                            top_logprobs=top[:max(top_n, 1)]))
    if as_ids:
        for entry in content:
            for named in (entry, *entry["top_logprobs"]):
                named["token"] = f"token_id:{named['token_id']}"
    return dict(content=content)
