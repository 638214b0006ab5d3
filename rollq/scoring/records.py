"""The pool's record of its scorers in Redis, as `queue/workers.py` keeps the workers': one
short-lived heartbeat key per scorer (the rewards it offers, with their versions), listed in a
sorted set by last beat. The client reads it to name the rewards on offer, and to refuse a reward
nobody offers where a scorer's operator said so.

And what they scored: each scorer adds a `Tally` of its last second (rewards per trainer and
job, statuses written, scoring time) to a capped stream, which the gateway reads as it comes
(`gateway/scoring_view.py`): live figures without scanning result streams or waiting for a
heartbeat."""

from __future__ import annotations

import contextlib
import time

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from rollq.queue.keys import Keys
from rollq.queue.names import TallyField

REWARD_S_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
"""Buckets of a group's scoring time (`reward_s`: every sample's reward, wall time)."""
TALLIES_KEPT = 10_000
"""Tallies the stream keeps (about): a few hours of one busy scorer, what a gateway started
later reads back."""


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
    refuse_unoffered: bool = False
    """The operator's `--refuse-unoffered`: while it is live, a scored submit whose reward no
    live scorer offers is refused (without it, such a job waits for a scorer that offers it)."""


class JobTally(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one scorer did for one job in one tally period. Rewards are those of every group it
    scored and wrote or queued again (`resampled`): delivered, filtered and regenerated alike,
    so the mean is the policy's, not the delivered groups' only."""

    trainer: str
    job_id: str
    written: dict[str, int] = {}
    """Results written, by status (`ok`, `filtered`, `failed`, `cancelled`)."""
    resampled: int = 0
    """Groups whose rewards were all equal, queued to be generated again (dynamic sampling)."""
    rewards: int = 0
    """Samples given a reward."""
    total: float = 0.0
    squares: float = 0.0
    """Sums of those rewards and of their squares (mean and spread, added over periods)."""
    missing: int = 0
    """Samples left without one (the reward raised, timed out or ran out of memory)."""
    scored: int = 0
    """Groups whose rewards were computed, and their scoring time in all."""
    reward_s: float = 0.0


def add_job_tally(into, tally: JobTally) -> None:
    """Add `tally`'s counts and sums to `into` (a JobTally, or the gateway's sums of many)."""
    for status, count in tally.written.items():
        into.written[status] = into.written.get(status, 0) + count
    into.resampled += tally.resampled
    into.rewards += tally.rewards
    into.total += tally.total
    into.squares += tally.squares
    into.missing += tally.missing
    into.scored += tally.scored
    into.reward_s += tally.reward_s


class Tally(msgspec.Struct, array_like=True):
    scorer_id: str
    at: float
    jobs: list[JobTally]
    reward_s: list[int]
    """Groups by scoring time: a count per `REWARD_S_BUCKETS` bound, then one above them all."""


async def add_tally(redis: Redis, keys: Keys, tally: Tally) -> None:
    await redis.xadd(keys.score_tallies, {TallyField.TALLY: msgspec.msgpack.encode(tally)},
                     maxlen=TALLIES_KEPT, approximate=True)


async def read_tallies(redis: Redis, keys: Keys, after: str, count: int = 1000) -> tuple[str, list[Tally]]:
    """Tallies added after stream id `after` ('0': from the oldest kept), oldest first, and the id
    to read after next time. One that does not decode is skipped (a newer scorer's, say: metrics
    must not stop the gateway)."""
    tallies = []
    for entry_id, fields in await redis.xrange(keys.score_tallies, "-" if after == "0" else f"({after}",
                                               "+", count=count):
        after = entry_id.decode()
        with contextlib.suppress(KeyError, msgspec.DecodeError, msgspec.ValidationError):
            tallies.append(msgspec.msgpack.decode(fields[TallyField.TALLY.encode()], type=Tally))
    return after, tallies


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
