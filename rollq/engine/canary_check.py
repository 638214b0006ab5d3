"""The engine's side of a version's canary (`rollq/canary.py`): vLLM scores the canary's
sequences (prompt logprobs) on the weights it holds, and the figures decide.

It takes vLLM's `AsyncLLM` itself (`VLLMEngine.llm`), not the VLLMEngine: the worker runs it
inside a load, after the new weights are in and before the gate opens for users, where
`VLLMEngine`'s request path would wait for the swap to end (`_request`'s swap gate). The caller
makes sure vLLM is generating (not paused) while it runs.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from typing import Any

from rollq.canary import Canary, Tolerance, Verdict, compare
from rollq.protocol import InvalidInput


async def engine_logprobs(llm: Any, canary: Canary, *, lora_request: Any = None) -> list[list[float]]:
    """vLLM's logprob of each canary token after the first, given the tokens before it: one
    request per sequence, all sent at once (one or two engine steps), no token sampled.

    `prompt_logprobs=0` asks for the prompt token's own logprob only (vLLM adds it to the top 0).
    A request that asks for prompt logprobs reads nothing from the prefix cache (vLLM v1's
    `KVCacheManager.get_computed_blocks`), so no KV of earlier weights enters the figures.
    `lora_request`: an adapter version's request, or on vLLM's CPU build with adapters enabled
    the zero adapter that full-weight requests carry (`rollq/engine/lora.py`)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    tag = uuid.uuid4().hex[:8]

    async def score(i: int, ids: list[int]) -> list[float]:
        final = None
        async for output in llm.generate({"prompt_token_ids": ids}, params, f"canary-{tag}-{i}",
                                         lora_request=lora_request):
            final = output  # FINAL_ONLY: the one output
        if final is None or final.prompt_logprobs is None:
            raise RuntimeError(f"canary sequence {i}: vLLM returned no prompt logprobs")
        # Position 0 has no entry (None); every later one a dict holding the prompt's token.
        return [entries[token].logprob if entries and token in entries else math.nan
                for token, entries in zip(ids[1:], final.prompt_logprobs[1:])]

    return list(await asyncio.gather(*(score(i, ids) for i, ids in enumerate(canary.token_ids()))))


def fits(llm: Any, canary: Canary, field: str = "canary") -> None:
    """A canary this engine cannot score (ids beyond its vocabulary, a sequence longer than its
    model length) is the publisher's mistake, said as such, not a version refused by figures."""
    vocab, longest = llm.model_config.get_vocab_size(), llm.model_config.max_model_len
    for i, ids in enumerate(canary.token_ids()):
        if len(ids) > longest:
            raise InvalidInput(f"{field}.sequences[{i}]", f"has {len(ids)} tokens; this engine's "
                               f"max_model_len is {longest}")
        if max(ids) >= vocab:
            raise InvalidInput(f"{field}.sequences[{i}]", f"holds token id {max(ids)}; this engine's "
                               f"vocabulary has {vocab} ids (0..{vocab - 1})")


def engine_dtype(llm: Any) -> str:
    """The dtype vLLM runs the model in, by its torch name without `torch.`."""
    return str(llm.model_config.dtype).removeprefix("torch.")


async def check(llm: Any, canary: Canary, *, tolerance: Tolerance | None = None,
                lora_request: Any = None) -> Verdict:
    """Score the canary on the engine and judge it: the worker's `tolerance` unless the publish
    overrides it, the dtype's default when neither is given (`rollq.canary.compare`)."""
    fits(llm, canary)
    scored = await engine_logprobs(llm, canary, lora_request=lora_request)
    return compare(canary, scored, engine_dtype=engine_dtype(llm), tolerance=tolerance)
