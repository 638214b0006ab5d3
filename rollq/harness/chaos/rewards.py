"""The rewards of `rollq chaos`'s scorers: deterministic functions of a sample's token ids, its
index and the group's `reward_inputs` (the group index), so that the trainer can recompute each
delivered reward from the samples it was handed and the run can tell a right reward from a
wrong, missing or stale one. One sync (scored in the scorer's child processes), one async
(in its event loop); neither ever raises.

    rollq scorer --rewards rollq.harness.chaos.rewards
"""

from __future__ import annotations

from rollq.scoring import Completion, reward

SYNC, ASYNC = "chaos_tokens", "chaos_tokens_async"


def expected(tokens: list[int], index: int, inputs: int) -> float:
    """The reward of a sample: what the trainer checks each delivered one against."""
    return float((sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + index * 7 + inputs) % 10_007)


@reward(SYNC, version="1", timeout_s=30)
def tokens_reward(completion: Completion, inputs: int) -> float:
    return expected(completion.tokens, completion.index, inputs)


@reward(ASYNC, version="1", timeout_s=30)
async def tokens_reward_async(completion: Completion, inputs: int) -> float:
    return expected(completion.tokens, completion.index, inputs)
