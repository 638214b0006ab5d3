"""Worker heartbeats: one short-lived key per worker, listed in a sorted set by last beat."""

from __future__ import annotations

import time

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from rollq.queue.keys import Keys
from rollq.registry.versions import Registry
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
    target: int | None = None
    """The version this worker is verifying, draining toward or loading (None: no swap)."""


class Heartbeat:
    """Also renews the worker's pin leases on versions (`holds`), as long as it beats."""

    def __init__(self, redis: Redis, keys: Keys, worker_id: str, *, ttl_s: float):
        self.redis, self.keys, self.worker_id, self.ttl_s = redis, keys, worker_id, ttl_s
        self.registry = Registry(redis, keys)
        self.holds: set[int] = set()
        """Versions this worker has pinned (set by the version follower)."""
        self.target: int | None = None
        self._pinned_to: int | None = None

    async def beat(self, *, version: int, inflight: int, state: str, last_error: str = "",
                   pinned: bool = False, totals: Totals | None = None) -> None:
        now = time.time()
        beat = WorkerState(self.worker_id, version, inflight, state, now, last_error, pinned,
                           totals or Totals(), self.target)
        # No MULTI (a cluster pipeline cannot be one): live_workers reads only beats whose key
        # exists, so a sorted-set entry without its beat is harmless.
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.keys.worker(self.worker_id), msgspec.json.encode(beat),
                     px=int(self.ttl_s * 1000))
            pipe.zadd(self.keys.workers, {self.worker_id: now})
            if pinned:
                pipe.zadd(self.keys.pinned_versions, {str(version): now})
            await pipe.execute()
        self._pinned_to = version if pinned else None
        for held in list(self.holds):
            await self.registry.pin(held, self.worker_id, self.ttl_s)

    async def remove(self) -> None:
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.delete(self.keys.worker(self.worker_id))
                pipe.zrem(self.keys.workers, self.worker_id)
                for held in self.holds:
                    pipe.zrem(self.keys.pins(held), self.worker_id)
                if self._pinned_to is not None:
                    # A deliberate stop: its version's groups need not wait for it. (Another
                    # pinned worker of that version marks it again at its next beat; a crashed
                    # worker never gets here, and its mark outlives it for PINNED_GRACE_S.)
                    pipe.zrem(self.keys.pinned_versions, str(self._pinned_to))
                await pipe.execute()
        except RedisError:  # best effort on the way out; the key expires anyway
            pass


async def live_workers(redis: Redis, keys: Keys) -> list[WorkerState]:
    ids = await redis.zrange(keys.workers, 0, -1)
    if not ids:
        return []
    beats = await redis.mget([keys.worker(i.decode()) for i in ids])
    return [msgspec.json.decode(b, type=WorkerState) for b in beats if b]


PINNED_GRACE_S = 300.0
"""How long a version stays servable after its last pinned worker's last beat: long enough for a
pinned vLLM worker to restart and load its version on a CPU (minutes), short enough that groups
for a version nobody will serve again fail within a few minutes."""


async def recently_pinned(redis: Redis, keys: Keys, within_s: float = PINNED_GRACE_S) -> set[int]:
    """Versions a pinned worker served within `within_s` (it may be restarting)."""
    since = time.time() - within_s
    await redis.zremrangebyscore(keys.pinned_versions, "-inf", f"({since}")
    return {int(v) for v in await redis.zrangebyscore(keys.pinned_versions, since, "+inf")}
