"""What the workers clean up so that nothing grows with the number of trainers ever seen: trainers
with nothing queued leave the trainers set (every claim reads each member's stream), and results
nobody read for a job's lifetime are dropped with their share of the quota."""

from __future__ import annotations

import logging
import time

from redis.asyncio import Redis

from rollq.queue.keys import Keys, base_trainer
from rollq.queue.scripts import Scripts

log = logging.getLogger("rollq.worker")

PRUNE_EVERY_S = 1.0
"""How often each worker takes the trainers whose work stream is empty out of the trainers set
(`trainer_prune.lua`); a trainer's next submit puts it back, and workers see it within
`loop.STREAMS_REFRESH_S`."""
PRUNE_CHUNK = 256
"""Trainers per prune script call."""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def prune_trainers(redis: Redis, scripts: Scripts, keys: Keys, trainers: list[str]) -> set[str]:
    """Take trainers with nothing queued out of the trainers set, and their empty keys with them;
    returns those removed."""
    gone: set[str] = set()
    k = keys
    for i in range(0, len(trainers), PRUNE_CHUNK):
        chunk = trainers[i:i + PRUNE_CHUNK]
        chunk_keys = [k.trainers] + [key for t in chunk for key in (
            k.work(t), k.results(t), k.outstanding(t), k.outstanding_bytes(t))]
        removed = await scripts.trainer_prune(keys=chunk_keys, args=chunk,
                                              client=redis)
        gone.update(_text(t) for t in removed)
    return gone


async def expire_results(redis: Redis, scripts: Scripts, keys: Keys, ttl_s: int, limit: int = 256) -> int:
    """Drop up to `limit` result streams nothing was written to for `ttl_s` (the worker's
    `job_ttl_s`), with the results still in them (they leave their trainer's quota); returns the
    results dropped. A trainer that reads its results within a job's lifetime never sees this."""
    k, dropped = keys, 0
    cutoff = time.time() - ttl_s
    for stream in await redis.zrangebyscore(k.result_streams, "-inf", cutoff, start=0, num=limit):
        stream = _text(stream)
        if not stream.startswith(k.results("")):
            # A scoring stream (finish.lua marks every stream it writes): groups wait there for
            # a scorer, however long; they are never dropped.
            await redis.zrem(k.result_streams, stream)
            continue
        trainer = k.trainer_of_results(stream)
        n = await scripts.results_expire(
            keys=[k.result_streams, stream, k.outstanding(trainer), k.outstanding(base_trainer(trainer))],
            args=[stream, cutoff], client=redis)
        if n >= 0:  # deleted: its count of results written goes too (a new stream counts anew)
            await redis.hdel(k.results_written, stream)
        if n > 0:
            log.warning("dropped %d results of trainer %r that nobody read for %d s", n, trainer, ttl_s)
            dropped += n
    return dropped
