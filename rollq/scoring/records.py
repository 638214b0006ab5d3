"""The pool's record of its scorers in Redis, as `queue/workers.py` keeps the workers': one
short-lived heartbeat key per scorer (the rewards it offers, with their versions), listed in a
sorted set by last beat. The client reads it to refuse a reward nobody offers."""

from __future__ import annotations

import time

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from rollq.queue.keys import Keys


class ScorerState(msgspec.Struct, frozen=True):
    scorer_id: str
    rewards: dict[str, str]
    """Reward name -> version."""
    at: float
    inflight: int = 0
    scored: int = 0
    """Groups delivered since it started."""
    reward_errors: int = 0
    """Samples left without a reward (raised, timed out, out of memory)."""
    restarts: int = 0
    """Reward child processes killed (timeouts) or found dead, and replaced."""


async def live_scorers(redis: Redis, keys: Keys) -> list[ScorerState]:
    ids = await redis.zrange(keys.scorers, 0, -1)
    if not ids:
        return []
    beats = await redis.mget([keys.scorer(i.decode()) for i in ids])
    return [msgspec.json.decode(b, type=ScorerState) for b in beats if b]


def on_offer(scorers: list[ScorerState]) -> dict[str, list[str]]:
    """Reward name -> the versions live scorers offer of it."""
    offered: dict[str, set[str]] = {}
    for s in scorers:
        for name, version in s.rewards.items():
            offered.setdefault(name, set()).add(version)
    return {name: sorted(versions) for name, versions in sorted(offered.items())}


async def beat(redis: Redis, keys: Keys, state: ScorerState, ttl_s: float) -> None:
    async with redis.pipeline(transaction=False) as pipe:
        pipe.set(keys.scorer(state.scorer_id), msgspec.json.encode(state), px=int(ttl_s * 1000))
        pipe.zadd(keys.scorers, {state.scorer_id: state.at})
        # Scorers beat while the sorted set forgets those that stopped long ago.
        pipe.zremrangebyscore(keys.scorers, "-inf", time.time() - 3600)
        await pipe.execute()


async def remove(redis: Redis, keys: Keys, scorer_id: str) -> None:
    try:
        async with redis.pipeline(transaction=False) as pipe:
            pipe.delete(keys.scorer(scorer_id))
            pipe.zrem(keys.scorers, scorer_id)
            await pipe.execute()
    except RedisError:  # best effort on the way out; the key expires anyway
        pass
