"""Retention: drop old versions, never one that a worker holds or an unfinished job may need."""

from __future__ import annotations

import logging

from redis.asyncio import Redis

from rollq.queue.keys import Keys
from rollq.registry.store import WeightStore
from rollq.registry.versions import Registry
from rollq.worker.heartbeat import live_workers

log = logging.getLogger("rollq.registry")


async def needed_by_jobs(redis: Redis, keys: Keys) -> set[tuple[int, int]]:
    """[min, max] windows of unfinished jobs with an upper bound; finished ones leave the set."""
    job_keys = [j.decode() for j in await redis.smembers(keys.bounded_jobs)]
    windows, finished = set(), []
    for job_key in job_keys:
        state, lo, hi = await redis.hmget(job_key, "state", "min_version", "max_version")
        if state is None or state != b"pending":
            finished.append(job_key)
        else:
            windows.add((int(lo), int(hi)))
    if finished:
        await redis.srem(keys.bounded_jobs, *finished)
    return windows


async def retain(redis: Redis, keys: Keys, store: WeightStore | None, keep: int) -> list[int]:
    """Keep the newest `keep` versions and every needed one; returns the versions removed."""
    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1")
    registry = Registry(redis, keys)
    entries = await registry.entries()
    protected = {e.version for e in entries[-keep:]}
    protected |= {w.version for w in await live_workers(redis, keys)}
    windows = await needed_by_jobs(redis, keys)
    removed = []
    for entry in entries:
        if entry.version in protected or any(lo <= entry.version <= hi for lo, hi in windows):
            continue
        await registry.unregister(entry.version)  # first: no worker finds it from now on
        if entry.owned and store is not None:
            store.delete(entry.path)
        removed.append(entry.version)
    if removed:
        log.info("retention removed versions %s of policy %r", removed, keys.policy)
    return removed
