"""InstantEngine: deterministic tokens with no model, for queue load/chaos tests and benchmarks.

It never stands in for generation in a test of generation. Its output is a pure function of
the prompt (`expected_tokens`), so a test can check that every result belongs to its prompt.
"""

from __future__ import annotations

import asyncio
import zlib
from functools import lru_cache

from rollq.canary import Canary, CanaryRefused, Tolerance
from rollq.engine.base import Generated, GroupError
import msgspec

from rollq.engine.chat import first_difference
from rollq.protocol import Chat, Sample, WorkItem, pack_floats, pack_tokens, unpack_tokens

FAIL_TOKEN = 2**31 - 7
"""A prompt starting with this token fails its group with GroupError (for tests of failures)."""
_FAIL_PREFIX = pack_tokens([FAIL_TOKEN])


def expected_tokens(prompt: bytes, sample_index: int, max_tokens: int, vocab_size: int) -> list[int]:
    return _tokens(zlib.crc32(prompt), sample_index, max_tokens, vocab_size)


def _tokens(crc: int, sample_index: int, max_tokens: int, vocab_size: int) -> list[int]:
    start = crc + 7919 * sample_index
    return [(start + 31 * j) % vocab_size for j in range(max_tokens)]


@lru_cache(maxsize=16)
def _logprobs(max_tokens: int) -> bytes:
    """Every token's logprob: -1.0 (bytes are immutable: one copy serves every sample)."""
    return pack_floats([-1.0] * max_tokens)


def _render(messages: list) -> bytes:
    return pack_tokens(list(b"".join(msgspec.json.encode(m) for m in messages)))


def _chat_prompt(chat: Chat) -> tuple[bytes, int]:
    """A chat "renders" to the UTF-8 bytes of each message's JSON, one after another; with an
    exact prefix, the prompt is that prefix and then the later messages' bytes (and drifts when
    rendering every message would not give the same: where, in tokens; -1 where it would)."""
    whole = _render(chat.messages)
    if not chat.prefix_tokens:
        return whole, -1
    exact = chat.prefix_tokens + _render(chat.messages[chat.prefix_messages:])
    return exact, first_difference(unpack_tokens(whole), unpack_tokens(exact))


class InstantEngine:
    def __init__(self, *, vocab_size: int = 32_000, delay_s: float = 0.0, version: int = 0):
        self.vocab_size = vocab_size
        self.delay_s = delay_s
        self._version = version

    @property
    def version(self) -> int:
        return self._version

    @property
    def alive(self) -> bool:
        return True

    @property
    def at_once(self) -> bool:
        # A subclass with its own generate_group (a test's gated engine) may suspend in it.
        return not self.delay_s and type(self).generate_group is InstantEngine.generate_group

    def continues_exactly(self, item: WorkItem) -> bool:
        return True  # its tokens are a function of the prompt alone, and a swap never cuts them

    async def generate_group(self, item: WorkItem) -> Generated:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        # Text prompts "tokenize" to their UTF-8 bytes; a chat's messages, to their JSON's.
        prompt, drift_at = item.prompt or pack_tokens(list(item.text.encode())), -1
        if item.chat is not None:
            prompt, drift_at = _chat_prompt(item.chat)
        if prompt[:4] == _FAIL_PREFIX:
            raise GroupError("InstantEngine: prompt starts with FAIL_TOKEN")
        max_tokens, vocab_size, version = item.sampling.max_tokens, self.vocab_size, self._version
        logprobs, crc = _logprobs(max_tokens), zlib.crc32(prompt)  # (the same for every sample)
        samples = [Sample(pack_tokens(_tokens(crc, i, max_tokens, vocab_size)), logprobs, "length",
                          versions=[(version, 0)])
                   for i in range(item.n)]
        return Generated(samples, prompt, prompt_drift=drift_at >= 0, prompt_drift_at=drift_at)

    async def swap(self, version: int, path: str, *, interrupt: bool = False,
                   keep: bool = False, canary: Canary | None = None,
                   tolerance: Tolerance | None = None) -> dict[str, float]:
        if canary is not None:  # it has no weights to score one with: never served unchecked
            raise CanaryRefused(version, None, "the instant engine cannot score a canary")
        self._version = version
        return {}

    async def close(self) -> None:
        pass
