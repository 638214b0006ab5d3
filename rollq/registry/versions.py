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

    # --- Canary refusals (`rollq/canary.py`) ---------------------------------------------------

    async def canary_refused(self, version: int, worker_id: str, reason: str,
                             followers: set[str]) -> bool:
        """Record this worker's refusal of `version`; when every live follower (`followers`:
        workers that would load it, this one included) has refused it, mark the version refused
        everywhere. True: marked. Two workers refusing at once both see both refusals (each
        writes before it reads), so the last one marks it."""
        await self.redis.hset(self.keys.canary_refusals(version), worker_id, reason)
        refusers = {w.decode() for w in await self.redis.hkeys(self.keys.canary_refusals(version))}
        if not followers <= refusers:
            return False
        await self.redis.hset(self.keys.refused_versions, str(version),
                              f"version {version} was refused by the canary of every live worker "
                              f"({len(refusers)}); {worker_id}: {reason}")
        return True

    async def canary_accepted(self, version: int, worker_id: str) -> None:
        """This worker serves `version`: not refused by it, nor everywhere."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hdel(self.keys.canary_refusals(version), worker_id)
            pipe.hdel(self.keys.refused_versions, str(version))
            await pipe.execute()

    async def refused_everywhere(self) -> dict[int, str]:
        """Versions every live worker's canary refused -> the reason."""
        marks = await self.redis.hgetall(self.keys.refused_versions)
        return {int(v): reason.decode() for v, reason in marks.items()}

    async def forget_refusals(self, version: int) -> None:
        """A retired version's refusals (retention)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(self.keys.canary_refusals(version))
            pipe.hdel(self.keys.refused_versions, str(version))
            await pipe.execute()
