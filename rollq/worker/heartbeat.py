"""Worker heartbeats: one short-lived key per worker, listed in a sorted set by last beat."""

from __future__ import annotations

import time

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from rollq.queue.keys import Keys
from rollq.worker.stats import Totals


class WorkerState(msgspec.Struct, frozen=True):
    worker_id: str
    version: int
    inflight: int
    state: str
    """`serving`, `draining` / `swapping` (a weight swap), or `stopping`."""
    at: float
    last_error: str = ""
    pinned: bool = False
    totals: Totals = msgspec.field(default_factory=Totals)


class Heartbeat:
    def __init__(self, redis: Redis, keys: Keys, worker_id: str, *, ttl_s: float):
        self.redis, self.keys, self.worker_id, self.ttl_s = redis, keys, worker_id, ttl_s

    async def beat(self, *, version: int, inflight: int, state: str, last_error: str = "",
                   pinned: bool = False, totals: Totals | None = None) -> None:
        now = time.time()
        beat = WorkerState(self.worker_id, version, inflight, state, now, last_error, pinned,
                           totals or Totals())
        # No MULTI (a cluster pipeline cannot be one): live_workers reads only beats whose key
        # exists, so a sorted-set entry without its beat is harmless.
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.keys.worker(self.worker_id), msgspec.json.encode(beat),
                     px=int(self.ttl_s * 1000))
            pipe.zadd(self.keys.workers, {self.worker_id: now})
            await pipe.execute()

    async def remove(self) -> None:
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.delete(self.keys.worker(self.worker_id))
                pipe.zrem(self.keys.workers, self.worker_id)
                await pipe.execute()
        except RedisError:  # best effort on the way out; the key expires anyway
            pass


async def live_workers(redis: Redis, keys: Keys) -> list[WorkerState]:
    ids = await redis.zrange(keys.workers, 0, -1)
    if not ids:
        return []
    beats = await redis.mget([keys.worker(i.decode()) for i in ids])
    return [msgspec.json.decode(b, type=WorkerState) for b in beats if b]
