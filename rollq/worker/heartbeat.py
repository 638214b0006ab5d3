"""A worker's heartbeat, the writing side (the record and its readers: `queue/workers.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from rollq.canary import CanaryCheck
from rollq.queue.keys import Keys
from rollq.queue.workers import Totals, WorkerState
from rollq.registry.versions import Registry


class Heartbeat:
    """Also renews the worker's pin leases on versions (`holds`), as long as it beats."""

    def __init__(self, redis: Redis, keys: Keys, worker_id: str, *, ttl_s: float):
        self.redis, self.keys, self.worker_id, self.ttl_s = redis, keys, worker_id, ttl_s
        self.registry = Registry(redis, keys)
        self.holds: set[int] = set()
        """Versions this worker has pinned (set by the version follower)."""
        self.target: int | None = None
        self.adapters: Iterable[int] = ()
        """Adapter versions loaded in the engine (the version follower's `ResidentAdapters.loaded`)."""
        self._pinned_to: int | None = None
        self.changed = asyncio.Event()
        """Set by `soon()`: the worker beats at once (`Worker._beat_on_change`), not at its next
        renewal (lease/3, 10 s by default), so readers see a swap as it happens."""
        self._writing = asyncio.Lock()
        """One beat at a time, in the order they were asked for: a beat of older values must not
        land after a newer one."""

    def soon(self) -> None:
        """The version or state changed: beat now."""
        self.changed.set()

    async def beat(self, *, version: int, inflight: int, state: str, last_error: str = "",
                   pinned: bool = False, totals: Totals | None = None,
                   capacity: int | None = None, max_model_len: int | None = None,
                   canaries: list[CanaryCheck] | None = None) -> None:
        async with self._writing:
            await self._write(version=version, inflight=inflight, state=state, last_error=last_error,
                              pinned=pinned, totals=totals, capacity=capacity,
                              max_model_len=max_model_len, canaries=canaries or [])

    async def _write(self, *, version: int, inflight: int, state: str, last_error: str,
                     pinned: bool, totals: Totals | None, capacity: int | None,
                     max_model_len: int | None, canaries: list[CanaryCheck]) -> None:
        now = time.time()
        beat = WorkerState(self.worker_id, version, inflight, state, now, last_error, pinned,
                           totals or Totals(), self.target, sorted(self.adapters), capacity,
                           max_model_len, canaries)
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

    async def release(self, version: int) -> None:
        """Stop renewing this worker's pin on `version` and remove it (if Redis is away, the
        lease lapses by itself)."""
        self.holds.discard(version)
        with contextlib.suppress(RedisError):
            await self.registry.unpin(version, self.worker_id)

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
