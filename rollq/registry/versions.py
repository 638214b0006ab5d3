"""Policy versions in Redis: strictly increasing, registered by compare-and-set, announced."""

from __future__ import annotations

from redis.asyncio import Redis

from rollq.protocol import VersionEntry, decode_version, encode
from rollq.queue.keys import Keys
from rollq.queue.names import Reply
from rollq.queue.scripts import Scripts, call_durably


class VersionConflict(Exception):
    """A publish of a version not above the newest one (or a concurrent duplicate that lost)."""


class Registry:
    def __init__(self, redis: Redis, keys: Keys, scripts: Scripts | None = None):
        self.redis = redis
        self.keys = keys
        self.scripts = scripts or Scripts(redis)

    async def register(self, entry: VersionEntry) -> None:
        verdict, latest = await call_durably(
            self.scripts.publish, self.redis,
            keys=[self.keys.versions, self.keys.latest, self.keys.version_events],
            args=[entry.version, encode(entry)],
        )
        if verdict.decode() == Reply.STALE:
            raise VersionConflict(
                f"policy {self.keys.policy!r}: version {entry.version} refused, the newest is "
                f"{int(latest)}; versions must strictly increase")

    async def latest(self) -> int | None:
        value = await self.redis.get(self.keys.latest)
        return None if value is None else int(value)

    async def get(self, version: int) -> VersionEntry | None:
        data = await self.redis.hget(self.keys.versions, str(version))
        return None if data is None else decode_version(data)

    async def entries(self) -> list[VersionEntry]:
        found = await self.redis.hgetall(self.keys.versions)
        return sorted((decode_version(v) for v in found.values()), key=lambda e: e.version)

    async def retire(self, version: int) -> Reply:
        """Deregister `version` unless it is the newest or a worker pins it (one script).

        OK: this caller removed it and owns the deletion of its files; else NEWEST, PINNED or
        GONE (someone else removed it first).
        """
        verdict = await self.scripts.retire(
            keys=[self.keys.versions, self.keys.latest, self.keys.pins(version)],
            args=[version], client=self.redis)
        return Reply(verdict.decode())

    async def pin(self, version: int, worker_id: str, lease_s: float) -> VersionEntry | None:
        """Lease `version` to a worker (taken again to renew it); None: it is no longer registered.

        A worker pins a version before it verifies it and holds the pin while it drains toward
        it, loads it and serves it: retention cannot remove it in between.
        """
        data = await self.scripts.pin(
            keys=[self.keys.versions, self.keys.pins(version)],
            args=[version, worker_id, max(1, int(lease_s * 1000))], client=self.redis)
        return None if data is None else decode_version(data)

    async def unpin(self, version: int, worker_id: str) -> None:
        await self.redis.zrem(self.keys.pins(version), worker_id)
