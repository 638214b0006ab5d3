"""The last steps of every publish, the client's and the gateway's: the registry entry of files
written and hashed (`commit_files`), registered, then the publisher's `keep` applied."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from redis.asyncio import Redis

from rollq.protocol import FileDigest, PushOffer, TensorDigest, VersionEntry
from rollq.queue.keys import Keys
from rollq.registry.retention import retain
from rollq.registry.store import WeightStore
from rollq.registry.versions import Registry, VersionConflict


async def commit_version(redis: Redis, keys: Keys, store: WeightStore, entry: VersionEntry,
                         keep: int | None, registry: Registry | None = None) -> None:
    """Raises VersionConflict for a version not above the newest; a refused version's copy in
    the store is deleted then (by-reference files are the trainer's, never deleted here; a
    push's are written after it registers: none yet)."""
    try:
        await (registry or Registry(redis, keys)).register(entry)
    except VersionConflict:
        if entry.owned and Path(entry.path).exists():
            await asyncio.to_thread(store.delete, entry.path)
        raise
    if keep is not None:
        await retain(redis, keys, store, keep)


async def commit_files(redis: Redis, keys: Keys, store: WeightStore, version: int, path: str | Path,
                       files: list[FileDigest], owned: bool, *, publisher: str, keep: int | None,
                       registry: Registry | None = None, adapter_on: int | None = None,
                       tensors: list[TensorDigest] | None = None,
                       push: PushOffer | None = None, canary: bytes = b"") -> VersionEntry:
    """Commit `version` from its files at `path`, written and hashed (`owned`: a copy in the
    store, deleted if the version is refused; else the publisher's, registered by reference).
    `adapter_on`: an adapter version on that full version; `tensors`, `push`: a push offered
    with it (`engine/pushes.py`); `canary`: the version's canary, encoded (`rollq/canary.py`).
    Returns the entry registered."""
    entry = VersionEntry(version, str(path), files, sum(f.bytes for f in files), time.time(), publisher,
                         owned, "full" if adapter_on is None else "adapter", adapter_on or 0,
                         tensors or [], push, canary)
    await commit_version(redis, keys, store, entry, keep, registry)
    return entry
