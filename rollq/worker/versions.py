"""What a worker knows of versions: the newest registered, those it cannot load, its swap state.

One object, written only through its own methods: by the version follower as it swaps (and by
the adapters it serves beside the loaded version), by the worker only when a group with a
staleness bound asks for the newest version afresh. The worker, its heartbeat and its metrics
read it. The loaded version itself is the engine's (`engine.version`).
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Literal

from rollq.canary import MAX_REPORTED_CHECKS, CanaryCheck, Verdict

from rollq.registry.versions import Registry

if TYPE_CHECKING:
    from rollq.worker.resident import ResidentAdapters

SwapState = Literal["serving", "draining", "swapping"]


class VersionState:
    def __init__(self, registry: Registry):
        self.registry = registry
        self.newest: int | None = None
        """The newest registered version, as last read (None: none yet, or not read)."""
        self.cannot_load: set[int] = set()
        """Versions refused (checksum, header, load error): never retried. Read-only outside."""
        self.swap: SwapState = "serving"
        self.last_error = ""
        """The last version error (refused, failed to load), for the heartbeat."""
        self.error_at = 0.0
        self.adapters: ResidentAdapters | None = None
        """Adapter versions served beside the loaded one (engines with adapter support)."""
        self.suspended = ""
        """Why this worker serves no version (`--canary-refusal none` after a refusal); "": it
        serves the one loaded."""
        self.canaries: deque[CanaryCheck] = deque(maxlen=MAX_REPORTED_CHECKS)
        """The latest canary checks, accepted and refused (the heartbeat reports them)."""
        self.awaited: int | None = None
        """A pushed version this worker did not take by its push and whose files it waits for
        (`VersionFollower._files_written`): not loadable yet, so groups that need it are left
        to the workers that took the push rather than held here for as long as the write takes."""

    def loadable_not(self) -> set[int]:
        """Versions this worker cannot swap to now: refused, skipped, or awaiting their files."""
        return self.cannot_load if self.awaited is None else self.cannot_load | {self.awaited}

    async def read_newest(self) -> int | None:
        """Read the newest registered version from the registry (and remember it)."""
        self.newest = await self.registry.latest()
        return self.newest

    def refuse(self, version: int, reason: str) -> None:
        """`version` can never be served here (it is not retried); `reason` is reported."""
        self.cannot_load.add(version)
        self.failed(reason)

    def checked(self, version: int, verdict: Verdict, *, adapter: bool = False) -> None:
        """A canary check's outcome, for the heartbeat (a refusal is also `refuse`d)."""
        self.canaries.append(CanaryCheck(version, verdict, time.time(), adapter))

    def suspend(self, reason: str) -> None:
        self.suspended = reason

    def resume(self) -> None:
        self.suspended = ""

    def skip(self, version: int) -> None:
        """`version` is not servable by this worker (no error: another worker may serve it)."""
        self.cannot_load.add(version)

    def failed(self, reason: str) -> None:
        self.last_error, self.error_at = reason, time.monotonic()

    def moving(self, state: SwapState) -> None:
        self.swap = state

    def serve_adapters(self, adapters: ResidentAdapters) -> None:
        self.adapters = adapters
