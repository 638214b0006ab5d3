"""Retention: drop old versions, never one that a worker pins or holds, or an unfinished job may need.

Adapter versions are retained like full ones (one version order); a kept adapter keeps its base.
Workers unload an adapter that is no longer registered once no group runs on it.

The last word is `Registry.retire` (one Lua script): a version is deregistered only if it is not
the newest and no worker's pin lease is live, and only then are its files deleted: by the caller
that deregistered it, or by one that found it deregistered already (GONE: its own call's reply
may have been lost to a dropped connection and the call sent again). Workers pin a version
before verifying it (`Registry.pin`, which succeeds only while the version is registered), so a
worker never loses files it is about to load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from rollq.queue import members
from rollq.queue.keys import Keys
from rollq.queue.names import EpisodeField, EpisodeState, JobField, JobState, Reply
from rollq.registry.safetensors_check import WeightError
from rollq.registry.store import WeightStore
from rollq.registry.versions import Registry
from rollq.queue.workers import live_workers

log = logging.getLogger("rollq.registry")


async def needed_by_jobs(redis: Redis, keys: Keys) -> set[tuple[int, int]]:
    """[min, max] windows of unfinished jobs with an upper bound; finished ones leave the set (and
    members that are no job record of the policy, or whose window does not parse: logged)."""
    legacy = await redis.type(keys.bounded_jobs) == b"set"  # left by an older rollq
    listed = await (redis.smembers(keys.bounded_jobs) if legacy else redis.zrange(keys.bounded_jobs, 0, -1))
    job_keys = members.job_keys(keys, listed)
    windows, finished = set(), []
    for job_key in job_keys:
        try:
            state, lo, hi = await redis.hmget(job_key, JobField.STATE, JobField.MIN_VERSION,
                                              JobField.MAX_VERSION)
        except ResponseError as e:  # a trainer's own key of another type: not a job of rollq's
            members.skip(keys.bounded_jobs, job_key, str(e))
            continue
        window = members.version(job_key, lo), members.version(job_key, hi)
        if state is None or state.decode(errors="replace") != JobState.PENDING:
            finished.append(job_key)
        elif None not in window:
            windows.add(window)
    if finished:
        await (redis.srem if legacy else redis.zrem)(keys.bounded_jobs, *finished)
    return windows


async def needed_by_episodes(redis: Redis, keys: Keys) -> set[int]:
    """Versions of live episodes (not ended, not expired): their next turns need them. Entries of
    expired or ended episodes leave the set (members that are no episode record: logged)."""
    await redis.zremrangebyscore(keys.episodes, "-inf", f"({time.time()}")
    episode_keys = members.episode_keys(keys, await redis.zrange(keys.episodes, 0, -1))
    if not episode_keys:
        return set()
    async with redis.pipeline(transaction=False) as pipe:
        for key in episode_keys:
            pipe.hmget(key, EpisodeField.STATE, EpisodeField.VERSION)
        found = await pipe.execute(raise_on_error=False)
    versions, gone = set(), []
    for key, reply in zip(episode_keys, found):
        if isinstance(reply, ResponseError):  # a trainer's own key of another type
            members.skip(keys.episodes, key, str(reply))
            continue
        state, version = reply
        if state is None or state.decode(errors="replace") == EpisodeState.ENDED:
            gone.append(key)
        elif (v := members.version(key, version)) is not None:
            versions.add(v)
    if gone:
        await redis.zrem(keys.episodes, *gone)
    return versions


async def retain(redis: Redis, keys: Keys, store: WeightStore | None, keep: int) -> list[int]:
    """Keep the newest `keep` versions and every needed one; returns the versions removed."""
    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1")
    registry = Registry(redis, keys)
    entries = await registry.entries()
    protected = {e.version for e in entries[-keep:]}
    protected |= {w.version for w in await live_workers(redis, keys)}
    protected |= await needed_by_episodes(redis, keys)
    windows = await needed_by_jobs(redis, keys)

    def needed(version: int) -> bool:
        return version in protected or any(lo <= version <= hi for lo, hi in windows)

    # An adapter version is served on top of its base: a needed adapter keeps its base too.
    protected |= {e.base for e in entries if e.kind == "adapter" and needed(e.version)}
    removed = []
    for entry in entries:
        if needed(entry.version):
            continue
        verdict = await registry.retire(entry.version)
        if verdict is Reply.GONE and entry.owned and store is not None:
            # Deregistered by someone else, or by this very call whose reply a dropped connection
            # lost (redis-py sent it again): nobody can pin it any more, so its files may go;
            # whoever deletes them first wins, quietly.
            with contextlib.suppress(WeightError, OSError):
                if Path(entry.path).exists():
                    await asyncio.to_thread(store.delete, entry.path)
        if verdict is not Reply.OK:  # pinned, newest, or someone else's
            continue
        removed.append(entry.version)
        await registry.forget_refusals(entry.version)
        if entry.owned and store is not None:
            try:
                await asyncio.to_thread(store.delete, entry.path)
            except (WeightError, OSError) as e:
                # Deregistered already (nobody can load it any more): a leftover directory is
                # an operator's cleanup, never a reason to fail the publish that called us.
                log.warning("version %d deregistered, but its files stay: %s", entry.version, e)
    if removed:
        log.info("retention removed versions %s of policy %r", removed, keys.policy)
    return removed
