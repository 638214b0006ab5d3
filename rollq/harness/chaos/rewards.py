"""The rewards of `rollq chaos`'s scorers: deterministic functions of a sample's token ids, its
index and the group's `reward_inputs` (the group index), so that the trainer can recompute each
delivered reward from the samples it was handed and the run can tell a right reward from a
wrong, missing or stale one. One sync (scored in the scorer's child processes), one async
(in its event loop); neither ever raises. The dynamic-sampling jobs' pair gives every sample of
an even group the same reward (regenerated, then `filtered`: the instant engine repeats a
group's tokens) and an odd group's samples rewards that always differ (delivered `ok`).

    rollq scorer --rewards rollq.harness.chaos.rewards
"""

from __future__ import annotations

from rollq.scoring import Completion, reward

SYNC, ASYNC = "chaos_tokens", "chaos_tokens_async"
UNIFORM_SYNC, UNIFORM_ASYNC = "chaos_even_uniform", "chaos_even_uniform_async"


def expected(tokens: list[int], index: int, inputs: int) -> float:
    """The reward of a sample: what the trainer checks each delivered one against."""
    return float((sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + index * 7 + inputs) % 10_007)


@reward(SYNC, version="1", timeout_s=30)
def tokens_reward(completion: Completion, inputs: int) -> float:
    return expected(completion.tokens, completion.index, inputs)


@reward(ASYNC, version="1", timeout_s=30)
async def tokens_reward_async(completion: Completion, inputs: int) -> float:
    return expected(completion.tokens, completion.index, inputs)


def expected_dynamic(tokens: list[int], index: int, inputs: int) -> float:
    """An even group's samples all get `inputs`; an odd group's sample i gets a value in
    [i, i + 1), so no two of its samples are equal."""
    if inputs % 2 == 0:
        return float(inputs)
    return index + expected(tokens, index, inputs) / 10_007


@reward(UNIFORM_SYNC, version="1", timeout_s=30)
def uniform_reward(completion: Completion, inputs: int) -> float:
    return expected_dynamic(completion.tokens, completion.index, inputs)


@reward(UNIFORM_ASYNC, version="1", timeout_s=30)
async def uniform_reward_async(completion: Completion, inputs: int) -> float:
    return expected_dynamic(completion.tokens, completion.index, inputs)
