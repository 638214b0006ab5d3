"""A scored job at submit (the client's side): each group's item carries its reward and inputs,
and a reward no live scorer offers is refused, naming those on offer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from redis.asyncio import Redis

from rollq.protocol import InvalidInput, ScoreSpec, check_id, decode_item, encode, validate_score
from rollq.queue.keys import Keys
from rollq.scoring.records import live_scorers, on_offer


def score_specs(reward: str, reward_inputs: Sequence[Any] | None, on_error: str,
                groups: int, resample: int | None = None, n: int = 2,
                deliver: int | None = None) -> list[ScoreSpec]:
    check_id("reward", reward)
    if deliver is not None and (isinstance(deliver, bool) or not isinstance(deliver, int)
                                or not 1 <= deliver <= groups):
        raise InvalidInput("deliver", f"{deliver!r} must be an integer in [1, {groups}] "
                                      "(the groups submitted)")
    if resample is not None:
        if isinstance(resample, bool) or not isinstance(resample, int):
            raise InvalidInput("dynamic_sampling", f"{resample!r} must be an integer (times to regenerate)")
        if n < 2:
            raise InvalidInput("dynamic_sampling", f"needs n >= 2 samples per group (n={n}): one "
                                                   "sample's rewards are always all equal")
    if on_error not in ("skip", "fail"):
        raise InvalidInput("reward_errors", f"{on_error!r} must be 'skip' (that sample gets no reward) "
                                            "or 'fail' (the group fails)")
    if reward_inputs is None:
        reward_inputs = [None] * groups
    if isinstance(reward_inputs, (str, bytes)) or not isinstance(reward_inputs, Sequence):
        raise InvalidInput("reward_inputs", "must be a list: one entry per group")
    if len(reward_inputs) != groups:
        raise InvalidInput("reward_inputs", f"has {len(reward_inputs)} entries for {groups} groups; "
                                            "give one per group")
    specs = [ScoreSpec(reward, inputs, on_error, resample, deliver=deliver) for inputs in reward_inputs]
    for i, spec in enumerate(specs):
        validate_score(spec, f"reward_inputs[{i}]")
    return specs


def scored_items(items: list[tuple[bytes, float]], specs: list[ScoreSpec]) -> list[tuple[bytes, float]]:
    """Each group's item with its reward; its samples carry their text (what rewards read) where
    the worker's model has a tokenizer (one without gives rewards the token ids alone)."""
    out = []
    for (data, deadline), spec in zip(items, specs):
        item = decode_item(data)
        sampling = msgspec.structs.replace(item.sampling, text_if_tokenizer=True)
        out.append((encode(msgspec.structs.replace(item, sampling=sampling, score=spec)), deadline))
    return out


async def check_offered(redis: Redis, keys: Keys, trainer: str, reward: str) -> None:
    """InvalidInput unless a live scorer offers `reward`; the trainer's scoring stream is listed
    for the scorers first (a scorer that starts later finds it too)."""
    await redis.sadd(keys.scoring_trainers, trainer)
    offered = on_offer(await live_scorers(redis, keys))
    if reward not in offered:
        on = ", ".join(f"{n} (v{'/'.join(v)})" for n, v in offered.items()) or "none: no scorer is running"
        raise InvalidInput("reward", f"no live scorer of policy {keys.policy!r} offers {reward!r}; "
                                     f"on offer: {on}")
