"""Follow the registry: learn of new versions at once, verify them, swap the engine to them.

New versions are announced on a stream that the follower blocks on; the newest version is also
read every `poll_s`, so a missed announcement (reconnect, Redis restart) delays a swap, never
loses it.
Weights are checked before the engine sees them (files, sizes, sha256, safetensors headers,
tensor names and shapes against the served model); a version that fails is reported and skipped
while the worker goes on serving the one it has.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from redis.exceptions import RedisError

from rollq.protocol import VersionEntry
from rollq.registry.safetensors_check import Schema, WeightError, check_compatible, dir_schema
from rollq.registry.store import verify
from rollq.registry.versions import Registry
from rollq.worker.windows import interruptible

if TYPE_CHECKING:
    from rollq.worker.loop import Worker

log = logging.getLogger("rollq.worker")

SwapMode = Literal["drain", "interrupt"]


def check_version(entry: VersionEntry, base_schema: Schema | None) -> None:
    """Everything that can be checked before loading; raises WeightError."""
    verify(entry.path, entry.files)
    if base_schema is not None:
        check_compatible(dir_schema(Path(entry.path)), base_schema, f"version {entry.version}")


async def swap_to(worker: Worker, entry: VersionEntry, mode: SwapMode, *, verify_s: float = 0.0) -> bool:
    """Gate closed → drain what must finish on the old version → swap → gate open.

    `verify_s`: time already spent checking the files, reported with the other phases.
    """
    version, began = entry.version, time.monotonic()
    worker.state = "draining"
    if mode == "drain":
        await worker.admission.close(lambda item: True)
    else:  # groups the new version may not serve, or that cannot be continued exactly, finish first
        await worker.admission.close(lambda item: not interruptible(item, version))
    phases = {"verify": verify_s, "drain": time.monotonic() - began}
    worker.state = "swapping"
    try:
        phases |= await worker.engine.swap(version, entry.path, interrupt=mode == "interrupt")
    except Exception as e:  # the engine is back on its old weights; report, do not retry this one
        worker.cannot_load.add(version)
        worker.last_error = f"swap to version {version} failed: {type(e).__name__}: {e}"
        worker.stats.swap(False, time.monotonic() - began, phases)
        log.error("%s; still serving version %d", worker.last_error, worker.engine.version)
        return False
    finally:
        worker.state = "serving"
        worker.admission.reopen()
    log.info("now serving version %d (%s swap, %.2f s: %s)", version, mode, time.monotonic() - began,
             ", ".join(f"{name} {seconds:.2f} s" for name, seconds in phases.items()))
    worker.stats.swap(True, time.monotonic() - began, phases)
    return True


class VersionFollower:
    def __init__(self, worker: Worker, registry: Registry, *, mode: SwapMode,
                 base_schema: Schema | None, poll_s: float):
        self.worker = worker
        self.registry = registry
        self.mode = mode
        self.base_schema = base_schema
        self.poll_s = poll_s

    async def run(self) -> None:
        """Until the worker stops (it ends by itself within `poll_s` of that).

        Announcements come on a stream read with a server-side block (XREAD BLOCK), not on
        pub/sub: redis-py's pub/sub reads time out client-side, and on Python 3.11 a cancellation
        that lands as such a timeout fires can be lost, which hung a worker's shutdown.
        """
        last = "$"
        while not self.worker.stopping:
            try:
                await self.catch_up()
                reply = await self.registry.redis.xread(
                    {self.registry.keys.version_events: last}, count=100,
                    block=max(1, int(self.poll_s * 1000)))
                for _, entries in reply or []:
                    last = entries[-1][0]
            except RedisError as e:
                log.warning("reading new versions failed (%s); retrying", e)
                await asyncio.sleep(self.poll_s)

    async def catch_up(self) -> None:
        newest = await self.registry.latest()
        self.worker.newest = newest
        engine = self.worker.engine
        if newest is None or newest <= engine.version or newest in self.worker.cannot_load:
            return
        entry = await self.registry.get(newest)
        if entry is None:
            return
        checking = time.monotonic()
        try:
            await asyncio.to_thread(check_version, entry, self.base_schema)
        except (WeightError, OSError) as e:
            self.worker.cannot_load.add(newest)
            self.worker.last_error = f"version {newest} refused: {e}"
            log.error("%s; still serving version %d", self.worker.last_error, engine.version)
            return
        await swap_to(self.worker, entry, self.mode, verify_s=time.monotonic() - checking)


async def load_pinned(worker: Worker, registry: Registry, version: int,
                      base_schema: Schema | None) -> None:
    """A pinned worker loads its version once at start; raises if it cannot."""
    if version == worker.engine.version:
        return
    entry = await registry.get(version)
    if entry is None:
        raise WeightError(f"--pin-version {version}: no such version in the registry")
    await asyncio.to_thread(check_version, entry, base_schema)
    await worker.engine.swap(version, entry.path, interrupt=False)
