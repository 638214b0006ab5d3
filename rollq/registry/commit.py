"""The last step of every publish, the client's and the gateway's: register a version whose
files are written and hashed, then apply the publisher's `keep`."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from rollq.protocol import VersionEntry
from rollq.queue.keys import Keys
from rollq.registry.retention import retain
from rollq.registry.store import WeightStore
from rollq.registry.versions import Registry, VersionConflict


async def commit_version(redis: Redis, keys: Keys, store: WeightStore, entry: VersionEntry,
                         keep: int | None, registry: Registry | None = None) -> None:
    """Raises VersionConflict for a version not above the newest; a refused version's copy in
    the store is deleted then (by-reference files are the trainer's, never deleted here)."""
    try:
        await (registry or Registry(redis, keys)).register(entry)
    except VersionConflict:
        if entry.owned:
            await asyncio.to_thread(store.delete, entry.path)
        raise
    if keep is not None:
        await retain(redis, keys, store, keep)
