"""A scored job at submit (the client's side): each group's item carries its reward and inputs;
a reward no live scorer offers is queued (and logged, naming those on offer), refused only where
the operator started a scorer with `--refuse-unoffered`."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import msgspec
from redis.asyncio import Redis

from rollq.protocol import InvalidInput, ScoreSpec, check_id, decode_item, encode, validate_score
from rollq.queue.keys import Keys
from rollq.scoring.records import live_scorers, on_offer

log = logging.getLogger("rollq.client")


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
    """List the trainer's scoring stream for the scorers (a scorer that starts later finds it
    too). A reward no live scorer offers is queued all the same, as work is before any worker
    is live: its groups are generated and wait on the scoring stream (`rollq status`, the
    dashboard) until a scorer offering it starts. InvalidInput only where the operator said so:
    a live scorer started with `--refuse-unoffered`."""
    await redis.sadd(keys.scoring_trainers, trainer)
    scorers = await live_scorers(redis, keys)
    offered = on_offer(scorers)
    if reward in offered:
        return
    on = ", ".join(f"{n} (v{'/'.join(v)})" for n, v in offered.items()) or "none: no scorer is running"
    if any(s.refuse_unoffered for s in scorers):
        raise InvalidInput("reward", f"no live scorer of policy {keys.policy!r} offers {reward!r}; "
                                     f"on offer: {on}")
    if (keys.policy, reward) not in _warned:  # once per reward: a trainer may submit many jobs early
        _warned.add((keys.policy, reward))
        log.warning("no live scorer of policy %r offers reward %r (on offer: %s): its groups are "
                    "queued and wait for one", keys.policy, reward, on)


_warned: set[tuple[str, str]] = set()
