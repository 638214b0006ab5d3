"""The vLLM/OpenAI-compatible surface: `/v1/completions` and `/v1/models`, through the queue.

A completion request becomes one rollq job (one group per prompt, `n` samples each) submitted
as the trainer `<token's trainer>~completions~<gateway id>` (`derived_trainer_id`); a router
reads that trainer's result stream and hands each group to the request waiting for its job. Choices come
prompt-major (all n of prompt 0, then prompt 1, ...), and each says which policy versions
produced it (`policy_versions`, as rollq's version segments) and which worker (`worker_id`:
what a trainer reports the training-inference gap against, `queue/gap.py`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from typing import Any, Literal

from redis.asyncio import Redis
from redis.exceptions import RedisError

from rollq import __version__
from rollq.gateway.http import ApiError
from rollq.gateway.streaming import StreamOptions
from rollq.gateway.structured import logit_bias_of, structured_outputs_of
from rollq.protocol import (MAX_JOB_GROUPS, MAX_PROMPT_TOKENS, GroupResult, InvalidInput, LogitBias, Sample,
                            Sampling, SwapMode, VersionWindow, unpack_floats, unpack_tokens)
from rollq.queue.connection import Backoff
from rollq.queue.keys import Keys
from rollq.queue.results import ResultReader
from rollq.queue.scripts import Scripts

log = logging.getLogger("rollq.gateway")


class OpenAIRequest(VersionWindow, kw_only=True, forbid_unknown_fields=True):
    """What /v1/completions and /v1/chat/completions share: vLLM's sampling fields of both, and
    rollq's version window (the fields of `VersionWindow`)."""

    model: str
    """The policy name."""
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool | None = None
    """Name logprobs' tokens `token_id:N`; null: the gateway's `--return-tokens-as-token-ids`
    (vLLM's server: the request's field wins over its flag)."""
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None
    # rollq's own: how long to wait (and the version window, inherited).
    timeout_s: float = 600.0
    swap_modes: list[SwapMode] | None = None
    """How a running group may cross a weight swap (`Sampling.swap_modes`; None: its default)."""
    reward: str | None = None
    """Scored samples: a reward the policy's `rollq scorer`s offer; each choice then carries its
    `reward` (null where the reward raised or timed out). As `RolloutClient.submit`'s."""
    reward_inputs: list[Any] | None = None
    """The reward's data, one entry per prompt (a chat: one)."""
    reward_errors: Literal["skip", "fail"] = "skip"

    def scoring(self) -> dict[str, Any]:
        return dict(reward=self.reward, reward_inputs=self.reward_inputs, reward_errors=self.reward_errors)


class CompletionRequest(OpenAIRequest, kw_only=True, forbid_unknown_fields=True):
    prompt: Any
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    max_tokens: int | None = 16
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    structured_outputs: dict[str, Any] | None = None
    """vLLM's `StructuredOutputsParams`: json, regex, choice, grammar, json_object, structural_tag."""
    response_format: dict[str, Any] | None = None
    prompt_logprobs: int | None = None
    """vLLM's: score the prompt, top N per position (`echo` with `logprobs` implies it)."""


def shared_sampling(req: OpenAIRequest, max_tokens: int | None) -> dict[str, Any]:
    """Sampling's arguments from the fields both routes share: those given, the allowed
    `extra` switches, stop strings as a list."""
    given = dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                 repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                 frequency_penalty=req.frequency_penalty, seed=req.seed, stop_token_ids=req.stop_token_ids,
                 max_tokens=max_tokens, logit_bias=logit_bias_of(req.logit_bias))
    if req.stream_options is not None and not req.stream:  # as vLLM
        raise InvalidInput("stream_options", "can only be defined when `stream=True`")
    extra: dict[str, Any] = {}
    if req.ignore_eos:
        extra["ignore_eos"] = True
    if req.min_tokens:
        extra["min_tokens"] = req.min_tokens
    # Stop strings are matched on the worker, on text vLLM decodes there (the worker needs a tokenizer).
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if req.swap_modes is not None:
        given["swap_modes"] = tuple(req.swap_modes)
    return {k: v for k, v in given.items() if v is not None} | dict(extra=extra, stop=stop)


def prompts_of(prompt: Any) -> list[list[int] | str]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        # Sizes before the per-value scan: a 16 MiB list of ids is refused without walking it.
        if len(prompt) > max(MAX_PROMPT_TOKENS, MAX_JOB_GROUPS):
            raise InvalidInput("prompt", f"has {len(prompt)} values; the limit is {MAX_PROMPT_TOKENS} "
                                         f"token ids or {MAX_JOB_GROUPS} prompts")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
               for p in prompt):
            return list(prompt)
    raise InvalidInput("prompt", "must be a string, a list of strings, a list of token ids or a list "
                                 "of token-id lists, and not empty")


def sampling_of(req: CompletionRequest) -> Sampling:
    unsupported = dict(suffix=req.suffix,
                       best_of=req.best_of not in (None, req.n) and req.best_of)
    for name, value in unsupported.items():
        if value:
            raise InvalidInput(name, "is not supported by rollq's completions")
    prompt_logprobs = req.prompt_logprobs
    if req.stream and prompt_logprobs not in (None, 0):  # as vLLM: its chunks have no such field
        raise InvalidInput("prompt_logprobs", "is not available when `stream=True`")
    if prompt_logprobs is None and req.echo:  # as vLLM: echoed logprobs cover the prompt too
        prompt_logprobs = req.logprobs
    # A worker whose model has a tokenizer decodes (vLLM's own text and token strings, as its
    # server gives them); one without serves token ids and the text is the gateway's.
    return Sampling(**shared_sampling(req, req.max_tokens if req.max_tokens is not None else 16),
                    logprobs=req.logprobs or 0, prompt_logprobs=prompt_logprobs,
                    structured_outputs=structured_outputs_of(req.structured_outputs, req.response_format),
                    text_if_tokenizer=True)


class Waiter:
    def __init__(self, groups: int):
        self.groups = groups
        self.results: dict[int, GroupResult] = {}
        self.done = asyncio.get_running_loop().create_future()

    def add(self, result: GroupResult) -> None:
        self.results[result.group_index] = result
        if len(self.results) >= self.groups and not self.done.done():
            self.done.set_result(None)


class CompletionRouter:
    """Reads one completions trainer's result stream and hands each group to its waiting request.

    Results of a job nobody waits for (the caller left, or a previous gateway run) are
    acknowledged and dropped: the caller has had its error already.
    """

    def __init__(self, redis: Redis, keys: Keys, trainer: str):
        self.trainer = trainer
        self._reader = ResultReader(redis, Scripts(redis), keys, trainer, "gateway")
        self._waiting: dict[str, Waiter] = {}
        self._task: asyncio.Task | None = None
        self._closing = False

    def expect(self, job_id: str, groups: int) -> Waiter:
        waiter = self._waiting[job_id] = Waiter(groups)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"completions-{self.trainer}")
        return waiter

    def forget(self, job_id: str) -> None:
        self._waiting.pop(job_id, None)

    async def _run(self) -> None:
        backoff = Backoff(0.1, 5.0)
        while not self._closing:  # ends by itself within a read: see PoolSampler.stopped
            try:
                entries = await self._reader.read(256, 1000)
                backoff.reset()
            except RedisError as e:
                wait = backoff.next()
                log.warning("completions router %s: %s; retrying in %.1f s", self.trainer, e, wait)
                await asyncio.sleep(wait)
                self._reader.replay()
                continue
            for _, result in entries:
                waiter = self._waiting.get(result.job_id)
                if waiter is not None:
                    waiter.add(result)
            if entries:
                await self._reader.ack([entry_id for entry_id, _ in entries])

    @property
    def task(self) -> asyncio.Task | None:
        return self._task

    def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()


class TokenText:
    """Token ids → text with the gateway's tokenizer, where the worker decoded none; and whether
    replies name tokens by id (`--return-tokens-as-token-ids`)."""

    def __init__(self, tokenizer: Any | None, as_ids: bool = False):
        self.tokenizer = tokenizer
        self.as_ids = as_ids

    def by_id(self, asked: bool | None) -> bool:
        """A request's `return_tokens_as_token_ids`, else the gateway's flag (vLLM 0.32's
        `should_return_as_token_id`: the request's field when not null, else the server's)."""
        return self.as_ids if asked is None else asked

    def text(self, ids: list[int]) -> str:
        """A prompt's text, as vLLM's server decodes one for `echo`."""
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def completion(self, ids: list[int]) -> str:
        """A completion's text, as vLLM's detokenizer (special tokens skipped)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def token(self, token_id: int, as_id: bool, given: str | None = None) -> str:
        """`given`: the worker's string for it (vLLM's own decoding)."""
        if as_id or (given is None and self.tokenizer is None):
            return f"token_id:{token_id}"
        return given if given is not None else self.tokenizer.decode([token_id])


def _positions(scored: Sample) -> list[list[tuple[int, float, str | None]]]:
    """Per position: (token id, logprob, the worker's string or None), best rank first; without
    top-N entries, the sampled token alone."""
    if scored.top_counts:
        ids, values = unpack_tokens(scored.top_ids), unpack_floats(scored.top_logprobs)
        texts, counts = scored.top_texts, scored.top_counts
    else:
        ids, values, texts = scored.token_ids, scored.token_logprobs, scored.token_texts
        counts = bytes([1] * len(ids))
    out, at = [], 0
    for count in counts:
        out.append([(ids[i], values[i], texts[i] if i < len(texts) else None) for i in range(at, at + count)])
        at += count
    return out


def _logprobs(sample: Sample, words: TokenText, as_ids: bool, echoed: Sample | None = None) -> dict:
    """OpenAI's completion logprobs; with `echoed` (the scored prompt) its tokens come first,
    the first one without a logprob, as vLLM's `echo`."""
    tokens, values, top = [], [], []
    for scored in (echoed, sample) if echoed is not None else (sample,):
        names = scored.token_texts
        for i, (t, v) in enumerate(zip(scored.token_ids, scored.token_logprobs)):
            tokens.append(words.token(t, as_ids, names[i] if i < len(names) else None))
            values.append(None if math.isnan(v) else max(v, -9999.0))
        top += [{words.token(t, as_ids, name): max(v, -9999.0) for t, v, name in position}
                if position else None for position in _positions(scored)]
    if echoed is not None:
        top[0] = None
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return dict(tokens=tokens, token_logprobs=values, text_offset=offsets, top_logprobs=top)


def prompt_logprobs_of(scored: Sample | None, top_n: int, words: TokenText) -> list | None:
    """vLLM's `prompt_logprobs`: None for the first token, then {token id: {logprob, rank,
    decoded_token}} per position (the prompt token's own rank from the worker, when outside the
    top N; None from a worker that predates `token_ranks`)."""
    if scored is None:
        return None
    ranks = unpack_tokens(scored.token_ranks) if scored.token_ranks else []
    out: list = [None]
    for i, position in enumerate(_positions(scored)[1:], start=1):
        out.append({str(t): dict(logprob=max(v, -9999.0),
                                 rank=r + 1 if r < top_n else ranks[i] if ranks else None,
                                 decoded_token=name if name is not None
                                 else words.token(t, False) if words.tokenizer else None)
                    for r, (t, v, name) in enumerate(position)})
    return out


def response(req: CompletionRequest, job_id: str, results: list[GroupResult], prompts: list,
             words: TokenText) -> dict:
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for r in sorted(results, key=lambda r: r.group_index):
        if r.status != "ok":
            status = 504 if r.status == "expired" else 400 if r.status == "failed" else 409
            raise ApiError(status, f"prompt {r.group_index}: {r.status}: {r.reason}", "prompt")
        prompt_ids = r.prompt_ids
        prompt_tokens += len(prompt_ids)
        original = prompts[r.group_index]
        for j, sample in enumerate(r.samples):
            ids = sample.token_ids
            completion_tokens += len(ids)
            text = _text(req, sample, original, prompt_ids, r.prompt_scores, words)
            echoed = r.prompt_scores if req.echo else None
            choice = dict(index=r.group_index * req.n + j, text=text,
                          logprobs=_logprobs(sample, words, words.by_id(req.return_tokens_as_token_ids),
                                             echoed)
                          if req.logprobs is not None else None,
                          prompt_logprobs=prompt_logprobs_of(r.prompt_scores, sampling_top(req), words),
                          finish_reason=sample.finish_reason, stop_reason=sample.stop_reason,
                          prompt_token_ids=prompt_ids if req.return_token_ids else None,
                          token_ids=ids if req.return_token_ids else None, routed_experts=None,
                          policy_versions=[list(v) for v in sample.versions], worker_id=r.worker_id)
            if r.reward:  # a scored job's (rollq's own key, as policy_versions)
                choice["reward"] = r.rewards[j] if j < len(r.rewards) else None
            choices.append(choice)
    # The keys of vLLM's CompletionResponse, its unused ones null as there.
    usage = dict(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=None,
                 completion_tokens_details=None)
    return dict(id=job_id, object="text_completion", created=int(time.time()), model=req.model,
                choices=choices, service_tier=None, system_fingerprint=f"rollq-{__version__}", usage=usage,
                kv_transfer_params=None, ec_transfer_params=None, metrics=None)


def _text(req: CompletionRequest, sample: Sample, original: Any, prompt_ids: list[int],
          scored: Sample | None, words: TokenText) -> str:
    # The worker's text where it decoded (always with stop strings: it ends before the stop
    # string), else the gateway's own decoding, if it has a tokenizer.
    decoded = bool(sample.text or sample.token_texts or req.stop)
    text = sample.text if decoded else words.completion(sample.token_ids)
    if not req.echo or req.return_token_ids:  # vLLM echoes no prompt text with return_token_ids
        return text
    if isinstance(original, str):
        return original + text
    if scored is not None and scored.text:  # the worker decoded the prompt, as vLLM's server does
        return scored.text + text
    return words.text(prompt_ids) + text


def sampling_top(req: CompletionRequest) -> int:
    """The N of the prompt's top-N logprobs the workers were asked for."""
    return (req.prompt_logprobs if req.prompt_logprobs is not None else req.logprobs) or 0


def new_job_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"
